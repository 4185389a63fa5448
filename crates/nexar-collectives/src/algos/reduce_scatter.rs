//! Reduce-scatter: `Input` (`count * world` elements) on every rank to `Data` (`count`)
//! on every rank, rank `r` getting block `r` reduced over all ranks.

use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::Chunking;
use crate::BufRange;

/// Ring: in step `s` rank `r` sends its partial of block `r - s - 1` (straight from
/// `Input` in step 0) and receives the partial of block `r - s - 2`, reduced with its own
/// input block. Partials alternate between two scratch slots, which only the next step's
/// send reads (so a driver may hand that send the reduced buffer and leave the slot
/// unwritten); the last step reduces into `Data`, which ends up holding block `r`.
pub(crate) fn ring(g: Geom, chunking: Chunking, name: &'static str, window: usize) -> DagSchedule {
    let mut b = DagBuilder::placed(g.in_place);
    let (n, r, blk) = (g.world, g.rank, g.bytes());
    if n == 1 {
        b.copy(BufRange::input(0..blk), BufRange::data(0..blk));
        return b.build(name, window);
    }
    let slot = |s: usize, range: &std::ops::Range<usize>| {
        if s == n - 2 {
            BufRange::data(range.clone())
        } else {
            let off = (s % 2) * blk;
            BufRange::scratch(range.start + off..range.end + off)
        }
    };
    for s in 0..n - 1 {
        let sb = (r + n - s - 1) % n;
        let rb = (r + 2 * n - s - 2) % n;
        for (c, range) in chunking.chunks(0..blk) {
            let src = if s == 0 {
                BufRange::input(range.start + sb * blk..range.end + sb * blk)
            } else {
                slot(s - 1, &range)
            };
            b.send(g.next(), chunking.step(s, c), src);
            b.recv_reduce_onto(
                g.prev(),
                chunking.step(s, c),
                BufRange::input(range.start + rb * blk..range.end + rb * blk),
                slot(s, &range),
            );
        }
    }
    b.build(name, window)
}

/// A round splits what it sends into messages where halves of it are at least this
/// large (see [`rh`]).
const RH_SPLIT_BYTES: usize = 256 << 10;

/// The messages, as block ranges in order, that carry blocks `lo..hi` to rank `v` in
/// recursive halving's round of distance `d` (the sender computes them for its partner
/// `v`, the receiver for itself, alike). In the next round `v` reduces onto one half of
/// them and sends the other on as it then cuts it: so this round sends the half `v` keeps
/// as one message and the half it passes on as those messages, and every message `v`
/// passes on is one it received, reduced. The last round, and halves under
/// [`RH_SPLIT_BYTES`], go whole.
fn rh_messages(
    v: usize,
    d: usize,
    (lo, hi): (usize, usize),
    blk: usize,
    out: &mut Vec<(usize, usize)>,
) {
    let half = (hi - lo) / 2;
    if d == 1 || half * blk < RH_SPLIT_BYTES {
        out.push((lo, hi));
        return;
    }
    let (keep, give) = rh_halves(v, d / 2, (lo, hi));
    let start = out.len();
    rh_messages(v ^ (d / 2), d / 2, give, blk, out);
    // In block order: the lower half first.
    if keep.0 < give.0 {
        out.insert(start, keep);
    } else {
        out.push(keep);
    }
}

/// The halves of blocks `lo..hi` that rank `v` keeps and gives away in recursive
/// halving's round of distance `d`: `(keep, give)`.
fn rh_halves(v: usize, d: usize, (lo, hi): (usize, usize)) -> ((usize, usize), (usize, usize)) {
    let mid = lo + (hi - lo) / 2;
    if v & d == 0 {
        ((lo, mid), (mid, hi))
    } else {
        ((mid, hi), (lo, mid))
    }
}

/// Recursive halving (world a power of two): round `i` sends the half of the current
/// window of blocks that the partner `rank ^ (world / 2^(i+1))` keeps and reduces the
/// partner's partial of the half this rank keeps; after `log2(world)` rounds the window
/// is block `rank`. Round 0 sends straight from `Input` and reduces onto it into scratch,
/// which holds the half kept then (so `Input` is read once, never copied); the last round
/// reduces into `Data`.
///
/// A round sends its half as the messages of [`rh_messages`] (phases `i * log2(world)`
/// on, each cut by `ch`): what a later round sends from scratch is then a reduced result
/// received whole, which nothing else reads (`Schedule::only_forwarded`), so a driver may
/// pass it on as it built it instead of storing it in scratch and copying it out again.
/// On 4 processes, a reduce-scatter of 64 MiB spent 5% of its CPU on that copy
/// (BENCHMARKS.md, session 36).
pub(crate) fn rh(g: Geom, ch: Chunking, window: usize) -> DagSchedule {
    let mut b = DagBuilder::placed(g.in_place);
    let (n, r, blk) = (g.world, g.rank, g.bytes());
    debug_assert!(n.is_power_of_two());
    if n == 1 {
        b.copy(BufRange::input(0..blk), BufRange::data(0..blk));
        return b.build("rh", window);
    }
    let rounds = n.trailing_zeros() as usize;
    // Where blocks `lo..hi` of this rank's partials lie: `Input` before round 0, then
    // scratch, which starts at the first block kept in round 0.
    let at = |origin: Option<usize>, (lo, hi): (usize, usize)| match origin {
        None => BufRange::input(lo * blk..hi * blk),
        Some(o) => BufRange::scratch((lo - o) * blk..(hi - o) * blk),
    };
    let mut origin: Option<usize> = None;
    let (mut lo, mut hi) = (0, n);
    let mut i = 0;
    let mut d = n / 2;
    let mut messages = Vec::new();
    while d >= 1 {
        let partner = r ^ d;
        let (keep, give) = rh_halves(r, d, (lo, hi));
        messages.clear();
        rh_messages(partner, d, give, blk, &mut messages);
        for (m, &part) in messages.iter().enumerate() {
            b.send_cut(&ch, partner, i * rounds + m, at(origin, part));
        }
        let kept = Some(origin.unwrap_or(keep.0));
        messages.clear();
        rh_messages(r, d, keep, blk, &mut messages);
        for (m, &part) in messages.iter().enumerate() {
            let dst = if d == 1 {
                BufRange::data(0..blk)
            } else {
                at(kept, part)
            };
            b.recv_reduce_onto_cut(&ch, partner, i * rounds + m, at(origin, part), dst);
        }
        origin = kept;
        (lo, hi) = keep;
        d /= 2;
        i += 1;
    }
    b.build("rh", window)
}
