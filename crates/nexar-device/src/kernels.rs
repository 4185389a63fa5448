//! The reduction kernels: [`reduce_bytes`], [`finalize_bytes`], [`fill_identity`] and their
//! typed forms.
//!
//! Semantics, the same on every code path (aligned or not, SSE2 or AVX2):
//! - integers wrap on overflow (`Sum`, `Prod`);
//! - float `Min`/`Max` follow [`f32::min`]/[`f32::max`]: when one side is NaN the other side
//!   wins, so NaNs are ignored unless both are NaN. Which zero `min(-0.0, 0.0)` returns is
//!   unspecified, as for `f32::min`;
//! - `f16`/`bf16` are widened to `f32`, combined, and rounded back to nearest, ties to even:
//!   `bf16::from_f32(op(a.to_f32(), b.to_f32()))` exactly, but that a NaN the `bf16`
//!   kernels compute is always the quiet NaN `0x7FC0`;
//! - `Avg` sums during the reduction and divides once, in [`finalize_bytes`].

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::{bf16_conv, simd, stage, DataType, DeviceError, Element, ReduceOp};

/// Checks that `op` is defined for `dtype`: [`ReduceOp::Avg`] is for float types only.
///
/// Fails with [`DeviceError::UnsupportedOp`] otherwise. Every kernel runs this check first.
pub const fn check_op(dtype: DataType, op: ReduceOp) -> Result<(), DeviceError> {
    if matches!(op, ReduceOp::Avg) && !dtype.is_float() {
        Err(DeviceError::UnsupportedOp { op, dtype })
    } else {
        Ok(())
    }
}

/// `dst = op(dst, src)`, element-wise over the raw bytes of `dtype` elements.
///
/// [`ReduceOp::Avg`] behaves as [`ReduceOp::Sum`] here; the division happens once, in
/// [`finalize_bytes`]. Neither slice needs to be aligned for `dtype`: with an aligned
/// destination the vectorized loop runs on it directly (reading an unaligned source with
/// unaligned loads, or for `f16` through an aligned block), and an unaligned destination
/// is staged through aligned blocks, with bit-identical results. See the module docs for
/// integer, NaN and half-precision rules.
///
/// # Errors
///
/// [`DeviceError::UnsupportedOp`] for `Avg` on an integer type,
/// [`DeviceError::LengthMismatch`] when `dst.len() != src.len()`, and
/// [`DeviceError::BadLength`] when the length is not a multiple of `dtype.size()`. On error
/// `dst` is unchanged.
pub fn reduce_bytes(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
) -> Result<(), DeviceError> {
    let op = kernel_op(dtype, op, dst.len(), &[src.len()])?;
    dispatch!(dtype, T => reduce_typed::<T>(op, dst, src));
    Ok(())
}

/// Checks a reduction's arguments (`dst` and every other buffer `len` bytes long, a whole
/// number of elements, `op` defined for `dtype`) and returns the op its kernels run:
/// [`ReduceOp::Avg`] sums, and divides later.
fn kernel_op(
    dtype: DataType,
    op: ReduceOp,
    len: usize,
    others: &[usize],
) -> Result<ReduceOp, DeviceError> {
    check_op(dtype, op)?;
    if let Some(&other) = others.iter().find(|&&o| o != len) {
        return Err(DeviceError::LengthMismatch {
            dst: len,
            src: other,
        });
    }
    dtype.element_count(len)?;
    Ok(if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    })
}

/// [`reduce_bytes`] for one type, its arguments checked.
fn reduce_typed<T: Kernel>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    stage::zip_blocks::<T>(
        dst,
        src,
        |d, s| T::combine(op, d, s),
        |d, s| T::combine_bytes(op, d, s),
    );
}

/// `dst = op(base, src)` element-wise over raw bytes: what copying `base` into `dst` and
/// then [`reduce_bytes`] gives, in one pass when `dst` and `base` are aligned for `dtype`
/// (`src` may lie anywhere; `f16` still takes two). Same rules as [`reduce_bytes`].
///
/// # Errors
///
/// As [`reduce_bytes`], with [`DeviceError::LengthMismatch`] also when `base` is not as
/// long as `dst`. On error `dst` is unchanged.
pub fn reduce_onto_bytes(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    base: &[u8],
    src: &[u8],
) -> Result<(), DeviceError> {
    let op = kernel_op(dtype, op, dst.len(), &[base.len(), src.len()])?;
    dispatch!(dtype, T => reduce_onto_typed::<T>(op, dst, base, src));
    Ok(())
}

/// [`reduce_onto_bytes`] with streaming (non-temporal) stores on x86-64 with AVX, for a
/// destination that nothing reads again soon and that is larger than the L2 cache (a
/// collective's result, read by the caller after the call; see
/// [`copy_bytes_streaming`](crate::copy_bytes_streaming)). A store through the cache
/// first reads the destination's old line from memory; out of the cache that makes the
/// three-buffer reduction move four lines for every one it writes, and it ran at 5.0 GiB/s
/// against the in-place reduction's 9.5 for 64 MiB buffers (`cargo bench -p nexar-device
/// --bench kernels -- 64MiB`). Here the results are computed a block at a time into a
/// buffer in the L1 cache and streamed to the destination from there. Same results, rules
/// and errors as [`reduce_onto_bytes`], which it is for short buffers, destinations not
/// aligned for `dtype`, and other CPUs.
///
/// # Errors
///
/// As [`reduce_onto_bytes`]. On error `dst` is unchanged.
///
/// ```
/// use nexar_device::{reduce_onto_bytes_streaming, DataType, ReduceOp};
/// let base: Vec<f32> = (0..100_000).map(|i| i as f32).collect();
/// let src = vec![0.5f32; 100_000];
/// let mut dst = vec![0f32; 100_000];
/// reduce_onto_bytes_streaming(
///     DataType::F32,
///     ReduceOp::Sum,
///     bytemuck::cast_slice_mut(&mut dst),
///     bytemuck::cast_slice(&base),
///     bytemuck::cast_slice(&src),
/// )?;
/// assert!(dst.iter().enumerate().all(|(i, &v)| v == i as f32 + 0.5));
/// # Ok::<(), nexar_device::DeviceError>(())
/// ```
pub fn reduce_onto_bytes_streaming(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    base: &[u8],
    src: &[u8],
) -> Result<(), DeviceError> {
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= 2 * STREAM_BLOCK
        && (dst.as_ptr() as usize) % dtype.size() == 0
        && std::arch::is_x86_feature_detected!("avx")
    {
        let op = kernel_op(dtype, op, dst.len(), &[base.len(), src.len()])?;
        dispatch!(dtype, T => reduce_onto_streaming::<T>(op, dst, base, src));
        return Ok(());
    }
    reduce_onto_bytes(dtype, op, dst, base, src)
}

/// Bytes [`reduce_onto_bytes_streaming`] computes into the L1 cache before streaming
/// them out: a multiple of the streaming step (128) and of every element size.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const STREAM_BLOCK: usize = 4 << 10;

/// [`reduce_onto_bytes_streaming`] for one type, its arguments checked, `dst` aligned for
/// `T` and AVX present: the bytes up to `dst`'s next cache line reduced in place, then
/// whole blocks, and the rest's whole 128-byte steps, reduced into an aligned block on the
/// stack and streamed out, then the last bytes reduced in place; one store fence.
#[cfg(target_arch = "x86_64")]
fn reduce_onto_streaming<T: Kernel>(op: ReduceOp, dst: &mut [u8], base: &[u8], src: &[u8]) {
    #[repr(C, align(64))]
    struct Block([u8; STREAM_BLOCK]);
    // A multiple of the element size: `dst` is aligned for `T`, and 64 is a multiple of
    // every element size.
    let head = ((64 - (dst.as_ptr() as usize & 63)) & 63).min(dst.len());
    let (first, dst) = dst.split_at_mut(head);
    reduce_onto_typed::<T>(op, first, &base[..head], &src[..head]);
    let (base, src) = (&base[head..], &src[head..]);
    let whole = dst.len() - dst.len() % STREAM_BLOCK;
    let mut block = Block([0; STREAM_BLOCK]);
    for ((d, b), s) in dst[..whole]
        .chunks_exact_mut(STREAM_BLOCK)
        .zip(base.chunks_exact(STREAM_BLOCK))
        .zip(src.chunks_exact(STREAM_BLOCK))
    {
        reduce_onto_typed::<T>(op, &mut block.0, b, s);
        // SAFETY: `d` and `block` are `STREAM_BLOCK` bytes each, apart (one is on the
        // stack); `d` starts on a cache line (`head` brought `dst` there and every block
        // is a multiple of 64 bytes); `STREAM_BLOCK` is a multiple of 128; AVX was
        // detected by the caller.
        unsafe { crate::copy::stream_lines_avx(d.as_mut_ptr(), block.0.as_ptr(), STREAM_BLOCK) };
    }
    // The rest's whole 128-byte steps the same way, then its last bytes in place.
    let lines = whole + (dst.len() - whole) / 128 * 128;
    let block = &mut block.0[..lines - whole];
    reduce_onto_typed::<T>(op, block, &base[whole..lines], &src[whole..lines]);
    // SAFETY: as above, for `lines - whole` bytes, a multiple of 128.
    unsafe {
        crate::copy::stream_lines_avx(dst[whole..].as_mut_ptr(), block.as_ptr(), block.len())
    };
    crate::copy::stream_fence();
    reduce_onto_typed::<T>(op, &mut dst[lines..], &base[lines..], &src[lines..]);
}

/// [`reduce_onto_bytes`] for one type, its arguments checked.
fn reduce_onto_typed<T: Kernel>(op: ReduceOp, dst: &mut [u8], base: &[u8], src: &[u8]) {
    if let Ok(b) = bytemuck::try_cast_slice::<u8, T>(base) {
        if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(dst) {
            T::combine_onto(op, d, b, src);
            return;
        }
    }
    crate::copy_bytes(dst, base);
    reduce_typed::<T>(op, dst, src);
}

/// Typed form of [`reduce_bytes`]: `dst = op(dst, src)` element-wise.
///
/// # Errors
///
/// As [`reduce_bytes`]; lengths in [`DeviceError::LengthMismatch`] are in bytes.
pub fn reduce_slice<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) -> Result<(), DeviceError> {
    reduce_bytes(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(dst),
        bytemuck::cast_slice(src),
    )
}

/// The final step of an [`ReduceOp::Avg`] reduction: divides every element by `divisor`
/// (the number of contributions, usually the world size). A no-op for every other op.
///
/// `f16`/`bf16` are divided in `f32` and rounded back to nearest, ties to even. `buf` need
/// not be aligned.
///
/// # Errors
///
/// [`DeviceError::UnsupportedOp`] for `Avg` on an integer type, [`DeviceError::BadLength`]
/// when `buf.len()` is not a multiple of `dtype.size()`, and [`DeviceError::ZeroDivisor`]
/// for `Avg` with `divisor == 0`. On error `buf` is unchanged.
pub fn finalize_bytes(
    dtype: DataType,
    op: ReduceOp,
    buf: &mut [u8],
    divisor: usize,
) -> Result<(), DeviceError> {
    check_op(dtype, op)?;
    dtype.element_count(buf.len())?;
    if op != ReduceOp::Avg {
        return Ok(());
    }
    if divisor == 0 {
        return Err(DeviceError::ZeroDivisor);
    }
    // x / 1 == x exactly, so skipping the pass changes no result.
    if divisor == 1 {
        return Ok(());
    }
    dispatch!(dtype, T => stage::map_blocks::<T>(buf, |b| T::divide(b, divisor)));
    Ok(())
}

/// Typed form of [`finalize_bytes`].
///
/// # Errors
///
/// As [`finalize_bytes`].
pub fn finalize_slice<T: Element>(
    op: ReduceOp,
    buf: &mut [T],
    divisor: usize,
) -> Result<(), DeviceError> {
    finalize_bytes(T::DTYPE, op, bytemuck::cast_slice_mut(buf), divisor)
}

/// Fills `buf` with the identity element of `op` for `dtype`, so that reducing any `x`
/// into it gives `x` back (the starting value of an exclusive scan): every `x` but a
/// NaN, which comes back a NaN, not always the same one (`bf16` gives `0x7FC0`, and
/// arithmetic quiets a signalling NaN).
///
/// `Sum`/`Avg`: zero (negative zero for floats, since `-0.0 + x == x` for every `x`,
/// including `-0.0`); `Prod`: one; `Min`: the largest value (`+inf` for floats); `Max`: the
/// smallest value (`-inf` for floats). With NaN-ignoring float `Min`/`Max`, a NaN `x` does
/// not come back as NaN. `buf` need not be aligned.
///
/// # Errors
///
/// [`DeviceError::UnsupportedOp`] for `Avg` on an integer type and
/// [`DeviceError::BadLength`] when `buf.len()` is not a multiple of `dtype.size()`.
pub fn fill_identity(dtype: DataType, op: ReduceOp, buf: &mut [u8]) -> Result<(), DeviceError> {
    check_op(dtype, op)?;
    dtype.element_count(buf.len())?;
    dispatch!(dtype, T => {
        let id = T::identity(op);
        for chunk in buf.chunks_exact_mut(size_of::<T>()) {
            chunk.copy_from_slice(bytemuck::bytes_of(&id));
        }
    });
    Ok(())
}

/// Runs `$body` with `$t` bound to the Rust type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DataType::F32 => {
                type $t = f32;
                $body
            }
            DataType::F64 => {
                type $t = f64;
                $body
            }
            DataType::F16 => {
                type $t = f16;
                $body
            }
            DataType::BF16 => {
                type $t = bf16;
                $body
            }
            DataType::I8 => {
                type $t = i8;
                $body
            }
            DataType::I32 => {
                type $t = i32;
                $body
            }
            DataType::I64 => {
                type $t = i64;
                $body
            }
            DataType::U8 => {
                type $t = u8;
                $body
            }
            DataType::U32 => {
                type $t = u32;
                $body
            }
            DataType::U64 => {
                type $t = u64;
                $body
            }
        }
    };
}
use dispatch;

/// The per-type kernels behind the byte-level functions. Slices are aligned and equally long.
trait Kernel: Element {
    /// `dst = op(dst, src)`; `op` is never `Avg` (callers map it to `Sum`).
    fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]);
    /// [`Kernel::combine`] with `src` the raw bytes of `dst.len()` elements at any
    /// alignment. By default the bytes are staged through an aligned block; types whose
    /// loop can load unaligned elements itself read them in place.
    fn combine_bytes(op: ReduceOp, dst: &mut [Self], src: &[u8]) {
        stage::zip_src_blocks(dst, src, |d, s| Self::combine(op, d, s));
    }
    /// `dst = op(base, src)`, `src` as in [`Kernel::combine_bytes`]. By default `base` is
    /// copied into `dst` first; types whose loop can read three buffers fuse the two.
    fn combine_onto(op: ReduceOp, dst: &mut [Self], base: &[Self], src: &[u8]) {
        crate::copy_bytes(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(base));
        Self::combine_bytes(op, dst, src);
    }
    /// The identity of `op` (see [`fill_identity`]).
    fn identity(op: ReduceOp) -> Self;
    /// Divides every element by `divisor`. Only called for float types.
    fn divide(buf: &mut [Self], divisor: usize);
}

/// Runs `body` with `f` bound to the element function of integer `op` on type `t`.
macro_rules! int_op {
    ($t:ty, $op:expr, |$f:ident| $body:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                let $f = <$t>::wrapping_add;
                $body
            }
            ReduceOp::Prod => {
                let $f = <$t>::wrapping_mul;
                $body
            }
            ReduceOp::Min => {
                let $f = <$t as Ord>::min;
                $body
            }
            ReduceOp::Max => {
                let $f = <$t as Ord>::max;
                $body
            }
        }
    };
}

/// Min and max of two floats, a NaN losing to a number. `f32::min`/`max` lower to IEEE
/// minNum/maxNum, which on ARM (FMINNM/FMAXNM, VMINNM/VMAXNM) give NaN for a
/// *signalling* NaN operand: there, and on every target not measured, the choice is
/// spelled out. On x86 they are kept: the spelled-out form does not vectorise on x86-64
/// (four to five times slower, `benches/kernels.rs`), where `min`/`max` already pick the
/// number (`float_min_max_ignore_signalling_nan`).
#[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
macro_rules! float_min {
    ($t:ty) => {
        |a: $t, b: $t| if (b < a) | a.is_nan() { b } else { a }
    };
}
#[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
macro_rules! float_max {
    ($t:ty) => {
        |a: $t, b: $t| if (b > a) | a.is_nan() { b } else { a }
    };
}
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
macro_rules! float_min {
    ($t:ty) => {
        <$t>::min
    };
}
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
macro_rules! float_max {
    ($t:ty) => {
        <$t>::max
    };
}

/// Runs `body` with `f` bound to the element function of float `op` on type `t`.
macro_rules! float_op {
    ($t:ty, $op:expr, |$f:ident| $body:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                let $f = |a: $t, b: $t| a + b;
                $body
            }
            ReduceOp::Prod => {
                let $f = |a: $t, b: $t| a * b;
                $body
            }
            ReduceOp::Min => {
                let $f = float_min!($t);
                $body
            }
            ReduceOp::Max => {
                let $f = float_max!($t);
                $body
            }
        }
    };
}

macro_rules! int_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                int_op!($t, op, |f| simd::zip_with(dst, src, f));
            }

            fn combine_bytes(op: ReduceOp, dst: &mut [Self], src: &[u8]) {
                int_op!($t, op, |f| simd::zip_with_bytes(dst, src, f));
            }

            fn combine_onto(op: ReduceOp, dst: &mut [Self], base: &[Self], src: &[u8]) {
                int_op!($t, op, |f| simd::zip3_with_bytes(dst, base, src, f));
            }

            fn identity(op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => 0,
                    ReduceOp::Prod => 1,
                    ReduceOp::Min => <$t>::MAX,
                    ReduceOp::Max => <$t>::MIN,
                }
            }

            fn divide(_buf: &mut [Self], _divisor: usize) {
                // Unreachable: `check_op` rejects `Avg` on integers before any kernel runs.
            }
        }
    )*};
}

int_kernel!(i8, i32, i64, u8, u32, u64);

macro_rules! float_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                float_op!($t, op, |f| simd::zip_with(dst, src, f));
            }

            fn combine_bytes(op: ReduceOp, dst: &mut [Self], src: &[u8]) {
                float_op!($t, op, |f| simd::zip_with_bytes(dst, src, f));
            }

            fn combine_onto(op: ReduceOp, dst: &mut [Self], base: &[Self], src: &[u8]) {
                float_op!($t, op, |f| simd::zip3_with_bytes(dst, base, src, f));
            }

            fn identity(op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => -0.0,
                    ReduceOp::Prod => 1.0,
                    ReduceOp::Min => <$t>::INFINITY,
                    ReduceOp::Max => <$t>::NEG_INFINITY,
                }
            }

            fn divide(buf: &mut [Self], divisor: usize) {
                // Divide rather than multiply by the reciprocal: exact rounding, and this
                // runs once per collective.
                let d = divisor as $t;
                simd::map_in_place(buf, |x| x / d);
            }
        }
    )*};
}

float_kernel!(f32, f64);

/// `f` on `bf16` through `f32`, for a loop that fuses the conversions in (they are plain
/// bit operations). A NaN result is the canonical quiet NaN: where both operands are
/// NaN, which payload the `f32` operation keeps depends on the order the compiler puts
/// them in, which differed between the loops and within one (runs of 8 elements each
/// way), so the same inputs gave different bytes on different paths. (Choosing the
/// destination's NaN instead cost a compare and a select more per element: 26% more time
/// for 64 KiB in the cache, 13% for 4 MiB.)
#[inline(always)]
fn bf16_via_f32(f: impl Fn(f32, f32) -> f32 + Copy) -> impl Fn(bf16, bf16) -> bf16 + Copy {
    move |a, b| bf16_conv::from_f32_canonical(f(bf16_conv::to_f32(a), bf16_conv::to_f32(b)))
}

impl Kernel for bf16 {
    fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
        float_op!(f32, op, |f| simd::zip_with(dst, src, bf16_via_f32(f)));
    }

    fn combine_bytes(op: ReduceOp, dst: &mut [Self], src: &[u8]) {
        float_op!(f32, op, |f| simd::zip_with_bytes(dst, src, bf16_via_f32(f)));
    }

    fn combine_onto(op: ReduceOp, dst: &mut [Self], base: &[Self], src: &[u8]) {
        float_op!(f32, op, |f| {
            simd::zip3_with_bytes(dst, base, src, bf16_via_f32(f))
        });
    }

    fn identity(op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => bf16::NEG_ZERO,
            ReduceOp::Prod => bf16::ONE,
            ReduceOp::Min => bf16::INFINITY,
            ReduceOp::Max => bf16::NEG_INFINITY,
        }
    }

    fn divide(buf: &mut [Self], divisor: usize) {
        // Its NaN is the canonical one too, as a reduction's: a GPU's division gives its
        // own NaN whatever the operand's, so ranks that divided on either side agree.
        let d = divisor as f32;
        simd::map_in_place(buf, |x| {
            bf16_conv::from_f32_canonical(bf16_conv::to_f32(x) / d)
        });
    }
}

/// `f16` through `f32`, on the fastest path this CPU supports.
#[inline(always)]
fn f16_zip(dst: &mut [f16], src: &[f16], f: impl Fn(f32, f32) -> f32 + Copy) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: both features the function is compiled for were detected just above.
        unsafe { simd::f16_zip_f16c(dst, src, f) };
        return;
    }
    f16_zip_blocks(dst, src, f);
}

/// `f16` through `f32` without F16C: `half` widens a block (in software, or with its own
/// run-time detected conversions), the f32 loop runs, and `half` narrows back.
fn f16_zip_blocks(dst: &mut [f16], src: &[f16], f: impl Fn(f32, f32) -> f32 + Copy) {
    let mut a = [0f32; F16_BLOCK];
    let mut b = [0f32; F16_BLOCK];
    for (d, s) in dst.chunks_mut(F16_BLOCK).zip(src.chunks(F16_BLOCK)) {
        let (a, b) = (&mut a[..d.len()], &mut b[..d.len()]);
        d.convert_to_f32_slice(a);
        s.convert_to_f32_slice(b);
        simd::zip_with(a, b, f);
        d.convert_from_f32_slice(a);
    }
}

/// `f16` elements per conversion block: two `f32` blocks of this size stay in L1.
const F16_BLOCK: usize = 512;

impl Kernel for f16 {
    fn combine(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
        float_op!(f32, op, |f| f16_zip(dst, src, f));
    }

    fn identity(op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => f16::NEG_ZERO,
            ReduceOp::Prod => f16::ONE,
            ReduceOp::Min => f16::INFINITY,
            ReduceOp::Max => f16::NEG_INFINITY,
        }
    }

    fn divide(buf: &mut [Self], divisor: usize) {
        let mut a = [0f32; F16_BLOCK];
        for d in buf.chunks_mut(F16_BLOCK) {
            let a = &mut a[..d.len()];
            d.convert_to_f32_slice(a);
            f32::divide(a, divisor);
            d.convert_from_f32_slice(a);
        }
    }
}

#[cfg(test)]
mod tests;
