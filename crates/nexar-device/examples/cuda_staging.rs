//! Staging and kernel bandwidth of the CUDA adapter on device 0.
//!
//! ```text
//! cargo run -p nexar-device --features cuda --release --example cuda_staging [MiB]
//! ```
//!
//! Prints device-to-host and host-to-device GB/s through the adapter's pinned staging (the
//! path every send and receive takes), the end-to-end GB/s of a reduce from host bytes, and
//! the f32 `Sum` kernel's GB/s on device-resident buffers (counting 3 bytes moved per byte
//! reduced: read dst, read src, write dst). Exits with status 2 when there is no GPU.

use std::time::Instant;

use nexar_device::{CudaAdapter, DeviceAdapter, DeviceBuffer, DeviceError, ReduceOp};

const ITERS: u32 = 10;

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let adapter = match CudaAdapter::new(0) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("skipping: no CUDA device: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&adapter, mib << 20) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// Runs `f` once to warm up, then `ITERS` times; returns GB/s for `bytes` per run.
fn rate(bytes: usize, mut f: impl FnMut() -> Result<(), DeviceError>) -> Result<f64, DeviceError> {
    f()?;
    let start = Instant::now();
    for _ in 0..ITERS {
        f()?;
    }
    let secs = start.elapsed().as_secs_f64() / f64::from(ITERS);
    Ok(bytes as f64 / secs / 1e9)
}

fn run(a: &CudaAdapter, bytes: usize) -> Result<(), DeviceError> {
    let name = a.device_name()?;
    println!(
        "device 0: {name}, buffer {} MiB, {ITERS} iterations",
        bytes >> 20
    );
    let t = Instant::now();
    a.prepare_kernels()?;
    println!(
        "nvrtc compile + load: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );

    let n = bytes / 4;
    let host: Vec<f32> = (0..n).map(|i| (i % 1024) as f32).collect();
    let mut dev = DeviceBuffer::from_host(a, &host)?;
    let other = DeviceBuffer::from_host(a, &host)?;
    let mut wire = vec![0u8; n * 4];

    let d2h = rate(bytes, || a.stage_buffer(&dev, &mut wire))?;
    println!("device->host (pinned staging): {d2h:8.2} GB/s");
    let h2d = rate(bytes, || a.write_buffer(&mut dev, &wire))?;
    println!("host->device (pinned staging): {h2d:8.2} GB/s");
    let red = rate(bytes, || {
        a.reduce_into_buffer(&mut dev, &wire, ReduceOp::Sum)
    })?;
    println!("reduce from host, f32 sum:     {red:8.2} GB/s (of received bytes)");
    let kernel = rate(3 * bytes, || {
        a.reduce_device(&mut dev, &other, ReduceOp::Sum)
    })?;
    println!("kernel f32 sum (device only):  {kernel:8.2} GB/s (3 x bytes moved)");

    // A quick correctness check of the raw trait path, so the numbers mean something.
    let small = [1.0f32, 2.0, 3.0];
    let mut buf = DeviceBuffer::from_host(a, &small)?;
    // SAFETY: `buf` holds 12 bytes and is borrowed mutably for the call.
    unsafe {
        a.reduce_from_host(
            buf.device_ptr_mut(),
            bytemuck_bytes(&small),
            nexar_device::DataType::F32,
            ReduceOp::Sum,
        )
    }?;
    let back = buf.to_host()?;
    if back != [2.0, 4.0, 6.0] {
        return Err(DeviceError::Adapter {
            adapter: "cuda",
            message: format!("sanity check failed: {back:?}"),
        });
    }
    println!("sanity check: ok");
    Ok(())
}

/// The bytes of an `f32` slice (the example avoids a bytemuck dependency of its own).
fn bytemuck_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 no alignment requirement; the length is in bytes.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}
