//! Reduce to a root. Only the root's `Data` changes; other ranks accumulate in scratch.

use super::broadcast::{absolute, relative};
use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::{lowbit, split_bytes, Chunking};
use crate::BufRange;

/// Binomial tree: relative rank `v` reduces the buffers of its children `v + 2^j`
/// (`2^j < lowbit(v)`, smallest first) into an accumulator, then sends it to
/// `v - lowbit(v)`. The root accumulates in `Data`; an inner rank copies its `Data` to
/// scratch and accumulates there; a leaf sends its `Data` as is.
pub(crate) fn binomial(g: Geom, root: usize, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    let v = relative(g.rank, root, n);
    let data = BufRange::data(0..g.bytes());
    let has_children = v + 1 < n && (v == 0 || lowbit(v) > 1);
    let acc = if v != 0 && has_children {
        let acc = BufRange::scratch(0..g.bytes());
        b.copy(data, acc.clone());
        acc
    } else {
        data
    };
    let limit = if v == 0 {
        n.next_power_of_two()
    } else {
        lowbit(v)
    };
    let mut mask = 1;
    while mask < limit {
        if v + mask < n {
            b.recv(absolute(v + mask, root, n), 0, acc.clone(), true);
        }
        mask <<= 1;
    }
    if v != 0 {
        b.send(absolute(v - lowbit(v), root, n), 0, acc);
    }
    b.build("binomial", window)
}

/// Reduce-scatter then gather: a ring reduce-scatter over `world` blocks (after which rank
/// `r` holds block `r + 1` reduced), then every rank sends its block straight to the root.
/// Non-roots run the reduce-scatter on a scratch copy of `Data`. About `2 * bytes` per
/// rank instead of `log2(world) * bytes` at the root.
pub(crate) fn reduce_scatter_gather(
    g: Geom,
    root: usize,
    chunking: Chunking,
    window: usize,
) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    if n > 1 {
        let blocks = split_bytes(g.count, n, g.esz);
        let (r, next, prev) = (g.rank, g.next(), g.prev());
        let on = |range: std::ops::Range<usize>| {
            if r == root {
                BufRange::data(range)
            } else {
                BufRange::scratch(range)
            }
        };
        if r != root {
            b.copy(
                BufRange::data(0..g.bytes()),
                BufRange::scratch(0..g.bytes()),
            );
        }
        for s in 0..n - 1 {
            let send_block = blocks[(r + n - s) % n].clone();
            let recv_block = blocks[(r + 2 * n - s - 1) % n].clone();
            for (c, range) in chunking.chunks(send_block) {
                b.send(next, chunking.step(s, c), on(range));
            }
            for (c, range) in chunking.chunks(recv_block) {
                b.recv(prev, chunking.step(s, c), on(range), true);
            }
        }
        let gather = n - 1;
        if r == root {
            for q in (0..n).filter(|&q| q != root) {
                let block = blocks[(q + 1) % n].clone();
                for (c, range) in chunking.chunks(block) {
                    b.recv(q, chunking.step(gather, c), BufRange::data(range), false);
                }
            }
        } else {
            for (c, range) in chunking.chunks(blocks[(r + 1) % n].clone()) {
                b.send(root, chunking.step(gather, c), on(range));
            }
        }
    }
    b.build("rsg", window)
}
