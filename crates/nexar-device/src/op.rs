//! [`ReduceOp`]: how a reduction combines two elements.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::DeviceError;

/// How a reduction combines elements from different ranks.
///
/// The names (`"sum"`, `"prod"`, `"min"`, `"max"`, `"avg"`) are used by
/// [`Display`](fmt::Display), [`FromStr`] and serde alike.
///
/// A NaN that a `bf16` reduction computes (an `Avg`'s division included) is always the
/// quiet NaN `0x7FC0`, on the CPU and in the CUDA kernels, whatever the NaN operands'
/// payloads (a value that no reduction touches, as on one rank, keeps its own). On the
/// CPU, other float types keep an operand's payload; which operand's, where both are
/// NaNs, is not fixed: it may differ between the CPU's loops and instruction sets. In the
/// CUDA kernels they do not: a GPU's float arithmetic gives its own NaN whatever the
/// operands' (`0x7FFFFFFF` for `f32`, and so `0x7FFF` for `f16`, computed in `f32`),
/// but for `Min`/`Max`, which pick an operand. So where two ranks reduce the same NaNs
/// (all-reduce by recursive doubling; a small device all-reduce, one rank on the GPU,
/// the other on the CPU; ranks on different CPUs) they can end with NaNs of different
/// payloads there. Use `bf16` where that matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// Addition; wraps on integer overflow.
    Sum,
    /// Multiplication; wraps on integer overflow.
    Prod,
    /// Minimum. For floats this follows [`f32::min`]: a NaN loses against any number.
    Min,
    /// Maximum. For floats this follows [`f32::max`]: a NaN loses against any number.
    Max,
    /// Arithmetic mean, for float types only: a [`Sum`](Self::Sum) during the reduction,
    /// then one division by the number of contributions in
    /// [`finalize_bytes`](crate::finalize_bytes). The partial sums are of the element
    /// type. In `f16`, whose sums pass 65504 (and become infinite) long before a mean
    /// does, the collectives of `nexar-actors` instead divide each contribution by the
    /// world size before the sum, as NCCL does, and nothing after: 4 ranks of 20000
    /// average to 20000, at the cost of rounding each divided input: exact when the
    /// world is a power of two, but an input under 2^-14 times the world size in
    /// magnitude loses precision (its quotient is subnormal), and one of at most 2^-25
    /// times the world size becomes zero. Where a call
    /// must leave its input as it was (a send buffer, a non-root's reduce, the other
    /// blocks of an in-place reduce-scatter) the division goes into a copy: one buffer of
    /// memory more, and a zero-copy buffer is then sent from that copy.
    Avg,
}

impl ReduceOp {
    /// Every reduce op, in declaration order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The lower-case name: `"sum"`, `"prod"`, `"min"`, `"max"` or `"avg"`.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = DeviceError;

    /// Parses a name as printed by [`ReduceOp::name`], ignoring ASCII case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| DeviceError::UnknownReduceOp(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn names_round_trip() {
        for o in ReduceOp::ALL {
            assert_eq!(o.to_string(), o.name());
            assert_eq!(o.name().parse::<ReduceOp>().unwrap(), o);
            assert_eq!(o.name().to_uppercase().parse::<ReduceOp>().unwrap(), o);
        }
        assert_eq!(
            "mean".parse::<ReduceOp>().unwrap_err(),
            DeviceError::UnknownReduceOp("mean".into())
        );
    }
}
