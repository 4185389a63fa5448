//! GPU buffers as [`DeviceMemory`], so collectives run on them in place: sends stage
//! ranges to host through pinned buffers, received bytes are written or reduced into the
//! device buffer by the GPU, and only the wire sees host memory.

use std::sync::Arc;

use super::{CudaAdapter, DeviceBuffer};
use crate::{
    check_op, check_range, DataType, DeviceAdapter, DeviceError, DeviceMemory, Element, ReduceOp,
};

/// A [`DeviceBuffer`] together with the adapter that stages and reduces it.
#[derive(Debug)]
pub struct CudaMemory<T: Element> {
    adapter: Arc<CudaAdapter>,
    buf: DeviceBuffer<T>,
}

impl<T: Element> CudaMemory<T> {
    /// Pairs `buf` with `adapter`; the buffer must live on the adapter's device.
    pub fn new(
        adapter: Arc<CudaAdapter>,
        buf: DeviceBuffer<T>,
    ) -> Result<CudaMemory<T>, DeviceError> {
        if buf.ordinal() != adapter.ordinal() {
            return Err(DeviceError::WrongDevice {
                adapter: adapter.ordinal(),
                buffer: buf.ordinal(),
            });
        }
        // Same ordinal, other context: refused too.
        adapter.check_buffer(&buf)?;
        Ok(CudaMemory { adapter, buf })
    }

    /// The device buffer back.
    pub fn into_inner(self) -> DeviceBuffer<T> {
        self.buf
    }

    /// The device buffer.
    pub fn buffer(&self) -> &DeviceBuffer<T> {
        &self.buf
    }
}

impl<T: Element> DeviceMemory for CudaMemory<T> {
    fn dtype(&self) -> DataType {
        T::DTYPE
    }

    fn byte_len(&self) -> usize {
        self.buf.byte_len()
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        check_range(T::DTYPE, self.byte_len(), offset, dst.len())?;
        // SAFETY: the range lies inside the buffer (checked above); the buffer is owned by
        // `self` and has no pending work (every adapter call synchronizes). The pointer is a
        // device address, inside no host allocation, so it is offset with `wrapping_add`
        // (plain address arithmetic), not `add`.
        unsafe {
            self.adapter
                .stage_to_host(self.buf.device_ptr().wrapping_add(offset), dst)
        }
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        check_range(T::DTYPE, self.byte_len(), offset, src.len())?;
        // SAFETY: as in `read`; `&mut self` makes the range exclusively ours.
        unsafe {
            self.adapter
                .write_from_host(self.buf.device_ptr_mut().wrapping_add(offset), src)
        }
    }

    fn reduce(&mut self, offset: usize, src: &[u8], op: ReduceOp) -> Result<(), DeviceError> {
        check_op(T::DTYPE, op)?;
        check_range(T::DTYPE, self.byte_len(), offset, src.len())?;
        // SAFETY: as in `write`.
        unsafe {
            self.adapter.reduce_from_host(
                self.buf.device_ptr_mut().wrapping_add(offset),
                src,
                T::DTYPE,
                op,
            )
        }
    }

    fn finalize(&mut self, op: ReduceOp, divisor: usize) -> Result<(), DeviceError> {
        let len = self.byte_len();
        // SAFETY: the whole buffer, owned by `self`.
        unsafe {
            self.adapter
                .finalize_raw(self.buf.device_ptr_mut(), len, T::DTYPE, op, divisor)
        }
    }
}
