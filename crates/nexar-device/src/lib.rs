//! Data types, reduction kernels and device adapters for nexar.
//!
//! This is the lowest crate of the workspace: it knows what a buffer's elements are
//! ([`DataType`], [`Element`]), how to combine two buffers ([`ReduceOp`], [`reduce_bytes`],
//! [`finalize_bytes`], [`fill_identity`]), how to copy them ([`copy_bytes`], whose speed
//! does not depend on the buffers' addresses, and [`copy_bytes_streaming`], which
//! bypasses the cache) and where buffers live ([`DeviceAdapter`],
//! [`CpuAdapter`]). It has no async code and no networking, and is usable alone.
//!
//! With the `cuda` feature (off by default) it also provides `CudaAdapter` and
//! `DeviceBuffer`: GPU memory staged through pinned host buffers, with reductions run as
//! NVRTC-compiled kernels on the device. The CUDA libraries are loaded at run time, so the
//! feature builds without a CUDA toolkit; see the `cuda` module docs (`CudaAdapter`).
//!
//! The kernels work on raw bytes because received data arrives as bytes, often at an
//! address that is not aligned for the element type; they take a fast path when the
//! destination is aligned (reading an unaligned source in place, for every type but
//! `f16`) and stage through aligned blocks otherwise, with bit-identical results either
//! way.
//!
//! ```
//! use nexar_device::{reduce_slice, ReduceOp};
//!
//! let mut acc = [1.0f32, 2.0, 3.0];
//! reduce_slice(ReduceOp::Sum, &mut acc, &[10.0, 20.0, 30.0])?;
//! assert_eq!(acc, [11.0, 22.0, 33.0]);
//! # Ok::<(), nexar_device::DeviceError>(())
//! ```

// Library code: no `expect` where a peer's bytes or a caller's input could make it fail
// (the workspace lints `unwrap_used` everywhere; tests may expect).
#![warn(clippy::expect_used)]
#![cfg_attr(test, allow(clippy::expect_used))]

mod adapter;
mod bf16_conv;
mod copy;
#[cfg(feature = "cuda")]
mod cuda;
mod dtype;
mod element;
mod error;
mod kernels;
mod memory;
mod op;
mod simd;
mod stage;

pub use adapter::{CpuAdapter, DeviceAdapter};
pub use copy::{copy_bytes, copy_bytes_streaming, extend_bytes};
#[cfg(feature = "cuda")]
pub use cuda::{CudaAdapter, CudaMemory, DeviceBuffer};
pub use dtype::DataType;
pub use element::Element;
pub use error::DeviceError;
pub use kernels::{
    check_op, fill_identity, finalize_bytes, finalize_slice, reduce_bytes, reduce_onto_bytes,
    reduce_onto_bytes_streaming, reduce_slice,
};
pub use memory::{check_range, DeviceMemory, HostBuffer};
pub use op::ReduceOp;
