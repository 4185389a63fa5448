//! All-gather: `Input` (`count` elements) on every rank to `Data` (`count * world`,
//! rank-major) on every rank.

use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::Chunking;
use crate::BufRange;

/// Byte range of block `i` when every block is `blk` bytes.
fn block(i: usize, blk: usize) -> std::ops::Range<usize> {
    i * blk..(i + 1) * blk
}

/// Ring: copy the own block into place, then for `world - 1` steps pass on the block
/// received in the previous step (the first step sends straight from `Input`).
pub(crate) fn ring(g: Geom, chunking: Chunking, name: &'static str, window: usize) -> DagSchedule {
    let mut b = DagBuilder::placed(g.in_place);
    let (n, r, blk) = (g.world, g.rank, g.bytes());
    b.copy(BufRange::input(0..blk), BufRange::data(block(r, blk)));
    for s in 0..n.saturating_sub(1) {
        let sb = (r + n - s) % n;
        let rb = (r + 2 * n - s - 1) % n;
        for (c, range) in chunking.chunks(0..blk) {
            let src = if s == 0 {
                BufRange::input(range.clone())
            } else {
                BufRange::data(range.start + sb * blk..range.end + sb * blk)
            };
            b.send(g.next(), chunking.step(s, c), src);
            let dst = BufRange::data(range.start + rb * blk..range.end + rb * blk);
            b.recv(g.prev(), chunking.step(s, c), dst, false);
        }
    }
    b.build(name, window)
}

/// Recursive doubling (world a power of two): in round `i` exchange the `2^i` blocks held
/// so far with the partner `rank ^ 2^i`. Every message is cut by `ch`, one phase a round.
pub(crate) fn rd(g: Geom, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::placed(g.in_place);
    let (n, r, blk) = (g.world, g.rank, g.bytes());
    debug_assert!(n.is_power_of_two());
    b.copy(BufRange::input(0..blk), BufRange::data(block(r, blk)));
    let mut d = 1;
    let mut i = 0;
    while d < n {
        let partner = r ^ d;
        let mine = (r & !(d - 1)) * blk;
        let theirs = (partner & !(d - 1)) * blk;
        b.send_cut(&ch, partner, i, BufRange::data(mine..mine + d * blk));
        let dst = BufRange::data(theirs..theirs + d * blk);
        b.recv_cut(&ch, partner, i, dst, false);
        d <<= 1;
        i += 1;
    }
    b.build("rd", window)
}

/// Bruck (any world size): scratch holds blocks `rank, rank+1, ...` in that order; in
/// round `k` a rank sends its first `min(2^k, world - 2^k)` blocks to `rank - 2^k` and
/// appends those of `rank + 2^k`. A final rotation puts the blocks in rank order. Every
/// message is cut by `ch`, one phase a round.
pub(crate) fn bruck(g: Geom, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::placed(g.in_place);
    let (n, r, blk) = (g.world, g.rank, g.bytes());
    b.scratch(n * blk);
    b.copy(BufRange::input(0..blk), BufRange::scratch(0..blk));
    let mut d = 1;
    let mut k = 0;
    while d < n {
        let cnt = d.min(n - d);
        let to = (r + n - d) % n;
        let from = (r + d) % n;
        b.send_cut(&ch, to, k, BufRange::scratch(0..cnt * blk));
        let dst = BufRange::scratch(d * blk..(d + cnt) * blk);
        b.recv_cut(&ch, from, k, dst, false);
        d <<= 1;
        k += 1;
    }
    // Scratch block i is rank (r + i) % n's block.
    let head = n - r;
    if blk > 0 {
        b.copy(
            BufRange::scratch(0..head * blk),
            BufRange::data(r * blk..n * blk),
        );
        if r > 0 {
            b.copy(
                BufRange::scratch(head * blk..n * blk),
                BufRange::data(0..r * blk),
            );
        }
    }
    b.build("bruck", window)
}
