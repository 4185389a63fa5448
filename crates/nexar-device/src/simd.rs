//! The element-wise loops every kernel runs, written for auto-vectorization.
//!
//! No intrinsics but in the F16C `f16` loop: the loops walk exact chunks of [`LANES`] elements so LLVM
//! sees fixed-length, bounds-check-free bodies it can turn into vector code. On x86 the same
//! generic loop is also compiled with AVX2 enabled and picked at run time when the CPU has
//! it; the default x86_64 target only assumes SSE2.

use bytemuck::Pod;

/// Elements per unrolled step; enough to fill several 256-bit registers for every type.
const LANES: usize = 32;

/// `dst[i] = f(dst[i], src[i])` for every `i`, on the fastest code path this CPU supports.
///
/// The slices must have equal length (callers check); any excess is ignored.
#[inline(always)]
pub(crate) fn zip_with<T: Copy, F: Fn(T, T) -> T + Copy>(dst: &mut [T], src: &[T], f: F) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: `zip_with_avx2` only requires that the CPU supports AVX2, which was
        // detected just above.
        unsafe { zip_with_avx2(dst, src, f) };
        return;
    }
    zip_with_portable(dst, src, f);
}

/// The loop behind [`zip_with`], compiled for the target's baseline features.
#[inline(always)]
fn zip_with_portable<T: Copy, F: Fn(T, T) -> T>(dst: &mut [T], src: &[T], f: F) {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    let mut d_chunks = dst.chunks_exact_mut(LANES);
    let mut s_chunks = src.chunks_exact(LANES);
    for (d, s) in (&mut d_chunks).zip(&mut s_chunks) {
        for (x, y) in d.iter_mut().zip(s) {
            *x = f(*x, *y);
        }
    }
    for (x, y) in d_chunks
        .into_remainder()
        .iter_mut()
        .zip(s_chunks.remainder())
    {
        *x = f(*x, *y);
    }
}

/// [`zip_with_portable`] compiled with AVX2 enabled.
///
/// # Safety
///
/// The CPU must support AVX2 (check with `is_x86_feature_detected!("avx2")`).
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
#[target_feature(enable = "avx2")]
unsafe fn zip_with_avx2<T: Copy, F: Fn(T, T) -> T>(dst: &mut [T], src: &[T], f: F) {
    zip_with_portable(dst, src, f);
}

/// [`zip_with`] with the source given as the raw bytes of its elements, at any alignment
/// (as received data usually is): each element is read with an unaligned load, which
/// costs what an aligned one does on x86, instead of the bytes being copied to an aligned
/// block first.
///
/// `src` must hold `dst.len()` elements (callers check); any excess is ignored.
#[inline(always)]
pub(crate) fn zip_with_bytes<T: Pod, F: Fn(T, T) -> T + Copy>(dst: &mut [T], src: &[u8], f: F) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: `zip_with_bytes_avx2` only requires that the CPU supports AVX2, which was
        // detected just above.
        unsafe { zip_with_bytes_avx2(dst, src, f) };
        return;
    }
    zip_with_bytes_portable(dst, src, f);
}

/// The loop behind [`zip_with_bytes`], compiled for the target's baseline features.
#[inline(always)]
fn zip_with_bytes_portable<T: Pod, F: Fn(T, T) -> T>(dst: &mut [T], src: &[u8], f: F) {
    let size = size_of::<T>();
    let n = dst.len().min(src.len() / size);
    let (dst, src) = (&mut dst[..n], &src[..n * size]);
    let mut d_chunks = dst.chunks_exact_mut(LANES);
    let mut s_chunks = src.chunks_exact(LANES * size);
    for (d, s) in (&mut d_chunks).zip(&mut s_chunks) {
        for (x, y) in d.iter_mut().zip(s.chunks_exact(size)) {
            *x = f(*x, bytemuck::pod_read_unaligned(y));
        }
    }
    for (x, y) in d_chunks
        .into_remainder()
        .iter_mut()
        .zip(s_chunks.remainder().chunks_exact(size))
    {
        *x = f(*x, bytemuck::pod_read_unaligned(y));
    }
}

/// [`zip_with_bytes_portable`] compiled with AVX2 enabled.
///
/// # Safety
///
/// The CPU must support AVX2 (check with `is_x86_feature_detected!("avx2")`).
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
#[target_feature(enable = "avx2")]
unsafe fn zip_with_bytes_avx2<T: Pod, F: Fn(T, T) -> T>(dst: &mut [T], src: &[u8], f: F) {
    zip_with_bytes_portable(dst, src, f);
}

/// `dst[i] = f(base[i], src[i])`, with `src` the raw bytes of its elements at any
/// alignment, as [`zip_with_bytes`]: one pass where a copy of `base` into `dst` and then
/// [`zip_with_bytes`] would take two.
///
/// `base` and `src` must hold `dst.len()` elements (callers check); any excess is ignored.
#[inline(always)]
pub(crate) fn zip3_with_bytes<T: Pod, F: Fn(T, T) -> T + Copy>(
    dst: &mut [T],
    base: &[T],
    src: &[u8],
    f: F,
) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: `zip3_with_bytes_avx2` only requires that the CPU supports AVX2, which
        // was detected just above.
        unsafe { zip3_with_bytes_avx2(dst, base, src, f) };
        return;
    }
    zip3_with_bytes_portable(dst, base, src, f);
}

/// The loop behind [`zip3_with_bytes`], compiled for the target's baseline features.
#[inline(always)]
fn zip3_with_bytes_portable<T: Pod, F: Fn(T, T) -> T>(dst: &mut [T], base: &[T], src: &[u8], f: F) {
    let size = size_of::<T>();
    let n = dst.len().min(base.len()).min(src.len() / size);
    let (dst, base, src) = (&mut dst[..n], &base[..n], &src[..n * size]);
    let mut d_chunks = dst.chunks_exact_mut(LANES);
    let mut b_chunks = base.chunks_exact(LANES);
    let mut s_chunks = src.chunks_exact(LANES * size);
    for ((d, b), s) in (&mut d_chunks).zip(&mut b_chunks).zip(&mut s_chunks) {
        for ((x, y), z) in d.iter_mut().zip(b).zip(s.chunks_exact(size)) {
            *x = f(*y, bytemuck::pod_read_unaligned(z));
        }
    }
    for ((x, y), z) in d_chunks
        .into_remainder()
        .iter_mut()
        .zip(b_chunks.remainder())
        .zip(s_chunks.remainder().chunks_exact(size))
    {
        *x = f(*y, bytemuck::pod_read_unaligned(z));
    }
}

/// [`zip3_with_bytes_portable`] compiled with AVX2 enabled.
///
/// # Safety
///
/// The CPU must support AVX2 (check with `is_x86_feature_detected!("avx2")`).
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
#[target_feature(enable = "avx2")]
unsafe fn zip3_with_bytes_avx2<T: Pod, F: Fn(T, T) -> T>(
    dst: &mut [T],
    base: &[T],
    src: &[u8],
    f: F,
) {
    zip3_with_bytes_portable(dst, base, src, f);
}

/// `dst[i] = to_f16(f(to_f32(dst[i]), to_f32(src[i])))` with the F16C conversion
/// instructions, eight elements at a time.
///
/// The conversions are exact widening and round-to-nearest-even narrowing, the same
/// instructions `half` uses on such CPUs, so results equal `f16::from_f32(f(a.to_f32(),
/// b.to_f32()))` bit for bit.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C (check with `is_x86_feature_detected!`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn f16_zip_f16c<F: Fn(f32, f32) -> f32>(
    dst: &mut [half::f16],
    src: &[half::f16],
    f: F,
) {
    use std::arch::x86_64::{
        _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps, _mm_loadu_si128,
        _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    let n = dst.len().min(src.len());
    let mut d_chunks = dst[..n].chunks_exact_mut(8);
    let mut s_chunks = src[..n].chunks_exact(8);
    for (d, s) in (&mut d_chunks).zip(&mut s_chunks) {
        let mut a = [0f32; 8];
        let mut b = [0f32; 8];
        // SAFETY: `d` and `s` are exactly 8 `f16`s (16 bytes) and `a`, `b` exactly 8 `f32`s
        // (32 bytes); the unaligned load/store intrinsics have no alignment requirement, and
        // the CPU features are the caller's promise.
        unsafe {
            _mm256_storeu_ps(
                a.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().cast())),
            );
            _mm256_storeu_ps(
                b.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast())),
            );
        }
        for (x, y) in a.iter_mut().zip(&b) {
            *x = f(*x, *y);
        }
        // SAFETY: as above; `d` is 16 writable bytes.
        unsafe {
            let r = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(a.as_ptr()));
            _mm_storeu_si128(d.as_mut_ptr().cast(), r);
        }
    }
    for (x, y) in d_chunks
        .into_remainder()
        .iter_mut()
        .zip(s_chunks.remainder())
    {
        *x = half::f16::from_f32(f(x.to_f32(), y.to_f32()));
    }
}

/// `buf[i] = f(buf[i])` for every `i`. Used only by the once-per-collective finalize step,
/// so it relies on plain auto-vectorization without run-time dispatch.
#[inline(always)]
pub(crate) fn map_in_place<T: Copy, F: Fn(T) -> T>(buf: &mut [T], f: F) {
    for x in buf {
        *x = f(*x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatched_matches_portable() {
        // On a machine with AVX2 `zip_with` never runs the portable loop; check both agree.
        let a: Vec<u32> = (0..1000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let b: Vec<u32> = (0..1000u32)
            .map(|i| i.wrapping_mul(40_503) ^ 0xDEAD)
            .collect();
        let mut x = a.clone();
        let mut y = a.clone();
        zip_with(&mut x, &b, u32::wrapping_mul);
        zip_with_portable(&mut y, &b, u32::wrapping_mul);
        assert_eq!(x, y);

        let fa: Vec<f32> = a.iter().map(|&v| v as f32 / 7.0).collect();
        let fb: Vec<f32> = b.iter().map(|&v| v as f32 / 3.0).collect();
        let mut x = fa.clone();
        let mut y = fa;
        zip_with(&mut x, &fb, f32::max);
        zip_with_portable(&mut y, &fb, f32::max);
        assert_eq!(x, y);
    }

    #[test]
    fn byte_sources_at_every_offset_match_typed_ones() {
        // The dispatched and portable loops over raw (unaligned) bytes give what the typed
        // loop gives, for lengths on both sides of the unrolled step.
        let a: Vec<u32> = (0..1000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let b: Vec<u32> = (0..1000u32)
            .map(|i| i.wrapping_mul(40_503) ^ 0xBEEF)
            .collect();
        let raw: Vec<u8> = bytemuck::cast_slice::<u32, u8>(&b).to_vec();
        for n in [0, 1, 31, 32, 33, 1000] {
            let mut want = a[..n].to_vec();
            zip_with(&mut want, &b[..n], u32::wrapping_add);
            for off in 0..4 {
                let mut shifted = vec![0u8; off];
                shifted.extend_from_slice(&raw[..4 * n]);
                let mut x = a[..n].to_vec();
                zip_with_bytes(&mut x, &shifted[off..], u32::wrapping_add);
                assert_eq!(x, want, "n {n} offset {off}");
                let mut y = a[..n].to_vec();
                zip_with_bytes_portable(&mut y, &shifted[off..], u32::wrapping_add);
                assert_eq!(y, want, "portable, n {n} offset {off}");
                let mut z = vec![7u32; n];
                zip3_with_bytes(&mut z, &a[..n], &shifted[off..], u32::wrapping_add);
                assert_eq!(z, want, "from a base, n {n} offset {off}");
                let mut w = vec![7u32; n];
                zip3_with_bytes_portable(&mut w, &a[..n], &shifted[off..], u32::wrapping_add);
                assert_eq!(w, want, "from a base, portable, n {n} offset {off}");
            }
        }
    }
}
