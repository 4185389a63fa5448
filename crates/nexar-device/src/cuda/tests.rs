//! Tests of the CUDA adapter. Those that need a GPU call [`gpu`] first, which prints a skip
//! message and returns `None` when `CudaAdapter::new(0)` fails; the rest run everywhere.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use super::staging::CHUNK;
use super::*;
use crate::{finalize_bytes, reduce_bytes, DataType, DeviceAdapter, ReduceOp};

/// The adapter for device 0, or `None` (after a visible skip message) without one.
fn gpu() -> Option<CudaAdapter> {
    match CudaAdapter::new(0) {
        Ok(a) => Some(a),
        Err(e) => {
            eprintln!("skipping: no CUDA device: {e}");
            None
        }
    }
}

fn sample(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// Element-wise equality of two byte buffers of `dtype`, where any two NaNs are equal
/// (the GPU's f16 conversions may produce a different NaN payload than `half`).
fn same(dtype: DataType, a: &[u8], b: &[u8]) -> bool {
    let size = dtype.size();
    a.len() == b.len()
        && a.chunks_exact(size)
            .zip(b.chunks_exact(size))
            .all(|(x, y)| x == y || (is_nan(dtype, x) && is_nan(dtype, y)))
}

fn is_nan(dtype: DataType, bytes: &[u8]) -> bool {
    let mut word = [0u8; 8];
    word[..bytes.len()].copy_from_slice(bytes);
    let bits = u64::from_le_bytes(word);
    match dtype {
        DataType::F32 => bits & 0x7fff_ffff > 0x7f80_0000,
        DataType::F64 => bits & 0x7fff_ffff_ffff_ffff > 0x7ff0_0000_0000_0000,
        DataType::F16 => bits & 0x7fff > 0x7c00,
        DataType::BF16 => bits & 0x7fff > 0x7f80,
        _ => false,
    }
}

// ---- Tests that run everywhere. ----

#[test]
fn new_without_device_is_a_typed_error() {
    match CudaAdapter::new(0) {
        Ok(a) => eprintln!("skipping: a CUDA device is present ({a:?})"),
        Err(e) => {
            assert!(matches!(e, DeviceError::Unavailable(_)), "{e:?}");
            assert!(e.to_string().starts_with("device unavailable: "), "{e}");
        }
    }
}

#[test]
fn absurd_ordinal_is_unavailable() {
    let err = CudaAdapter::new(1 << 20).unwrap_err();
    assert!(matches!(err, DeviceError::Unavailable(_)), "{err:?}");
}

#[test]
fn launch_config_covers_every_element() {
    use super::staging::launch_config;
    for n in [0u64, 1, 255, 256, 257, 1 << 20, 1 << 40] {
        let cfg = launch_config(n);
        let threads = u64::from(cfg.grid_dim.0) * u64::from(cfg.block_dim.0);
        assert!(cfg.grid_dim.0 >= 1);
        // Either one thread per element, or the grid-stride loop covers the rest.
        assert!(
            threads >= n.min(1 << 24) || cfg.grid_dim.0 == 1 << 16,
            "{n}"
        );
    }
    assert_eq!(CHUNK % 8, 0, "chunks must not split elements");
}

// ---- Tests that need a GPU. ----

#[test]
fn staging_round_trips_at_any_offset_and_size() {
    let Some(a) = gpu() else { return };
    assert_eq!(a.name(), "cuda");
    assert!(!a.host_accessible());
    for len in [1, 7, 4096, CHUNK - 1, CHUNK + 13, 2 * CHUNK + 5] {
        let data = sample(len + 3, len as u8);
        let buf = DeviceBuffer::<u8>::from_host(&a, &data).unwrap();
        assert_eq!(buf.to_host().unwrap(), data, "{len}");
        assert_eq!(buf.to_host_with(&a).unwrap(), data, "{len}");
        // Unaligned, offset device pointer through the raw trait.
        let mut host = vec![0u8; len];
        // SAFETY: `buf` holds len + 3 bytes, so [1, len + 1) is in bounds.
        unsafe { a.stage_to_host(buf.device_ptr().wrapping_add(1), &mut host) }.unwrap();
        assert_eq!(host, data[1..len + 1], "{len}");

        let mut buf = DeviceBuffer::<u8>::zeros(&a, len + 3).unwrap();
        let src = sample(len, 99);
        // SAFETY: as above, and `buf` is borrowed mutably.
        unsafe { a.write_from_host(buf.device_ptr_mut().wrapping_add(2), &src) }.unwrap();
        let back = buf.to_host().unwrap();
        assert_eq!(back[2..len + 2], src[..], "{len}");
        assert_eq!(back[..2], [0, 0]);
        assert_eq!(back[len + 2], 0);
    }
    // Empty transfers accept null, as on the CPU.
    // SAFETY: zero-length transfers may use any pointer.
    unsafe {
        a.stage_to_host(std::ptr::null(), &mut []).unwrap();
        a.write_from_host(std::ptr::null_mut(), &[]).unwrap();
    }
    assert!(a.idle_staging_buffers() >= 1, "staging buffers are pooled");
}

#[test]
fn reduce_matches_cpu_for_every_dtype_and_op() {
    let Some(a) = gpu() else { return };
    a.prepare_kernels().unwrap();
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL {
            // Aligned and unaligned destinations.
            for offset in [0, 1] {
                let n = 1000 * dtype.size();
                let src = sample(n, 3);
                let init = sample(n + offset, 77);
                let mut expected = init[offset..].to_vec();
                let want = reduce_bytes(dtype, op, &mut expected, &src);
                let mut buf = DeviceBuffer::<u8>::from_host(&a, &init).unwrap();
                // SAFETY: `buf` holds n + offset bytes and is borrowed mutably.
                let got = unsafe {
                    a.reduce_from_host(buf.device_ptr_mut().wrapping_add(offset), &src, dtype, op)
                };
                assert_eq!(got, want, "{dtype} {op} +{offset}");
                let back = buf.to_host().unwrap();
                assert!(
                    same(dtype, &back[offset..], &expected),
                    "{dtype} {op} +{offset}"
                );
            }
        }
    }
}

#[test]
fn multi_chunk_reduce_and_finalize() {
    let Some(a) = gpu() else { return };
    let n = (2 * CHUNK + 4096) / 4;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut buf = DeviceBuffer::from_host(&a, &x).unwrap();
    a.reduce_into_buffer(&mut buf, bytemuck::cast_slice(&y), ReduceOp::Avg)
        .unwrap();
    a.finalize_buffer(&mut buf, ReduceOp::Avg, 2).unwrap();
    let got = buf.to_host_with(&a).unwrap();
    for i in (0..n).step_by(997) {
        assert_eq!(got[i], (x[i] + y[i]) / 2.0, "{i}");
    }
}

/// A `bf16` division on the GPU gives the canonical NaN, as the CPU's does: the GPU's
/// division gives its own NaN whatever the payload (`0x7FFF` once rounded).
#[test]
fn a_bf16_division_gives_the_canonical_nan_on_the_gpu() {
    let Some(a) = gpu() else { return };
    let x = [
        0x7FC0u16,
        0x7FC1,
        0xFFC2,
        half::bf16::from_f32(3.0).to_bits(),
    ]
    .map(half::bf16::from_bits);
    let mut buf = DeviceBuffer::from_host(&a, &x).unwrap();
    a.finalize_buffer(&mut buf, ReduceOp::Avg, 2).unwrap();
    let got: Vec<u16> = buf
        .to_host_with(&a)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let mut cpu = x.to_vec();
    crate::finalize_slice(ReduceOp::Avg, &mut cpu, 2).unwrap();
    let cpu: Vec<u16> = cpu.iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, cpu);
    assert_eq!(
        got,
        [0x7FC0, 0x7FC0, 0x7FC0, half::bf16::from_f32(1.5).to_bits()]
    );
}

#[test]
fn finalize_matches_cpu() {
    let Some(a) = gpu() else { return };
    for dtype in DataType::ALL.into_iter().filter(|d| d.is_float()) {
        for offset in [0, 1] {
            let n = 513 * dtype.size();
            let init = sample(n + offset, 5);
            let mut expected = init[offset..].to_vec();
            finalize_bytes(dtype, ReduceOp::Avg, &mut expected, 3).unwrap();
            let mut buf = DeviceBuffer::<u8>::from_host(&a, &init).unwrap();
            // SAFETY: `buf` holds n + offset bytes and is borrowed mutably.
            unsafe {
                a.finalize_raw(
                    buf.device_ptr_mut().wrapping_add(offset),
                    n,
                    dtype,
                    ReduceOp::Avg,
                    3,
                )
            }
            .unwrap();
            let back = buf.to_host().unwrap();
            assert!(same(dtype, &back[offset..], &expected), "{dtype} +{offset}");
        }
    }
    let mut buf = DeviceBuffer::from_host(&a, &[1.0f32, 2.0]).unwrap();
    assert_eq!(
        a.finalize_buffer(&mut buf, ReduceOp::Avg, 0),
        Err(DeviceError::ZeroDivisor)
    );
    // Other ops are a no-op.
    a.finalize_buffer(&mut buf, ReduceOp::Sum, 0).unwrap();
    assert_eq!(buf.to_host().unwrap(), [1.0, 2.0]);
    let mut ints = DeviceBuffer::from_host(&a, &[1i32, 2]).unwrap();
    assert!(matches!(
        a.finalize_buffer(&mut ints, ReduceOp::Avg, 2),
        Err(DeviceError::UnsupportedOp { .. })
    ));
}

#[test]
fn typed_buffers_check_lengths_and_ops() {
    let Some(a) = gpu() else { return };
    let data = [1.5f32, -2.0, 3.25];
    let mut buf = DeviceBuffer::from_host(&a, &data).unwrap();
    assert_eq!(buf.len(), 3);
    assert_eq!(buf.byte_len(), 12);
    assert_eq!(buf.ordinal(), 0);
    assert_eq!(buf.to_host().unwrap(), data);

    let mut short = [0u8; 8];
    assert_eq!(
        a.stage_buffer(&buf, &mut short),
        Err(DeviceError::LengthMismatch { dst: 8, src: 12 })
    );
    assert_eq!(
        a.write_buffer(&mut buf, &[0u8; 16]),
        Err(DeviceError::LengthMismatch { dst: 12, src: 16 })
    );
    assert!(matches!(
        a.write_buffer(&mut buf, &[0u8; 13]),
        Err(DeviceError::BadLength { len: 13, .. })
    ));
    let mut ints = DeviceBuffer::from_host(&a, &[1i32, 2]).unwrap();
    assert!(matches!(
        a.reduce_into_buffer(&mut ints, &[0u8; 8], ReduceOp::Avg),
        Err(DeviceError::UnsupportedOp { .. })
    ));
    a.reduce_into_buffer(
        &mut ints,
        bytemuck::cast_slice(&[i32::MAX, 5]),
        ReduceOp::Sum,
    )
    .unwrap();
    assert_eq!(ints.to_host().unwrap(), [i32::MIN, 7], "integers wrap");

    let other = DeviceBuffer::from_host(&a, &[10i32, -20]).unwrap();
    a.reduce_device(&mut ints, &other, ReduceOp::Max).unwrap();
    assert_eq!(ints.to_host().unwrap(), [10, 7]);

    let empty = DeviceBuffer::<f64>::zeros(&a, 0).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.to_host().unwrap(), Vec::<f64>::new());
    a.stage_buffer(&empty, &mut []).unwrap();
}

#[test]
fn wrong_device_is_rejected() {
    let Some(a) = gpu() else { return };
    let Ok(b) = CudaAdapter::new(1) else {
        eprintln!("skipping: no second CUDA device");
        return;
    };
    let mut on_b = DeviceBuffer::from_host(&b, &[1u32, 2]).unwrap();
    assert_eq!(
        a.write_buffer(&mut on_b, &[0u8; 8]),
        Err(DeviceError::WrongDevice {
            adapter: 0,
            buffer: 1
        })
    );
    assert!(matches!(
        on_b.to_host_with(&a),
        Err(DeviceError::WrongDevice { .. })
    ));
}

#[test]
fn concurrent_callers_use_separate_staging() {
    let Some(a) = gpu() else { return };
    let a = Arc::new(a);
    let threads: Vec<_> = (0..6u8)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for round in 0..4u8 {
                    let data = sample(CHUNK + 100 * usize::from(t), t ^ round);
                    let buf = DeviceBuffer::<u8>::from_host(&a, &data).unwrap();
                    assert_eq!(buf.to_host_with(&a).unwrap(), data);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(a.idle_staging_buffers() <= 4);
}
