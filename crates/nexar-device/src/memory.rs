//! Owned buffers that collectives can run on where they live (host or device).

use crate::{check_op, DataType, DeviceError, Element, ReduceOp};

/// An owned buffer of one data type, in host or device memory, that a collective works on
/// in place: the runtime reads ranges of it to send, and writes or reduces received bytes
/// into ranges of it, without ever holding a host copy of the whole buffer. Offsets and
/// lengths are in bytes and must be whole elements.
///
/// Collectives take the buffer by value and give it back when done, so no task can
/// touch it after the caller stopped waiting.
pub trait DeviceMemory: std::any::Any + Send + 'static {
    /// Element type of the buffer.
    fn dtype(&self) -> DataType;
    /// Length in bytes.
    fn byte_len(&self) -> usize;
    /// Copies `dst.len()` bytes starting at `offset` into host memory `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Overwrites `src.len()` bytes starting at `offset` with host bytes `src`.
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), DeviceError>;
    /// `self[offset..] = op(self[offset..], src)` for `src.len()` bytes (Avg sums).
    fn reduce(&mut self, offset: usize, src: &[u8], op: ReduceOp) -> Result<(), DeviceError>;
    /// Divides the whole buffer by `divisor` for Avg: the final step of an Avg reduction,
    /// or, in `f16`, where the collectives divide each contribution first, the first.
    fn finalize(&mut self, op: ReduceOp, divisor: usize) -> Result<(), DeviceError>;
}

/// Checks that `[offset, offset + len)` lies inside `total` bytes and on element
/// boundaries of `dtype`.
pub fn check_range(
    dtype: DataType,
    total: usize,
    offset: usize,
    len: usize,
) -> Result<(), DeviceError> {
    let end = offset.checked_add(len).ok_or(DeviceError::LengthMismatch {
        dst: total,
        src: len,
    })?;
    if end > total {
        return Err(DeviceError::LengthMismatch {
            dst: total - offset.min(total),
            src: len,
        });
    }
    if offset % dtype.size() != 0 {
        return Err(DeviceError::BadOffset { offset, dtype });
    }
    dtype.element_count(len)?;
    Ok(())
}

/// Host memory as a [`DeviceMemory`]: the reference implementation, and what CPU callers
/// use with the device-style collective API.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostBuffer<T: Element>(pub Vec<T>);

impl<T: Element> HostBuffer<T> {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

impl<T: Element> DeviceMemory for HostBuffer<T> {
    fn dtype(&self) -> DataType {
        T::DTYPE
    }

    fn byte_len(&self) -> usize {
        std::mem::size_of_val(self.0.as_slice())
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        check_range(T::DTYPE, self.byte_len(), offset, dst.len())?;
        crate::copy_bytes(dst, &self.bytes()[offset..offset + dst.len()]);
        Ok(())
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        check_range(T::DTYPE, self.byte_len(), offset, src.len())?;
        crate::copy_bytes(&mut self.bytes_mut()[offset..offset + src.len()], src);
        Ok(())
    }

    fn reduce(&mut self, offset: usize, src: &[u8], op: ReduceOp) -> Result<(), DeviceError> {
        check_op(T::DTYPE, op)?;
        check_range(T::DTYPE, self.byte_len(), offset, src.len())?;
        let dst = &mut self.bytes_mut()[offset..offset + src.len()];
        crate::reduce_bytes(T::DTYPE, op, dst, src)
    }

    fn finalize(&mut self, op: ReduceOp, divisor: usize) -> Result<(), DeviceError> {
        crate::finalize_slice(op, &mut self.0, divisor)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn host_buffer_ranges_are_checked() {
        let mut b = HostBuffer(vec![1.0f32, 2.0, 3.0]);
        let mut out = [0u8; 4];
        b.read(4, &mut out).unwrap();
        assert_eq!(f32::from_le_bytes(out), 2.0);
        assert!(b.read(10, &mut out).is_err());
        assert_eq!(
            b.read(2, &mut out),
            Err(DeviceError::BadOffset {
                offset: 2,
                dtype: DataType::F32
            }),
            "not on an element boundary"
        );
        assert!(matches!(
            b.read(4, &mut out[..3]),
            Err(DeviceError::BadLength { len: 3, .. })
        ));
        b.reduce(8, &5.0f32.to_le_bytes(), ReduceOp::Sum).unwrap();
        assert_eq!(b.0[2], 8.0);
        b.write(0, &0.5f32.to_le_bytes()).unwrap();
        b.finalize(ReduceOp::Avg, 2).unwrap();
        assert_eq!(b.0, vec![0.25, 1.0, 4.0]);
        assert!(HostBuffer(vec![1i32])
            .reduce(0, &[0; 4], ReduceOp::Avg)
            .is_err());
    }
}
