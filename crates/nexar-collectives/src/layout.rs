//! Geometry shared by the algorithms: splitting buffers into blocks and chunks on
//! element boundaries, and numbering messages.

use std::ops::Range;

/// Splits `count` elements of `esz` bytes into `parts` contiguous blocks, the first
/// `count % parts` one element longer, and returns their byte ranges.
pub(crate) fn split_bytes(count: usize, parts: usize, esz: usize) -> Vec<Range<usize>> {
    let base = count / parts;
    let extra = count % parts;
    let mut out = Vec::with_capacity(parts);
    let mut start = 0;
    for i in 0..parts {
        let len = (base + usize::from(i < extra)) * esz;
        out.push(start..start + len);
        start += len;
    }
    out
}

/// The byte range spanning blocks `lo..hi` of contiguous `blocks`.
pub(crate) fn span(blocks: &[Range<usize>], lo: usize, hi: usize) -> Range<usize> {
    if lo >= hi {
        return blocks.get(lo).map_or(0..0, |b| b.start..b.start);
    }
    blocks[lo].start..blocks[hi - 1].end
}

/// How blocks and messages are cut into chunks: the pipelined variants' chunks, and every
/// algorithm's cut at `CollectiveConfig::max_message_bytes`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunking {
    /// Chunk size in bytes, a positive multiple of the element size.
    bytes: usize,
    /// Chunks in the largest block (at least 1); message steps are numbered
    /// `phase * per_block + chunk`.
    pub(crate) per_block: u32,
}

/// Keeps `phases * per_block` below 2^30 so steps stay far from 2^31.
const MAX_STEPS: usize = 1 << 30;

impl Chunking {
    /// Chunks of about `chunk_bytes` (rounded down to whole elements, at least one) for
    /// blocks of at most `max_block` bytes, numbered over `phases` phases.
    pub(crate) fn new(chunk_bytes: usize, esz: usize, max_block: usize, phases: usize) -> Self {
        let mut bytes = (chunk_bytes / esz).max(1) * esz;
        let limit = (MAX_STEPS / phases.max(1)).max(1);
        if max_block.div_ceil(bytes) > limit {
            bytes = max_block.div_ceil(limit).div_ceil(esz) * esz;
        }
        let per_block = max_block.div_ceil(bytes).max(1);
        Self {
            bytes,
            per_block: u32::try_from(per_block).unwrap_or(u32::MAX),
        }
    }

    /// The chunks of a byte range, numbered from 0; an empty range has none.
    pub(crate) fn chunks(&self, r: Range<usize>) -> impl Iterator<Item = (u32, Range<usize>)> {
        let bytes = self.bytes;
        let n = r.len().div_ceil(bytes);
        (0..n).map(move |c| {
            let s = r.start + c * bytes;
            (c as u32, s..s.saturating_add(bytes).min(r.end))
        })
    }

    /// The message step of chunk `chunk` in phase `phase`.
    pub(crate) fn step(&self, phase: usize, chunk: u32) -> u32 {
        debug_assert!(chunk < self.per_block, "a chunk past the block bound");
        phase as u32 * self.per_block + chunk
    }
}

/// Lowest set bit of a non-zero `v`.
pub(crate) fn lowbit(v: usize) -> usize {
    v & v.wrapping_neg()
}

/// Largest power of two not above `n` (n >= 1).
pub(crate) fn pow2_floor(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// Size of the binomial subtree rooted at relative rank `v` in a tree of `n` ranks.
pub(crate) fn subtree(v: usize, n: usize) -> usize {
    if v == 0 {
        n
    } else {
        lowbit(v).min(n - v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_contiguous_and_balanced() {
        for count in 0..40 {
            for parts in 1..10 {
                let b = split_bytes(count, parts, 4);
                assert_eq!(b.len(), parts);
                assert_eq!(b[0].start, 0);
                assert_eq!(b[parts - 1].end, count * 4);
                for w in b.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len());
                    assert!(w[0].len() - w[1].len() <= 4);
                }
            }
        }
    }

    #[test]
    fn chunks_respect_elements() {
        let c = Chunking::new(10, 4, 100, 4);
        assert_eq!(c.per_block, 13);
        let v: Vec<_> = c.chunks(4..104).collect();
        assert_eq!(v.len(), 13);
        assert!(v.iter().all(|(_, r)| r.len() % 4 == 0 && !r.is_empty()));
        assert_eq!(v.last().map(|x| x.1.end), Some(104));
        assert_eq!(c.chunks(0..0).count(), 0);
        let huge = Chunking::new(1, 1, 1 << 40, 4);
        assert!(u64::from(huge.per_block) * 4 <= 1 << 30);
    }

    #[test]
    fn subtrees_partition() {
        for n in 1..40 {
            assert_eq!(subtree(0, n), n);
            for v in 1..n {
                assert!(subtree(v, n) >= 1);
            }
            assert_eq!(pow2_floor(n).leading_zeros(), (n).leading_zeros());
        }
    }
}
