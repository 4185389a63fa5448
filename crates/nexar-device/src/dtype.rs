//! [`DataType`]: the element type of a buffer, as it travels between ranks.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::DeviceError;

/// The element type of a buffer taking part in a collective.
///
/// Every rank of a collective must use the same data type. The names (`"f32"`, `"bf16"`,
/// ...) are used by [`Display`](fmt::Display), [`FromStr`] and serde alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataType {
    /// 32-bit IEEE 754 binary32 float (`f32`).
    F32,
    /// 64-bit IEEE 754 binary64 float (`f64`).
    F64,
    /// 16-bit IEEE 754 binary16 float (`half::f16`).
    F16,
    /// 16-bit brain float: the top half of an `f32` (`half::bf16`).
    BF16,
    /// 8-bit signed integer (`i8`).
    I8,
    /// 32-bit signed integer (`i32`).
    I32,
    /// 64-bit signed integer (`i64`).
    I64,
    /// 8-bit unsigned integer (`u8`).
    U8,
    /// 32-bit unsigned integer (`u32`).
    U32,
    /// 64-bit unsigned integer (`u64`).
    U64,
}

impl DataType {
    /// Every data type, in declaration order.
    pub const ALL: [DataType; 10] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::BF16,
        DataType::I8,
        DataType::I32,
        DataType::I64,
        DataType::U8,
        DataType::U32,
        DataType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::BF16 => 2,
            DataType::F32 | DataType::I32 | DataType::U32 => 4,
            DataType::F64 | DataType::I64 | DataType::U64 => 8,
        }
    }

    /// Whether this is a floating-point type (and so supports [`ReduceOp::Avg`](crate::ReduceOp::Avg)).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F32 | DataType::F64 | DataType::F16 | DataType::BF16
        )
    }

    /// The lower-case name: `"f32"`, `"f64"`, `"f16"`, `"bf16"`, `"i8"`, ...
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F64 => "f64",
            DataType::F16 => "f16",
            DataType::BF16 => "bf16",
            DataType::I8 => "i8",
            DataType::I32 => "i32",
            DataType::I64 => "i64",
            DataType::U8 => "u8",
            DataType::U32 => "u32",
            DataType::U64 => "u64",
        }
    }

    /// Number of elements in a buffer of `byte_len` bytes.
    ///
    /// Fails with [`DeviceError::BadLength`] when `byte_len` is not a multiple of
    /// [`size`](Self::size): the check to run where a byte buffer enters.
    pub const fn element_count(self, byte_len: usize) -> Result<usize, DeviceError> {
        if byte_len % self.size() == 0 {
            Ok(byte_len / self.size())
        } else {
            Err(DeviceError::BadLength {
                len: byte_len,
                dtype: self,
            })
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = DeviceError;

    /// Parses a name as printed by [`DataType::name`], ignoring ASCII case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DataType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| DeviceError::UnknownDataType(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(d.to_string(), d.name());
            assert_eq!(d.name().parse::<DataType>().unwrap(), d);
            assert_eq!(d.name().to_uppercase().parse::<DataType>().unwrap(), d);
        }
        assert_eq!(
            "f128".parse::<DataType>().unwrap_err(),
            DeviceError::UnknownDataType("f128".into())
        );
        assert!("".parse::<DataType>().is_err());
    }

    #[test]
    fn sizes_and_kinds() {
        let floats: Vec<_> = DataType::ALL.into_iter().filter(|d| d.is_float()).collect();
        assert_eq!(
            floats,
            [DataType::F32, DataType::F64, DataType::F16, DataType::BF16]
        );
        assert_eq!(DataType::BF16.size(), 2);
        assert_eq!(DataType::U64.size(), 8);
        assert_eq!(DataType::I8.size(), 1);
        assert_eq!(DataType::I32.size(), 4);
    }

    #[test]
    fn element_count_checks_length() {
        assert_eq!(DataType::F32.element_count(12).unwrap(), 3);
        assert_eq!(DataType::F32.element_count(0).unwrap(), 0);
        assert_eq!(
            DataType::F64.element_count(12).unwrap_err(),
            DeviceError::BadLength {
                len: 12,
                dtype: DataType::F64
            }
        );
    }
}
