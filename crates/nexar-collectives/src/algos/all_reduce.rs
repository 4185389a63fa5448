//! All-reduce in place on `Data`: ring (optionally pipelined), recursive
//! halving-doubling and recursive doubling.

use super::{Fold, FoldRole, Geom};
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::{span, split_bytes, Chunking};
use crate::BufRange;

/// Ring all-reduce: a ring reduce-scatter (after `world - 1` steps rank `r` holds block
/// `r + 1` fully reduced) then a ring all-gather, over `world` blocks split on element
/// boundaries. With `chunking` finer than whole blocks, every block travels as chunks and
/// each chunk depends only on the same chunk of the previous step, so steps overlap.
pub(crate) fn ring(g: Geom, chunking: Chunking, name: &'static str, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let n = g.world;
    if n > 1 {
        let blocks = split_bytes(g.count, n, g.esz);
        let (r, next, prev) = (g.rank, g.next(), g.prev());
        for s in 0..n - 1 {
            let send_block = &blocks[(r + n - s) % n];
            let recv_block = &blocks[(r + 2 * n - s - 1) % n];
            ring_step(
                &mut b, &chunking, s, next, send_block, prev, recv_block, true,
            );
        }
        for s in 0..n - 1 {
            let send_block = &blocks[(r + 1 + n - s) % n];
            let recv_block = &blocks[(r + n - s) % n];
            ring_step(
                &mut b,
                &chunking,
                n - 1 + s,
                next,
                send_block,
                prev,
                recv_block,
                false,
            );
        }
    }
    b.build(name, window)
}

/// One ring step on `Data`: send `send_block` to `next`, receive `recv_block` from `prev`,
/// chunk by chunk.
#[allow(clippy::too_many_arguments)]
fn ring_step(
    b: &mut DagBuilder,
    chunking: &Chunking,
    phase: usize,
    next: usize,
    send_block: &std::ops::Range<usize>,
    prev: usize,
    recv_block: &std::ops::Range<usize>,
    reduce: bool,
) {
    let mut sends = chunking.chunks(send_block.clone());
    let mut recvs = chunking.chunks(recv_block.clone());
    loop {
        let s = sends.next();
        let r = recvs.next();
        if s.is_none() && r.is_none() {
            break;
        }
        if let Some((c, range)) = s {
            b.send(next, chunking.step(phase, c), BufRange::data(range));
        }
        if let Some((c, range)) = r {
            b.recv(prev, chunking.step(phase, c), BufRange::data(range), reduce);
        }
    }
}

/// Recursive halving-doubling (Rabenseifner): fold to `p = 2^k` ranks, reduce-scatter by
/// recursive halving (each round exchanges half of the current window with the partner
/// at distance `p / 2^(i+1)`), all-gather by recursive doubling, unfold. Moves about
/// `2 * bytes` per rank in `2k` rounds (plus two for the fold). Every message is cut by
/// `ch`, numbered over `2k + 2` phases.
pub(crate) fn rhd(g: Geom, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let fold = Fold::new(g.world);
    let whole = BufRange::data(0..g.bytes());
    let post = 2 * fold.k + 1;
    match fold.role(g.rank) {
        FoldRole::Extra { partner } => {
            b.send_cut(&ch, partner, 0, whole.clone());
            b.recv_cut(&ch, partner, post, whole, false);
        }
        FoldRole::Member { new_rank, extra } => {
            if let Some(e) = extra {
                b.recv_cut(&ch, e, 0, whole.clone(), true);
            }
            let p = fold.p;
            let blocks = split_bytes(g.count, p, g.esz);
            let (mut lo, mut hi) = (0, p);
            for i in 0..fold.k {
                let d = p >> (i + 1);
                let partner = fold.real(new_rank ^ d);
                let mid = lo + (hi - lo) / 2;
                let (keep, give) = if new_rank & d == 0 {
                    ((lo, mid), (mid, hi))
                } else {
                    ((mid, hi), (lo, mid))
                };
                let step = 1 + i;
                b.send_cut(
                    &ch,
                    partner,
                    step,
                    BufRange::data(span(&blocks, give.0, give.1)),
                );
                b.recv_cut(
                    &ch,
                    partner,
                    step,
                    BufRange::data(span(&blocks, keep.0, keep.1)),
                    true,
                );
                (lo, hi) = keep;
            }
            for i in (0..fold.k).rev() {
                let d = p >> (i + 1);
                let partner = fold.real(new_rank ^ d);
                let width = hi - lo;
                let other = if new_rank & d == 0 {
                    (hi, hi + width)
                } else {
                    (lo - width, lo)
                };
                let step = 1 + fold.k + (fold.k - 1 - i);
                b.send_cut(&ch, partner, step, BufRange::data(span(&blocks, lo, hi)));
                b.recv_cut(
                    &ch,
                    partner,
                    step,
                    BufRange::data(span(&blocks, other.0, other.1)),
                    false,
                );
                (lo, hi) = (lo.min(other.0), hi.max(other.1));
            }
            if let Some(e) = extra {
                b.send_cut(&ch, e, post, whole);
            }
        }
    }
    b.build("rhd", window)
}

/// Recursive doubling: fold to `p = 2^k` ranks, then in round `i` exchange the whole
/// vector with the partner at distance `2^i` (received into the other of two buffers,
/// then reduced, the lower rank's operand first on both), then unfold. `k` rounds of `bytes` each: the latency-optimal choice for tiny buffers.
/// Every message is cut by `ch`, numbered over `k + 2` phases.
pub(crate) fn rd(g: Geom, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let fold = Fold::new(g.world);
    let whole = BufRange::data(0..g.bytes());
    let tmp = BufRange::scratch(0..g.bytes());
    let post = fold.k + 1;
    match fold.role(g.rank) {
        FoldRole::Extra { partner } => {
            b.send_cut(&ch, partner, 0, whole.clone());
            b.recv_cut(&ch, partner, post, whole, false);
        }
        FoldRole::Member { new_rank, extra } => {
            if let Some(e) = extra {
                b.recv_cut(&ch, e, 0, whole.clone(), true);
            }
            // The running result and the other buffer, where the partner's vector lands.
            // Both ranks of a pair compute op(lower rank's, higher rank's), so they end
            // with the same bits even where a float op's result depends on the order of
            // its operands (zeros of both signs under Min and Max, NaN payloads): the
            // higher rank reduces into the received vector, which then holds the result.
            let (mut cur, mut other) = (whole.clone(), tmp);
            for i in 0..fold.k {
                let partner_new = new_rank ^ (1 << i);
                let partner = fold.real(partner_new);
                let step = 1 + i;
                b.send_cut(&ch, partner, step, cur.clone());
                b.recv_cut(&ch, partner, step, other.clone(), false);
                if new_rank < partner_new {
                    b.reduce(other.clone(), cur.clone());
                } else {
                    b.reduce(cur.clone(), other.clone());
                    std::mem::swap(&mut cur, &mut other);
                }
            }
            if cur != whole {
                b.copy(cur, whole.clone());
            }
            if let Some(e) = extra {
                b.send_cut(&ch, e, post, whole);
            }
        }
    }
    b.build("rd", window)
}
