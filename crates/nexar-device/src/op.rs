//! [`ReduceOp`]: how a reduction combines two elements.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::DeviceError;

/// How a reduction combines elements from different ranks.
///
/// The names (`"sum"`, `"prod"`, `"min"`, `"max"`, `"avg"`) are used by
/// [`Display`](fmt::Display), [`FromStr`] and serde alike.
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
    /// type, so in `f16` a sum past 65504 is infinite even where the mean is not (4
    /// ranks of 20000 average to `inf`): scale `f16` inputs by `1 / world` and use `Sum`
    /// where that can happen.
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
