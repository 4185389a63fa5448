//! Every collective against a sequential reference, in the simulator: world sizes
//! 1..=16, uneven and empty counts, every dtype and op, every algorithm, several seeds.

#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use nexar_collectives::{
    all_gather, all_gather_in_place, all_reduce, all_to_all, broadcast, gather, reduce,
    reduce_scatter, reduce_scatter_in_place, scan, scatter, Algorithm, CollectiveConfig,
    RankBuffers,
};
use nexar_device::{DataType, ReduceOp};
use proptest::prelude::*;

/// A config that forces `alg` and makes pipelining visible on small buffers.
fn cfg(alg: Option<Algorithm>) -> CollectiveConfig {
    let mut c = CollectiveConfig::default();
    c.pipeline_chunk_bytes = 96;
    c.window = 4;
    // Linear gathers pace their senders two at a time, whatever the block size.
    c.incast_bytes = 1;
    c.algorithm = alg;
    c
}

const SEEDS: [u64; 2] = [1, 0xDEAD_BEEF];

fn check_all_reduce(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_all_reduce_cfg(world, count, dtype, op, &cfg(alg), seed);
}

fn check_all_reduce_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    c: &CollectiveConfig,
    seed: u64,
) {
    let esz = dtype.size();
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count))
        .collect();
    let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let mut expect = fold(dtype, op, count * esz, &parts);
    finalize(dtype, op, &mut expect, world);
    let bufs = inputs
        .iter()
        .map(|d| RankBuffers::new(d.clone(), Vec::new()))
        .collect();
    let alg = c.algorithm;
    let out = run(
        seed,
        dtype,
        op,
        world,
        |r| all_reduce(r, world, count, dtype, op, c),
        bufs,
        alg.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        let mut got = b.data.clone();
        finalize(dtype, op, &mut got, world);
        assert_eq!(
            got, expect,
            "all_reduce {alg:?} rank {r} world {world} count {count} {dtype:?} {op:?}"
        );
    }
}

fn check_broadcast(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_broadcast_cfg(world, count, dtype, root, &cfg(alg), seed);
}

fn check_broadcast_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) {
    let esz = dtype.size();
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let msg = values(&mut rng, dtype, ReduceOp::Sum, 0, count);
    let bufs = (0..world)
        .map(|r| {
            let data = if r == root {
                msg.clone()
            } else {
                garbage(&mut rng, count * esz)
            };
            RankBuffers::new(data, Vec::new())
        })
        .collect();
    let alg = c.algorithm;
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| broadcast(r, world, count, dtype, root, c),
        bufs,
        alg.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert_eq!(
            b.data, msg,
            "broadcast {alg:?} rank {r} root {root} world {world} count {count}"
        );
    }
}

fn check_reduce(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_reduce_cfg(world, count, dtype, op, root, &cfg(alg), seed);
}

fn check_reduce_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) {
    let esz = dtype.size();
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count))
        .collect();
    let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let mut expect = fold(dtype, op, count * esz, &parts);
    finalize(dtype, op, &mut expect, world);
    let bufs = inputs
        .iter()
        .map(|d| RankBuffers::new(d.clone(), Vec::new()))
        .collect();
    let alg = c.algorithm;
    let out = run(
        seed,
        dtype,
        op,
        world,
        |r| reduce(r, world, count, dtype, op, root, c),
        bufs,
        alg.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        if r == root {
            let mut got = b.data.clone();
            finalize(dtype, op, &mut got, world);
            assert_eq!(
                got, expect,
                "reduce {alg:?} root {root} world {world} count {count} {dtype:?} {op:?}"
            );
        } else {
            assert_eq!(b.data, inputs[r], "reduce {alg:?} modified non-root {r}");
        }
    }
}

/// Which ranks run all-gather or reduce-scatter in place.
#[derive(Clone, Copy, Debug)]
enum Placing {
    /// None: every rank has its own `Input`.
    Apart,
    /// Every rank.
    InPlace,
    /// The odd ranks (the forms share their messages, so they mix).
    Mixed,
}

impl Placing {
    fn in_place(self, rank: usize) -> bool {
        match self {
            Placing::Apart => false,
            Placing::InPlace => true,
            Placing::Mixed => rank % 2 == 1,
        }
    }
}

fn check_all_gather(
    world: usize,
    count: usize,
    dtype: DataType,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_all_gather_cfg(world, count, dtype, &cfg(alg), seed, Placing::Apart);
}

fn check_all_gather_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    c: &CollectiveConfig,
    seed: u64,
    placing: Placing,
) {
    let esz = dtype.size();
    let blk = count * esz;
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, ReduceOp::Sum, r, count))
        .collect();
    let expect = inputs.concat();
    let bufs = inputs
        .iter()
        .enumerate()
        .map(|(r, i)| {
            let mut data = garbage(&mut rng, blk * world);
            if placing.in_place(r) {
                data[r * blk..(r + 1) * blk].copy_from_slice(i);
                RankBuffers::new(data, Vec::new())
            } else {
                RankBuffers::new(data, i.clone())
            }
        })
        .collect();
    let alg = c.algorithm;
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| {
            if placing.in_place(r) {
                all_gather_in_place(r, world, count, dtype, c)
            } else {
                all_gather(r, world, count, dtype, c)
            }
        },
        bufs,
        alg.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert_eq!(
            b.data, expect,
            "all_gather {alg:?} {placing:?} rank {r} world {world} count {count}"
        );
        if !placing.in_place(r) {
            assert_eq!(b.input, inputs[r]);
        }
    }
}

fn check_reduce_scatter(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_reduce_scatter_cfg(world, count, dtype, op, &cfg(alg), seed, Placing::Apart);
}

fn check_reduce_scatter_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    c: &CollectiveConfig,
    seed: u64,
    placing: Placing,
) {
    let esz = dtype.size();
    let blk = count * esz;
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count * world))
        .collect();
    let bufs = inputs
        .iter()
        .enumerate()
        .map(|(r, i)| {
            if placing.in_place(r) {
                RankBuffers::new(i.clone(), Vec::new())
            } else {
                RankBuffers::new(garbage(&mut rng, blk), i.clone())
            }
        })
        .collect();
    let alg = c.algorithm;
    let out = run(
        seed,
        dtype,
        op,
        world,
        |r| {
            if placing.in_place(r) {
                reduce_scatter_in_place(r, world, count, dtype, op, c)
            } else {
                reduce_scatter(r, world, count, dtype, op, c)
            }
        },
        bufs,
        alg.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        let parts: Vec<&[u8]> = inputs.iter().map(|i| &i[r * blk..(r + 1) * blk]).collect();
        let mut expect = fold(dtype, op, blk, &parts);
        finalize(dtype, op, &mut expect, world);
        let what = format!(
            "reduce_scatter {alg:?} {placing:?} rank {r} world {world} count {count} {dtype:?} {op:?}"
        );
        let mut got = if placing.in_place(r) {
            // The other blocks keep this rank's input.
            let mut rest = b.data.clone();
            let mine: Vec<u8> = rest.drain(r * blk..(r + 1) * blk).collect();
            let mut own = inputs[r].clone();
            own.drain(r * blk..(r + 1) * blk);
            assert_eq!(rest, own, "{what}: the other blocks changed");
            mine
        } else {
            assert_eq!(b.input, inputs[r]);
            b.data.clone()
        };
        finalize(dtype, op, &mut got, world);
        assert_eq!(got, expect, "{what}");
    }
}

fn check_gather(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    alg: Option<Algorithm>,
    seed: u64,
) {
    let esz = dtype.size();
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, ReduceOp::Sum, r, count))
        .collect();
    let bufs = inputs
        .iter()
        .enumerate()
        .map(|(r, i)| {
            let data = if r == root {
                garbage(&mut rng, count * esz * world)
            } else {
                Vec::new()
            };
            RankBuffers::new(data, i.clone())
        })
        .collect();
    let c = cfg(alg);
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| gather(r, world, count, dtype, root, &c),
        bufs,
        alg.map(Algorithm::name),
    );
    assert_eq!(
        out.ranks[root].data,
        inputs.concat(),
        "gather root {root} world {world} count {count}"
    );
}

fn check_scatter(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    alg: Option<Algorithm>,
    seed: u64,
) {
    let esz = dtype.size();
    let blk = count * esz;
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let all = values(&mut rng, dtype, ReduceOp::Sum, 0, count * world);
    let bufs = (0..world)
        .map(|r| {
            let input = if r == root { all.clone() } else { Vec::new() };
            RankBuffers::new(garbage(&mut rng, blk), input)
        })
        .collect();
    let c = cfg(alg);
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| scatter(r, world, count, dtype, root, &c),
        bufs,
        alg.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert_eq!(
            b.data,
            all[r * blk..(r + 1) * blk],
            "scatter root {root} rank {r} world {world} count {count}"
        );
    }
}

fn check_all_to_all(world: usize, count: usize, dtype: DataType, alg: Algorithm, seed: u64) {
    let esz = dtype.size();
    let blk = count * esz;
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, ReduceOp::Sum, r, count * world))
        .collect();
    let bufs = inputs
        .iter()
        .map(|i| RankBuffers::new(garbage(&mut rng, blk * world), i.clone()))
        .collect();
    let c = cfg(Some(alg));
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| all_to_all(r, world, count, dtype, &c),
        bufs,
        Some(alg.name()),
    );
    for (j, b) in out.ranks.iter().enumerate() {
        for (r, input) in inputs.iter().enumerate() {
            assert_eq!(
                b.data[r * blk..(r + 1) * blk],
                input[j * blk..(j + 1) * blk],
                "all_to_all {alg} world {world} count {count}: {r} -> {j}"
            );
        }
    }
}

fn check_scan(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    exclusive: bool,
    seed: u64,
) {
    let esz = dtype.size();
    let mut rng = rng(seed ^ (world * 1000 + count) as u64);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count))
        .collect();
    let bufs = inputs
        .iter()
        .map(|d| RankBuffers::new(d.clone(), Vec::new()))
        .collect();
    let c = cfg(None);
    let out = run(
        seed,
        dtype,
        op,
        world,
        |r| scan(r, world, count, dtype, op, exclusive, &c),
        bufs,
        Some("rd"),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        let upto = if exclusive { r } else { r + 1 };
        let parts: Vec<&[u8]> = inputs[..upto].iter().map(Vec::as_slice).collect();
        let expect = fold(dtype, op, count * esz, &parts);
        assert_eq!(
            b.data, expect,
            "scan exclusive={exclusive} rank {r} world {world} count {count} {dtype:?} {op:?}"
        );
    }
}

fn roots(world: usize) -> Vec<usize> {
    let mut r = vec![0, world / 2, world - 1];
    r.dedup();
    r
}

const ALL_REDUCE: [Option<Algorithm>; 5] = [
    None,
    Some(Algorithm::Ring),
    Some(Algorithm::RingPipelined),
    Some(Algorithm::RecursiveDoubling),
    Some(Algorithm::RecursiveHalvingDoubling),
];
const BROADCAST: [Option<Algorithm>; 3] = [
    Some(Algorithm::Binomial),
    Some(Algorithm::Chain),
    Some(Algorithm::ScatterAllGather),
];
const ALL_TO_ALL: [Algorithm; 2] = [Algorithm::Pairwise, Algorithm::Bruck];
const ROOTED: [Option<Algorithm>; 3] = [None, Some(Algorithm::Binomial), Some(Algorithm::Linear)];
const REDUCE: [Option<Algorithm>; 2] = [
    Some(Algorithm::Binomial),
    Some(Algorithm::ReduceScatterGather),
];

fn all_gather_algs(world: usize) -> Vec<Option<Algorithm>> {
    let mut v = vec![
        None,
        Some(Algorithm::Ring),
        Some(Algorithm::RingPipelined),
        Some(Algorithm::Bruck),
    ];
    if world.is_power_of_two() {
        v.push(Some(Algorithm::RecursiveDoubling));
    }
    v
}

fn reduce_scatter_algs(world: usize) -> Vec<Option<Algorithm>> {
    let mut v = vec![None, Some(Algorithm::Ring), Some(Algorithm::RingPipelined)];
    if world.is_power_of_two() {
        v.push(Some(Algorithm::RecursiveHalving));
    }
    v
}

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
    #![proptest_config(ProptestConfig::with_cases(64))]

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
            1 => check_broadcast_cfg(world, count, dt, root, &c, seed),
            2 => check_reduce_cfg(world, count, dt, ReduceOp::Max, root, &c, seed),
            3 => check_all_gather_cfg(world, count, dt, &c, seed, Placing::Apart),
            _ => check_reduce_scatter_cfg(world, count, dt, ReduceOp::Sum, &c, seed, Placing::Apart),
        }
    }
}
