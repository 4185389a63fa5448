//! Gather (`Input`, `count` elements, to the root's `Data`, `count * world` rank-major) and
//! scatter (the root's `Input`, `count * world`, to every rank's `Data`, `count`), over
//! binomial trees (few rounds: small blocks) or linearly (every block crosses the wire
//! once: large blocks).
//!
//! In the tree rooted at `root`, relative rank `v` owns the blocks of relative ranks
//! `v..v + subtree(v)`. Inner ranks stage their subtree's blocks in scratch in relative
//! order, so every message is one contiguous range. The root (unless it is rank 0, where
//! relative and absolute order agree) stages too, and rotates between relative and rank
//! order with two local copies.

use super::broadcast::{absolute, relative};
use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::{lowbit, subtree, Chunking};
use crate::{BufRange, OpId};

/// The children of relative rank `v`, as `(relative rank, subtree size)`, smallest first.
fn children(v: usize, n: usize) -> Vec<(usize, usize)> {
    let limit = if v == 0 {
        n.next_power_of_two()
    } else {
        lowbit(v)
    };
    let mut out = Vec::new();
    let mut mask = 1;
    while mask < limit {
        if v + mask < n {
            out.push((v + mask, subtree(v + mask, n)));
        }
        mask <<= 1;
    }
    out
}

/// Where the root keeps relative blocks `a..b` (contiguous in relative order).
fn root_stage(root: usize, blk: usize, a: usize, b: usize) -> BufRange {
    if root == 0 {
        BufRange::data(a * blk..b * blk)
    } else {
        BufRange::scratch(a * blk..b * blk)
    }
}

/// Binomial gather; every message is cut by `ch` (one phase).
pub(crate) fn gather(g: Geom, root: usize, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let (n, blk) = (g.world, g.bytes());
    let v = relative(g.rank, root, n);
    let own = BufRange::input(0..blk);
    if v == 0 {
        b.copy(own, BufRange::data(root * blk..(root + 1) * blk));
        for (c, m) in children(0, n) {
            let dst = root_stage(root, blk, c, c + m);
            b.recv_cut(&ch, absolute(c, root, n), 0, dst, false);
        }
        if root != 0 && blk > 0 {
            // Relative 1..n-root are ranks root+1..n; relative n-root..n are ranks 0..root.
            let head = n - root;
            if head > 1 {
                b.copy(
                    BufRange::scratch(blk..head * blk),
                    BufRange::data((root + 1) * blk..n * blk),
                );
            }
            b.copy(
                BufRange::scratch(head * blk..n * blk),
                BufRange::data(0..root * blk),
            );
        }
    } else {
        let parent = absolute(v - lowbit(v), root, n);
        let kids = children(v, n);
        if kids.is_empty() {
            b.send_cut(&ch, parent, 0, own);
        } else {
            let m = subtree(v, n);
            b.copy(own, BufRange::scratch(0..blk));
            for (c, cm) in kids {
                let off = c - v;
                b.recv_cut(
                    &ch,
                    absolute(c, root, n),
                    0,
                    BufRange::scratch(off * blk..(off + cm) * blk),
                    false,
                );
            }
            b.send_cut(&ch, parent, 0, BufRange::scratch(0..m * blk));
        }
    }
    b.build("binomial", window)
}

/// Binomial scatter; every message is cut by `ch` (one phase).
pub(crate) fn scatter(g: Geom, root: usize, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let (n, blk) = (g.world, g.bytes());
    let v = relative(g.rank, root, n);
    if v == 0 {
        b.copy(
            BufRange::input(root * blk..(root + 1) * blk),
            BufRange::data(0..blk),
        );
        let src = |a: usize, e: usize| {
            if root == 0 {
                BufRange::input(a * blk..e * blk)
            } else {
                BufRange::scratch(a * blk..e * blk)
            }
        };
        if root != 0 && blk > 0 {
            let head = n - root;
            if head > 1 {
                b.copy(
                    BufRange::input((root + 1) * blk..n * blk),
                    BufRange::scratch(blk..head * blk),
                );
            }
            b.copy(
                BufRange::input(0..root * blk),
                BufRange::scratch(head * blk..n * blk),
            );
        }
        for (c, m) in children(0, n).into_iter().rev() {
            b.send_cut(&ch, absolute(c, root, n), 0, src(c, c + m));
        }
    } else {
        let parent = absolute(v - lowbit(v), root, n);
        let kids = children(v, n);
        if kids.is_empty() {
            b.recv_cut(&ch, parent, 0, BufRange::data(0..blk), false);
        } else {
            let m = subtree(v, n);
            b.recv_cut(&ch, parent, 0, BufRange::scratch(0..m * blk), false);
            b.copy(BufRange::scratch(0..blk), BufRange::data(0..blk));
            for (c, cm) in kids.into_iter().rev() {
                let off = c - v;
                b.send_cut(
                    &ch,
                    absolute(c, root, n),
                    0,
                    BufRange::scratch(off * blk..(off + cm) * blk),
                );
            }
        }
    }
    b.build("binomial", window)
}

/// Paces the senders of a linear gather into one root, so that what they have in flight
/// toward it stays under what its receive buffer holds (see
/// [`CollectiveConfig::incast_bytes`](crate::CollectiveConfig::incast_bytes)). The
/// senders are let in in the order `root + 1, root + 2, ...`: the first `at_once` start
/// at once, and each later one waits for an empty go message (step `go`) that the root
/// sends once the block of the sender `at_once` places before it is in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Incast {
    root: usize,
    world: usize,
    at_once: usize,
    go: u32,
}

impl Incast {
    /// Pacing for senders of `block` bytes each, with `incast_bytes` let in at once
    /// (at least two senders); `go` must be a step the root sends its senders nothing
    /// else under.
    pub(crate) fn new(
        incast_bytes: usize,
        block: usize,
        root: usize,
        world: usize,
        go: u32,
    ) -> Self {
        let at_once = (incast_bytes / block.max(1)).max(2);
        Incast {
            root,
            world,
            at_once,
            go,
        }
    }

    /// The senders, in the order they are let in.
    pub(crate) fn senders(&self) -> impl Iterator<Item = usize> {
        let (root, n) = (self.root, self.world);
        (1..n).map(move |i| (root + i) % n)
    }

    /// On sender `rank`: what its sends to the root wait for (the go message, if it is
    /// not among the first `at_once`).
    pub(crate) fn wait(&self, b: &mut DagBuilder, rank: usize) -> Vec<OpId> {
        let place = (rank + self.world - self.root) % self.world;
        if place <= self.at_once {
            return Vec::new();
        }
        vec![b.recv(self.root, self.go, BufRange::data(0..0), false)]
    }

    /// On the root, once it has posted the receives `got` of the sender at `place` (1 for
    /// `root + 1`): lets in the sender `at_once` places later, when they complete.
    pub(crate) fn admit_after(&self, b: &mut DagBuilder, place: usize, got: &[OpId]) {
        let later = place + self.at_once;
        if later < self.world {
            let next = (self.root + later) % self.world;
            b.send_after(next, self.go, BufRange::data(0..0), got);
        }
    }
}

/// Linear gather: every other rank sends its block straight to the root, which receives
/// it in place in `Data`; only the root's own block is copied. Every block crosses the
/// wire once (the tree forwards blocks through inner ranks: `log2(world) / 2` times on
/// average), and nothing is staged. Senders are paced by `incast_bytes` ([`Incast`]).
/// Every block is cut by `ch` (phase 0; the go messages take phase 1).
pub(crate) fn gather_linear(
    g: Geom,
    root: usize,
    ch: Chunking,
    incast_bytes: usize,
    window: usize,
) -> DagSchedule {
    let mut b = DagBuilder::new();
    let (n, blk) = (g.world, g.bytes());
    let own = BufRange::input(0..blk);
    let pace = Incast::new(incast_bytes, blk, root, n, ch.step(1, 0));
    if g.rank == root {
        b.copy(own, BufRange::data(root * blk..(root + 1) * blk));
        for (i, q) in pace.senders().enumerate() {
            let dst = BufRange::data(q * blk..(q + 1) * blk);
            let got = b.recv_cut(&ch, q, 0, dst, false);
            pace.admit_after(&mut b, i + 1, &got);
        }
    } else {
        let go = pace.wait(&mut b, g.rank);
        b.send_cut_after(&ch, root, 0, own, &go);
    }
    b.build("linear", window)
}

/// Linear scatter: the root sends every other rank its block straight from `Input` (the
/// next ranks first) and copies its own; the others receive in place. Every block is cut
/// by `ch` (one phase).
pub(crate) fn scatter_linear(g: Geom, root: usize, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let (n, blk) = (g.world, g.bytes());
    let mine = BufRange::data(0..blk);
    if g.rank == root {
        b.copy(BufRange::input(root * blk..(root + 1) * blk), mine);
        for q in (1..n).map(|i| (root + i) % n) {
            b.send_cut(&ch, q, 0, BufRange::input(q * blk..(q + 1) * blk));
        }
    } else {
        b.recv_cut(&ch, root, 0, mine, false);
    }
    b.build("linear", window)
}
