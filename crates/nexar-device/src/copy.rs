//! Bulk byte copies whose speed does not depend on where the two buffers sit.
//!
//! `copy_from_slice` calls the C library's `memcpy`. glibc (2.36 here) copies blocks from
//! about 2 KiB up to the size of the L2 cache with the `rep movsb` instruction, and on this
//! project's machines (AMD EPYC) that instruction runs at a nineteenth of its speed when the
//! destination starts 1 to 31 bytes past the source, counted modulo 4096: 2.0 GiB/s
//! against 38 GiB/s at offset 0, for 64 KiB copies in cache (`cargo bench -p nexar-device
//! --bench kernels -- copy/`, which also shows `copy_bytes` at 32-38 GiB/s at both
//! offsets, and all four at 29 GiB/s for 4 MiB, where glibc takes another path).
//!
//! Received data arrives a packet's payload at a time, kilobytes, right in that range, and
//! a collective cannot choose where a user's buffer or a received packet lies. Buffers
//! allocated alike can sit at such an offset from each other (two heap buffers of one size,
//! a multiple of 4 KiB, allocated one after the other are 16 bytes off, by malloc's chunk
//! header), and then every copy between them crawls: reduce-scatter's copy of its own
//! input block into its output spent 30% of the call's CPU there. The copies on the data path therefore go through [`copy_bytes`] and
//! [`extend_bytes`], which move 32 bytes at a time with vector loads and stores (AVX,
//! detected at run time) at the same speed for every offset, and leave short copies, and
//! CPUs without AVX, to `memcpy`.

/// Copies shorter than this go to `memcpy`, which moves them with vector instructions
/// (glibc turns to `rep movsb` from 2112 bytes).
const SHORT: usize = 2048;

/// Copies 128-byte steps from `$src` to `$dst` from offset `$i` while a whole step fits
/// in `$n` bytes, four 32-byte loads then four stores with `$store`, and leaves `$i` at
/// the first byte not copied. Used inside `unsafe` AVX functions, which hold the
/// promises: both ranges are `$n` bytes, and `$dst + $i` suits `$store`'s alignment.
#[cfg(target_arch = "x86_64")]
macro_rules! copy_steps {
    ($dst:ident, $src:ident, $i:ident, $n:ident, $store:path) => {
        while $i + 128 <= $n {
            let (s, d) = ($src.add($i), $dst.add($i));
            let v0 = _mm256_loadu_si256(s.cast::<__m256i>());
            let v1 = _mm256_loadu_si256(s.add(32).cast::<__m256i>());
            let v2 = _mm256_loadu_si256(s.add(64).cast::<__m256i>());
            let v3 = _mm256_loadu_si256(s.add(96).cast::<__m256i>());
            $store(d.cast::<__m256i>(), v0);
            $store(d.add(32).cast::<__m256i>(), v1);
            $store(d.add(64).cast::<__m256i>(), v2);
            $store(d.add(96).cast::<__m256i>(), v3);
            $i += 128;
        }
    };
}

/// `dst.copy_from_slice(src)`, at the same speed wherever the two slices lie (see the
/// module docs).
///
/// # Panics
///
/// When the lengths differ, as `copy_from_slice` does: callers slice both sides to one
/// length first.
///
/// ```
/// let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
/// let mut dst = vec![0u8; 10_001];
/// nexar_device::copy_bytes(&mut dst[1..], &src);
/// assert_eq!(&dst[1..], &src[..]);
/// ```
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_bytes: destination and source lengths differ"
    );
    // SAFETY: `dst` is `src.len()` writable bytes, and a `&mut` slice never overlaps a
    // shared one.
    unsafe { copy_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// `out.extend_from_slice(src)`, at the same speed wherever the two lie (see the module
/// docs).
pub fn extend_bytes(out: &mut Vec<u8>, src: &[u8]) {
    out.reserve(src.len());
    let at = out.len();
    // SAFETY: `reserve` made room for `src.len()` more bytes after the first `at`; the
    // spare capacity is `out`'s own memory, apart from `src` (borrowed while `out` is
    // borrowed mutably). Once those bytes are written they are initialized, so the length
    // may cover them.
    unsafe {
        copy_raw(out.as_mut_ptr().add(at), src.as_ptr(), src.len());
        out.set_len(at + src.len());
    }
}

/// `dst.copy_from_slice(src)` with streaming (non-temporal) stores on x86-64 with AVX:
/// the destination's bytes go to memory without passing through the cache, so a large
/// copy neither reads the destination's old lines in first nor evicts what other work
/// has in the cache. For a destination that nothing reads again soon (a collective's
/// result, read by the caller after the call), larger than the core's L2 cache: there,
/// with 2 ranks in one process, writing the all-gather's own block and last received
/// block this way cut the call's CPU per byte by 14-35% from 4 MiB (bench/HISTORY.md,
/// session 17). A copy whose destination is read right after should use [`copy_bytes`],
/// which leaves it in the cache. Elsewhere (other CPUs, short copies) it is
/// [`copy_bytes`].
///
/// # Panics
///
/// When the lengths differ, as [`copy_bytes`] does.
///
/// ```
/// let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
/// let mut dst = vec![0u8; 100_003];
/// nexar_device::copy_bytes_streaming(&mut dst[3..], &src);
/// assert_eq!(&dst[3..], &src[..]);
/// ```
pub fn copy_bytes_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_bytes_streaming: destination and source lengths differ"
    );
    #[cfg(target_arch = "x86_64")]
    if src.len() >= SHORT && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: `dst` is `src.len()` writable bytes apart from `src` (a `&mut` slice
        // never overlaps a shared one), and AVX was detected just above.
        unsafe { copy_streaming_avx(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
        return;
    }
    copy_bytes(dst, src);
}

/// [`copy_bytes_streaming`]'s copy: the bytes up to the destination's next cache line
/// (64-byte boundary) by `memcpy`, then 128-byte steps of four 32-byte loads and four
/// aligned streaming stores (two whole lines), the rest by `memcpy`; a store fence at the end makes the streamed
/// bytes visible to other threads before anything this thread stores afterwards.
///
/// # Safety
///
/// As [`copy_raw`], and the CPU must support AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn copy_streaming_avx(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    let head = ((64 - (dst as usize & 63)) & 63).min(n);
    // SAFETY: the first `head <= n` bytes of both ranges (the caller's promise).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    // SAFETY: every step lies inside both ranges; `dst + i` is 64-byte aligned (`head`
    // brought it there and every step is a multiple of 64), more than the 32 bytes the
    // streaming store requires; the loads have no alignment requirement.
    unsafe { copy_steps!(dst, src, i, n, _mm256_stream_si256) };
    _mm_sfence();
    // SAFETY: the last `n - i` bytes of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) }
}

/// Copies `n` bytes (a multiple of 128) from `src` to `dst`, which starts on a cache line,
/// with streaming stores and no fence: for a caller that streams many blocks and fences
/// once after the last ([`stream_fence`]).
///
/// # Safety
///
/// As [`copy_raw`]; `dst` must be 64-byte aligned, `n` a multiple of 128, and the CPU must
/// support AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
pub(crate) unsafe fn stream_lines_avx(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    debug_assert!(dst as usize % 64 == 0 && n % 128 == 0);
    let mut i = 0;
    // SAFETY: every step lies inside both ranges (the caller's promise); `dst + i` is
    // 64-byte aligned (the caller's promise, and every step is a multiple of 64); the
    // loads have no alignment requirement.
    unsafe { copy_steps!(dst, src, i, n, _mm256_stream_si256) };
}

/// Makes the bytes this thread stored with streaming stores visible to other threads
/// before anything it stores afterwards (`sfence`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn stream_fence() {
    // SAFETY: `sfence` needs SSE, which every x86-64 CPU has.
    unsafe { std::arch::x86_64::_mm_sfence() };
}

/// Copies `n` bytes from `src` to `dst`.
///
/// # Safety
///
/// `src` must be valid for `n` reads, `dst` for `n` writes, and the two ranges must not
/// overlap.
pub(crate) unsafe fn copy_raw(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= SHORT && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the caller's promise, and AVX was detected just above.
        unsafe { copy_avx(dst, src, n) };
        return;
    }
    // SAFETY: the caller's promise.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

/// [`copy_raw`] in 128-byte steps of four 32-byte loads then four stores, with the last
/// `n % 128` bytes left to `memcpy` (too short for `rep movsb`).
///
/// # Safety
///
/// As [`copy_raw`], and the CPU must support AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn copy_avx(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let mut i = 0;
    // SAFETY: every step lies inside both ranges (the caller's promise); the unaligned
    // forms have no alignment requirement.
    unsafe { copy_steps!(dst, src, i, n, _mm256_storeu_si256) };
    // SAFETY: the last `n - i` bytes of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks that `copy` gives the bytes `copy_from_slice` gives at every length around
    /// the vector step and the short-copy threshold, at each (source, destination) offset
    /// of `offsets`, and leaves the bytes around the destination alone.
    fn check_copies(copy: impl Fn(&mut [u8], &[u8]), offsets: &[(usize, usize)]) {
        let src: Vec<u8> = (0..12_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let lens = (0..300)
            .chain(SHORT - 160..SHORT + 300)
            .chain([4096, 4097, 8191, 10_000]);
        for len in lens {
            for &(s_off, d_off) in offsets {
                let mut dst = vec![0xAAu8; len + 200];
                let from = &src[s_off..s_off + len];
                copy(&mut dst[d_off..d_off + len], from);
                assert_eq!(
                    &dst[d_off..d_off + len],
                    from,
                    "len {len} offsets {s_off}/{d_off}"
                );
                assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "before, len {len}");
                assert!(
                    dst[d_off + len..].iter().all(|&b| b == 0xAA),
                    "after, len {len}"
                );
            }
        }
    }

    /// Offsets between source and destination within a few vectors (both signs).
    #[test]
    fn copies_equal_copy_from_slice_at_every_length_and_offset() {
        let offsets = [(0, 0), (0, 1), (0, 17), (0, 31), (5, 0), (33, 64), (1, 40)];
        check_copies(copy_bytes, &offsets);
    }

    /// Destinations on and off a cache line; the kernel itself also at the short lengths
    /// that the public function leaves to `memcpy`.
    #[test]
    fn streaming_copies_equal_copy_from_slice_at_every_length_and_alignment() {
        let offsets = [(0, 0), (0, 1), (0, 31), (0, 32), (7, 3), (33, 64), (1, 63)];
        check_copies(copy_bytes_streaming, &offsets);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx") {
            check_copies(
                |d, s| {
                    assert_eq!(d.len(), s.len());
                    // SAFETY: `d` is `s.len()` writable bytes apart from `s`; AVX was
                    // detected.
                    unsafe { copy_streaming_avx(d.as_mut_ptr(), s.as_ptr(), s.len()) }
                },
                &offsets,
            );
        }
    }

    #[test]
    fn extend_appends_after_what_is_there() {
        let src: Vec<u8> = (0..9_000u32).map(|i| (i % 253) as u8).collect();
        for len in [0, 1, 127, 128, 2047, 2048, 2049, 9_000] {
            let mut out = vec![1u8, 2, 3];
            extend_bytes(&mut out, &src[..len]);
            assert_eq!(out.len(), 3 + len);
            assert_eq!(&out[..3], &[1, 2, 3]);
            assert_eq!(&out[3..], &src[..len]);
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn unequal_lengths_panic_as_copy_from_slice_does() {
        copy_bytes(&mut [0u8; 4], &[1u8; 5]);
    }
}
