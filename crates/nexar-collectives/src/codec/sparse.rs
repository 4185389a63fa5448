//! [`Sparse`]: a compressed tensor, its wire format ([`encode`], [`decode`]) and
//! [`accumulate`], the receiving side of a compressed all-reduce.

use nexar_device::DataType;

use super::element::{CompressElement, WideFloat};
use super::CodecError;

/// Bytes before the indices: count `u32`, k `u32`, type tag `u8`, three reserved zeros.
pub(super) const HEADER_LEN: usize = 12;

/// A sparse tensor: `len` elements, zero except at `indices`, where they are `values`.
///
/// Always valid: indices strictly increasing and below `len`, one value per index, `len`
/// at most `u32::MAX`. [`compress`](crate::compress) and [`decode`] produce one;
/// [`Sparse::new`] checks one built by hand.
#[derive(Clone, Debug, PartialEq)]
pub struct Sparse<T> {
    len: usize,
    indices: Vec<u32>,
    values: Vec<T>,
}

impl<T: CompressElement> Sparse<T> {
    /// A sparse tensor of `len` elements with `values[j]` at `indices[j]`.
    ///
    /// Fails unless the indices are strictly increasing and below `len`, there are as
    /// many values as indices, and `len <= u32::MAX`.
    pub fn new(len: usize, indices: Vec<u32>, values: Vec<T>) -> Result<Self, CodecError> {
        check_len(len)?;
        if values.len() != indices.len() {
            return Err(CodecError::LengthMismatch {
                expected: indices.len(),
                actual: values.len(),
            });
        }
        if indices.len() > len {
            return Err(CodecError::TooManyEntries {
                k: indices.len(),
                len,
            });
        }
        check_indices(&indices, len)?;
        Ok(Self::new_unchecked(len, indices, values))
    }

    /// For callers that built `indices` valid by construction.
    pub(super) fn new_unchecked(len: usize, indices: Vec<u32>, values: Vec<T>) -> Self {
        debug_assert!(check_indices(&indices, len).is_ok() && indices.len() == values.len());
        Self {
            len,
            indices,
            values,
        }
    }

    /// Number of elements of the dense tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the dense tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of stored entries (`k`).
    pub fn nnz(&self) -> usize {
        self.indices.len()
    }

    /// The stored positions, strictly increasing.
    pub fn indices(&self) -> &[u32] {
        &self.indices
    }

    /// The stored values, `values()[j]` at `indices()[j]`.
    pub fn values(&self) -> &[T] {
        &self.values
    }

    /// The dense tensor: zeros with the values at their indices.
    pub fn to_dense(&self) -> Vec<T> {
        let mut dense = vec![T::narrow(T::Wide::default()); self.len];
        for (&i, &v) in self.indices.iter().zip(&self.values) {
            if let Some(d) = dense.get_mut(i as usize) {
                *d = v;
            }
        }
        dense
    }

    /// Bytes of [`encode`]'s output.
    pub fn encoded_len(&self) -> usize {
        encoded_len(self.nnz(), T::DTYPE)
    }
}

/// Bytes of an encoding of `k` entries of `dtype`.
pub(super) fn encoded_len(k: usize, dtype: DataType) -> usize {
    k.saturating_mul(4 + dtype.size())
        .saturating_add(HEADER_LEN)
}

/// Encodes `sparse` for the wire.
///
/// Format (all integers little-endian): element count `u32`, entry count `k` `u32`, the
/// element type tag `u8` (1 `f32`, 2 `f64`, 3 `f16`, 4 `bf16`), three zero bytes, `k`
/// indices `u32` strictly increasing, then `k` values, each in the element type's
/// little-endian IEEE 754 representation. Exactly [`Sparse::encoded_len`] bytes, which
/// depends only on `k`, the type and so, for a codec, on the tensor length
/// ([`Codec::wire_bytes`](crate::Codec::wire_bytes)).
pub fn encode<T: CompressElement>(sparse: &Sparse<T>) -> Vec<u8> {
    let mut out = Vec::with_capacity(sparse.encoded_len());
    // Both fit: a Sparse never holds more than u32::MAX elements.
    out.extend_from_slice(&(sparse.len as u32).to_le_bytes());
    out.extend_from_slice(&(sparse.nnz() as u32).to_le_bytes());
    out.extend_from_slice(&[type_tag(T::DTYPE), 0, 0, 0]);
    for &i in &sparse.indices {
        out.extend_from_slice(&i.to_le_bytes());
    }
    for &v in &sparse.values {
        v.write_le(&mut out);
    }
    out
}

/// Decodes bytes from [`encode`], checking everything a peer could get wrong.
///
/// `expected_len` is the receiver's own tensor length. Fails with the first problem
/// found, checked in this order: [`Truncated`](CodecError::Truncated) when the bytes do
/// not hold the header; [`DataTypeMismatch`](CodecError::DataTypeMismatch);
/// [`ReservedNonZero`](CodecError::ReservedNonZero);
/// [`CountMismatch`](CodecError::CountMismatch) for an encoding of another length than
/// `expected_len`; [`TooManyEntries`](CodecError::TooManyEntries) when `k` exceeds the
/// count; [`Truncated`](CodecError::Truncated) / [`TrailingBytes`](CodecError::TrailingBytes)
/// unless the length is exactly what the header implies;
/// [`IndexOutOfRange`](CodecError::IndexOutOfRange),
/// [`DuplicateIndex`](CodecError::DuplicateIndex) and
/// [`UnsortedIndices`](CodecError::UnsortedIndices) for the first index at fault.
/// Allocates only after the length check, so a lying header cannot make it allocate more
/// than the input's size.
pub fn decode<T: CompressElement>(
    bytes: &[u8],
    expected_len: usize,
) -> Result<Sparse<T>, CodecError> {
    let (header, body) = bytes
        .split_at_checked(HEADER_LEN)
        .ok_or(CodecError::Truncated {
            needed: HEADER_LEN,
            actual: bytes.len(),
        })?;
    let count = read_u32(header, 0) as usize;
    let k = read_u32(header, 4) as usize;
    let tag = header.get(8).copied().unwrap_or_default();
    if tag != type_tag(T::DTYPE) {
        return Err(CodecError::DataTypeMismatch {
            expected: T::DTYPE,
            found: tag,
        });
    }
    if header
        .get(9..HEADER_LEN)
        .is_none_or(|r| r.iter().any(|&b| b != 0))
    {
        return Err(CodecError::ReservedNonZero);
    }
    if count != expected_len {
        return Err(CodecError::CountMismatch {
            expected: expected_len,
            actual: count,
        });
    }
    if k > count {
        return Err(CodecError::TooManyEntries { k, len: count });
    }
    let needed = encoded_len(k, T::DTYPE);
    if bytes.len() < needed {
        return Err(CodecError::Truncated {
            needed,
            actual: bytes.len(),
        });
    }
    if bytes.len() > needed {
        return Err(CodecError::TrailingBytes {
            expected: needed,
            actual: bytes.len(),
        });
    }
    // The length is exact, so this split cannot fail; stay panic-free regardless.
    let (index_bytes, value_bytes) = body.split_at_checked(k * 4).ok_or(CodecError::Truncated {
        needed,
        actual: bytes.len(),
    })?;
    let indices: Vec<u32> = index_bytes
        .chunks_exact(4)
        .map(|c| read_u32(c, 0))
        .collect();
    check_indices(&indices, count)?;
    let values = value_bytes
        .chunks_exact(T::DTYPE.size())
        .map(T::read_le)
        .collect::<Option<Vec<T>>>()
        .ok_or(CodecError::Truncated {
            needed,
            actual: bytes.len(),
        })?;
    Ok(Sparse::new_unchecked(count, indices, values))
}

/// Adds `sparse` into `dense`: `dense[i] += v` for every stored `(i, v)`.
///
/// Fails with [`CodecError::LengthMismatch`], leaving `dense` untouched, unless both have
/// the same length. `f16`/`bf16` add in `f32` and round back to nearest, ties to even.
///
/// A compressed all-reduce is an all-gather of every rank's [`encode`]d tensor, then
/// [`decode`] and `accumulate` of each into a zeroed buffer: that is
/// [`ReduceOp::Sum`](nexar_device::ReduceOp::Sum) of the decompressed tensors. For
/// [`ReduceOp::Avg`](nexar_device::ReduceOp::Avg), divide by the world size afterwards
/// with [`nexar_device::finalize_slice`]. Accumulating in rank order on every rank gives
/// bit-identical results on every rank.
pub fn accumulate<T: CompressElement>(
    dense: &mut [T],
    sparse: &Sparse<T>,
) -> Result<(), CodecError> {
    if dense.len() != sparse.len {
        return Err(CodecError::LengthMismatch {
            expected: dense.len(),
            actual: sparse.len,
        });
    }
    for (&i, &v) in sparse.indices.iter().zip(&sparse.values) {
        // Always in range for a valid Sparse of this length.
        if let Some(d) = dense.get_mut(i as usize) {
            *d = T::narrow(d.widen().add(v.widen()));
        }
    }
    Ok(())
}

/// Fails unless `len` fits the wire format's `u32` count.
pub(super) fn check_len(len: usize) -> Result<(), CodecError> {
    if u32::try_from(len).is_err() {
        return Err(CodecError::TooLong { len });
    }
    Ok(())
}

/// Fails unless `indices` are strictly increasing and below `len`.
fn check_indices(indices: &[u32], len: usize) -> Result<(), CodecError> {
    let mut previous: Option<u32> = None;
    for &index in indices {
        if index as usize >= len {
            return Err(CodecError::IndexOutOfRange { index, len });
        }
        match previous {
            Some(p) if p == index => return Err(CodecError::DuplicateIndex { index }),
            Some(p) if p > index => return Err(CodecError::UnsortedIndices { previous: p, index }),
            _ => {}
        }
        previous = Some(index);
    }
    Ok(())
}

/// The header's element type tag.
fn type_tag(dtype: DataType) -> u8 {
    match dtype {
        DataType::F32 => 1,
        DataType::F64 => 2,
        DataType::F16 => 3,
        DataType::BF16 => 4,
        // CompressElement is only implemented for the four float types.
        _ => 0,
    }
}

/// The little-endian `u32` at `offset`, or 0 past the end (callers check lengths first).
fn read_u32(bytes: &[u8], offset: usize) -> u32 {
    bytes
        .get(offset..offset + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}
