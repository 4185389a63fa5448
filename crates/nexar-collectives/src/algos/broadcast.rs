//! Broadcast in place on `Data`: binomial tree, pipelined chain, and binomial scatter
//! followed by an all-gather (recursive doubling or ring).

use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::{lowbit, span, split_bytes, subtree, Chunking};
use crate::BufRange;

/// Relative rank of `rank` in a tree rooted at `root`, and back.
pub(crate) fn relative(rank: usize, root: usize, world: usize) -> usize {
    (rank + world - root) % world
}

pub(crate) fn absolute(v: usize, root: usize, world: usize) -> usize {
    (v + root) % world
}

/// Binomial tree: relative rank `v` receives the whole buffer from `v - lowbit(v)`, then
/// sends it to `v + 2^j` for every `2^j < lowbit(v)`, largest subtree first.
/// `ceil(log2 world)` rounds of `bytes`, each message cut by `ch` (one phase).
pub(crate) fn binomial(g: Geom, root: usize, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    let v = relative(g.rank, root, n);
    let whole = BufRange::data(0..g.bytes());
    let top = if v == 0 {
        n.next_power_of_two()
    } else {
        b.recv_cut(
            &ch,
            absolute(v - lowbit(v), root, n),
            0,
            whole.clone(),
            false,
        );
        lowbit(v)
    };
    let mut mask = top >> 1;
    while mask > 0 {
        if v + mask < n {
            b.send_cut(&ch, absolute(v + mask, root, n), 0, whole.clone());
        }
        mask >>= 1;
    }
    b.build("binomial", window)
}

/// Pipelined chain: the buffer travels `root -> root+1 -> ... -> root-1` in chunks; a rank
/// forwards chunk `c` as soon as it has it. About `(world - 1 + chunks)` chunk times.
pub(crate) fn chain(g: Geom, root: usize, chunking: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    let v = relative(g.rank, root, n);
    for (c, range) in chunking.chunks(0..g.bytes()) {
        if v > 0 {
            b.recv(
                absolute(v - 1, root, n),
                c,
                BufRange::data(range.clone()),
                false,
            );
        }
        if v + 1 < n {
            b.send(absolute(v + 1, root, n), c, BufRange::data(range));
        }
    }
    b.build("chain", window)
}

/// Scatter then all-gather (van de Geijn): the buffer is split into `world` blocks by
/// relative rank; a binomial scatter leaves block `v` on relative rank `v` (each subtree's
/// blocks are contiguous, so everything stays in place in `Data`), then an all-gather
/// over relative ranks completes every copy, skipping the blocks a rank already holds
/// from the scatter (so the root receives nothing): by recursive doubling with `rd` (on a
/// power-of-two world only), else by a ring. At most `2 * bytes` per rank.
/// The scatter's messages are cut by `scatter` (phase 0), recursive doubling's too (phase
/// `1 + i` in round `i`), the ring's blocks by `chunking`, numbered after the scatter's.
pub(crate) fn scatter_allgather(
    g: Geom,
    root: usize,
    scatter: Chunking,
    chunking: Chunking,
    rd: bool,
    window: usize,
) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    if n > 1 {
        let v = relative(g.rank, root, n);
        let blocks = split_bytes(g.count, n, g.esz);
        let top = if v == 0 {
            n.next_power_of_two()
        } else {
            let m = subtree(v, n);
            let parent = absolute(v - lowbit(v), root, n);
            let range = BufRange::data(span(&blocks, v, v + m));
            b.recv_cut(&scatter, parent, 0, range, false);
            lowbit(v)
        };
        let mut mask = top >> 1;
        while mask > 0 {
            if v + mask < n {
                let c = v + mask;
                let m = subtree(c, n);
                b.send_cut(
                    &scatter,
                    absolute(c, root, n),
                    0,
                    BufRange::data(span(&blocks, c, c + m)),
                );
            }
            mask >>= 1;
        }
        // A block that the scatter left on a rank (every block of its subtree) is neither
        // sent to it nor received by it again: the root takes nothing in the all-gather,
        // and no receive has to wait for the scatter's sends to finish reading its range.
        let held = |u: usize, block: usize| block >= u && block < u + subtree(u, n);
        if rd && n.is_power_of_two() {
            // Recursive doubling over relative ranks: in round `i` the group of `2^i`
            // blocks a rank holds goes to the partner `v ^ 2^i`. A scatter subtree holds
            // either all of a group or none of it, so each message is whole or left out.
            // What a rank sends is the scatter's receive and earlier rounds' receives,
            // which a driver that copies its sends passes on as they came
            // (`Schedule::parts`).
            let mut d = 1;
            let mut i = 1;
            while d < n {
                let u = v ^ d;
                let (mine, theirs) = (v & !(d - 1), u & !(d - 1));
                let (out, into) = (
                    span(&blocks, mine, mine + d),
                    span(&blocks, theirs, theirs + d),
                );
                // Empty groups (fewer elements than ranks) travel not at all.
                if !held(u, mine) && !out.is_empty() {
                    b.send_cut(&scatter, absolute(u, root, n), i, BufRange::data(out));
                }
                if !held(v, theirs) && !into.is_empty() {
                    b.recv_cut(
                        &scatter,
                        absolute(u, root, n),
                        i,
                        BufRange::data(into),
                        false,
                    );
                }
                d <<= 1;
                i += 1;
            }
            return b.build("scatter_allgather", window);
        }
        let next = absolute(v + 1, root, n);
        let prev = absolute(v + n - 1, root, n);
        let ring = scatter.step(1, 0);
        for s in 0..n - 1 {
            let send_b = (v + n - s) % n;
            let recv_b = (v + 2 * n - s - 1) % n;
            if !held((v + 1) % n, send_b) {
                for (c, range) in chunking.chunks(blocks[send_b].clone()) {
                    b.send(next, ring + chunking.step(s, c), BufRange::data(range));
                }
            }
            if !held(v, recv_b) {
                for (c, range) in chunking.chunks(blocks[recv_b].clone()) {
                    b.recv(
                        prev,
                        ring + chunking.step(s, c),
                        BufRange::data(range),
                        false,
                    );
                }
            }
        }
    }
    b.build("scatter_allgather", window)
}
