//! [`DeviceError`]: everything that can go wrong in this crate.

use crate::{DataType, ReduceOp};

/// An error from a reduction kernel, a parse, or a device adapter.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The reduce op is not defined for the data type ([`ReduceOp::Avg`] on an integer type).
    #[error("reduce op {op} is not supported for data type {dtype}")]
    UnsupportedOp {
        /// The requested op.
        op: ReduceOp,
        /// The data type it was requested for.
        dtype: DataType,
    },
    /// A byte buffer's length is not a multiple of the element size.
    #[error("buffer of {len} bytes is not a whole number of {dtype} elements ({} bytes each)", .dtype.size())]
    BadLength {
        /// The buffer length in bytes.
        len: usize,
        /// The data type the buffer was meant to hold.
        dtype: DataType,
    },
    /// An offset into a buffer does not fall on an element boundary.
    #[error("offset of {offset} bytes is not on a {dtype} element boundary ({} bytes each)", .dtype.size())]
    BadOffset {
        /// The offset in bytes.
        offset: usize,
        /// The data type the buffer holds.
        dtype: DataType,
    },
    /// The destination and source of a reduction or copy differ in length.
    #[error("destination is {dst} bytes but source is {src} bytes")]
    LengthMismatch {
        /// Destination length in bytes.
        dst: usize,
        /// Source length in bytes.
        src: usize,
    },
    /// A string did not name a [`DataType`].
    #[error("unknown data type {0:?}")]
    UnknownDataType(String),
    /// A string did not name a [`ReduceOp`].
    #[error("unknown reduce op {0:?}")]
    UnknownReduceOp(String),
    /// [`finalize_bytes`](crate::finalize_bytes) was asked to average over zero contributions.
    #[error("cannot average over zero contributions")]
    ZeroDivisor,
    /// No usable device: the driver library is missing, the driver failed to initialize,
    /// or there is no device with the requested ordinal. The message says which.
    #[error("device unavailable: {0}")]
    Unavailable(String),
    /// A device buffer was handed to an adapter for another device (or another context on
    /// the same device).
    #[error(
        "buffer is on device {buffer} but the adapter is for device {adapter} (or another context)"
    )]
    WrongDevice {
        /// The adapter's device ordinal.
        adapter: usize,
        /// The buffer's device ordinal.
        buffer: usize,
    },
    /// A device adapter failed (for example a CUDA call returned an error).
    #[error("{adapter} adapter: {message}")]
    Adapter {
        /// The adapter's [`name`](crate::DeviceAdapter::name).
        adapter: &'static str,
        /// What went wrong, as the device reported it.
        message: String,
    },
}
