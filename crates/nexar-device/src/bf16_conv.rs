//! Branch-free bf16 <-> f32 conversions.
//!
//! Bit-identical to `half::bf16::to_f32` / `half::bf16::from_f32` (round to nearest, ties
//! to even; NaNs stay NaN with the quiet bit set), but written with selects instead of
//! early returns so that LLVM vectorizes the loops that call them.

use half::bf16;

/// `half::bf16::to_f32`, branch-free.
#[inline(always)]
pub(crate) fn to_f32(x: bf16) -> f32 {
    let bits = x.to_bits() as u32;
    let nan = (bits & 0x7FFF) > 0x7F80;
    let quiet = if nan { 0x0040 } else { 0 };
    f32::from_bits((bits | quiet) << 16)
}

/// `half::bf16::from_f32`, branch-free (the kernels round with [`from_f32_canonical`];
/// this checks the rounding they share against `half`'s).
#[cfg(test)]
pub(crate) fn from_f32(x: f32) -> bf16 {
    rounded_or(x, |bits| (bits >> 16) | 0x0040)
}

/// The quiet NaN every bf16 reduction gives for a NaN result ([`from_f32_canonical`]).
pub(crate) const CANONICAL_NAN: u16 = 0x7FC0;

/// `half::bf16::from_f32`, branch-free, but any NaN becomes [`CANONICAL_NAN`]: for the
/// results of reductions, whose NaN payload would otherwise depend on which operand the
/// compiler put first (it may swap them, and did differently in different loops and
/// within one), and of divisions (a GPU's gives its own NaN). No dearer than keeping the
/// payload: the same select, of a constant.
#[inline(always)]
pub(crate) fn from_f32_canonical(x: f32) -> bf16 {
    rounded_or(x, |_| u32::from(CANONICAL_NAN))
}

/// `x` rounded to bf16, or `nan` of its bits when it is a NaN.
#[inline(always)]
fn rounded_or(x: f32, nan: impl Fn(u32) -> u32) -> bf16 {
    let bits = x.to_bits();
    // Round to nearest, ties to even: adding 0x7FFF plus the lowest kept bit carries into
    // the kept half exactly when the dropped half is above one half, or equal to one half
    // with an odd kept half. Only NaNs can overflow, and they take the other branch.
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7FFF + lsb) >> 16;
    let is_nan = (bits & 0x7FFF_FFFF) > 0x7F80_0000;
    let out = if is_nan { nan(bits) } else { rounded };
    bf16::from_bits(out as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn to_f32_matches_half_for_every_bf16() {
        for bits in 0..=u16::MAX {
            let x = bf16::from_bits(bits);
            assert_eq!(to_f32(x).to_bits(), x.to_f32().to_bits(), "{bits:#06x}");
        }
    }

    #[test]
    fn from_f32_matches_half() {
        // Every upper half with a spread of lower halves, including the tie and
        // round-bit patterns.
        let lows = [
            0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFF, 0x4000, 0x1234,
        ];
        for high in 0..=u16::MAX as u32 {
            for low in lows {
                let f = f32::from_bits((high << 16) | low);
                assert_eq!(
                    from_f32(f).to_bits(),
                    bf16::from_f32(f).to_bits(),
                    "{:#010x}",
                    f.to_bits()
                );
            }
        }
    }
}
