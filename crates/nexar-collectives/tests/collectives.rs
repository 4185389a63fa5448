//! Every collective against a sequential reference, in the simulator: world sizes
//! 1..=16, uneven and empty counts, every dtype and op, every algorithm, several seeds.

#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use nexar_collectives::Algorithm;
use nexar_device::{DataType, ReduceOp};
use proptest::prelude::*;

const SEEDS: [u64; 2] = [1, 0xDEAD_BEEF];

/// Worlds 1..=16, all counts, f32 and i32 sums (plus i32 max), every algorithm.
const LARGE: usize = 4099;
const WIDE: [(DataType, ReduceOp); 3] = [
    (DataType::F32, ReduceOp::Sum),
    (DataType::I32, ReduceOp::Sum),
    (DataType::I32, ReduceOp::Max),
];

#[test]
fn all_reduce_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, LARGE) {
                for alg in ALL_REDUCE {
                    for (dtype, op) in WIDE {
                        check_all_reduce(world, count, dtype, op, alg, seed);
                    }
                }
            }
        }
    }
}

/// Every rank ends an all-reduce with the same bits, also where a float op's result
/// depends on the order of its operands: Min and Max of zeros of both signs, and Sum and
/// Max of NaNs with different payloads (recursive doubling reduces each pair's vectors
/// on both ranks of the pair, and used to take its own vector first on each).
#[test]
fn every_rank_ends_an_all_reduce_with_the_same_bits() {
    // Element i of rank r: a zero of the sign of bit 0 of (r + i), a NaN with payload
    // r + 1, or an ordinary value, by i mod 3.
    let value = |r: usize, i: usize| -> f32 {
        match i % 3 {
            0 if (r + i) % 2 == 0 => 0.0,
            0 => -0.0,
            1 => f32::from_bits(0x7fc0_0000 | (r as u32 + 1)),
            _ => (r * 7 + i) as f32,
        }
    };
    let count = 30;
    for world in 2..=9 {
        for alg in ALL_REDUCE {
            for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Sum] {
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|r| (0..count).flat_map(|i| value(r, i).to_le_bytes()).collect())
                    .collect();
                let c = cfg(alg);
                let out = run(
                    1,
                    DataType::F32,
                    op,
                    world,
                    |r| nexar_collectives::all_reduce(r, world, count, DataType::F32, op, &c),
                    in_place(&inputs),
                    None,
                );
                for (r, b) in out.ranks.iter().enumerate() {
                    assert!(
                        b.data == out.ranks[0].data,
                        "{alg:?} world {world} {op:?}: rank {r} ends with other bits than rank 0"
                    );
                }
            }
        }
    }
}

#[test]
fn broadcast_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, LARGE) {
                for alg in BROADCAST {
                    for root in roots(world) {
                        check_broadcast(world, count, DataType::F32, root, alg, seed);
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, LARGE) {
                for alg in REDUCE {
                    for root in roots(world) {
                        for (dtype, op) in WIDE {
                            check_reduce(world, count, dtype, op, root, alg, seed);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn all_gather_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, 1031) {
                for alg in all_gather_algs(world) {
                    check_all_gather(world, count, DataType::I32, alg, seed);
                }
            }
        }
    }
}

#[test]
fn all_gather_and_reduce_scatter_in_place_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, 1031) {
                for placing in [Placing::InPlace, Placing::Mixed] {
                    for alg in all_gather_algs(world) {
                        let c = cfg(alg);
                        check_all_gather_cfg(world, count, DataType::I32, &c, seed, placing);
                    }
                    for alg in reduce_scatter_algs(world) {
                        for (dtype, op) in WIDE {
                            let c = cfg(alg);
                            check_reduce_scatter_cfg(world, count, dtype, op, &c, seed, placing);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, 1031) {
                for alg in reduce_scatter_algs(world) {
                    for (dtype, op) in WIDE {
                        check_reduce_scatter(world, count, dtype, op, alg, seed);
                    }
                }
            }
        }
    }
}

#[test]
fn gather_scatter_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, 1031) {
                for root in roots(world) {
                    for alg in ROOTED {
                        check_gather(world, count, DataType::I32, root, alg, seed);
                        check_scatter(world, count, DataType::I32, root, alg, seed);
                    }
                }
            }
        }
    }
}

#[test]
fn all_to_all_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, 1031) {
                for alg in ALL_TO_ALL {
                    check_all_to_all(world, count, DataType::I32, alg, seed);
                }
            }
        }
    }
}

#[test]
fn scan_every_world() {
    for seed in SEEDS {
        for world in 1..=16 {
            for count in counts(world, LARGE) {
                for (dtype, op) in WIDE {
                    for exclusive in [false, true] {
                        check_scan(world, count, dtype, op, exclusive, seed);
                    }
                }
            }
        }
    }
}

/// Every dtype and every valid op, on a few worlds (odd, even, power of two), every
/// algorithm.
const TYPED_WORLDS: [usize; 4] = [2, 3, 5, 8];

fn typed_counts(world: usize) -> Vec<usize> {
    let mut c = vec![0, 1, world + 1, 97];
    c.dedup();
    c
}

#[test]
fn all_reduce_every_dtype_and_op() {
    for world in TYPED_WORLDS {
        for dtype in DataType::ALL {
            for op in ops(dtype) {
                for count in typed_counts(world) {
                    for alg in ALL_REDUCE {
                        check_all_reduce(world, count, dtype, op, alg, 7);
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_and_reduce_scatter_every_dtype_and_op() {
    for world in TYPED_WORLDS {
        for dtype in DataType::ALL {
            for op in ops(dtype) {
                for count in typed_counts(world) {
                    for alg in REDUCE {
                        check_reduce(world, count, dtype, op, world - 1, alg, 11);
                    }
                    for alg in reduce_scatter_algs(world) {
                        check_reduce_scatter(world, count, dtype, op, alg, 13);
                    }
                }
            }
        }
    }
}

#[test]
fn scan_every_dtype_and_op() {
    for world in TYPED_WORLDS {
        for dtype in DataType::ALL {
            for op in ops(dtype).into_iter().filter(|&o| o != ReduceOp::Avg) {
                for count in typed_counts(world) {
                    check_scan(world, count, dtype, op, false, 17);
                    check_scan(world, count, dtype, op, true, 19);
                }
            }
        }
    }
}

#[test]
fn data_movement_every_dtype() {
    for world in TYPED_WORLDS {
        for dtype in DataType::ALL {
            for count in typed_counts(world) {
                for alg in BROADCAST {
                    check_broadcast(world, count, dtype, 1, alg, 23);
                }
                for alg in all_gather_algs(world) {
                    check_all_gather(world, count, dtype, alg, 29);
                }
                for alg in ROOTED {
                    check_gather(world, count, dtype, world - 1, alg, 31);
                    check_scatter(world, count, dtype, world - 1, alg, 37);
                }
                for alg in ALL_TO_ALL {
                    check_all_to_all(world, count, dtype, alg, 41);
                }
            }
        }
    }
}

/// More seeds on a few shapes: delivery order must not matter.
#[test]
fn many_seeds() {
    for seed in 100..116 {
        for world in [3, 6, 7] {
            check_all_reduce(
                world,
                50,
                DataType::I64,
                ReduceOp::Sum,
                Some(Algorithm::RingPipelined),
                seed,
            );
            check_all_reduce(
                world,
                50,
                DataType::I64,
                ReduceOp::Prod,
                Some(Algorithm::RecursiveHalvingDoubling),
                seed,
            );
            check_reduce(
                world,
                50,
                DataType::I64,
                ReduceOp::Sum,
                1,
                Some(Algorithm::ReduceScatterGather),
                seed,
            );
            check_broadcast(world, 50, DataType::I64, 2, Some(Algorithm::Chain), seed);
            check_reduce_scatter(
                world,
                20,
                DataType::I64,
                ReduceOp::Min,
                Some(Algorithm::RingPipelined),
                seed,
            );
            check_scan(world, 20, DataType::I64, ReduceOp::Sum, true, seed);
        }
    }
}

proptest! {
    // A fixed seed: the same cases on every run (a failure found once is found again).
    #![proptest_config(ProptestConfig {
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x006e_6578_6172),
        ..ProptestConfig::with_cases(64)
    })]

    /// Any collective, any shape, any algorithm, any chunk size and window.
    #[test]
    fn any_collective_any_shape(
        which in 0usize..5,
        world in 1usize..=11,
        count in 0usize..200,
        alg in 0usize..5,
        chunk in 1usize..40,
        window in 0usize..6,
        root in 0usize..11,
        seed in any::<u64>(),
    ) {
        let algs: Vec<Option<Algorithm>> = match which {
            0 => ALL_REDUCE.to_vec(),
            1 => BROADCAST.to_vec(),
            2 => REDUCE.to_vec(),
            3 => all_gather_algs(world),
            _ => reduce_scatter_algs(world),
        };
        let mut c = cfg(algs[alg % algs.len()]);
        c.pipeline_chunk_bytes = chunk * 8;
        c.window = window;
        let root = root % world;
        let dt = DataType::I64;
        match which {
            0 => check_all_reduce_cfg(world, count, dt, ReduceOp::Sum, &c, seed),
            1 => {
                check_broadcast_cfg(world, count, dt, root, &c, seed);
            }
            2 => {
                check_reduce_cfg(world, count, dt, ReduceOp::Max, root, &c, seed);
            }
            3 => check_all_gather_cfg(world, count, dt, &c, seed, Placing::Apart),
            _ => check_reduce_scatter_cfg(world, count, dt, ReduceOp::Sum, &c, seed, Placing::Apart),
        }
    }
}

proptest! {
    // A fixed seed, as above.
    #![proptest_config(ProptestConfig {
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x0063_7574_7321),
        ..ProptestConfig::with_cases(2048)
    })]

    /// Every collective, every dtype and op it takes, with pipeline chunks and message caps
    /// of any byte length (so cuts fall inside elements of 2, 4 and 8 bytes and are
    /// rounded to whole ones), low size thresholds (so the automatic choice varies with
    /// the count), any window and pacing, every root, and in-place forms mixed in.
    #[test]
    fn any_collective_any_dtype_any_cut(
        which in 0usize..10,
        world in 1usize..=12,
        count in 0usize..300,
        dtype in 0usize..DataType::ALL.len(),
        op in 0usize..8,
        alg in 0usize..6,
        chunk in 1usize..200,
        cap in prop_oneof![Just(None), (1usize..120).prop_map(Some)],
        thresholds in 0usize..3,
        window in 0usize..4,
        incast in prop_oneof![Just(1usize), Just(64), Just(1 << 20)],
        root in 0usize..12,
        placing in 0usize..3,
        seed in any::<u64>(),
    ) {
        let dtype = DataType::ALL[dtype];
        let mut ops = ops(dtype);
        if which >= 8 {
            // Scans take no average.
            ops.retain(|&o| o != ReduceOp::Avg);
        }
        let op = ops[op % ops.len()];
        let algs: Vec<Option<Algorithm>> = match which {
            0 => ALL_REDUCE.to_vec(),
            1 => BROADCAST.iter().copied().chain([None]).collect(),
            2 => REDUCE.iter().copied().chain([None]).collect(),
            3 => all_gather_algs(world),
            4 => reduce_scatter_algs(world),
            5 | 6 => ROOTED.to_vec(),
            7 => ALL_TO_ALL.iter().copied().map(Some).collect(),
            _ => vec![None],
        };
        let mut c = match cap {
            Some(cap) => capped(algs[alg % algs.len()], cap),
            None => cfg(algs[alg % algs.len()]),
        };
        c.pipeline_chunk_bytes = chunk;
        c.window = window;
        c.incast_bytes = incast;
        if thresholds > 0 {
            // Sizes of this test's counts cross them: tiny, small and pipelined forms.
            let unit = 64 * thresholds;
            c.tiny_bytes = unit;
            c.small_bytes = 4 * unit;
            c.pipeline_threshold_bytes = 16 * unit;
            c.broadcast_rd_block_bytes = unit / 2;
        }
        let root = root % world;
        let placing = Placing::ALL[placing];
        match which {
            0 => check_all_reduce_cfg(world, count, dtype, op, &c, seed),
            1 => {
                check_broadcast_cfg(world, count, dtype, root, &c, seed);
            }
            2 => {
                check_reduce_cfg(world, count, dtype, op, root, &c, seed);
            }
            3 => check_all_gather_cfg(world, count, dtype, &c, seed, placing),
            4 => check_reduce_scatter_cfg(world, count, dtype, op, &c, seed, placing),
            5 => check_gather_cfg(world, count, dtype, root, &c, seed),
            6 => check_scatter_cfg(world, count, dtype, root, &c, seed),
            7 => check_all_to_all_cfg(world, count, dtype, &c, seed),
            _ => check_scan_cfg(world, count, dtype, op, which == 9, &c, seed),
        }
    }
}
