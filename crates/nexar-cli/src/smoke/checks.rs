//! The per-rank bodies of the smoke checks.
//!
//! Each check derives every rank's input from `(rank, index)`, so any rank can compute
//! the expected result on its own. Checks finish all their communication before judging
//! (see [`Verdict`]); an error from the runtime itself ends the check at once.

use half::f16;
use nexar_actors::{Communicator, NexarError};
use nexar_device::ReduceOp;

use super::verify::Verdict;
use crate::benchmark::BenchElem;

/// Message sizes for the point-to-point ring, in bytes: empty, tiny, around the 64 KiB
/// control/bulk lane boundary, and 1 MiB.
const P2P_SIZES: [usize; 6] = [0, 1, 4096, 64 << 10, (64 << 10) + 1, 1 << 20];
/// Tag for the ring messages; all sizes share it, so arrival order is tested across lanes.
const P2P_TAG: u64 = 7;
/// Barriers in a row.
const BARRIER_ROUNDS: usize = 20;
/// Element counts for reductions: empty, one, odd (not a multiple of any world size
/// that matters) and 1 MiB of `f32`.
const LENS: [usize; 4] = [0, 1, 1031, 1 << 18];
/// Elements per rank in the block collectives; odd so blocks are never aligned to chunks.
const BLOCK: usize = 129;

/// Turns a runtime error into the check's failure reason.
fn failed(what: &str) -> impl FnOnce(NexarError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn ring_payload(src: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + src * 7 + len) % 251) as u8)
        .collect()
}

/// Every rank sends each size to the next rank while receiving from the previous one;
/// messages must arrive whole and in the order sent.
pub(super) async fn p2p_ring(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let send_all = async {
        for len in P2P_SIZES {
            let what = format!("send {len} B to rank {next}");
            comm.send(&ring_payload(rank, len), next, P2P_TAG)
                .await
                .map_err(failed(&what))?;
        }
        Ok::<_, String>(())
    };
    let recv_all = async {
        let mut got = Vec::new();
        for len in P2P_SIZES {
            let mut buf = vec![0u8; len];
            let what = format!("recv {len} B from rank {prev}");
            comm.recv(&mut buf, prev, P2P_TAG)
                .await
                .map_err(failed(&what))?;
            got.push(buf);
        }
        Ok::<_, String>(got)
    };
    // Concurrently, so a send that waits for flow control never blocks our own receives.
    let (sent, received) = tokio::join!(send_all, recv_all);
    sent?;
    let mut verdict = Verdict::default();
    for (len, buf) in P2P_SIZES.into_iter().zip(received?) {
        verdict.equal(
            &format!("{len} B from rank {prev}"),
            &buf,
            &ring_payload(prev, len),
        );
    }
    verdict.finish()
}

/// Many barriers in a row: each must complete on every rank.
pub(super) async fn barrier(comm: Communicator) -> Result<(), String> {
    for round in 0..BARRIER_ROUNDS {
        comm.barrier()
            .await
            .map_err(failed(&format!("barrier {round}")))?;
    }
    Ok(())
}

fn small_int(r: usize, i: usize, modulus: usize) -> usize {
    (r + i) % modulus
}

/// Rank `r`'s addend at `i` in the f16 sum: 0-2 on the ranks whose sums the bench keeps
/// exact in f16 ([`BenchElem::SUMMED_RANKS`]), 0 on the others, so that no partial sum, in
/// whatever order an algorithm adds, passes 2048 (past which f16 rounds integers).
fn half_int(r: usize, i: usize) -> usize {
    if r < <f16 as BenchElem>::SUMMED_RANKS {
        small_int(r, i, 3)
    } else {
        0
    }
}

fn signed(r: usize, i: usize) -> i32 {
    ((i * 7919 + r * 104_729) % 2001) as i32 - 1000
}

/// Sum of `f32` (integer-valued, so exact), sum of `f16` (exact too: see [`half_int`]), max
/// of `i32` and average of `f64`.
pub(super) async fn all_reduce(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut verdict = Verdict::default();
    for len in LENS {
        let mut sum: Vec<f32> = (0..len).map(|i| small_int(rank, i, 13) as f32).collect();
        let mut half: Vec<f16> = (0..len)
            .map(|i| f16::from_f32(half_int(rank, i) as f32))
            .collect();
        let mut max: Vec<i32> = (0..len).map(|i| signed(rank, i)).collect();
        let mut avg: Vec<f64> = (0..len).map(|i| rank as f64 + i as f64 * 0.5).collect();
        comm.all_reduce(&mut sum, ReduceOp::Sum)
            .await
            .map_err(failed("sum f32"))?;
        comm.all_reduce(&mut half, ReduceOp::Sum)
            .await
            .map_err(failed("sum f16"))?;
        comm.all_reduce(&mut max, ReduceOp::Max)
            .await
            .map_err(failed("max i32"))?;
        comm.all_reduce(&mut avg, ReduceOp::Avg)
            .await
            .map_err(failed("avg f64"))?;

        let want: Vec<f32> = (0..len)
            .map(|i| (0..world).map(|r| small_int(r, i, 13) as f32).sum())
            .collect();
        verdict.equal(&format!("sum f32 x{len}"), &sum, &want);
        let want: Vec<f16> = (0..len)
            .map(|i| f16::from_f32((0..world).map(|r| half_int(r, i) as f32).sum()))
            .collect();
        verdict.equal(&format!("sum f16 x{len}"), &half, &want);
        let want: Vec<i32> = (0..len)
            .map(|i| (0..world).map(|r| signed(r, i)).fold(i32::MIN, i32::max))
            .collect();
        verdict.equal(&format!("max i32 x{len}"), &max, &want);
        let want: Vec<f64> = (0..len)
            .map(|i| (world - 1) as f64 / 2.0 + i as f64 * 0.5)
            .collect();
        verdict.close(&format!("avg f64 x{len}"), &avg, &want, |g, w| {
            (g - w).abs() <= 1e-9 * w.abs().max(1.0)
        });
    }
    verdict.finish()
}

fn bcast_value(root: usize, i: usize) -> u32 {
    (i as u32)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(root as u32)
}

/// Broadcast from the last rank (non-zero whenever the world has more than one rank).
pub(super) async fn broadcast(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let root = world - 1;
    let mut verdict = Verdict::default();
    for len in LENS {
        let want: Vec<u32> = (0..len).map(|i| bcast_value(root, i)).collect();
        let mut buf = if rank == root {
            want.clone()
        } else {
            vec![0xDEAD_BEEF; len]
        };
        comm.broadcast(&mut buf, root)
            .await
            .map_err(failed(&format!("broadcast x{len}")))?;
        verdict.equal(&format!("broadcast x{len} from rank {root}"), &buf, &want);
    }
    verdict.finish()
}

fn reduce_value(r: usize, i: usize) -> i64 {
    (r as i64 + 1) * i as i64 - r as i64
}

/// Sum of `i64` into rank `1 % world`; the other ranks' buffers must come back unchanged.
pub(super) async fn reduce(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let root = 1 % world;
    let mut verdict = Verdict::default();
    for len in LENS {
        let mine: Vec<i64> = (0..len).map(|i| reduce_value(rank, i)).collect();
        let mut buf = mine.clone();
        comm.reduce(&mut buf, ReduceOp::Sum, root)
            .await
            .map_err(failed(&format!("reduce x{len}")))?;
        if rank == root {
            let want: Vec<i64> = (0..len)
                .map(|i| (0..world).map(|r| reduce_value(r, i)).sum())
                .collect();
            verdict.equal(&format!("reduce x{len} on root {root}"), &buf, &want);
        } else {
            verdict.equal(
                &format!("reduce x{len} on non-root (must be unchanged)"),
                &buf,
                &mine,
            );
        }
    }
    verdict.finish()
}

fn block_value(r: usize, i: usize) -> f32 {
    (r * 1000 + i) as f32
}

/// Every rank contributes a block; every rank gets all blocks in rank order.
pub(super) async fn all_gather(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let send: Vec<f32> = (0..BLOCK).map(|i| block_value(rank, i)).collect();
    let mut recv = vec![f32::NAN; BLOCK * world];
    comm.all_gather(&send, &mut recv)
        .await
        .map_err(failed("all_gather"))?;
    let want: Vec<f32> = (0..world)
        .flat_map(|r| (0..BLOCK).map(move |i| block_value(r, i)))
        .collect();
    let mut verdict = Verdict::default();
    verdict.equal("all_gather", &recv, &want);
    verdict.finish()
}

/// Sum of `u64` and max of `i32`; rank `r` must get block `r` of the reduction.
pub(super) async fn reduce_scatter(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let sum_in = |r: usize, k: usize| ((r + 1) * k) as u64;
    let send: Vec<u64> = (0..BLOCK * world).map(|k| sum_in(rank, k)).collect();
    let mut sum = vec![0u64; BLOCK];
    comm.reduce_scatter(&send, &mut sum, ReduceOp::Sum)
        .await
        .map_err(failed("sum u64"))?;
    let send: Vec<i32> = (0..BLOCK * world).map(|k| signed(rank, k)).collect();
    let mut max = vec![0i32; BLOCK];
    comm.reduce_scatter(&send, &mut max, ReduceOp::Max)
        .await
        .map_err(failed("max i32"))?;

    let mine = rank * BLOCK..(rank + 1) * BLOCK;
    let want: Vec<u64> = mine
        .clone()
        .map(|k| (0..world).map(|r| sum_in(r, k)).sum())
        .collect();
    let mut verdict = Verdict::default();
    verdict.equal("sum u64", &sum, &want);
    let want: Vec<i32> = mine
        .map(|k| (0..world).map(|r| signed(r, k)).fold(i32::MIN, i32::max))
        .collect();
    verdict.equal("max i32", &max, &want);
    verdict.finish()
}

/// Gather to the last rank; non-root ranks pass an empty receive buffer.
pub(super) async fn gather(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let root = world - 1;
    let value = |r: usize, i: usize| (r * 10_000 + i) as i32;
    let send: Vec<i32> = (0..BLOCK).map(|i| value(rank, i)).collect();
    let mut recv = if rank == root {
        vec![-1; BLOCK * world]
    } else {
        Vec::new()
    };
    comm.gather(&send, &mut recv, root)
        .await
        .map_err(failed("gather"))?;
    let mut verdict = Verdict::default();
    if rank == root {
        let want: Vec<i32> = (0..world)
            .flat_map(|r| (0..BLOCK).map(move |i| value(r, i)))
            .collect();
        verdict.equal(&format!("gather on root {root}"), &recv, &want);
    }
    verdict.finish()
}

/// Scatter from rank `world / 2`; non-root ranks pass an empty send buffer.
pub(super) async fn scatter(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let root = world / 2;
    let send: Vec<f64> = if rank == root {
        (0..BLOCK * world).map(|k| k as f64).collect()
    } else {
        Vec::new()
    };
    let mut recv = vec![f64::NAN; BLOCK];
    comm.scatter(&send, &mut recv, root)
        .await
        .map_err(failed("scatter"))?;
    let want: Vec<f64> = (rank * BLOCK..(rank + 1) * BLOCK)
        .map(|k| k as f64)
        .collect();
    let mut verdict = Verdict::default();
    verdict.equal(&format!("scatter from root {root}"), &recv, &want);
    verdict.finish()
}

/// Element `k` of the block rank `from` sends rank `to` in the all-to-all check, on a
/// world of `world` ranks: a different value for every (from, to, k) of the world.
fn all_to_all_value(world: usize, from: usize, to: usize, k: usize) -> u64 {
    ((from * world + to) * BLOCK + k) as u64
}

/// Block `j` of rank `r`'s input must land as block `r` of rank `j`'s output.
pub(super) async fn all_to_all(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let value = |from: usize, to: usize, k: usize| all_to_all_value(world, from, to, k);
    let send: Vec<u64> = (0..world)
        .flat_map(|j| (0..BLOCK).map(move |k| value(rank, j, k)))
        .collect();
    let mut recv = vec![u64::MAX; BLOCK * world];
    comm.all_to_all(&send, &mut recv)
        .await
        .map_err(failed("all_to_all"))?;
    let want: Vec<u64> = (0..world)
        .flat_map(|j| (0..BLOCK).map(move |k| value(j, rank, k)))
        .collect();
    let mut verdict = Verdict::default();
    verdict.equal("all_to_all", &recv, &want);
    verdict.finish()
}

/// Inputs for the scans, and the expected prefix over `ranks`.
struct ScanCase {
    sum: Vec<i64>,
    max: Vec<f32>,
}

impl ScanCase {
    const LEN: usize = 1031;

    fn input(rank: usize) -> ScanCase {
        ScanCase {
            sum: (0..Self::LEN).map(|i| reduce_value(rank, i)).collect(),
            max: (0..Self::LEN).map(|i| signed(rank, i) as f32).collect(),
        }
    }

    /// The reduction over `ranks`; for an empty range, each op's identity.
    fn prefix(ranks: std::ops::Range<usize>) -> ScanCase {
        let sum = (0..Self::LEN)
            .map(|i| ranks.clone().map(|r| reduce_value(r, i)).sum())
            .collect();
        let max = (0..Self::LEN)
            .map(|i| {
                ranks
                    .clone()
                    .map(|r| signed(r, i) as f32)
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect();
        ScanCase { sum, max }
    }
}

async fn run_scan(comm: &Communicator, exclusive: bool) -> Result<(), String> {
    let rank = comm.rank();
    let mut got = ScanCase::input(rank);
    if exclusive {
        comm.exclusive_scan(&mut got.sum, ReduceOp::Sum)
            .await
            .map_err(failed("sum i64"))?;
        comm.exclusive_scan(&mut got.max, ReduceOp::Max)
            .await
            .map_err(failed("max f32"))?;
    } else {
        comm.scan(&mut got.sum, ReduceOp::Sum)
            .await
            .map_err(failed("sum i64"))?;
        comm.scan(&mut got.max, ReduceOp::Max)
            .await
            .map_err(failed("max f32"))?;
    }
    let want = ScanCase::prefix(0..if exclusive { rank } else { rank + 1 });
    let mut verdict = Verdict::default();
    verdict.equal("sum i64", &got.sum, &want.sum);
    verdict.equal("max f32", &got.max, &want.max);
    verdict.finish()
}

/// Inclusive prefix sum (`i64`) and max (`f32`): rank `r` gets ranks `0..=r`.
pub(super) async fn scan(comm: Communicator) -> Result<(), String> {
    run_scan(&comm, false).await
}

/// Exclusive prefix sum and max: rank `r` gets ranks `0..r`, rank 0 the identities
/// (`0` and `-inf`).
pub(super) async fn exclusive_scan(comm: Communicator) -> Result<(), String> {
    run_scan(&comm, true).await
}

/// Splits into even and odd ranks, ordered by descending parent rank, then checks the
/// child's shape, an all_reduce and a broadcast from the child's rank 0 on it.
pub(super) async fn split(comm: Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let color = (rank % 2) as u32;
    let key = (world - rank) as u32;
    let child = comm.split(color, key).await.map_err(failed("split"))?;
    let mut sum = [rank as u64, 1];
    child
        .all_reduce(&mut sum, ReduceOp::Sum)
        .await
        .map_err(failed("child all_reduce"))?;
    let mut first = [rank as u64];
    child
        .broadcast(&mut first, 0)
        .await
        .map_err(failed("child broadcast"))?;

    // Same parity, ordered by key: descending parent rank.
    let group: Vec<usize> = (0..world).rev().filter(|r| r % 2 == rank % 2).collect();
    let mut verdict = Verdict::default();
    verdict.ensure(child.world_size() == group.len(), || {
        format!(
            "child world size {}, want {}",
            child.world_size(),
            group.len()
        )
    });
    let want_rank = group.iter().position(|r| *r == rank);
    verdict.ensure(Some(child.rank()) == want_rank, || {
        format!("child rank {}, want {want_rank:?}", child.rank())
    });
    let want_members: Vec<_> = group.iter().map(|r| comm.members()[*r]).collect();
    verdict.equal("child members", child.members(), &want_members);
    let want_sum = [group.iter().map(|r| *r as u64).sum(), group.len() as u64];
    verdict.equal("child all_reduce", &sum, &want_sum);
    verdict.equal(
        "child broadcast from child rank 0",
        &first,
        &[group[0] as u64],
    );
    verdict.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The all-to-all check's values differ for every sender, receiver and element, on
    /// the largest worlds too: a block delivered to the wrong rank cannot pass it. (They
    /// repeated from 1001 ranks on: rank 0's block for 1000 read as rank 1's for 0.)
    #[test]
    fn all_to_all_values_tell_every_block_apart() {
        for world in [1, 2, 3, 7] {
            let mut seen = std::collections::HashSet::new();
            for from in 0..world {
                for to in 0..world {
                    for k in 0..BLOCK {
                        assert!(
                            seen.insert(all_to_all_value(world, from, to, k)),
                            "world {world}: ({from}, {to}, {k}) repeats a value"
                        );
                    }
                }
            }
        }
        // The pair that used to coincide, on 1001 ranks.
        for k in 0..BLOCK {
            assert_ne!(
                all_to_all_value(1001, 0, 1000, k),
                all_to_all_value(1001, 1, 0, k)
            );
        }
    }

    /// The f16 sum stays exact on any world, added rank by rank in either direction (a
    /// ring's order, say), where all ranks' 0-2 would pass 2048 beyond about 2000 ranks.
    #[test]
    fn half_sums_stay_exact_on_any_world() {
        for world in [1, 2, 3, 1025, 4096, 10_000] {
            for i in 0..3 {
                let want = f16::from_f32((0..world).map(|r| half_int(r, i) as f32).sum());
                let add = |acc: f16, r: usize| acc + f16::from_f32(half_int(r, i) as f32);
                let up = (0..world).fold(f16::ZERO, add);
                let down = (0..world).rev().fold(f16::ZERO, add);
                assert_eq!((up, down), (want, want), "world {world}, element {i}");
            }
        }
    }
}
