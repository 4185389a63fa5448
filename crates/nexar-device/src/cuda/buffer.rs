//! [`DeviceBuffer`]: a typed, owned allocation on a CUDA device.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};

use super::{driver_error, CudaAdapter};
use crate::{DeviceError, Element};

/// `len` elements of `T` in device memory, allocated through a [`CudaAdapter`] and freed
/// on drop, so user code never handles raw device addresses.
///
/// The buffer remembers its device and context; the adapter's typed methods
/// ([`CudaAdapter::stage_buffer`], [`CudaAdapter::write_buffer`],
/// [`CudaAdapter::reduce_into_buffer`], ...) reject a buffer from another device with
/// [`DeviceError::WrongDevice`] and a host slice of the wrong size with
/// [`DeviceError::LengthMismatch`]. Every method waits for its device work before
/// returning, so a buffer never has work pending when user code sees it.
pub struct DeviceBuffer<T: Element> {
    /// `None` when empty: the driver does not allocate zero bytes.
    slice: Option<CudaSlice<u8>>,
    /// The allocation's device address (0 when empty).
    ptr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
    _elem: PhantomData<T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// Allocates `len` elements with all bits zero on `adapter`'s device.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Adapter`] if the allocation fails (for example out of memory), or if
    /// `len` elements overflow `usize` bytes.
    pub fn zeros(adapter: &CudaAdapter, len: usize) -> Result<Self, DeviceError> {
        let bytes = len
            .checked_mul(T::DTYPE.size())
            .ok_or_else(|| DeviceError::Adapter {
                adapter: "cuda",
                message: format!("{len} elements of {} overflow usize", T::DTYPE),
            })?;
        let stream = adapter.stream();
        let (slice, ptr) = if bytes == 0 {
            (None, 0)
        } else {
            let slice = stream
                .alloc_zeros::<u8>(bytes)
                .map_err(driver_error("allocate device buffer"))?;
            let ptr = slice.device_ptr(stream).0;
            (Some(slice), ptr)
        };
        // Stream-ordered allocation and zeroing must finish before other streams use it.
        stream.synchronize().map_err(driver_error("synchronize"))?;
        Ok(DeviceBuffer {
            slice,
            ptr,
            len,
            ctx: adapter.context().clone(),
            _elem: PhantomData,
        })
    }

    /// Allocates a buffer on `adapter`'s device holding a copy of `data`, copied through the
    /// adapter's pinned staging.
    ///
    /// # Errors
    ///
    /// As [`zeros`](Self::zeros), and [`DeviceError::Adapter`] if the copy fails.
    pub fn from_host(adapter: &CudaAdapter, data: &[T]) -> Result<Self, DeviceError> {
        let mut buf = Self::zeros(adapter, data.len())?;
        adapter.write_buffer(&mut buf, bytemuck::cast_slice(data))?;
        Ok(buf)
    }

    /// Copies the buffer back to a new host vector, through `adapter`'s pinned staging.
    ///
    /// # Errors
    ///
    /// [`DeviceError::WrongDevice`] if `adapter` is not on this buffer's device and
    /// context, [`DeviceError::Adapter`] if the copy fails.
    pub fn to_host_with(&self, adapter: &CudaAdapter) -> Result<Vec<T>, DeviceError> {
        let mut out = vec![T::zeroed(); self.len];
        adapter.stage_buffer(self, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Copies the buffer back to a new host vector with a plain synchronous copy (no pinned
    /// staging; use [`to_host_with`](Self::to_host_with) on hot paths).
    ///
    /// # Errors
    ///
    /// [`DeviceError::Adapter`] if the copy fails.
    pub fn to_host(&self) -> Result<Vec<T>, DeviceError> {
        let mut out = vec![T::zeroed(); self.len];
        if let Some(slice) = &self.slice {
            let stream = slice.stream();
            stream
                .memcpy_dtoh(slice, bytemuck::cast_slice_mut::<T, u8>(&mut out))
                .map_err(driver_error("device to host copy"))?;
            stream.synchronize().map_err(driver_error("synchronize"))?;
        }
        Ok(out)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes: `len() * T::DTYPE.size()`.
    pub fn byte_len(&self) -> usize {
        self.len * T::DTYPE.size()
    }

    /// The ordinal of the device the buffer lives on.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device address of the first element, as the [`DeviceAdapter`](crate::DeviceAdapter) methods take it
    /// (null when empty). It is not dereferenceable on the host; it stays valid while the
    /// buffer lives. Prefer the typed [`CudaAdapter`] methods where possible.
    pub fn device_ptr(&self) -> *const u8 {
        self.ptr as *const u8
    }

    /// Mutable form of [`device_ptr`](Self::device_ptr), for
    /// [`DeviceAdapter::write_from_host`](crate::DeviceAdapter::write_from_host) and
    /// [`DeviceAdapter::reduce_from_host`](crate::DeviceAdapter::reduce_from_host).
    pub fn device_ptr_mut(&mut self) -> *mut u8 {
        self.ptr as *mut u8
    }

    pub(super) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl<T: Element> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("ordinal", &self.ordinal())
            .finish_non_exhaustive()
    }
}
