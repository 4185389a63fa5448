//! Running typed kernels on byte buffers that may not be aligned for their element type.
//!
//! Received data often sits at an odd offset inside a network buffer. When a byte slice is
//! aligned it is cast in place. An unaligned source next to an aligned destination goes to
//! the kernel as bytes, which most kernels read in place; otherwise (and for kernels that
//! cannot) a slice is copied through an aligned stack block, the kernel runs on the block,
//! and (for the destination) the result is copied back. Kernels are element-wise, so every
//! route gives bit-identical results.

use bytemuck::Pod;

/// Bytes per staging block: a multiple of every element size, small enough for the stack
/// and L1.
const BLOCK_BYTES: usize = 4096;

/// An aligned scratch block; 64-byte alignment covers every element type.
#[repr(C, align(64))]
struct Block([u8; BLOCK_BYTES]);

impl Block {
    fn new() -> Self {
        Block([0; BLOCK_BYTES])
    }

    /// The first `n` bytes as `T`s. `n` must be a multiple of `size_of::<T>()`, which holds
    /// for every chunk of a buffer whose length is a multiple of it, since `BLOCK_BYTES` is.
    fn typed_mut<T: Pod>(&mut self, n: usize) -> &mut [T] {
        // Cannot fail: the block is 64-byte aligned and `n` is a whole number of elements.
        bytemuck::cast_slice_mut(&mut self.0[..n])
    }
}

/// Calls `f(dst_elems, src_elems)` over the whole of two equally long byte buffers, whose
/// length is a multiple of `size_of::<T>()`: in one call when both are aligned, through
/// `f_src_bytes(dst_elems, src)` when only the destination is (the common receive case:
/// the local buffer is aligned, the network bytes are not), and block by block, both
/// staged, otherwise.
pub(crate) fn zip_blocks<T: Pod>(
    dst: &mut [u8],
    src: &[u8],
    mut f: impl FnMut(&mut [T], &[T]),
    f_src_bytes: impl FnOnce(&mut [T], &[u8]),
) {
    debug_assert_eq!(dst.len(), src.len());
    debug_assert_eq!(dst.len() % size_of::<T>(), 0);
    if let Ok(dst_typed) = bytemuck::try_cast_slice_mut::<u8, T>(dst) {
        match bytemuck::try_cast_slice::<u8, T>(src) {
            Ok(s) => f(dst_typed, s),
            Err(_) => f_src_bytes(dst_typed, src),
        }
        return;
    }
    let mut dst_block = Block::new();
    let mut src_block = Block::new();
    for (d, s) in dst.chunks_mut(BLOCK_BYTES).zip(src.chunks(BLOCK_BYTES)) {
        let n = d.len();
        crate::copy_bytes(&mut dst_block.0[..n], d);
        crate::copy_bytes(&mut src_block.0[..n], s);
        f(dst_block.typed_mut(n), src_block.typed_mut(n));
        crate::copy_bytes(d, &dst_block.0[..n]);
    }
}

/// Calls `f(dst_chunk, src_elems)` over `dst` and the elements whose raw bytes are `src`
/// (equally long, at any alignment), the source copied block by block into an aligned
/// block: for kernels that cannot read unaligned bytes themselves.
pub(crate) fn zip_src_blocks<T: Pod>(dst: &mut [T], src: &[u8], mut f: impl FnMut(&mut [T], &[T])) {
    debug_assert_eq!(size_of_val(dst), src.len());
    let mut block = Block::new();
    let per_block = BLOCK_BYTES / size_of::<T>();
    for (d, s) in dst.chunks_mut(per_block).zip(src.chunks(BLOCK_BYTES)) {
        let staged = block.typed_mut::<T>(s.len());
        crate::copy_bytes(bytemuck::cast_slice_mut::<T, u8>(staged), s);
        f(d, staged);
    }
}

/// Calls `f(elems)` over the whole of a byte buffer whose length is a multiple of
/// `size_of::<T>()`, in place when aligned or block by block otherwise.
pub(crate) fn map_blocks<T: Pod>(buf: &mut [u8], mut f: impl FnMut(&mut [T])) {
    debug_assert_eq!(buf.len() % size_of::<T>(), 0);
    if let Ok(typed) = bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        f(typed);
        return;
    }
    let mut block = Block::new();
    for chunk in buf.chunks_mut(BLOCK_BYTES) {
        let n = chunk.len();
        crate::copy_bytes(&mut block.0[..n], chunk);
        f(block.typed_mut(n));
        crate::copy_bytes(chunk, &block.0[..n]);
    }
}
