//! [`CompressElement`]: the float element types a codec can compress, and [`WideFloat`],
//! the precision their error-feedback residual is kept in.

use std::cmp::Ordering;
use std::fmt::Debug;

use half::{bf16, f16};
use nexar_device::Element;

/// The precision error feedback and accumulation compute in: `f32` or `f64`.
///
/// Sealed; the methods are the few operations the codecs need and are not part of the
/// supported API.
pub trait WideFloat:
    Copy + Default + Debug + PartialEq + Send + Sync + 'static + sealed::Sealed
{
    #[doc(hidden)]
    fn add(self, other: Self) -> Self;
    #[doc(hidden)]
    fn sub(self, other: Self) -> Self;
    #[doc(hidden)]
    fn mul(self, other: Self) -> Self;
    #[doc(hidden)]
    fn abs(self) -> Self;
    #[doc(hidden)]
    fn total_cmp(&self, other: &Self) -> Ordering;
    #[doc(hidden)]
    fn from_f64(x: f64) -> Self;
    #[doc(hidden)]
    fn to_f64(self) -> f64;
}

macro_rules! wide {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl WideFloat for $t {
            #[inline]
            fn add(self, other: Self) -> Self { self + other }
            #[inline]
            fn sub(self, other: Self) -> Self { self - other }
            #[inline]
            fn mul(self, other: Self) -> Self { self * other }
            #[inline]
            fn abs(self) -> Self { <$t>::abs(self) }
            #[inline]
            fn total_cmp(&self, other: &Self) -> Ordering { <$t>::total_cmp(self, other) }
            #[inline]
            fn from_f64(x: f64) -> Self { x as $t }
            #[inline]
            fn to_f64(self) -> f64 { f64::from(self) }
        }
    )*};
}

wide!(f32, f64);

/// A gradient element type the codecs support: `f32`, `f64`, `half::f16` and `half::bf16`.
///
/// Sealed. Arithmetic (error feedback, rescaling, [`accumulate`](crate::accumulate)) runs
/// in [`Wide`](Self::Wide): `f64` for `f64`, `f32` for the other three; `f16` and `bf16`
/// results are rounded back to nearest, ties to even, as `half` and the nexar-device
/// kernels do.
pub trait CompressElement: Element + sealed::Sealed {
    /// The precision of this type's arithmetic and of its [`Residual`](crate::Residual).
    type Wide: WideFloat;

    #[doc(hidden)]
    fn widen(self) -> Self::Wide;
    #[doc(hidden)]
    fn narrow(w: Self::Wide) -> Self;
    #[doc(hidden)]
    fn write_le(self, out: &mut Vec<u8>);
    /// `None` unless `bytes` is exactly one element long.
    #[doc(hidden)]
    fn read_le(bytes: &[u8]) -> Option<Self>;
}

impl sealed::Sealed for f16 {}
impl sealed::Sealed for bf16 {}

macro_rules! compress_element {
    ($($t:ty => $wide:ty, $widen:expr, $narrow:expr);* $(;)?) => {$(
        impl CompressElement for $t {
            type Wide = $wide;

            #[inline]
            fn widen(self) -> $wide {
                $widen(self)
            }

            #[inline]
            fn narrow(w: $wide) -> Self {
                $narrow(w)
            }

            #[inline]
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }

            #[inline]
            fn read_le(bytes: &[u8]) -> Option<Self> {
                bytes.try_into().ok().map(<$t>::from_le_bytes)
            }
        }
    )*};
}

compress_element! {
    f32 => f32, std::convert::identity, std::convert::identity;
    f64 => f64, std::convert::identity, std::convert::identity;
    f16 => f32, f16::to_f32, f16::from_f32;
    bf16 => f32, bf16::to_f32, bf16::from_f32;
}

mod sealed {
    /// Keeps [`CompressElement`](super::CompressElement) and
    /// [`WideFloat`](super::WideFloat) implementations inside this crate.
    pub trait Sealed {}
}
