//! Simulator runs of shapes `collectives.rs` leaves out: the chunked forms of the
//! scatter-allgather broadcast and of the reduce-scatter-then-gather reduce (chosen once a
//! buffer reaches `pipeline_threshold_bytes`, which those tests never lower), with their
//! message counts, and worlds above 16 for every collective. Each result is checked
//! exactly against a sequential reference.

#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use nexar_collectives::{barrier, Algorithm, CollectiveConfig, RankBuffers, SimNet};
use nexar_device::{check_op, DataType, ReduceOp};

// ---------------------------------------------------------------------------------------
// Shapes
// ---------------------------------------------------------------------------------------

/// Every root.
fn every(world: usize) -> Vec<usize> {
    (0..world).collect()
}

/// Roots 0, 1, world / 2 and world - 1.
fn sampled_roots(world: usize) -> Vec<usize> {
    let mut r = roots(world);
    r.push(1.min(world - 1));
    r.sort_unstable();
    r.dedup();
    r
}

/// `0, 1, world - 1, world + 1` (for worlds below 96).
fn few_counts(world: usize) -> Vec<usize> {
    counts(world, 97).into_iter().filter(|&c| c != 97).collect()
}

// ---------------------------------------------------------------------------------------
// Message counts of the chunked schedules
// ---------------------------------------------------------------------------------------

/// The byte lengths of `count` elements split into `world` blocks, the first
/// `count % world` one element longer.
fn block_lens(count: usize, world: usize, esz: usize) -> Vec<usize> {
    (0..world)
        .map(|i| (count / world + usize::from(i < count % world)) * esz)
        .collect()
}

/// What a `pipeline_chunk_bytes` of `chunk` becomes: whole elements, at least one.
fn chunk_bytes(chunk: usize, esz: usize) -> usize {
    (chunk / esz).max(1) * esz
}

/// Messages of a chunked scatter-allgather broadcast: one scatter message to each other
/// rank, then, in chunks, every block to every rank that the scatter did not leave it on
/// (relative rank `v` holds blocks `v..v + subtree`, the root all of them). With `rd`
/// the all-gather is recursive doubling instead, which pipelines nothing: relative rank
/// `v` receives, in round `i`, its partner's group of `2^i` blocks as one message, unless
/// the scatter left the group on it or the group is empty.
fn scatter_allgather_messages(
    count: usize,
    world: usize,
    esz: usize,
    chunk: usize,
    rd: bool,
) -> usize {
    if world == 1 {
        return 0;
    }
    let cb = chunk_bytes(chunk, esz);
    let lens = block_lens(count, world, esz);
    if rd {
        let rd: usize = (1..world)
            .map(|v| {
                let held = v & v.wrapping_neg();
                (0..world.trailing_zeros())
                    .filter(|i| {
                        let d = 1 << i;
                        let group = (v ^ d) & !(d - 1);
                        !(v..v + held).contains(&group)
                            && lens[group..group + d].iter().sum::<usize>() > 0
                    })
                    .count()
            })
            .sum();
        return (world - 1) + rd;
    }
    let ring: usize = (1..world)
        .map(|v| {
            // The binomial subtree of relative rank v: its lowest set bit, cut at the end.
            let held = (v & v.wrapping_neg()).min(world - v);
            (0..world)
                .filter(|b| !(v..v + held).contains(b))
                .map(|b| lens[b].div_ceil(cb))
                .sum::<usize>()
        })
        .sum();
    (world - 1) + ring
}

/// Messages of a chunked rsg reduce with `incast_bytes = 1` (two senders at once): every
/// block, in chunks, over `world - 1` ring hops; each non-root rank's block `rank + 1`, in
/// chunks, to the root; a go message to each sender after the first two.
fn rsg_messages(count: usize, world: usize, esz: usize, chunk: usize, root: usize) -> usize {
    if world == 1 {
        return 0;
    }
    let cb = chunk_bytes(chunk, esz);
    let lens = block_lens(count, world, esz);
    let ring: usize = lens.iter().map(|l| l.div_ceil(cb)).sum();
    let to_root: usize = (0..world)
        .filter(|&r| r != root)
        .map(|r| lens[(r + 1) % world].div_ceil(cb))
        .sum();
    (world - 1) * ring + to_root + (world - 1).saturating_sub(2)
}

// ---------------------------------------------------------------------------------------
// The chunked forms, forced for every size (`pipeline_threshold_bytes = 0`)
// ---------------------------------------------------------------------------------------

fn chunked(alg: Algorithm, chunk: usize) -> CollectiveConfig {
    let mut c = cfg(Some(alg));
    c.pipeline_threshold_bytes = 0;
    c.pipeline_chunk_bytes = chunk;
    c
}

const SAG_DTYPES: [DataType; 3] = [DataType::F16, DataType::U8, DataType::F64];

/// Ops on integer and float types, `Avg` on each float width.
const RSG_CASES: [(DataType, ReduceOp); 8] = [
    (DataType::I32, ReduceOp::Sum),
    (DataType::I64, ReduceOp::Prod),
    (DataType::U8, ReduceOp::Max),
    (DataType::I8, ReduceOp::Min),
    (DataType::F32, ReduceOp::Avg),
    (DataType::F64, ReduceOp::Avg),
    (DataType::F16, ReduceOp::Avg),
    (DataType::BF16, ReduceOp::Avg),
];

/// Chunked scatter-allgather broadcasts of every count, dtype and root given, each with
/// the chunked message pattern.
fn chunked_broadcast(
    world: usize,
    counts: &[usize],
    dtypes: &[DataType],
    roots: &[usize],
    chunk: usize,
    seed: u64,
) {
    // Recursive doubling on 8, 16, ... ranks whatever the blocks' size, and never.
    for rd_from in [0, usize::MAX] {
        let mut c = chunked(Algorithm::ScatterAllGather, chunk);
        c.broadcast_rd_block_bytes = rd_from;
        let rd = rd_from == 0 && world >= 8 && world.is_power_of_two();
        for &count in counts {
            for &dtype in dtypes {
                for &root in roots {
                    let sent = check_broadcast_cfg(world, count, dtype, root, &c, seed);
                    assert_eq!(
                        sent,
                        scatter_allgather_messages(count, world, dtype.size(), chunk, rd),
                        "chunked broadcast world {world} count {count} {dtype:?} root {root} \
                         chunk {chunk} rd {rd}: not the chunked message pattern"
                    );
                }
            }
        }
    }
}

/// Chunked rsg reduces (the gather paced two senders at a time) of every count, dtype/op
/// pair and root given, each with the chunked message pattern.
fn chunked_reduce(
    world: usize,
    counts: &[usize],
    cases: &[(DataType, ReduceOp)],
    roots: &[usize],
    chunk: usize,
    seed: u64,
) {
    let c = chunked(Algorithm::ReduceScatterGather, chunk);
    for &count in counts {
        for &(dtype, op) in cases {
            for &root in roots {
                let sent = check_reduce_cfg(world, count, dtype, op, root, &c, seed);
                assert_eq!(
                    sent,
                    rsg_messages(count, world, dtype.size(), chunk, root),
                    "chunked reduce world {world} count {count} {dtype:?} {op:?} root {root} \
                     chunk {chunk}: not the chunked message pattern"
                );
            }
        }
    }
}

/// 96-byte chunks: worlds 1-16, counts 0, 1 (every block but the first empty), world - 1
/// (the last block empty), world + 1 and 97, every root, f16, u8 and f64, two delivery
/// orders.
#[test]
fn chunked_scatter_allgather_broadcast_96_byte_chunks() {
    for seed in [3, 0x5EED] {
        for world in 1..=16 {
            chunked_broadcast(
                world,
                &counts(world, 97),
                &SAG_DTYPES,
                &every(world),
                96,
                seed,
            );
        }
    }
}

/// 96-byte chunks of 4099 elements (several chunks per block): worlds 1-16, every root,
/// f16, u8 and f64.
#[test]
fn chunked_scatter_allgather_broadcast_96_byte_chunks_4099() {
    for world in 1..=16 {
        chunked_broadcast(world, &[4099], &SAG_DTYPES, &every(world), 96, 8);
    }
}

/// One-element chunks (a chunk size below the element size rounds up to one element):
/// worlds 1-16, counts 0, 1, world - 1, world + 1 and 97, every root, f16, u8 and f64.
#[test]
fn chunked_scatter_allgather_broadcast_one_element_chunks() {
    for world in 1..=16 {
        chunked_broadcast(world, &counts(world, 97), &SAG_DTYPES, &every(world), 1, 5);
    }
}

/// One-element chunks of 521 elements (hundreds of messages per rank; the simulator's
/// cost grows with the square of a rank's pending receives, so not 4099): worlds 1-16,
/// roots 0, 1, world / 2 and world - 1, each dtype on a third of the worlds.
#[test]
fn chunked_scatter_allgather_broadcast_one_element_chunks_521() {
    for world in 1..=16 {
        let dtype = SAG_DTYPES[world % 3];
        chunked_broadcast(world, &[521], &[dtype], &sampled_roots(world), 1, 9);
    }
}

/// 96-byte chunks: worlds 2-16, every root, counts 0, 1, world - 1 (the last block
/// empty), world + 1 and 97 (with 1, every block but the first empty), eight dtype/op
/// pairs with Avg on every float type, three delivery orders.
#[test]
fn chunked_reduce_scatter_gather_reduce_96_byte_chunks() {
    for (dtype, op) in RSG_CASES {
        check_op(dtype, op).unwrap();
    }
    for seed in [1, 2, 0xC0FFEE] {
        for world in 2..=16 {
            chunked_reduce(
                world,
                &counts(world, 97),
                &RSG_CASES,
                &every(world),
                96,
                seed,
            );
        }
    }
}

/// 96-byte chunks of larger buffers (several chunks per block): 1031 elements with every
/// root, 4099 with roots 0 and world - 1; worlds 2-16, the eight dtype/op pairs.
#[test]
fn chunked_reduce_scatter_gather_reduce_96_byte_chunks_large() {
    for world in 2..=16 {
        chunked_reduce(world, &[1031], &RSG_CASES, &every(world), 96, 4);
        chunked_reduce(world, &[4099], &RSG_CASES, &[0, world - 1], 96, 5);
    }
}

/// One-element chunks: every block of more than one element splits. Worlds 2-16, every
/// root, the eight dtype/op pairs; counts 0, 1, world - 1 and world + 1 with two delivery
/// orders.
#[test]
fn chunked_reduce_scatter_gather_reduce_one_element_chunks() {
    for seed in [6, 7] {
        for world in 2..=16 {
            chunked_reduce(
                world,
                &few_counts(world),
                &RSG_CASES,
                &every(world),
                1,
                seed,
            );
        }
    }
}

/// One-element chunks of 97 elements: worlds 2-16, every root, the eight dtype/op pairs.
#[test]
fn chunked_reduce_scatter_gather_reduce_one_element_chunks_97() {
    for world in 2..=16 {
        chunked_reduce(world, &[97], &RSG_CASES, &every(world), 1, 8);
    }
}

// ---------------------------------------------------------------------------------------
// Worlds above 16
// ---------------------------------------------------------------------------------------

const BIG_WORLDS: [usize; 4] = [17, 31, 32, 33];

const WIDE: [(DataType, ReduceOp); 5] = [
    (DataType::F32, ReduceOp::Sum),
    (DataType::I32, ReduceOp::Max),
    (DataType::I64, ReduceOp::Prod),
    (DataType::BF16, ReduceOp::Avg),
    (DataType::U8, ReduceOp::Min),
];

/// `f(world, count)` for each big world and counts 0, 1, world - 1, world + 1 and 97.
fn each_big(mut f: impl FnMut(usize, usize)) {
    for world in BIG_WORLDS {
        for count in counts(world, 97) {
            f(world, count);
        }
    }
}

fn check_barrier(world: usize, seed: u64) {
    let schedules = (0..world).map(|r| barrier(r, world).unwrap()).collect();
    let bufs = (0..world)
        .map(|_| RankBuffers::new(Vec::new(), Vec::new()))
        .collect();
    let out = SimNet::new(seed)
        .run(DataType::U8, ReduceOp::Sum, schedules, bufs)
        .unwrap_or_else(|e| panic!("barrier world {world} seed {seed}: {e}"));
    // Dissemination: ceil(log2 world) rounds of one empty message per rank.
    let rounds = world.next_power_of_two().trailing_zeros() as usize;
    assert_eq!(out.stats.messages, world * rounds, "barrier world {world}");
    assert_eq!(out.stats.bytes, 0, "barrier world {world}");
}

#[test]
fn big_worlds_all_reduce() {
    each_big(|world, count| {
        for alg in ALL_REDUCE {
            for (dtype, op) in WIDE {
                check_all_reduce(world, count, dtype, op, alg, 21);
            }
        }
    });
}

/// Every root, each broadcast algorithm, and scatter-allgather chunked as well.
#[test]
fn big_worlds_broadcast_every_root() {
    each_big(|world, count| {
        for root in 0..world {
            for alg in BROADCAST {
                check_broadcast(world, count, DataType::F32, root, alg, 22);
            }
        }
        chunked_broadcast(world, &[count], &[DataType::F16], &every(world), 96, 23);
    });
}

/// Every root, both reduce algorithms, and rsg chunked as well.
#[test]
fn big_worlds_reduce_every_root() {
    each_big(|world, count| {
        for root in 0..world {
            for alg in REDUCE {
                check_reduce(world, count, DataType::I32, ReduceOp::Sum, root, alg, 24);
            }
        }
        let avg = [(DataType::F32, ReduceOp::Avg)];
        chunked_reduce(world, &[count], &avg, &every(world), 96, 25);
    });
}

/// Every dtype/op pair of [`WIDE`] on a sample of roots.
#[test]
fn big_worlds_reduce_ops_sampled_roots() {
    each_big(|world, count| {
        for root in sampled_roots(world) {
            for alg in REDUCE {
                for (dtype, op) in WIDE {
                    check_reduce(world, count, dtype, op, root, alg, 26);
                }
            }
        }
    });
}

#[test]
fn big_worlds_all_gather_and_reduce_scatter() {
    each_big(|world, count| {
        for placing in Placing::ALL {
            for alg in all_gather_algs(world) {
                check_all_gather_cfg(world, count, DataType::I32, &cfg(alg), 27, placing);
            }
            for alg in reduce_scatter_algs(world) {
                for (dtype, op) in WIDE {
                    check_reduce_scatter_cfg(world, count, dtype, op, &cfg(alg), 28, placing);
                }
            }
        }
    });
}

/// Every root, binomial and linear (forced and chosen by size).
#[test]
fn big_worlds_gather_and_scatter_every_root() {
    each_big(|world, count| {
        for root in 0..world {
            for alg in ROOTED {
                check_gather(world, count, DataType::I32, root, alg, 29);
                check_scatter(world, count, DataType::I32, root, alg, 30);
            }
        }
    });
}

#[test]
fn big_worlds_all_to_all_scan_and_barrier() {
    for world in BIG_WORLDS {
        for seed in 0..4 {
            check_barrier(world, seed);
        }
    }
    each_big(|world, count| {
        for alg in ALL_TO_ALL {
            check_all_to_all(world, count, DataType::I32, alg, 31);
        }
        for (dtype, op) in WIDE.into_iter().filter(|&(_, op)| op != ReduceOp::Avg) {
            for exclusive in [false, true] {
                check_scan(world, count, dtype, op, exclusive, 32);
            }
        }
    });
}
