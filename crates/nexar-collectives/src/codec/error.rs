//! [`CodecError`]: bad codec parameters, mismatched lengths and malformed encodings.

use nexar_device::DataType;

/// An error from a gradient-compression codec.
///
/// The decoding variants ([`Truncated`](Self::Truncated) to
/// [`UnsortedIndices`](Self::UnsortedIndices)) mean a peer sent bytes that are not a valid
/// encoding for the expected tensor; nothing was written anywhere.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// A ratio outside `(0, 1]`, or not a number.
    #[error("compression ratio {0} is not in (0, 1]")]
    InvalidRatio(f64),
    /// A tensor longer than the wire format's `u32` element count and indices can describe.
    #[error("{len} elements is more than a compressed tensor can hold ({max})", max = u32::MAX)]
    TooLong {
        /// The length given.
        len: usize,
    },
    /// Two buffers that must have the same number of elements do not: data and residual,
    /// dense and sparse in [`accumulate`](crate::accumulate), indices and values.
    #[error("length mismatch: expected {expected} elements, got {actual}")]
    LengthMismatch {
        /// The length required.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// The encoding is shorter than its header says it must be.
    #[error("encoding truncated: need {needed} bytes, got {actual}")]
    Truncated {
        /// Bytes required (saturated at `usize::MAX`).
        needed: usize,
        /// Bytes received.
        actual: usize,
    },
    /// The encoding has bytes after its last value.
    #[error("encoding has trailing bytes: expected {expected} bytes, got {actual}")]
    TrailingBytes {
        /// The exact length the header implies.
        expected: usize,
        /// Bytes received.
        actual: usize,
    },
    /// The encoding holds a different element type (or an unknown type tag).
    #[error("encoding element type tag {found} is not {expected}")]
    DataTypeMismatch {
        /// The element type the receiver decodes.
        expected: DataType,
        /// The tag found in the header.
        found: u8,
    },
    /// The header's reserved bytes are not zero: a newer or corrupt encoding.
    #[error("encoding header reserved bytes are not zero")]
    ReservedNonZero,
    /// The encoding describes a tensor of a different length than the receiver's.
    #[error("encoding is for {actual} elements, expected {expected}")]
    CountMismatch {
        /// The element count the receiver expects.
        expected: usize,
        /// The element count in the header.
        actual: usize,
    },
    /// More entries than the tensor has elements.
    #[error("{k} entries for a tensor of {len} elements")]
    TooManyEntries {
        /// The entry count.
        k: usize,
        /// The tensor length.
        len: usize,
    },
    /// An index past the end of the tensor.
    #[error("index {index} out of range for a tensor of {len} elements")]
    IndexOutOfRange {
        /// The index.
        index: u32,
        /// The tensor length.
        len: usize,
    },
    /// The same index twice.
    #[error("index {index} appears more than once")]
    DuplicateIndex {
        /// The repeated index.
        index: u32,
    },
    /// Indices not in strictly increasing order.
    #[error("index {index} follows the larger index {previous}")]
    UnsortedIndices {
        /// The earlier, larger index.
        previous: u32,
        /// The index that follows it.
        index: u32,
    },
}
