//! Reduce to a root. Only the root's `Data` changes; other ranks accumulate in scratch.

use super::broadcast::{absolute, relative};
use super::gather::Incast;
use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::{lowbit, split_bytes, Chunking};
use crate::{BufRange, OpId};
use std::ops::Range;

/// Binomial tree: relative rank `v` reduces the buffers of its children `v + 2^j`
/// (`2^j < lowbit(v)`, smallest first) into an accumulator, then sends it to
/// `v - lowbit(v)`. The root accumulates in `Data`; an inner rank accumulates in scratch,
/// its first child's buffer reduced onto its `Data` there (so `Data` is only read); a
/// leaf sends its `Data` as is. Every message is cut by `ch` (one phase).
pub(crate) fn binomial(g: Geom, root: usize, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    let v = relative(g.rank, root, n);
    let data = BufRange::data(0..g.bytes());
    let has_children = v + 1 < n && (v == 0 || lowbit(v) > 1);
    let acc = if v != 0 && has_children {
        BufRange::scratch(0..g.bytes())
    } else {
        data.clone()
    };
    let limit = if v == 0 {
        n.next_power_of_two()
    } else {
        lowbit(v)
    };
    let mut mask = 1;
    while mask < limit {
        if v + mask < n {
            let child = absolute(v + mask, root, n);
            if mask == 1 && acc != data {
                b.recv_reduce_onto_cut(&ch, child, 0, data.clone(), acc.clone());
            } else {
                b.recv_cut(&ch, child, 0, acc.clone(), true);
            }
        }
        mask <<= 1;
    }
    if v != 0 {
        b.send_cut(&ch, absolute(v - lowbit(v), root, n), 0, acc);
    }
    b.build("binomial", window)
}

/// Reduce-scatter then gather: a ring reduce-scatter over `world` blocks (after which rank
/// `r` holds block `r + 1` reduced), then every rank sends its block straight to the root,
/// paced by `incast_bytes` ([`Incast`]).
/// About `2 * bytes` per rank instead of `log2(world) * bytes` at the root.
///
/// The root reduces in its `Data`. The others only read theirs: in step `s` a rank
/// reduces what it receives onto its own block into one of two scratch slots of a block
/// each (alternating, so the next step's send reads one while the next receive writes the
/// other), and its last slot is what it sends to the root.
pub(crate) fn reduce_scatter_gather(
    g: Geom,
    root: usize,
    chunking: Chunking,
    incast_bytes: usize,
    window: usize,
) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    if n > 1 {
        let blocks = split_bytes(g.count, n, g.esz);
        let (r, next, prev) = (g.rank, g.next(), g.prev());
        let slot_len = blocks.iter().map(|b| b.len()).max().unwrap_or(0);
        // Where a piece of `block`'s partial after step `s` lies on this rank.
        let partial = |s: usize, block: &Range<usize>, piece: Range<usize>| {
            if r == root {
                BufRange::data(piece)
            } else {
                let at = (s % 2) * slot_len;
                BufRange::scratch(piece.start - block.start + at..piece.end - block.start + at)
            }
        };
        for s in 0..n - 1 {
            let send_block = &blocks[(r + n - s) % n];
            let recv_block = &blocks[(r + 2 * n - s - 1) % n];
            for (c, range) in chunking.chunks(send_block.clone()) {
                let src = if s == 0 {
                    BufRange::data(range)
                } else {
                    partial(s - 1, send_block, range)
                };
                b.send(next, chunking.step(s, c), src);
            }
            for (c, range) in chunking.chunks(recv_block.clone()) {
                let step = chunking.step(s, c);
                if r == root {
                    b.recv(prev, step, BufRange::data(range), true);
                } else {
                    let dst = partial(s, recv_block, range.clone());
                    b.recv_reduce_onto(prev, step, BufRange::data(range), dst);
                }
            }
        }
        let gather = n - 1;
        let own = &blocks[(r + 1) % n];
        // The go messages take the phase after the gather: the root sends nothing else
        // under it.
        let pace = Incast::new(incast_bytes, slot_len, root, n, chunking.step(n, 0));
        if r == root {
            for (i, q) in pace.senders().enumerate() {
                let block = blocks[(q + 1) % n].clone();
                let got: Vec<OpId> = chunking
                    .chunks(block)
                    .map(|(c, range)| {
                        b.recv(q, chunking.step(gather, c), BufRange::data(range), false)
                    })
                    .collect();
                pace.admit_after(&mut b, i + 1, &got);
            }
        } else {
            let go = pace.wait(&mut b, r);
            for (c, range) in chunking.chunks(own.clone()) {
                let src = partial(n - 2, own, range);
                b.send_after(root, chunking.step(gather, c), src, &go);
            }
        }
    }
    b.build("rsg", window)
}
