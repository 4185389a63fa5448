//! The driver-facing constructors: validate the arguments, pick an algorithm by size and
//! world, build the schedule.

use nexar_device::{check_op, DataType, ReduceOp};

use crate::algos::{self, Geom};
use crate::dag::InPlace;
use crate::layout::Chunking;
use crate::{Algorithm, CollectiveConfig, Schedule, ScheduleError};

/// Checks rank and world and that `count * blocks` elements of `dtype` fit in `usize`.
fn geom(
    rank: usize,
    world: usize,
    count: usize,
    dtype: DataType,
    blocks: usize,
) -> Result<Geom, ScheduleError> {
    if world == 0 {
        return Err(ScheduleError::EmptyWorld);
    }
    if world > crate::MAX_WORLD {
        return Err(ScheduleError::WorldTooLarge {
            world,
            max: crate::MAX_WORLD,
        });
    }
    if rank >= world {
        return Err(ScheduleError::RankOutOfRange { rank, world });
    }
    count
        .checked_mul(dtype.size())
        .and_then(|b| b.checked_mul(blocks))
        .ok_or(ScheduleError::SizeOverflow {
            count,
            dtype,
            blocks,
        })?;
    Ok(Geom {
        rank,
        world,
        esz: dtype.size(),
        count,
        in_place: None,
    })
}

fn check_root(root: usize, world: usize) -> Result<(), ScheduleError> {
    if root >= world {
        return Err(ScheduleError::RootOutOfRange { root, world });
    }
    Ok(())
}

fn boxed(s: crate::DagSchedule) -> Result<Box<dyn Schedule>, ScheduleError> {
    Ok(Box::new(s))
}

/// Pipeline chunks (at most `max_message_bytes`) for blocks of at most `max_block` bytes,
/// numbered over `phases` phases.
fn pipeline(cfg: &CollectiveConfig, g: &Geom, max_block: usize, phases: usize) -> Chunking {
    let chunk = cfg.pipeline_chunk_bytes.min(cfg.max_message_bytes);
    Chunking::new(chunk, g.esz, max_block, phases)
}

/// Messages of at most `max_message_bytes` (whole elements), for an algorithm whose
/// messages are at most `max_message` bytes long and numbered below `phases` per pair of
/// ranks: every rank computes the same from the same call.
fn capped(cfg: &CollectiveConfig, g: &Geom, max_message: usize, phases: usize) -> Chunking {
    Chunking::new(cfg.max_message_bytes, g.esz, max_message, phases)
}

/// All-gather's and reduce-scatter's ring for a buffer of `bytes` past the logarithmic
/// algorithms: pipelined from `pipeline_threshold_bytes`, so that chunks of consecutive
/// steps overlap, but with two ranks never. There both are one exchange, so chunks
/// overlap nothing, and each costs the driver and the transport a message. Whole blocks
/// against 1 MiB chunks, at 8 and 64 MiB, across 2 processes and in one: 1-10% less CPU
/// per call. Over a trusted lane, across 2 processes at 32 and 64 MiB, 7-38% less with
/// zero-copy buffers, but with slices 6% more at 64 MiB (11% in one process;
/// BENCHMARKS.md, session 36). (All-reduce keeps its pipeline with two ranks, whose two
/// steps overlap.)
fn ring_or_pipelined(cfg: &CollectiveConfig, world: usize, bytes: usize) -> Algorithm {
    if bytes < cfg.pipeline_threshold_bytes || world == 2 {
        Algorithm::Ring
    } else {
        Algorithm::RingPipelined
    }
}

/// Rounds of a logarithmic algorithm over `world` ranks: `ceil(log2 world)`.
fn rounds(world: usize) -> usize {
    world.next_power_of_two().trailing_zeros() as usize
}

/// All-reduce of `count` elements in place on [`BufId::Data`](crate::BufId::Data)
/// (`count * dtype.size()` bytes on every rank).
///
/// [`ReduceOp::Avg`] is reduced as a sum; the driver then calls
/// [`nexar_device::finalize_bytes`] on the whole `Data` with divisor `world`.
///
/// Algorithms: `rd`, `rhd`, `ring`, `ring_pipelined` (see [`CollectiveConfig`]).
pub fn all_reduce(
    rank: usize,
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count, dtype, 1)?;
    check_op(dtype, op)?;
    let bytes = g.bytes();
    let alg = cfg
        .forced(&[
            Algorithm::Ring,
            Algorithm::RingPipelined,
            Algorithm::RecursiveDoubling,
            Algorithm::RecursiveHalvingDoubling,
        ])
        .unwrap_or(if bytes < cfg.tiny_bytes {
            Algorithm::RecursiveDoubling
        } else if bytes < cfg.small_bytes || (world > 2 && world.is_power_of_two()) {
            // With 2^k ranks rhd needs no fold, so it moves what ring moves in
            // 2 log2(world) rounds instead of 2 (world - 1): fewer, larger messages. At
            // every size: against the pipelined ring at 16 and 64 MiB, 12-17% less CPU
            // and time with 4 and 8 ranks, in one process and across processes, and
            // 1.15x the buffers in memory instead of 1.25x (bench/HISTORY.md, session 31).
            // With 2 ranks both take 2 rounds: ring measured cheaper to 8 MiB, alike at
            // 32 MiB (rhd 6-8% cheaper at 128 MiB; not changed). On other worlds
            // rhd's fold sends the whole buffer over one link twice more: faster in one
            // process from 5 ranks, but 27-29% slower across 6 processes at 16 and
            // 64 MiB (BENCHMARKS.md, session 32), so those keep the ring.
            Algorithm::RecursiveHalvingDoubling
        } else if bytes < cfg.pipeline_threshold_bytes {
            Algorithm::Ring
        } else {
            // Pipelined with two ranks too: its reduce-scatter step and all-gather step
            // overlap chunk by chunk. Whole blocks took up to 9% less CPU over QUIC at
            // 16 and 64 MiB (2% more in one of six rows), but over a trusted lane 2-19%
            // more at 32 and 64 MiB, and up to 36% more time (BENCHMARKS.md, session 36).
            Algorithm::RingPipelined
        });
    let max_block = count.div_ceil(world) * g.esz;
    // Recursive doubling and halving-doubling number their messages over at most
    // 2 log2(world) + 2 phases (the fold's two included).
    let log_phases = 2 * rounds(world) + 2;
    boxed(match alg {
        Algorithm::RecursiveDoubling => {
            algos::all_reduce::rd(g, capped(cfg, &g, bytes, log_phases), cfg.window)
        }
        Algorithm::RecursiveHalvingDoubling => {
            algos::all_reduce::rhd(g, capped(cfg, &g, bytes, log_phases), cfg.window)
        }
        Algorithm::Ring => {
            let ch = capped(cfg, &g, max_block, 2 * world);
            algos::all_reduce::ring(g, ch, "ring", cfg.window)
        }
        _ => {
            let ch = pipeline(cfg, &g, max_block, 2 * world);
            algos::all_reduce::ring(g, ch, "ring_pipelined", cfg.window)
        }
    })
}

/// Broadcast of `count` elements in place on `Data` from `root` to every rank.
///
/// Algorithms: `binomial`, `scatter_allgather` (its all-gather by recursive doubling on
/// 8, 16, ... ranks from blocks of `broadcast_rd_block_bytes`), `chain` (see
/// [`CollectiveConfig`]).
pub fn broadcast(
    rank: usize,
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count, dtype, 1)?;
    check_root(root, world)?;
    let bytes = g.bytes();
    let alg = cfg
        .forced(&[
            Algorithm::Binomial,
            Algorithm::Chain,
            Algorithm::ScatterAllGather,
        ])
        .unwrap_or(if bytes < cfg.small_bytes {
            Algorithm::Binomial
        } else if bytes < cfg.pipeline_threshold_bytes {
            // With two ranks, scatter-allgather is the buffer in two halves; a chain
            // sends it in pipeline chunks, each copied as it arrives (2 ranks, 4 MiB:
            // about 12% faster and 7-20% less CPU, measured when scatter-allgather still
            // sent the root a half back and so moved 1.5x the buffer).
            if world == 2 {
                Algorithm::Chain
            } else {
                Algorithm::ScatterAllGather
            }
        } else {
            Algorithm::Chain
        });
    boxed(match alg {
        Algorithm::Chain => {
            let ch = pipeline(cfg, &g, bytes, 1);
            algos::broadcast::chain(g, root, ch, cfg.window)
        }
        Algorithm::ScatterAllGather => {
            let max_block = count.div_ceil(world) * g.esz;
            let ch = if bytes >= cfg.pipeline_threshold_bytes {
                pipeline(cfg, &g, max_block, world)
            } else {
                capped(cfg, &g, max_block, world)
            };
            // Recursive doubling gathers in log2(world) rounds, the ring in world - 1: on 4
            // processes it took up to 20% more CPU at 1 MiB (the ring's hops are shorter
            // there), so 4 ranks keep the ring (BENCHMARKS.md, session 32).
            let rd =
                world >= 8 && world.is_power_of_two() && max_block >= cfg.broadcast_rd_block_bytes;
            // The scatter is phase 0; recursive doubling's rounds follow.
            let scatter = capped(cfg, &g, bytes, 1 + rounds(world));
            algos::broadcast::scatter_allgather(g, root, scatter, ch, rd, cfg.window)
        }
        _ => algos::broadcast::binomial(g, root, capped(cfg, &g, bytes, 1), cfg.window),
    })
}

/// Reduce of `count` elements on `Data` to `root`: the root's `Data` ends with the
/// reduction over all ranks; every other rank's `Data` is left unchanged (they work in
/// scratch).
///
/// [`ReduceOp::Avg`] is reduced as a sum; the driver then calls
/// [`nexar_device::finalize_bytes`] on the root's whole `Data` with divisor `world`.
///
/// Algorithms: `binomial`, `rsg` (reduce-scatter then gather; see [`CollectiveConfig`]).
/// Two ranks use `binomial` unless `rsg` is forced: there the tree sends the buffer
/// once, and `rsg` sends it one and a half times for the same bytes into the root (2
/// ranks, 16 and 64 MiB: 1.8-1.9x the speed at 0.5-0.6x the CPU per call;
/// bench/HISTORY.md, session 13).
pub fn reduce(
    rank: usize,
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count, dtype, 1)?;
    check_root(root, world)?;
    check_op(dtype, op)?;
    let bytes = g.bytes();
    let alg = cfg
        .forced(&[Algorithm::Binomial, Algorithm::ReduceScatterGather])
        .unwrap_or(if bytes < cfg.pipeline_threshold_bytes || world == 2 {
            Algorithm::Binomial
        } else {
            Algorithm::ReduceScatterGather
        });
    boxed(match alg {
        Algorithm::ReduceScatterGather => {
            let max_block = count.div_ceil(world) * g.esz;
            let ch = if bytes >= cfg.pipeline_threshold_bytes {
                pipeline(cfg, &g, max_block, world)
            } else {
                capped(cfg, &g, max_block, world)
            };
            algos::reduce::reduce_scatter_gather(g, root, ch, cfg.incast_bytes, cfg.window)
        }
        _ => algos::reduce::binomial(g, root, capped(cfg, &g, bytes, 1), cfg.window),
    })
}

/// All-gather: every rank's `Input` (`count_per_rank` elements) lands, in rank order, in
/// every rank's `Data` (`count_per_rank * world` elements).
///
/// Algorithms: `rd` (power-of-two worlds: for small buffers, and at every size with more
/// than 2 ranks) or `bruck` for small buffers, `ring`, `ring_pipelined` (see
/// [`CollectiveConfig`]).
pub fn all_gather(
    rank: usize,
    world: usize,
    count_per_rank: usize,
    dtype: DataType,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count_per_rank, dtype, world)?;
    all_gather_on(g, cfg)
}

/// All-gather in place (MPI's `MPI_IN_PLACE`): `Data` holds `count_per_rank * world`
/// elements, this rank's own in block `rank`, and ends as [`all_gather`]'s `Data` does.
/// There is no `Input`; the own block is not copied, except by Bruck's algorithm (world
/// not a power of two, buffer under `small_bytes`), which gathers into scratch of the
/// whole buffer's size and rotates the blocks back into `Data`. The messages are those of
/// [`all_gather`], so ranks may mix the two forms.
pub fn all_gather_in_place(
    rank: usize,
    world: usize,
    count_per_rank: usize,
    dtype: DataType,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let mut g = geom(rank, world, count_per_rank, dtype, world)?;
    g.in_place = Some(InPlace {
        input_at: rank * g.bytes(),
        data_at: 0,
    });
    all_gather_on(g, cfg)
}

fn all_gather_on(g: Geom, cfg: &CollectiveConfig) -> Result<Box<dyn Schedule>, ScheduleError> {
    let world = g.world;
    let total = g.bytes() * world;
    let pow2 = world.is_power_of_two();
    let mut supported = vec![Algorithm::Ring, Algorithm::RingPipelined, Algorithm::Bruck];
    if pow2 {
        supported.push(Algorithm::RecursiveDoubling);
    }
    let alg = cfg
        .forced(&supported)
        .unwrap_or(if total < cfg.small_bytes {
            if pow2 {
                Algorithm::RecursiveDoubling
            } else {
                Algorithm::Bruck
            }
        } else if pow2 && world > 2 {
            // log2(world) rounds of growing messages instead of world - 1 rounds of
            // blocks. With zero-copy buffers, 12% less CPU at 4 MiB on 4 ranks in one
            // process, 19% on 8 processes, 11-18% at 16-64 MiB (BENCHMARKS.md, session
            // 32). With slices each round's message is the own block, copied, and the
            // earlier rounds' receives passed on as they came (`Schedule::parts`), as the
            // ring passes its blocks on: at 1-4 MiB 0-3% more CPU than the ring in one
            // process, 1-5% less on 4 processes and 12-19% less on 8 (session 33). With 2
            // ranks both are one exchange, and measured alike.
            Algorithm::RecursiveDoubling
        } else {
            ring_or_pipelined(cfg, world, total)
        });
    let log = capped(cfg, &g, total, rounds(world));
    boxed(match alg {
        Algorithm::RecursiveDoubling => algos::all_gather::rd(g, log, cfg.window),
        Algorithm::Bruck => algos::all_gather::bruck(g, log, cfg.window),
        Algorithm::Ring => {
            let ch = capped(cfg, &g, g.bytes(), world);
            algos::all_gather::ring(g, ch, "ring", cfg.window)
        }
        _ => {
            let ch = pipeline(cfg, &g, g.bytes(), world);
            algos::all_gather::ring(g, ch, "ring_pipelined", cfg.window)
        }
    })
}

/// Reduce-scatter: every rank's `Input` holds `world` blocks of `count_per_rank`
/// elements; rank `r`'s `Data` (`count_per_rank` elements) ends with block `r` reduced
/// over all ranks (MPI and NCCL order).
///
/// [`ReduceOp::Avg`] is reduced as a sum; the driver then calls
/// [`nexar_device::finalize_bytes`] on the whole `Data` with divisor `world`.
///
/// Algorithms: `rh` (power-of-two worlds: small buffers, and every size with more than 2
/// ranks), `ring`, `ring_pipelined` (see [`CollectiveConfig`]).
pub fn reduce_scatter(
    rank: usize,
    world: usize,
    count_per_rank: usize,
    dtype: DataType,
    op: ReduceOp,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count_per_rank, dtype, world)?;
    check_op(dtype, op)?;
    reduce_scatter_on(g, cfg)
}

/// Reduce-scatter in place: `Data` holds `count_per_rank * world` elements, this rank's
/// input, and ends with block `rank` reduced over all ranks (the result
/// [`reduce_scatter`] leaves in its `Data`); the other blocks keep their values. There
/// is no `Input`. The messages are those of [`reduce_scatter`], so ranks may mix the two
/// forms.
///
/// [`ReduceOp::Avg`] is reduced as a sum; the driver then finalises block `rank` with
/// divisor `world`.
pub fn reduce_scatter_in_place(
    rank: usize,
    world: usize,
    count_per_rank: usize,
    dtype: DataType,
    op: ReduceOp,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let mut g = geom(rank, world, count_per_rank, dtype, world)?;
    check_op(dtype, op)?;
    g.in_place = Some(InPlace {
        input_at: 0,
        data_at: rank * g.bytes(),
    });
    reduce_scatter_on(g, cfg)
}

fn reduce_scatter_on(g: Geom, cfg: &CollectiveConfig) -> Result<Box<dyn Schedule>, ScheduleError> {
    let world = g.world;
    let total = g.bytes() * world;
    let pow2 = world.is_power_of_two();
    let mut supported = vec![Algorithm::Ring, Algorithm::RingPipelined];
    if pow2 {
        supported.push(Algorithm::RecursiveHalving);
    }
    let alg = cfg
        .forced(&supported)
        .unwrap_or(if pow2 && (total < cfg.small_bytes || world > 2) {
            // On 4, 8, 16, ... ranks at every size, as all-reduce's rhd and all-gather's
            // rd: log2(world) rounds instead of world - 1, which pass their partials on
            // as the ring does (`rh_messages`). With zero-copy buffers, against the ring
            // at 1-64 MiB: on 8 processes 2-12% less CPU, on 4 processes 2-6% less; in
            // one process 1-2% less with 4 ranks, but 3-7% more with 8 from 4 MiB. With
            // slices, whose sends copy, round 0 copies half the input out where the ring
            // copies a block: on 8 processes 1-8% more CPU, on 4 processes 3% less to 1%
            // more (measured on the build that sent whole messages). It holds half the
            // input in scratch where the ring holds two blocks: 64 MiB on 8 processes
            // peaked at 1.51x the buffers against 1.31x (BENCHMARKS.md, session 36).
            Algorithm::RecursiveHalving
        } else {
            ring_or_pipelined(cfg, world, total)
        });
    boxed(match alg {
        Algorithm::RecursiveHalving => {
            // At most log2(world) messages a round (`rh_messages`), in pipeline chunks.
            // The partials a round passes on are each held in a buffer of the node's send
            // pool, a chunk's size, until sent. Whole messages (8 and 16 MiB at 64 MiB on
            // 8 and 4 ranks) and messages cut at 4 MiB outgrew the pool, which keeps 1 MiB
            // pieces for copied sends: calls took fresh pages for them, about 1,000 page
            // faults per call on 4 processes (after other collectives had filled the
            // pool). In 1 MiB chunks none in that sweep, and 3-8% more CPU than whole
            // messages measured alone (BENCHMARKS.md, session 36).
            let ch = pipeline(cfg, &g, total, rounds(world) * rounds(world));
            algos::reduce_scatter::rh(g, ch, cfg.window)
        }
        Algorithm::Ring => {
            let ch = capped(cfg, &g, g.bytes(), world);
            algos::reduce_scatter::ring(g, ch, "ring", cfg.window)
        }
        _ => {
            let ch = pipeline(cfg, &g, g.bytes(), world);
            algos::reduce_scatter::ring(g, ch, "ring_pipelined", cfg.window)
        }
    })
}

/// Gather: every rank's `Input` (`count_per_rank` elements) lands, in rank order, in the
/// root's `Data` (`count_per_rank * world` elements). Other ranks' `Data` is empty.
///
/// Algorithms: `binomial` under [`CollectiveConfig::small_bytes`] (of the whole
/// `count_per_rank * world` buffer), else `linear`. The tree forwards blocks through
/// inner ranks (at 1-64 MiB on 8 ranks it took 1.6-2.5x the time and about twice the CPU
/// per call; bench/HISTORY.md, session 13); linearly every block crosses the wire once.
pub fn gather(
    rank: usize,
    world: usize,
    count_per_rank: usize,
    dtype: DataType,
    root: usize,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count_per_rank, dtype, world)?;
    check_root(root, world)?;
    boxed(if rooted_linear(cfg, &g) {
        // Phase 0 the blocks, phase 1 the go messages.
        let ch = capped(cfg, &g, g.bytes(), 2);
        algos::gather::gather_linear(g, root, ch, cfg.incast_bytes, cfg.window)
    } else {
        let ch = capped(cfg, &g, g.bytes() * world, 1);
        algos::gather::gather(g, root, ch, cfg.window)
    })
}

/// Whether gather or scatter of `g`'s blocks runs linearly: forced, or by default when
/// the whole buffer is at least `small_bytes`.
fn rooted_linear(cfg: &CollectiveConfig, g: &Geom) -> bool {
    cfg.forced(&[Algorithm::Binomial, Algorithm::Linear])
        .map_or(g.bytes().saturating_mul(g.world) >= cfg.small_bytes, |a| {
            a == Algorithm::Linear
        })
}

/// Scatter: block `r` of the root's `Input` (`count_per_rank * world` elements) lands in
/// rank `r`'s `Data` (`count_per_rank` elements). Other ranks' `Input` is empty.
///
/// Algorithms: `binomial` under [`CollectiveConfig::small_bytes`] (of the whole
/// `count_per_rank * world` buffer), else `linear` (see [`gather`]).
pub fn scatter(
    rank: usize,
    world: usize,
    count_per_rank: usize,
    dtype: DataType,
    root: usize,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count_per_rank, dtype, world)?;
    check_root(root, world)?;
    boxed(if rooted_linear(cfg, &g) {
        algos::gather::scatter_linear(g, root, capped(cfg, &g, g.bytes(), 1), cfg.window)
    } else {
        let ch = capped(cfg, &g, g.bytes() * world, 1);
        algos::gather::scatter(g, root, ch, cfg.window)
    })
}

/// All-to-all: block `j` of rank `r`'s `Input` lands in block `r` of rank `j`'s `Data`
/// (both `count_per_rank * world` elements).
///
/// Algorithms: `bruck` for blocks under [`CollectiveConfig::bruck_block_bytes`] (and more
/// than two ranks), else `pairwise`.
pub fn all_to_all(
    rank: usize,
    world: usize,
    count_per_rank: usize,
    dtype: DataType,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, count_per_rank, dtype, world)?;
    let alg = cfg
        .forced(&[Algorithm::Pairwise, Algorithm::Bruck])
        .unwrap_or(if g.bytes() < cfg.bruck_block_bytes && world > 2 {
            Algorithm::Bruck
        } else {
            Algorithm::Pairwise
        });
    if alg == Algorithm::Bruck {
        // Bruck's scratch: the rotated blocks, then a packed send and a packed receive of
        // up to half of them each.
        let blocks = world
            .div_ceil(2)
            .checked_mul(2)
            .and_then(|h| h.checked_add(world))
            .ok_or(ScheduleError::SizeOverflow {
                count: count_per_rank,
                dtype,
                blocks: world,
            })?;
        geom(rank, world, count_per_rank, dtype, blocks)?;
    }
    boxed(match alg {
        Algorithm::Bruck => {
            let ch = capped(cfg, &g, g.bytes() * world, rounds(world));
            algos::all_to_all::bruck(g, ch, cfg.window)
        }
        _ => algos::all_to_all::pairwise(g, capped(cfg, &g, g.bytes(), world), cfg.window),
    })
}

/// Scan in place on `Data` (`count` elements): with `exclusive == false` rank `r` ends
/// with the reduction over ranks `0..=r`; with `exclusive == true` over ranks `0..r`, and
/// rank 0 with the op's identity (the schedule fills it with
/// [`Action::FillIdentity`](crate::Action::FillIdentity)).
///
/// [`ReduceOp::Avg`] is rejected with [`ScheduleError::UnsupportedOp`]: each rank would
/// need a different divisor.
///
/// Algorithm: `rd` (recursive doubling).
pub fn scan(
    rank: usize,
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    exclusive: bool,
    cfg: &CollectiveConfig,
) -> Result<Box<dyn Schedule>, ScheduleError> {
    // The exclusive form keeps a partial result and a received one in scratch.
    let g = geom(rank, world, count, dtype, if exclusive { 2 } else { 1 })?;
    check_op(dtype, op)?;
    if op == ReduceOp::Avg {
        return Err(ScheduleError::UnsupportedOp {
            collective: if exclusive { "exclusive scan" } else { "scan" },
            op,
        });
    }
    let ch = capped(cfg, &g, g.bytes(), rounds(world));
    boxed(algos::scan::recursive_doubling(
        g, ch, exclusive, cfg.window,
    ))
}

/// Barrier: completes on a rank only after every rank has started it. Messages are
/// empty; `Data` may be an empty buffer. Algorithm: `dissemination`.
pub fn barrier(rank: usize, world: usize) -> Result<Box<dyn Schedule>, ScheduleError> {
    let g = geom(rank, world, 0, DataType::U8, 1)?;
    boxed(algos::barrier::dissemination(g.rank, g.world))
}
