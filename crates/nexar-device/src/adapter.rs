//! [`DeviceAdapter`]: the seam between the runtime and where buffers live.

use crate::{reduce_bytes, DataType, DeviceError, ReduceOp};

/// Moves and reduces bytes between host memory (where network buffers live) and the memory
/// a collective's buffer lives in (host RAM, a GPU, ...).
///
/// The runtime sends from a buffer by staging it to the host, and receives into it by
/// writing or reducing host bytes into it. Device memory is named by raw pointers because
/// it may not be addressable from the CPU at all.
///
/// # Contract for implementors
///
/// Callers promise the pointer preconditions listed on each method; in return an
/// implementation must touch device memory only inside the `len` bytes at the given pointer
/// (`len` being the length of the host slice), must not keep the pointer past the call, and
/// must have finished every access to that memory by the time it returns (asynchronous
/// devices synchronize before returning). On error, the device bytes may have been partly
/// written.
pub trait DeviceAdapter: Send + Sync + 'static {
    /// A short name for logs and errors, e.g. `"cpu"`.
    fn name(&self) -> &'static str;

    /// Copies `dst.len()` bytes of device memory at `src` into host memory `dst`, for a send.
    ///
    /// # Safety
    ///
    /// `src` must be valid for reads of `dst.len()` bytes for the duration of the call and
    /// must not overlap `dst`. If `dst` is empty, `src` may be any pointer, even null.
    unsafe fn stage_to_host(&self, src: *const u8, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies received host bytes `src` into device memory at `dst`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `src.len()` bytes for the duration of the call, and
    /// nothing else may read or write that memory meanwhile (in particular it must not
    /// overlap `src`). If `src` is empty, `dst` may be any pointer, even null.
    unsafe fn write_from_host(&self, dst: *mut u8, src: &[u8]) -> Result<(), DeviceError>;

    /// Reduces received host bytes `src` into device memory at `dst`: `dst = op(dst, src)`
    /// element-wise, with the semantics of [`reduce_bytes`] (so `Avg` sums).
    ///
    /// # Errors
    ///
    /// As [`reduce_bytes`]: an unsupported op or a `src` length that is not a whole number of
    /// elements leaves the device memory unchanged.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for reads and writes of `src.len()` bytes for the duration of the
    /// call, and nothing else may read or write that memory meanwhile (in particular it must
    /// not overlap `src`). If `src` is empty, `dst` may be any pointer, even null. `dst`
    /// need not be aligned for `dtype`.
    unsafe fn reduce_from_host(
        &self,
        dst: *mut u8,
        src: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), DeviceError>;

    /// Whether the pointers this adapter is given are ordinary host memory, so that a caller
    /// may use them as host slices directly and skip the staging copies. `false` unless an
    /// adapter says otherwise.
    fn host_accessible(&self) -> bool {
        false
    }
}

/// The adapter for host memory: the pointers are ordinary host pointers and every method is
/// a `memcpy` or a call to [`reduce_bytes`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuAdapter;

impl DeviceAdapter for CpuAdapter {
    fn name(&self) -> &'static str {
        "cpu"
    }

    unsafe fn stage_to_host(&self, src: *const u8, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller guarantees `src` is valid for reads of `dst.len()` bytes and
        // does not overlap `dst`; `dst` is a live `&mut` slice of that length; u8 has no
        // alignment requirement.
        unsafe { crate::copy::copy_raw(dst.as_mut_ptr(), src, dst.len()) };
        Ok(())
    }

    unsafe fn write_from_host(&self, dst: *mut u8, src: &[u8]) -> Result<(), DeviceError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller guarantees `dst` is valid for writes of `src.len()` bytes and
        // not aliased (so not overlapping `src`); u8 has no alignment requirement.
        unsafe { crate::copy::copy_raw(dst, src.as_ptr(), src.len()) };
        Ok(())
    }

    unsafe fn reduce_from_host(
        &self,
        dst: *mut u8,
        src: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), DeviceError> {
        if src.is_empty() {
            // Still report an unsupported op, without touching a possibly dangling `dst`.
            return reduce_bytes(dtype, op, &mut [], &[]);
        }
        // SAFETY: the caller guarantees `dst` is non-null (src is non-empty), valid for reads
        // and writes of `src.len()` bytes for this call, and that nothing else accesses that
        // memory meanwhile, so a unique `&mut [u8]` over it is sound; u8 needs no alignment.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst, src.len()) };
        reduce_bytes(dtype, op, dst, src)
    }

    fn host_accessible(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn sample(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn copies_match_slices() {
        let a = CpuAdapter;
        assert_eq!(a.name(), "cpu");
        assert!(a.host_accessible());
        let device = sample(37, 5);
        let mut host = vec![0u8; 37];
        // SAFETY: `device` is a live buffer of 37 bytes.
        unsafe { a.stage_to_host(device.as_ptr(), &mut host) }.unwrap();
        assert_eq!(host, device);

        let mut device = vec![0u8; 37];
        let src = sample(37, 9);
        // SAFETY: `device` is a live, unaliased buffer of 37 bytes.
        unsafe { a.write_from_host(device.as_mut_ptr(), &src) }.unwrap();
        assert_eq!(device, src);
    }

    #[test]
    fn empty_transfers_accept_null() {
        let a = CpuAdapter;
        // SAFETY: zero-length transfers may use any pointer, even null.
        unsafe {
            a.stage_to_host(std::ptr::null(), &mut []).unwrap();
            a.write_from_host(std::ptr::null_mut(), &[]).unwrap();
            a.reduce_from_host(std::ptr::null_mut(), &[], DataType::F32, ReduceOp::Sum)
                .unwrap();
            assert!(matches!(
                a.reduce_from_host(std::ptr::null_mut(), &[], DataType::I32, ReduceOp::Avg),
                Err(DeviceError::UnsupportedOp { .. })
            ));
        }
    }

    #[test]
    fn reduce_matches_reduce_bytes() {
        let a = CpuAdapter;
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                let n = 24 * dtype.size();
                let src = sample(n, 3);
                let init = sample(n + 1, 77);
                let mut expected = init[1..].to_vec();
                let want = reduce_bytes(dtype, op, &mut expected, &src);
                // Unaligned device pointer on purpose.
                let mut device = init.clone();
                // SAFETY: `device[1..]` is a live, unaliased buffer of `n` bytes.
                let got = unsafe { a.reduce_from_host(device[1..].as_mut_ptr(), &src, dtype, op) };
                assert_eq!(got, want, "{dtype} {op}");
                assert_eq!(device[1..], expected[..], "{dtype} {op}");
            }
        }
        let mut device = [0u8; 3];
        // SAFETY: `device` is a live buffer of 3 bytes.
        let err = unsafe {
            a.reduce_from_host(
                device.as_mut_ptr(),
                &[1, 2, 3],
                DataType::F32,
                ReduceOp::Sum,
            )
        };
        assert!(matches!(err, Err(DeviceError::BadLength { len: 3, .. })));
    }

    #[test]
    fn adapter_is_object_safe() {
        let boxed: Box<dyn DeviceAdapter> = Box::new(CpuAdapter);
        assert_eq!(boxed.name(), "cpu");
    }
}
