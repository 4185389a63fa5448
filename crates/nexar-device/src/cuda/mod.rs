//! The CUDA device adapter ([`CudaAdapter`]) and typed device buffers ([`DeviceBuffer`]),
//! behind the `cuda` cargo feature (off by default).
//!
//! The user-facing documentation (building, design, testing) is on [`CudaAdapter`].

mod adapter;
mod buffer;
mod memory;
mod source;
mod staging;
#[cfg(test)]
mod tests;

pub use adapter::CudaAdapter;
pub use buffer::DeviceBuffer;
pub use memory::CudaMemory;

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
