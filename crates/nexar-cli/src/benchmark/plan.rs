//! Which algorithm a collective runs and how many bytes each rank puts on the wire, read
//! from the same schedule the runtime builds (nexar-collectives is sans-IO, so a schedule
//! can be stepped without a network).

use nexar_actors::CollectiveConfig;
use nexar_collectives::{self as coll, Action, Schedule};
use nexar_device::{DataType, ReduceOp};

use super::BenchOp;

/// The algorithm and this rank's payload bytes sent per call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The schedule's name (`"ring"`, `"rhd"`, ...), or the op's own for send/recv.
    pub(crate) algorithm: &'static str,
    /// Payload bytes this rank sends to other ranks per call (frame headers, QUIC and TLS
    /// overhead not included).
    pub(crate) wire_bytes: u64,
}

/// The plan of `op` on `rank` of `world` for a size of `count` elements (the whole buffer
/// as the bench counts it: for all_gather the receive buffer, for reduce_scatter the send
/// buffer). `burst` is the number of messages one p2p iteration sends.
pub(crate) fn plan(
    op: BenchOp,
    rank: usize,
    world: usize,
    count: usize,
    dtype: DataType,
    burst: usize,
    cfg: &CollectiveConfig,
) -> Result<Plan, String> {
    let bytes = (count * dtype.size()) as u64;
    let sum = ReduceOp::Sum;
    let schedule = match op {
        BenchOp::AllReduce => coll::all_reduce(rank, world, count, dtype, sum, cfg),
        BenchOp::Broadcast => coll::broadcast(rank, world, count, dtype, 0, cfg),
        BenchOp::Reduce => coll::reduce(rank, world, count, dtype, sum, 0, cfg),
        BenchOp::AllGather => coll::all_gather(rank, world, count / world, dtype, cfg),
        BenchOp::ReduceScatter => coll::reduce_scatter(rank, world, count / world, dtype, sum, cfg),
        BenchOp::AllToAll => coll::all_to_all(rank, world, count / world, dtype, cfg),
        BenchOp::Gather => coll::gather(rank, world, count / world, dtype, 0, cfg),
        BenchOp::Scatter => coll::scatter(rank, world, count / world, dtype, 0, cfg),
        BenchOp::Barrier => coll::barrier(rank, world),
        BenchOp::SendRecv => {
            let wire_bytes = if world > 1 { bytes } else { 0 };
            return Ok(Plan {
                algorithm: "sendrecv",
                wire_bytes,
            });
        }
        BenchOp::P2p => {
            let wire_bytes = if rank == 0 { bytes * burst as u64 } else { 0 };
            return Ok(Plan {
                algorithm: "stream",
                wire_bytes,
            });
        }
        BenchOp::PingPong => {
            let wire_bytes = if rank < 2 { bytes } else { 0 };
            return Ok(Plan {
                algorithm: "pingpong",
                wire_bytes,
            });
        }
    }
    .map_err(|e| format!("{op} of {count} x {}: {e}", dtype.name()))?;
    Ok(Plan {
        algorithm: schedule.name(),
        wire_bytes: sent_bytes(schedule, rank)?,
    })
}

/// Steps `schedule` to the end, completing every action as soon as it is issued, and adds
/// up the bytes of its sends to other ranks.
fn sent_bytes(mut schedule: Box<dyn Schedule>, rank: usize) -> Result<u64, String> {
    let mut ready = Vec::new();
    let mut total = 0u64;
    schedule.poll(&mut ready);
    while let Some(action) = ready.pop() {
        if let Action::Send { peer, src, .. } = &action {
            if *peer != rank {
                total += src.len() as u64;
            }
        }
        schedule
            .complete(action.id())
            .map_err(|e| format!("stepping the {} schedule: {e}", schedule.name()))?;
        schedule.poll(&mut ready);
    }
    if !schedule.is_done() {
        return Err(format!("the {} schedule stalled", schedule.name()));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn total(op: BenchOp, world: usize, count: usize) -> (&'static str, u64) {
        let cfg = CollectiveConfig::default();
        let mut sum = 0;
        let mut name = "";
        for rank in 0..world {
            let p = plan(op, rank, world, count, DataType::F32, 1, &cfg).expect("plan");
            sum += p.wire_bytes;
            name = p.algorithm;
        }
        (name, sum)
    }

    #[test]
    fn ring_all_reduce_sends_twice_n_minus_one_over_n() {
        // 1.5 MiB of f32 on 6 ranks: ring, every rank sends 2 * 5/6 of the buffer.
        let (name, bytes) = total(BenchOp::AllReduce, 6, 6 << 16);
        assert_eq!(name, "ring");
        assert_eq!(bytes, 6 * 2 * 5 * (6 << 18) / 6);
    }

    #[test]
    fn rhd_all_reduce_on_four_ranks_sends_what_ring_would() {
        // 1 MiB of f32 on 4 ranks: rhd (no fold on 2^k ranks), 2 * 3/4 of the buffer.
        let (name, bytes) = total(BenchOp::AllReduce, 4, 1 << 18);
        assert_eq!(name, "rhd");
        assert_eq!(bytes, 4 * 2 * 3 * (1 << 20) / 4);
    }

    #[test]
    fn all_gather_sends_n_minus_one_blocks_per_rank() {
        let (_, bytes) = total(BenchOp::AllGather, 4, 1 << 18);
        assert_eq!(bytes, 4 * 3 * (1 << 20) / 4);
        let (_, bytes) = total(BenchOp::AllToAll, 4, 1 << 18);
        assert_eq!(bytes, 4 * 3 * (1 << 20) / 4);
    }

    #[test]
    fn barrier_and_p2p() {
        let (name, bytes) = total(BenchOp::Barrier, 4, 0);
        assert_eq!((name, bytes), ("dissemination", 0));
        let cfg = CollectiveConfig::default();
        let p = plan(BenchOp::P2p, 0, 2, 256, DataType::F32, 8, &cfg).expect("plan");
        assert_eq!(p.wire_bytes, 8 * 1024);
    }
}
