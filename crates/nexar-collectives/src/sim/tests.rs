//! Simulator runs of shapes the crate's integration tests (`tests/collectives.rs`) leave
//! out: the chunked forms of the scatter-allgather broadcast and of the
//! reduce-scatter-then-gather reduce (chosen once a buffer reaches
//! `pipeline_threshold_bytes`, which those tests never lower), and worlds above 16 for
//! every collective. Each result is checked exactly against a sequential reference.

#![allow(clippy::unwrap_used)]

use nexar_device::{check_op, fill_identity, finalize_bytes, reduce_bytes, DataType, ReduceOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{
    all_gather, all_gather_in_place, all_reduce, all_to_all, barrier, broadcast, gather, reduce,
    reduce_scatter, reduce_scatter_in_place, scan, scatter, Algorithm, CollectiveConfig,
    RankBuffers, Schedule, ScheduleError, SimNet, SimOutput,
};

// ---------------------------------------------------------------------------------------
// Data and references
// ---------------------------------------------------------------------------------------

fn rng(seed: u64, world: usize, count: usize) -> StdRng {
    StdRng::seed_from_u64(seed ^ ((world as u64) << 40) ^ ((count as u64) << 8))
}

fn signed(dtype: DataType) -> bool {
    !matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64)
}

/// Small integers as `dtype` elements.
fn encode(dtype: DataType, vals: &[i64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DataType::F32 => out.extend((v as f32).to_le_bytes()),
            DataType::F64 => out.extend((v as f64).to_le_bytes()),
            DataType::F16 => out.extend(half::f16::from_f32(v as f32).to_le_bytes()),
            DataType::BF16 => out.extend(half::bf16::from_f32(v as f32).to_le_bytes()),
            DataType::I8 => out.extend((v as i8).to_le_bytes()),
            DataType::I32 => out.extend((v as i32).to_le_bytes()),
            DataType::I64 => out.extend(v.to_le_bytes()),
            DataType::U8 => out.extend((v as u8).to_le_bytes()),
            DataType::U32 => out.extend((v as u32).to_le_bytes()),
            DataType::U64 => out.extend((v as u64).to_le_bytes()),
        }
    }
    out
}

/// `n` integer-valued elements such that any reduction over up to 36 ranks, in any
/// order, is exact in every type: sums stay within +-252 (bf16 holds every integer up to
/// 256; the integer types wrap, which is order-independent), products within +-16.
fn values(rng: &mut StdRng, dtype: DataType, op: ReduceOp, rank: usize, n: usize) -> Vec<u8> {
    let s = signed(dtype);
    let vals: Vec<i64> = (0..n)
        .map(|_| match op {
            ReduceOp::Sum | ReduceOp::Avg => {
                if s {
                    rng.gen_range(-7..=7)
                } else {
                    rng.gen_range(0..=7)
                }
            }
            ReduceOp::Prod => {
                let mag = if rank < 4 && rng.gen_bool(0.3) { 2 } else { 1 };
                if s && rng.gen_bool(0.5) {
                    -mag
                } else {
                    mag
                }
            }
            ReduceOp::Min | ReduceOp::Max => {
                if s {
                    rng.gen_range(-100..=100)
                } else {
                    rng.gen_range(0..=200)
                }
            }
        })
        .collect();
    encode(dtype, &vals)
}

/// Arbitrary bytes, for collectives that only move data.
fn payload(rng: &mut StdRng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.gen()).collect()
}

/// Bytes that differ from `b` everywhere: a buffer starting as this must be fully
/// overwritten to end as `b`.
fn complement(b: &[u8]) -> Vec<u8> {
    b.iter().map(|x| !x).collect()
}

/// `op` folded over `parts` in order, then divided by `world` for `Avg` (what a driver
/// does when the schedule is done); no parts gives the identity.
fn reference(dtype: DataType, op: ReduceOp, len: usize, parts: &[&[u8]], world: usize) -> Vec<u8> {
    let mut acc = vec![0u8; len];
    match parts.split_first() {
        None => fill_identity(dtype, op, &mut acc).unwrap(),
        Some((first, rest)) => {
            acc.copy_from_slice(first);
            for p in rest {
                reduce_bytes(dtype, op, &mut acc, p).unwrap();
            }
        }
    }
    finalize_bytes(dtype, op, &mut acc, world).unwrap();
    acc
}

fn finalized(dtype: DataType, op: ReduceOp, buf: &[u8], world: usize) -> Vec<u8> {
    let mut out = buf.to_vec();
    finalize_bytes(dtype, op, &mut out, world).unwrap();
    out
}

/// Builds every rank's schedule, checks the chosen algorithm's name, and runs them.
#[allow(clippy::too_many_arguments)]
fn simulate(
    what: &str,
    seed: u64,
    dtype: DataType,
    op: ReduceOp,
    world: usize,
    make: impl Fn(usize) -> Result<Box<dyn Schedule>, ScheduleError>,
    bufs: Vec<RankBuffers>,
    expect_name: Option<&str>,
) -> SimOutput {
    let schedules: Vec<_> = (0..world)
        .map(|r| make(r).unwrap_or_else(|e| panic!("{what}: rank {r}: {e}")))
        .collect();
    if let Some(name) = expect_name {
        for (r, s) in schedules.iter().enumerate() {
            assert_eq!(s.name(), name, "{what}: rank {r} chose another algorithm");
        }
    }
    SimNet::new(seed)
        .run(dtype, op, schedules, bufs)
        .unwrap_or_else(|e| panic!("{what} seed {seed}: {e}"))
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
/// rank, then every block, in chunks, over `world - 1` ring hops.
fn scatter_allgather_messages(count: usize, world: usize, esz: usize, chunk: usize) -> usize {
    if world == 1 {
        return 0;
    }
    let cb = chunk_bytes(chunk, esz);
    let chunks: usize = block_lens(count, world, esz)
        .iter()
        .map(|l| l.div_ceil(cb))
        .sum();
    (world - 1) + (world - 1) * chunks
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
// Checks, one per collective
// ---------------------------------------------------------------------------------------

/// Broadcast from `root`; the others start with the complement of the message. Returns
/// the messages sent.
fn check_broadcast(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) -> usize {
    let what = format!(
        "broadcast {:?} world {world} count {count} {dtype:?} root {root} chunk {} threshold {}",
        c.algorithm, c.pipeline_chunk_bytes, c.pipeline_threshold_bytes
    );
    let mut rng = rng(seed, world, count);
    let msg = payload(&mut rng, count * dtype.size());
    let bufs = (0..world)
        .map(|r| {
            let data = if r == root {
                msg.clone()
            } else {
                complement(&msg)
            };
            RankBuffers::new(data, Vec::new())
        })
        .collect();
    let out = simulate(
        &what,
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| broadcast(r, world, count, dtype, root, c),
        bufs,
        c.algorithm.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(b.data == msg, "{what} seed {seed}: rank {r} ends wrong");
    }
    out.stats.messages
}

/// Reduce to `root`; the others' `Data` must come back unchanged. Returns the messages
/// sent.
#[allow(clippy::too_many_arguments)]
fn check_reduce(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) -> usize {
    let what = format!(
        "reduce {:?} world {world} count {count} {dtype:?} {op:?} root {root} chunk {} \
         threshold {} incast {}",
        c.algorithm, c.pipeline_chunk_bytes, c.pipeline_threshold_bytes, c.incast_bytes
    );
    let esz = dtype.size();
    let mut rng = rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count))
        .collect();
    let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let expect = reference(dtype, op, count * esz, &parts, world);
    let bufs = inputs
        .iter()
        .map(|d| RankBuffers::new(d.clone(), Vec::new()))
        .collect();
    let out = simulate(
        &what,
        seed,
        dtype,
        op,
        world,
        |r| reduce(r, world, count, dtype, op, root, c),
        bufs,
        c.algorithm.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        if r == root {
            let got = finalized(dtype, op, &b.data, world);
            assert!(
                got == expect,
                "{what} seed {seed}: the root's result is wrong"
            );
        } else {
            assert!(
                b.data == inputs[r],
                "{what} seed {seed}: non-root {r}'s Data changed"
            );
        }
    }
    out.stats.messages
}

fn check_all_reduce(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    c: &CollectiveConfig,
    seed: u64,
) {
    let what = format!(
        "all_reduce {:?} world {world} count {count} {dtype:?} {op:?}",
        c.algorithm
    );
    let mut rng = rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count))
        .collect();
    let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let expect = reference(dtype, op, count * dtype.size(), &parts, world);
    let bufs = inputs
        .iter()
        .map(|d| RankBuffers::new(d.clone(), Vec::new()))
        .collect();
    let out = simulate(
        &what,
        seed,
        dtype,
        op,
        world,
        |r| all_reduce(r, world, count, dtype, op, c),
        bufs,
        c.algorithm.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        let got = finalized(dtype, op, &b.data, world);
        assert!(got == expect, "{what} seed {seed}: rank {r} ends wrong");
    }
}

/// Which ranks run all-gather or reduce-scatter in place.
#[derive(Clone, Copy, Debug)]
enum Placing {
    Apart,
    InPlace,
    /// The odd ranks.
    Mixed,
}

impl Placing {
    const ALL: [Placing; 3] = [Placing::Apart, Placing::InPlace, Placing::Mixed];

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
    c: &CollectiveConfig,
    placing: Placing,
    seed: u64,
) {
    let what = format!(
        "all_gather {:?} {placing:?} world {world} count {count} {dtype:?}",
        c.algorithm
    );
    let blk = count * dtype.size();
    let mut rng = rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world).map(|_| payload(&mut rng, blk)).collect();
    let expect = inputs.concat();
    let bufs = (0..world)
        .map(|r| {
            let mut data = complement(&expect);
            if placing.in_place(r) {
                data[r * blk..(r + 1) * blk].copy_from_slice(&inputs[r]);
                RankBuffers::new(data, Vec::new())
            } else {
                RankBuffers::new(data, inputs[r].clone())
            }
        })
        .collect();
    let out = simulate(
        &what,
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
        c.algorithm.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(b.data == expect, "{what} seed {seed}: rank {r} ends wrong");
        if !placing.in_place(r) {
            assert!(
                b.input == inputs[r],
                "{what} seed {seed}: rank {r}'s input changed"
            );
        }
    }
}

fn check_reduce_scatter(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    c: &CollectiveConfig,
    placing: Placing,
    seed: u64,
) {
    let what = format!(
        "reduce_scatter {:?} {placing:?} world {world} count {count} {dtype:?} {op:?}",
        c.algorithm
    );
    let blk = count * dtype.size();
    let mut rng = rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count * world))
        .collect();
    let bufs = (0..world)
        .map(|r| {
            if placing.in_place(r) {
                RankBuffers::new(inputs[r].clone(), Vec::new())
            } else {
                RankBuffers::new(vec![0xa5; blk], inputs[r].clone())
            }
        })
        .collect();
    let out = simulate(
        &what,
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
        c.algorithm.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        let mine = r * blk..(r + 1) * blk;
        let parts: Vec<&[u8]> = inputs.iter().map(|i| &i[mine.clone()]).collect();
        let expect = reference(dtype, op, blk, &parts, world);
        let got = if placing.in_place(r) {
            let mut rest = b.data.clone();
            let got: Vec<u8> = rest.drain(mine.clone()).collect();
            let mut own = inputs[r].clone();
            own.drain(mine.clone());
            assert!(
                rest == own,
                "{what} seed {seed}: rank {r}'s other blocks changed"
            );
            got
        } else {
            assert!(
                b.input == inputs[r],
                "{what} seed {seed}: rank {r}'s input changed"
            );
            b.data.clone()
        };
        let got = finalized(dtype, op, &got, world);
        assert!(got == expect, "{what} seed {seed}: rank {r} ends wrong");
    }
}

fn check_gather(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) {
    let what = format!(
        "gather {:?} world {world} count {count} {dtype:?} root {root}",
        c.algorithm
    );
    let blk = count * dtype.size();
    let mut rng = rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world).map(|_| payload(&mut rng, blk)).collect();
    let expect = inputs.concat();
    let bufs = (0..world)
        .map(|r| {
            let data = if r == root {
                complement(&expect)
            } else {
                Vec::new()
            };
            RankBuffers::new(data, inputs[r].clone())
        })
        .collect();
    let out = simulate(
        &what,
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| gather(r, world, count, dtype, root, c),
        bufs,
        c.algorithm.map(Algorithm::name),
    );
    assert!(
        out.ranks[root].data == expect,
        "{what} seed {seed}: the root ends wrong"
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(
            b.input == inputs[r],
            "{what} seed {seed}: rank {r}'s input changed"
        );
    }
}

fn check_scatter(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) {
    let what = format!(
        "scatter {:?} world {world} count {count} {dtype:?} root {root}",
        c.algorithm
    );
    let blk = count * dtype.size();
    let mut rng = rng(seed, world, count);
    let all = payload(&mut rng, blk * world);
    let bufs = (0..world)
        .map(|r| {
            let input = if r == root { all.clone() } else { Vec::new() };
            RankBuffers::new(complement(&all[r * blk..(r + 1) * blk]), input)
        })
        .collect();
    let out = simulate(
        &what,
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| scatter(r, world, count, dtype, root, c),
        bufs,
        c.algorithm.map(Algorithm::name),
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(
            b.data == all[r * blk..(r + 1) * blk],
            "{what} seed {seed}: rank {r} ends wrong"
        );
    }
}

fn check_all_to_all(world: usize, count: usize, dtype: DataType, c: &CollectiveConfig, seed: u64) {
    let what = format!(
        "all_to_all {:?} world {world} count {count} {dtype:?}",
        c.algorithm
    );
    let blk = count * dtype.size();
    let mut rng = rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world).map(|_| payload(&mut rng, blk * world)).collect();
    let block = |r: usize| r * blk..(r + 1) * blk;
    let expect: Vec<Vec<u8>> = (0..world)
        .map(|j| inputs.iter().flat_map(|i| i[block(j)].to_vec()).collect())
        .collect();
    let bufs = (0..world)
        .map(|r| RankBuffers::new(complement(&expect[r]), inputs[r].clone()))
        .collect();
    let out = simulate(
        &what,
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| all_to_all(r, world, count, dtype, c),
        bufs,
        c.algorithm.map(Algorithm::name),
    );
    for (j, b) in out.ranks.iter().enumerate() {
        assert!(
            b.data == expect[j],
            "{what} seed {seed}: rank {j} ends wrong"
        );
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
    let what = format!("scan exclusive={exclusive} world {world} count {count} {dtype:?} {op:?}");
    let len = count * dtype.size();
    let mut rng = rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count))
        .collect();
    let bufs = inputs
        .iter()
        .map(|d| RankBuffers::new(d.clone(), Vec::new()))
        .collect();
    let c = CollectiveConfig::default();
    let out = simulate(
        &what,
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
        let expect = reference(dtype, op, len, &parts, 1);
        assert!(b.data == expect, "{what} seed {seed}: rank {r} ends wrong");
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

// ---------------------------------------------------------------------------------------
// Chunked scatter-allgather broadcast
// ---------------------------------------------------------------------------------------

/// Scatter-allgather forced and chunked for every size (`pipeline_threshold_bytes = 0`).
fn chunked_sag(chunk: usize) -> CollectiveConfig {
    let mut c = CollectiveConfig::default().with_algorithm(Algorithm::ScatterAllGather);
    c.pipeline_threshold_bytes = 0;
    c.pipeline_chunk_bytes = chunk;
    c.window = 4;
    c
}

const SAG_DTYPES: [DataType; 3] = [DataType::F16, DataType::U8, DataType::F64];

/// `0, 1, world - 1, world + 1` and, if given, `large`.
fn small_counts(world: usize, large: Option<usize>) -> Vec<usize> {
    let mut c = vec![0, 1, world - 1, world + 1];
    c.extend(large);
    c.sort_unstable();
    c.dedup();
    c
}

fn check_chunked_broadcast(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    chunk: usize,
    seed: u64,
) {
    let c = chunked_sag(chunk);
    let sent = check_broadcast(world, count, dtype, root, &c, seed);
    assert_eq!(
        sent,
        scatter_allgather_messages(count, world, dtype.size(), chunk),
        "chunked broadcast world {world} count {count} {dtype:?} root {root} chunk {chunk}: \
         not the chunked message pattern"
    );
}

/// 96-byte chunks: worlds 1-16, counts 0, 1 (every block but the first empty), world - 1
/// (the last block empty), world + 1 and 97, every root, f16, u8 and f64, two delivery
/// orders.
#[test]
fn chunked_scatter_allgather_broadcast_96_byte_chunks() {
    for seed in [3, 0x5EED] {
        for world in 1..=16 {
            for count in small_counts(world, Some(97)) {
                for dtype in SAG_DTYPES {
                    for root in 0..world {
                        check_chunked_broadcast(world, count, dtype, root, 96, seed);
                    }
                }
            }
        }
    }
}

/// 96-byte chunks of 4099 elements (several chunks per block): worlds 1-16, every root,
/// f16, u8 and f64.
#[test]
fn chunked_scatter_allgather_broadcast_96_byte_chunks_4099() {
    for world in 1..=16 {
        for dtype in SAG_DTYPES {
            for root in 0..world {
                check_chunked_broadcast(world, 4099, dtype, root, 96, 8);
            }
        }
    }
}

/// One-element chunks (a chunk size below the element size rounds up to one element):
/// worlds 1-16, counts 0, 1, world - 1, world + 1 and 97, every root, f16, u8 and f64.
#[test]
fn chunked_scatter_allgather_broadcast_one_element_chunks() {
    for world in 1..=16 {
        for count in small_counts(world, Some(97)) {
            for dtype in SAG_DTYPES {
                for root in 0..world {
                    check_chunked_broadcast(world, count, dtype, root, 1, 5);
                }
            }
        }
    }
}

/// One-element chunks of 521 elements (hundreds of messages per rank; the simulator's
/// cost grows with the square of a rank's pending receives, so not 4099): worlds 1-16,
/// roots 0, 1, world / 2 and world - 1, each dtype on a third of the worlds.
#[test]
fn chunked_scatter_allgather_broadcast_one_element_chunks_521() {
    for world in 1..=16 {
        let dtype = SAG_DTYPES[world % 3];
        for root in roots(world) {
            check_chunked_broadcast(world, 521, dtype, root, 1, 9);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Chunked reduce-scatter-then-gather reduce
// ---------------------------------------------------------------------------------------

/// rsg forced and chunked for every size, its gather paced two senders at a time.
fn chunked_rsg(chunk: usize) -> CollectiveConfig {
    let mut c = CollectiveConfig::default().with_algorithm(Algorithm::ReduceScatterGather);
    c.pipeline_threshold_bytes = 0;
    c.pipeline_chunk_bytes = chunk;
    c.incast_bytes = 1;
    c.window = 4;
    c
}

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

#[allow(clippy::too_many_arguments)]
fn check_chunked_reduce(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    chunk: usize,
    seed: u64,
) {
    let c = chunked_rsg(chunk);
    let sent = check_reduce(world, count, dtype, op, root, &c, seed);
    assert_eq!(
        sent,
        rsg_messages(count, world, dtype.size(), chunk, root),
        "chunked reduce world {world} count {count} {dtype:?} {op:?} root {root} chunk \
         {chunk}: not the chunked message pattern"
    );
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
            for count in small_counts(world, Some(97)) {
                for (dtype, op) in RSG_CASES {
                    for root in 0..world {
                        check_chunked_reduce(world, count, dtype, op, root, 96, seed);
                    }
                }
            }
        }
    }
}

/// 96-byte chunks of larger buffers (several chunks per block): 1031 elements with every
/// root, 4099 with roots 0 and world - 1; worlds 2-16, the eight dtype/op pairs.
#[test]
fn chunked_reduce_scatter_gather_reduce_96_byte_chunks_large() {
    for world in 2..=16 {
        for (dtype, op) in RSG_CASES {
            for root in 0..world {
                check_chunked_reduce(world, 1031, dtype, op, root, 96, 4);
            }
            for root in [0, world - 1] {
                check_chunked_reduce(world, 4099, dtype, op, root, 96, 5);
            }
        }
    }
}

/// One-element chunks: every block of more than one element splits. Worlds 2-16, every
/// root, the eight dtype/op pairs; counts 0, 1, world - 1 and world + 1 with two delivery
/// orders.
#[test]
fn chunked_reduce_scatter_gather_reduce_one_element_chunks() {
    for seed in [6, 7] {
        for world in 2..=16 {
            for count in small_counts(world, None) {
                for (dtype, op) in RSG_CASES {
                    for root in 0..world {
                        check_chunked_reduce(world, count, dtype, op, root, 1, seed);
                    }
                }
            }
        }
    }
}

/// One-element chunks of 97 elements: worlds 2-16, every root, the eight dtype/op pairs.
#[test]
fn chunked_reduce_scatter_gather_reduce_one_element_chunks_97() {
    for world in 2..=16 {
        for (dtype, op) in RSG_CASES {
            for root in 0..world {
                check_chunked_reduce(world, 97, dtype, op, root, 1, 8);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Worlds above 16
// ---------------------------------------------------------------------------------------

const BIG_WORLDS: [usize; 4] = [17, 31, 32, 33];

/// The config the integration tests use: small chunks and window, linear gathers paced.
fn small_chunks(alg: Option<Algorithm>) -> CollectiveConfig {
    CollectiveConfig {
        pipeline_chunk_bytes: 96,
        window: 4,
        incast_bytes: 1,
        algorithm: alg,
        ..CollectiveConfig::default()
    }
}

fn big_counts(world: usize) -> [usize; 5] {
    [0, 1, world - 1, world + 1, 97]
}

/// Roots 0, 1, world / 2 and world - 1.
fn roots(world: usize) -> Vec<usize> {
    let mut r = vec![0, 1.min(world - 1), world / 2, world - 1];
    r.sort_unstable();
    r.dedup();
    r
}

const WIDE: [(DataType, ReduceOp); 5] = [
    (DataType::F32, ReduceOp::Sum),
    (DataType::I32, ReduceOp::Max),
    (DataType::I64, ReduceOp::Prod),
    (DataType::BF16, ReduceOp::Avg),
    (DataType::U8, ReduceOp::Min),
];

#[test]
fn big_worlds_all_reduce() {
    for world in BIG_WORLDS {
        for count in big_counts(world) {
            for alg in [
                None,
                Some(Algorithm::Ring),
                Some(Algorithm::RingPipelined),
                Some(Algorithm::RecursiveDoubling),
                Some(Algorithm::RecursiveHalvingDoubling),
            ] {
                for (dtype, op) in WIDE {
                    check_all_reduce(world, count, dtype, op, &small_chunks(alg), 21);
                }
            }
        }
    }
}

/// Every root, each broadcast algorithm, and scatter-allgather chunked as well.
#[test]
fn big_worlds_broadcast_every_root() {
    for world in BIG_WORLDS {
        for count in big_counts(world) {
            for root in 0..world {
                for alg in [
                    Algorithm::Binomial,
                    Algorithm::Chain,
                    Algorithm::ScatterAllGather,
                ] {
                    let c = small_chunks(Some(alg));
                    check_broadcast(world, count, DataType::F32, root, &c, 22);
                }
                check_chunked_broadcast(world, count, DataType::F16, root, 96, 23);
            }
        }
    }
}

/// Every root, both reduce algorithms, and rsg chunked as well.
#[test]
fn big_worlds_reduce_every_root() {
    for world in BIG_WORLDS {
        for count in big_counts(world) {
            for root in 0..world {
                for alg in [Algorithm::Binomial, Algorithm::ReduceScatterGather] {
                    let c = small_chunks(Some(alg));
                    check_reduce(world, count, DataType::I32, ReduceOp::Sum, root, &c, 24);
                }
                check_chunked_reduce(world, count, DataType::F32, ReduceOp::Avg, root, 96, 25);
            }
        }
    }
}

/// Every dtype/op pair of [`WIDE`] on a sample of roots.
#[test]
fn big_worlds_reduce_ops_sampled_roots() {
    for world in BIG_WORLDS {
        for count in big_counts(world) {
            for root in roots(world) {
                for alg in [Algorithm::Binomial, Algorithm::ReduceScatterGather] {
                    for (dtype, op) in WIDE {
                        let c = small_chunks(Some(alg));
                        check_reduce(world, count, dtype, op, root, &c, 26);
                    }
                }
            }
        }
    }
}

#[test]
fn big_worlds_all_gather_and_reduce_scatter() {
    for world in BIG_WORLDS {
        let pow2 = world.is_power_of_two();
        let mut ag = vec![
            None,
            Some(Algorithm::Ring),
            Some(Algorithm::RingPipelined),
            Some(Algorithm::Bruck),
        ];
        let mut rs = vec![None, Some(Algorithm::Ring), Some(Algorithm::RingPipelined)];
        if pow2 {
            ag.push(Some(Algorithm::RecursiveDoubling));
            rs.push(Some(Algorithm::RecursiveHalving));
        }
        for count in big_counts(world) {
            for placing in Placing::ALL {
                for &alg in &ag {
                    let c = small_chunks(alg);
                    check_all_gather(world, count, DataType::I32, &c, placing, 27);
                }
                for &alg in &rs {
                    for (dtype, op) in WIDE {
                        let c = small_chunks(alg);
                        check_reduce_scatter(world, count, dtype, op, &c, placing, 28);
                    }
                }
            }
        }
    }
}

/// Every root, binomial and linear (forced and chosen by size).
#[test]
fn big_worlds_gather_and_scatter_every_root() {
    for world in BIG_WORLDS {
        for count in big_counts(world) {
            for root in 0..world {
                for alg in [None, Some(Algorithm::Binomial), Some(Algorithm::Linear)] {
                    let c = small_chunks(alg);
                    check_gather(world, count, DataType::I32, root, &c, 29);
                    check_scatter(world, count, DataType::I32, root, &c, 30);
                }
            }
        }
    }
}

#[test]
fn big_worlds_all_to_all_scan_and_barrier() {
    for world in BIG_WORLDS {
        for seed in 0..4 {
            check_barrier(world, seed);
        }
        for count in big_counts(world) {
            for alg in [Algorithm::Pairwise, Algorithm::Bruck] {
                check_all_to_all(world, count, DataType::I32, &small_chunks(Some(alg)), 31);
            }
            for (dtype, op) in WIDE {
                if op == ReduceOp::Avg {
                    continue;
                }
                for exclusive in [false, true] {
                    check_scan(world, count, dtype, op, exclusive, 32);
                }
            }
        }
    }
}
