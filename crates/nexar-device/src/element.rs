//! [`Element`]: the link between a Rust element type and its [`DataType`].

use crate::DataType;

/// A Rust type whose slices can take part in collectives: `f32`, `f64`, `half::f16`,
/// `half::bf16`, `i8`, `i32`, `i64`, `u8`, `u32` and `u64`.
///
/// `DTYPE` is the matching [`DataType`]; `size_of::<Self>() == Self::DTYPE.size()` always
/// holds. The trait is sealed: the kernels only know these ten types.
pub trait Element:
    bytemuck::Pod + Send + Sync + std::fmt::Debug + PartialEq + 'static + sealed::Sealed
{
    /// The data type of this element type.
    const DTYPE: DataType;
}

mod sealed {
    /// Keeps [`Element`](super::Element) implementations inside this crate.
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
        }
    )*};
}

element! {
    f32 => F32,
    f64 => F64,
    half::f16 => F16,
    half::bf16 => BF16,
    i8 => I8,
    i32 => I32,
    i64 => I64,
    u8 => U8,
    u32 => U32,
    u64 => U64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size_matches<T: Element>() {
        assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size(), "{}", T::DTYPE);
    }

    #[test]
    fn sizes_match_dtypes() {
        size_matches::<f32>();
        size_matches::<f64>();
        size_matches::<half::f16>();
        size_matches::<half::bf16>();
        size_matches::<i8>();
        size_matches::<i32>();
        size_matches::<i64>();
        size_matches::<u8>();
        size_matches::<u32>();
        size_matches::<u64>();
    }
}
