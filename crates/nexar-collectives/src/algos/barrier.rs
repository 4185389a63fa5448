//! Dissemination barrier.

use crate::dag::{DagBuilder, DagSchedule};
use crate::{BufRange, OpId};

/// Dissemination barrier: in round `k` every rank sends an empty message to
/// `rank + 2^k` and waits for one from `rank - 2^k`; a round's send waits for the previous
/// round's receive, so after `ceil(log2 world)` rounds every rank has heard, transitively,
/// from every other.
pub(crate) fn dissemination(rank: usize, world: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let mut prev_recv: Option<OpId> = None;
    let mut d = 1;
    let mut k = 0u32;
    while d < world {
        let to = (rank + d) % world;
        let from = (rank + world - d) % world;
        let after: Vec<OpId> = prev_recv.into_iter().collect();
        b.send_after(to, k, BufRange::data(0..0), &after);
        prev_recv = Some(b.recv(from, k, BufRange::data(0..0), false));
        d <<= 1;
        k += 1;
    }
    b.build("dissemination", 0)
}
