//! Gradient compression: sparsifying codecs with error feedback, their wire format, and
//! the accumulation that turns an all-gather of encodings into an all-reduce.
//!
//! A compressed all-reduce of `data` (`n` elements of `T`) over `w` ranks:
//!
//! 1. Every rank: `let s = compress_with_feedback(&codec, step, data, &mut residual)?`,
//!    with the same `codec` and `step` on every rank (a training step or the collective's
//!    sequence number; random-k then picks the same indices everywhere).
//! 2. `encode(&s)`: exactly [`Codec::wire_bytes`]`(n, T::DTYPE)` bytes on every rank, so
//!    an all-gather with fixed-size blocks carries them.
//! 3. Zero `data`, then for each rank's block in rank order
//!    `accumulate(data, &decode(block, n)?)?`. That is the sum of the decompressed
//!    tensors ([`ReduceOp::Sum`](nexar_device::ReduceOp::Sum)), bit-identical on every
//!    rank; for [`ReduceOp::Avg`](nexar_device::ReduceOp::Avg) finish with
//!    [`nexar_device::finalize_slice`] and divisor `w`.
//!
//! Each rank sends `wire_bytes` instead of `n * size` bytes, but receives `w - 1` blocks,
//! so this beats a dense ring all-reduce (about `2 n size` per rank) while
//! `w * wire_bytes < 2 n size`.
//!
//! ```
//! use nexar_collectives::{accumulate, compress_with_feedback, decode, encode, Codec, Residual};
//!
//! let codec = Codec::top_k(0.5)?;
//! let grads = [[1.0f32, -4.0, 0.5, 2.0], [0.0, 1.0, -3.0, 0.25]];
//! let mut residuals = [Residual::<f32>::new(4), Residual::new(4)];
//! let blocks = grads
//!     .iter()
//!     .zip(&mut residuals)
//!     .map(|(g, r)| compress_with_feedback(&codec, 0, g, r).map(|s| encode(&s)))
//!     .collect::<Result<Vec<_>, _>>()?;
//! assert!(blocks.iter().all(|b| b.len() == codec.wire_bytes(4, nexar_device::DataType::F32)));
//! let mut sum = [0.0f32; 4];
//! for b in &blocks {
//!     accumulate(&mut sum, &decode(b, 4)?)?;
//! }
//! assert_eq!(sum, [0.0, -3.0, -3.0, 2.0]);
//! assert_eq!(residuals[0].as_slice(), [1.0, 0.0, 0.5, 0.0]);
//! # Ok::<(), nexar_collectives::CodecError>(())
//! ```

mod element;
mod error;
mod select;
mod sparse;

#[cfg(test)]
mod experiment;
#[cfg(test)]
mod tests;

use nexar_device::DataType;

pub use element::{CompressElement, WideFloat};
pub use error::CodecError;
pub use sparse::{accumulate, decode, encode, Sparse};

use sparse::check_len;

/// The fraction of a tensor's entries a codec keeps: a number in `(0, 1]`.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct Ratio(f64);

impl Ratio {
    /// Fails with [`CodecError::InvalidRatio`] unless `0 < ratio <= 1`.
    pub fn new(ratio: f64) -> Result<Self, CodecError> {
        if ratio > 0.0 && ratio <= 1.0 {
            Ok(Self(ratio))
        } else {
            Err(CodecError::InvalidRatio(ratio))
        }
    }

    /// The ratio as a number.
    pub fn get(self) -> f64 {
        self.0
    }

    /// Entries kept out of `n`: `ceil(ratio * n)`, at least 1 and at most `n` (0 for
    /// `n == 0`). A product within rounding error of a whole number counts as that
    /// number: `0.07` is stored a little above 7/100, and keeps 7 of 100, not 8.
    pub fn k(self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let x = self.0 * n as f64;
        let whole = x.round();
        let k = if (x - whole).abs() <= 2.0 * f64::EPSILON * x {
            whole
        } else {
            x.ceil()
        };
        (k as usize).clamp(1, n)
    }
}

/// A sparsifying gradient codec: which `k` of a tensor's `n` entries a rank sends.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Codec {
    /// The `k` entries of largest magnitude (after adding the residual, with error
    /// feedback). Found in expected linear time; ties go to the lower index; NaN counts
    /// as larger than any number, so it is sent rather than hidden in the residual.
    TopK {
        /// Fraction of entries kept.
        ratio: Ratio,
    },
    /// `k` entries chosen uniformly at random, determined by `(seed, step)` alone: the
    /// same on every rank and every rerun, different from step to step.
    ///
    /// Without error feedback ([`compress`]) the values are scaled by `n / k`, so the
    /// decompressed tensor is an unbiased estimate of the input. With error feedback
    /// ([`compress_with_feedback`]) they are not: the residual already carries what was
    /// left out, and scaling would make it grow by a factor of about `n / k - 1` per call.
    /// The scaled values are rounded to the element type: in `f16`, any input above
    /// `65504 * k / n` goes out as infinity (700 at a ratio of 0.01), so loss-scaled `f16`
    /// gradients want error feedback, or a wider type.
    RandomK {
        /// Fraction of entries kept.
        ratio: Ratio,
        /// Seed shared by all ranks.
        seed: u64,
    },
}

impl Codec {
    /// [`Codec::TopK`] keeping `ratio` of the entries; fails unless `0 < ratio <= 1`.
    pub fn top_k(ratio: f64) -> Result<Self, CodecError> {
        Ok(Self::TopK {
            ratio: Ratio::new(ratio)?,
        })
    }

    /// [`Codec::RandomK`] keeping `ratio` of the entries; fails unless `0 < ratio <= 1`.
    pub fn random_k(ratio: f64, seed: u64) -> Result<Self, CodecError> {
        Ok(Self::RandomK {
            ratio: Ratio::new(ratio)?,
            seed,
        })
    }

    /// The fraction of entries kept.
    pub fn ratio(&self) -> Ratio {
        match *self {
            Self::TopK { ratio } | Self::RandomK { ratio, .. } => ratio,
        }
    }

    /// Entries kept out of `n` ([`Ratio::k`]).
    pub fn k(&self, n: usize) -> usize {
        self.ratio().k(n)
    }

    /// Bytes one rank puts on the wire for a tensor of `n` elements of `dtype`: the exact
    /// length of [`encode`]'s output (12-byte header, then `k` indices of 4 bytes and `k`
    /// values). Saturates at `usize::MAX`.
    pub fn wire_bytes(&self, n: usize, dtype: DataType) -> usize {
        sparse::encoded_len(self.k(n), dtype)
    }
}

/// Error-feedback state for one tensor: what earlier calls of [`compress_with_feedback`]
/// did not send, added to the next call's input.
///
/// Kept in [`CompressElement::Wide`] precision (`f32` for `f16`/`bf16`), so small
/// gradients are not lost to rounding. A value sent that is not finite (an infinite or
/// NaN input, or an `f16` beyond 65504, sent as infinity) leaves 0 behind in its place:
/// the sum of that call is not finite (skip the step, as after a loss-scaling
/// overflow), and later calls go on from there. A non-finite input that is not sent stays
/// in the residual until it is; [`reset`](Self::reset) clears it.
#[derive(Clone, Debug, PartialEq)]
pub struct Residual<T: CompressElement> {
    values: Vec<T::Wide>,
}

impl<T: CompressElement> Residual<T> {
    /// A zero residual for a tensor of `len` elements.
    pub fn new(len: usize) -> Self {
        Self {
            values: vec![T::Wide::default(); len],
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The residual, element by element.
    pub fn as_slice(&self) -> &[T::Wide] {
        &self.values
    }

    /// Sets every element to zero.
    pub fn reset(&mut self) {
        self.values.fill(T::Wide::default());
    }
}

/// Compresses `data` without error feedback.
///
/// [`Codec::TopK`] sends the chosen entries as they are; [`Codec::RandomK`] scales them
/// by `n / k` so that the result is unbiased. `step` only matters to random-k: pass the
/// same value on every rank, a different one each call. Fails with
/// [`CodecError::TooLong`] for more than `u32::MAX` elements.
pub fn compress<T: CompressElement>(
    codec: &Codec,
    step: u64,
    data: &[T],
) -> Result<Sparse<T>, CodecError> {
    let n = data.len();
    check_len(n)?;
    let k = codec.k(n);
    let (indices, values) = match *codec {
        Codec::TopK { .. } => {
            let indices = select::top_k(data.iter().map(|x| x.widen().abs()), k);
            // Indices come from the selection and are below n.
            let values = indices.iter().map(|&i| data[i as usize]).collect();
            (indices, values)
        }
        Codec::RandomK { seed, .. } => {
            let indices = select::random_k(seed, step, n, k);
            let scale = T::Wide::from_f64(n as f64 / k.max(1) as f64);
            let values = indices
                .iter()
                .map(|&i| T::narrow(data[i as usize].widen().mul(scale)))
                .collect();
            (indices, values)
        }
    };
    Ok(Sparse::new_unchecked(n, indices, values))
}

/// Compresses `data` with error feedback, updating `residual`.
///
/// Compresses `x' = data + residual` (computed in [`CompressElement::Wide`]), then sets
/// `residual = x' - decompress(sent)`, so nothing is lost, only delayed: over any number
/// of calls, the sum of what was sent plus the final residual equals the sum of the
/// inputs, up to rounding. The values sent are `x'` rounded to `T` (the rounding error
/// stays in the residual too); random-k values are not rescaled (see [`Codec::RandomK`]).
///
/// Fails, changing nothing, with [`CodecError::LengthMismatch`] unless `residual` has
/// `data.len()` elements, or [`CodecError::TooLong`] past `u32::MAX` elements.
pub fn compress_with_feedback<T: CompressElement>(
    codec: &Codec,
    step: u64,
    data: &[T],
    residual: &mut Residual<T>,
) -> Result<Sparse<T>, CodecError> {
    let n = data.len();
    check_len(n)?;
    if residual.len() != n {
        return Err(CodecError::LengthMismatch {
            expected: n,
            actual: residual.len(),
        });
    }
    let acc = &mut residual.values;
    for (r, x) in acc.iter_mut().zip(data) {
        *r = x.widen().add(*r);
    }
    let k = codec.k(n);
    let indices = match *codec {
        Codec::TopK { .. } => select::top_k(acc.iter().map(|r| r.abs()), k),
        Codec::RandomK { seed, .. } => select::random_k(seed, step, n, k),
    };
    let values = indices
        .iter()
        .map(|&i| {
            // Indices come from the selection and are below n.
            let r = &mut acc[i as usize];
            let sent = T::narrow(*r);
            // What is left; where that is not finite (an infinite or NaN input was sent,
            // or an f16 overflowed to infinity) nothing is: the non-finite value went out
            // in the sum, and a NaN kept here would be sent again every call (it ranks
            // first) and crowd the other values out.
            let left = r.sub(sent.widen());
            *r = if left.to_f64().is_finite() {
                left
            } else {
                T::Wide::default()
            };
            sent
        })
        .collect();
    Ok(Sparse::new_unchecked(n, indices, values))
}
