//! Dissemination barrier.

use crate::dag::{DagBuilder, DagSchedule};
use crate::{BufRange, OpId};

/// Dissemination barrier: in round `k` every rank sends an empty message to
/// `rank + 2^k` and waits for one from `rank - 2^k`; a round's send waits for every
/// earlier round's receive (the previous round's, and through the previous round's send
/// those before it), so after `ceil(log2 world)` rounds every rank has heard, transitively,
/// from every other. (A send that waited for the previous round's receive alone went out
/// while an earlier round's was still missing: on 6 ranks, rank 5 left the barrier with
/// rank 0 never in it.)
pub(crate) fn dissemination(rank: usize, world: usize) -> DagSchedule {
    let mut b = DagBuilder::new();
    let mut prev: Vec<OpId> = Vec::new();
    let mut d = 1;
    let mut k = 0u32;
    while d < world {
        let to = (rank + d) % world;
        let from = (rank + world - d) % world;
        let send = b.send_after(to, k, BufRange::data(0..0), &prev);
        let recv = b.recv(from, k, BufRange::data(0..0), false);
        prev = vec![send, recv];
        d <<= 1;
        k += 1;
    }
    b.build("dissemination", 0)
}
