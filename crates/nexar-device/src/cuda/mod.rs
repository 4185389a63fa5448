//! The CUDA device adapter ([`CudaAdapter`]) and typed device buffers ([`DeviceBuffer`]),
//! behind the `cuda` cargo feature (off by default).
//!
//! # Building
//!
//! The feature pulls in [`cudarc`] with *dynamic loading*: `libcuda` (the driver) and
//! `libnvrtc` (the run-time compiler) are opened with `dlopen` when first needed, so
//! building needs neither a GPU nor a CUDA toolkit, and a binary built with the feature
//! still runs on a machine without them. [`CudaAdapter::new`] then fails with
//! [`DeviceError::Unavailable`](crate::DeviceError::Unavailable) instead of panicking.
//! The bindings target the CUDA 12.4 API, which newer drivers (12.x and 13.x) also serve;
//! `libnvrtc.so.12` (or an unversioned `libnvrtc.so`) must be on the loader path for
//! reductions. Setting `CUDARC_CUDA_VERSION` (for example `13000`) at build time picks other
//! bindings and library names.
//!
//! # Design
//!
//! Only the wire sees host memory. A send stages device memory to the host
//! ([`DeviceAdapter::stage_to_host`](crate::DeviceAdapter::stage_to_host)); a receive writes
//! host bytes to the device or reduces them into it. Copies go through page-locked (pinned)
//! host buffers with asynchronous copies on a stream, in 8 MiB chunks, double-buffered so
//! that the DMA engine and the CPU-side `memcpy` into the caller's slice overlap. The
//! pinned buffers, their stream and some device scratch live in a small pool inside the
//! adapter and are reused across calls, since pinning memory is expensive; concurrent
//! callers each take their own set. Every call synchronizes before it returns, as the
//! [`DeviceAdapter`](crate::DeviceAdapter) contract requires.
//!
//! Reductions run on the GPU: received bytes are staged into device scratch, then a small
//! kernel computes `dst = op(dst, scratch)`. There is one kernel per (data type, op), with
//! the CPU kernels' semantics: integers wrap, float `min`/`max` ignore a NaN operand,
//! `f16`/`bf16` are computed in `f32` and rounded to nearest, ties to even, and `Avg` sums
//! (divide once at the end with [`CudaAdapter::finalize_buffer`] or
//! [`CudaAdapter::finalize_raw`]). The kernels' CUDA C source is generated in this crate
//! and compiled with NVRTC the first time a reduction needs it (or eagerly with
//! [`CudaAdapter::prepare_kernels`]).
//!
//! Device memory must have no pending work on other streams when it is handed to the
//! adapter: synchronize your own streams first. [`DeviceBuffer`] methods synchronize before
//! they return, so buffers made with them are always ready.
//!
//! # Testing
//!
//! ```text
//! cargo test -p nexar-device --features cuda
//! ```
//!
//! runs the CPU-side tests everywhere (kernel source generation, the typed error without a
//! driver) and the GPU tests when `CudaAdapter::new(0)` succeeds; without a device each GPU
//! test prints `skipping: no CUDA device: <reason>` and passes. `gpu-check.sh` in the crate
//! directory builds in release mode, runs the tests and the `cuda_staging` bandwidth
//! example in one go.

mod adapter;
mod buffer;
mod source;
mod staging;
#[cfg(test)]
mod tests;

pub use adapter::CudaAdapter;
pub use buffer::DeviceBuffer;

use crate::DeviceError;

/// The adapter name used in errors and logs.
const NAME: &str = "cuda";

/// A raw device address (`CUdeviceptr`), kept private to this module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DevPtr(u64);

impl DevPtr {
    fn offset(self, bytes: usize) -> DevPtr {
        DevPtr(self.0 + bytes as u64)
    }
}

/// Maps a driver error into [`DeviceError::Adapter`], naming what was being done.
fn driver_error(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> DeviceError {
    move |e| DeviceError::Adapter {
        adapter: NAME,
        message: format!("{what}: {e}"),
    }
}
