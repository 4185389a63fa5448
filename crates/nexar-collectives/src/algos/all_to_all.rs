//! All-to-all: block `j` of rank `r`'s `Input` goes to block `r` of rank `j`'s `Data`.

use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::Chunking;
use crate::BufRange;

/// Pairwise exchange: in step `s` (1..world) rank `r` sends to `r + s` and receives from
/// `r - s`, so every rank sends and receives exactly once per step. No data hazards, so
/// only the window orders the sends. Every block is cut by `ch`, one phase a step
/// (phases `1..world`).
pub(crate) fn pairwise(g: Geom, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let (n, r, blk) = (g.world, g.rank, g.bytes());
    let at = |i: usize| i * blk..(i + 1) * blk;
    b.copy(BufRange::input(at(r)), BufRange::data(at(r)));
    for s in 1..n {
        let to = (r + s) % n;
        let from = (r + n - s) % n;
        b.send_cut(&ch, to, s, BufRange::input(at(to)));
        b.recv_cut(&ch, from, s, BufRange::data(at(from)), false);
    }
    b.build("pairwise", window)
}

/// Bruck (for small blocks): `ceil(log2 world)` rounds instead of `world - 1`. Scratch
/// holds the blocks rotated so slot `i` is the block for rank `rank + i`; in round `k`
/// every slot with bit `k` set moves (packed into one message) to rank `rank + 2^k`, so
/// a block travels `i` ranks in total. Afterwards slot `i` holds the block from rank
/// `rank - i`. Each rank sends about `world / 2` blocks per round. Every message is cut
/// by `ch`, one phase a round.
pub(crate) fn bruck(g: Geom, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let (n, r, blk) = (g.world, g.rank, g.bytes());
    let at = |i: usize| i * blk..(i + 1) * blk;
    let tmp = |i: usize, j: usize| BufRange::scratch(i * blk..j * blk);
    if blk == 0 || n == 1 {
        b.copy(BufRange::input(at(r)), BufRange::data(at(r)));
        return b.build("bruck", window);
    }
    // Slot i = Input block (r + i) % n.
    b.copy(BufRange::input(r * blk..n * blk), tmp(0, n - r));
    if r > 0 {
        b.copy(BufRange::input(0..r * blk), tmp(n - r, n));
    }
    let half = n.div_ceil(2);
    let pack = n * blk;
    let unpack = pack + half * blk;
    let mut d = 1;
    let mut k = 0;
    while d < n {
        // Slots with bit k set come in runs of d consecutive slots.
        let runs: Vec<(usize, usize)> = (0..n)
            .step_by(2 * d)
            .map(|s| (s + d, (s + 2 * d).min(n)))
            .filter(|(a, e)| a < e)
            .collect();
        let mut off = 0;
        for &(a, e) in &runs {
            let len = (e - a) * blk;
            b.copy(tmp(a, e), BufRange::scratch(pack + off..pack + off + len));
            off += len;
        }
        b.send_cut(&ch, (r + d) % n, k, BufRange::scratch(pack..pack + off));
        b.recv_cut(
            &ch,
            (r + n - d) % n,
            k,
            BufRange::scratch(unpack..unpack + off),
            false,
        );
        let mut off = 0;
        for &(a, e) in &runs {
            let len = (e - a) * blk;
            b.copy(
                BufRange::scratch(unpack + off..unpack + off + len),
                tmp(a, e),
            );
            off += len;
        }
        d <<= 1;
        k += 1;
    }
    for i in 0..n {
        b.copy(tmp(i, i + 1), BufRange::data(at((r + n - i) % n)));
    }
    b.build("bruck", window)
}
