//! Shared helpers: integer-valued test data, sequential references, a runner, and one
//! check per collective against a sequential reference.

#![allow(dead_code, unreachable_pub)]

use nexar_collectives::{
    all_gather, all_gather_in_place, all_reduce, all_to_all, broadcast, gather, reduce,
    reduce_scatter, reduce_scatter_in_place, scan, scatter, Algorithm, CollectiveConfig,
    RankBuffers, Schedule, ScheduleError, SimNet, SimOutput,
};
use nexar_device::{fill_identity, finalize_bytes, reduce_bytes, DataType, ReduceOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn signed(dtype: DataType) -> bool {
    !matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64)
}

/// Encodes small integers as `dtype` elements (exactly representable in every type).
pub fn encode(dtype: DataType, vals: &[i64]) -> Vec<u8> {
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

/// `n` integer-valued elements chosen so that any reduction of up to 36 ranks, in any
/// order, is exact in every type: sums stay within +-252 (bf16 holds every integer up to
/// 256; the integer types wrap, which is order-independent), products within +-16.
pub fn values(rng: &mut StdRng, dtype: DataType, op: ReduceOp, rank: usize, n: usize) -> Vec<u8> {
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
                // Magnitude 2 only on ranks 0..4: products stay within +-16.
                let two = rank < 4 && rng.gen_bool(0.3);
                let mag = if two { 2 } else { 1 };
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

/// Random bytes that a collective must overwrite.
pub fn garbage(rng: &mut StdRng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.gen()).collect()
}

/// Sequential reduction of `parts` in order; an empty list gives the identity.
pub fn fold(dtype: DataType, op: ReduceOp, len: usize, parts: &[&[u8]]) -> Vec<u8> {
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
    acc
}

/// What the driver does after a reduction with `Avg`.
pub fn finalize(dtype: DataType, op: ReduceOp, buf: &mut [u8], world: usize) {
    finalize_bytes(dtype, op, buf, world).unwrap();
}

/// Builds one schedule per rank and runs them.
pub fn run(
    seed: u64,
    dtype: DataType,
    op: ReduceOp,
    world: usize,
    make: impl Fn(usize) -> Result<Box<dyn Schedule>, ScheduleError>,
    bufs: Vec<RankBuffers>,
    expect_name: Option<&str>,
) -> SimOutput {
    let schedules: Vec<_> = (0..world).map(|r| make(r).unwrap()).collect();
    if let Some(name) = expect_name {
        for s in &schedules {
            assert_eq!(s.name(), name);
        }
    }
    let name = schedules.first().map(|s| s.name()).unwrap_or("");
    match SimNet::new(seed).run(dtype, op, schedules, bufs) {
        Ok(out) => out,
        Err(e) => panic!("{name} world {world} {dtype:?} {op:?} seed {seed}: {e}"),
    }
}

/// Element counts worth testing for `world` ranks.
pub fn counts(world: usize, large: usize) -> Vec<usize> {
    let mut c = vec![0, 1, world.saturating_sub(1), world + 1, 97, large];
    c.sort_unstable();
    c.dedup();
    c
}

/// Valid ops for a dtype.
pub fn ops(dtype: DataType) -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|&op| nexar_device::check_op(dtype, op).is_ok())
        .collect()
}

/// The data generator of one case.
pub fn case_rng(seed: u64, world: usize, count: usize) -> StdRng {
    rng(seed ^ ((world as u64) << 40) ^ ((count as u64) << 8))
}

/// Bytes that differ from `b` everywhere: a buffer starting as this must be fully
/// overwritten to end as `b`.
pub fn complement(b: &[u8]) -> Vec<u8> {
    b.iter().map(|x| !x).collect()
}

/// [`fold`], then what the driver does for `Avg`.
pub fn reference(
    dtype: DataType,
    op: ReduceOp,
    len: usize,
    parts: &[&[u8]],
    world: usize,
) -> Vec<u8> {
    let mut acc = fold(dtype, op, len, parts);
    finalize(dtype, op, &mut acc, world);
    acc
}

/// A copy of `buf`, finalized.
pub fn finalized(dtype: DataType, op: ReduceOp, buf: &[u8], world: usize) -> Vec<u8> {
    let mut out = buf.to_vec();
    finalize(dtype, op, &mut out, world);
    out
}

/// Block `r` of `blk` bytes.
fn block(r: usize, blk: usize) -> std::ops::Range<usize> {
    r * blk..(r + 1) * blk
}

/// A config that forces `alg` and makes pipelining visible on small buffers.
pub fn cfg(alg: Option<Algorithm>) -> CollectiveConfig {
    let mut c = CollectiveConfig::default();
    c.pipeline_chunk_bytes = 96;
    c.window = 4;
    // Linear gathers pace their senders two at a time, whatever the block size.
    c.incast_bytes = 1;
    c.algorithm = alg;
    c
}

/// [`cfg`] with messages of at most `cap` bytes (whole elements, at least one).
pub fn capped(alg: Option<Algorithm>, cap: usize) -> CollectiveConfig {
    let mut c = cfg(alg);
    c.max_message_bytes = cap;
    c
}

/// Fails `what` if a message of `out` was longer than `c` allows for `dtype`: its
/// `max_message_bytes` rounded down to whole elements, at least one.
pub fn assert_capped(out: &SimOutput, c: &CollectiveConfig, dtype: DataType, what: &str) {
    let esz = dtype.size();
    let limit = (c.max_message_bytes / esz).max(1) * esz;
    assert!(
        out.stats.largest_message <= limit,
        "{what}: a message of {} bytes, over max_message_bytes {} ({limit} in whole elements)",
        out.stats.largest_message,
        c.max_message_bytes
    );
}

/// Roots 0, world / 2 and world - 1.
pub fn roots(world: usize) -> Vec<usize> {
    let mut r = vec![0, world / 2, world - 1];
    r.dedup();
    r
}

pub const ALL_REDUCE: [Option<Algorithm>; 5] = [
    None,
    Some(Algorithm::Ring),
    Some(Algorithm::RingPipelined),
    Some(Algorithm::RecursiveDoubling),
    Some(Algorithm::RecursiveHalvingDoubling),
];
pub const BROADCAST: [Option<Algorithm>; 3] = [
    Some(Algorithm::Binomial),
    Some(Algorithm::Chain),
    Some(Algorithm::ScatterAllGather),
];
pub const ALL_TO_ALL: [Algorithm; 2] = [Algorithm::Pairwise, Algorithm::Bruck];
pub const ROOTED: [Option<Algorithm>; 3] =
    [None, Some(Algorithm::Binomial), Some(Algorithm::Linear)];
pub const REDUCE: [Option<Algorithm>; 2] = [
    Some(Algorithm::Binomial),
    Some(Algorithm::ReduceScatterGather),
];

pub fn all_gather_algs(world: usize) -> Vec<Option<Algorithm>> {
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

pub fn reduce_scatter_algs(world: usize) -> Vec<Option<Algorithm>> {
    let mut v = vec![None, Some(Algorithm::Ring), Some(Algorithm::RingPipelined)];
    if world.is_power_of_two() {
        v.push(Some(Algorithm::RecursiveHalving));
    }
    v
}

/// Which ranks run all-gather or reduce-scatter in place.
#[derive(Clone, Copy, Debug)]
pub enum Placing {
    /// None: every rank has its own `Input`.
    Apart,
    /// Every rank.
    InPlace,
    /// The odd ranks (the forms share their messages, so they mix).
    Mixed,
}

impl Placing {
    pub const ALL: [Placing; 3] = [Placing::Apart, Placing::InPlace, Placing::Mixed];

    pub fn in_place(self, rank: usize) -> bool {
        match self {
            Placing::Apart => false,
            Placing::InPlace => true,
            Placing::Mixed => rank % 2 == 1,
        }
    }
}

// Checks, one per collective. Every buffer a collective must write starts as the
// complement of its expected end, so a byte left unwritten always shows.

pub fn check_all_reduce(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_all_reduce_cfg(world, count, dtype, op, &cfg(alg), seed);
}

pub fn check_all_reduce_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    c: &CollectiveConfig,
    seed: u64,
) {
    let alg = c.algorithm;
    let what =
        format!("all_reduce {alg:?} world {world} count {count} {dtype:?} {op:?} seed {seed}");
    let inputs = rank_values(seed, world, count, dtype, op);
    let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let expect = reference(dtype, op, count * dtype.size(), &parts, world);
    let bufs = in_place(&inputs);
    let out = run(
        seed,
        dtype,
        op,
        world,
        |r| all_reduce(r, world, count, dtype, op, c),
        bufs,
        alg.map(Algorithm::name),
    );
    assert_capped(&out, c, dtype, &what);
    for (r, b) in out.ranks.iter().enumerate() {
        let got = finalized(dtype, op, &b.data, world);
        assert!(got == expect, "{what}: rank {r} ends wrong");
    }
}

pub fn check_broadcast(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_broadcast_cfg(world, count, dtype, root, &cfg(alg), seed);
}

/// Broadcast from `root`; returns the messages sent.
pub fn check_broadcast_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) -> usize {
    let alg = c.algorithm;
    let what = format!(
        "broadcast {alg:?} world {world} count {count} {dtype:?} root {root} chunk {} seed {seed}",
        c.pipeline_chunk_bytes
    );
    let mut rng = case_rng(seed, world, count);
    let msg = garbage(&mut rng, count * dtype.size());
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
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| broadcast(r, world, count, dtype, root, c),
        bufs,
        alg.map(Algorithm::name),
    );
    assert_capped(&out, c, dtype, &what);
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(b.data == msg, "{what}: rank {r} ends wrong");
    }
    out.stats.messages
}

pub fn check_reduce(
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

/// Reduce to `root`; the others' `Data` must come back unchanged. Returns the messages
/// sent.
pub fn check_reduce_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) -> usize {
    let alg = c.algorithm;
    let what = format!(
        "reduce {alg:?} world {world} count {count} {dtype:?} {op:?} root {root} chunk {} \
         threshold {} incast {} seed {seed}",
        c.pipeline_chunk_bytes, c.pipeline_threshold_bytes, c.incast_bytes
    );
    let inputs = rank_values(seed, world, count, dtype, op);
    let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let expect = reference(dtype, op, count * dtype.size(), &parts, world);
    let bufs = in_place(&inputs);
    let out = run(
        seed,
        dtype,
        op,
        world,
        |r| reduce(r, world, count, dtype, op, root, c),
        bufs,
        alg.map(Algorithm::name),
    );
    assert_capped(&out, c, dtype, &what);
    for (r, b) in out.ranks.iter().enumerate() {
        if r == root {
            let got = finalized(dtype, op, &b.data, world);
            assert!(got == expect, "{what}: the root's result is wrong");
        } else {
            assert!(b.data == inputs[r], "{what}: non-root {r}'s Data changed");
        }
    }
    out.stats.messages
}

pub fn check_all_gather(
    world: usize,
    count: usize,
    dtype: DataType,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_all_gather_cfg(world, count, dtype, &cfg(alg), seed, Placing::Apart);
}

pub fn check_all_gather_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    c: &CollectiveConfig,
    seed: u64,
    placing: Placing,
) {
    let alg = c.algorithm;
    let what =
        format!("all_gather {alg:?} {placing:?} world {world} count {count} {dtype:?} seed {seed}");
    let blk = count * dtype.size();
    let mut rng = case_rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world).map(|_| garbage(&mut rng, blk)).collect();
    let expect = inputs.concat();
    let bufs = (0..world)
        .map(|r| {
            let mut data = complement(&expect);
            if placing.in_place(r) {
                data[block(r, blk)].copy_from_slice(&inputs[r]);
                RankBuffers::new(data, Vec::new())
            } else {
                RankBuffers::new(data, inputs[r].clone())
            }
        })
        .collect();
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
    assert_capped(&out, c, dtype, &what);
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(b.data == expect, "{what}: rank {r} ends wrong");
        if !placing.in_place(r) {
            assert!(b.input == inputs[r], "{what}: rank {r}'s input changed");
        }
    }
}

pub fn check_reduce_scatter(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_reduce_scatter_cfg(world, count, dtype, op, &cfg(alg), seed, Placing::Apart);
}

pub fn check_reduce_scatter_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    c: &CollectiveConfig,
    seed: u64,
    placing: Placing,
) {
    let alg = c.algorithm;
    let what =
        format!("reduce_scatter {alg:?} {placing:?} world {world} count {count} {dtype:?} {op:?} seed {seed}");
    let blk = count * dtype.size();
    let mut rng = case_rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count * world))
        .collect();
    // Each rank's block, reduced but not yet finalized.
    let raw: Vec<Vec<u8>> = (0..world)
        .map(|r| {
            let parts: Vec<&[u8]> = inputs.iter().map(|i| &i[block(r, blk)]).collect();
            fold(dtype, op, blk, &parts)
        })
        .collect();
    let bufs = (0..world)
        .map(|r| {
            if placing.in_place(r) {
                RankBuffers::new(inputs[r].clone(), Vec::new())
            } else {
                RankBuffers::new(complement(&raw[r]), inputs[r].clone())
            }
        })
        .collect();
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
    assert_capped(&out, c, dtype, &what);
    for (r, b) in out.ranks.iter().enumerate() {
        let got = if placing.in_place(r) {
            // The other blocks keep this rank's input.
            let mut rest = b.data.clone();
            let mine: Vec<u8> = rest.drain(block(r, blk)).collect();
            let mut own = inputs[r].clone();
            own.drain(block(r, blk));
            assert!(rest == own, "{what}: rank {r}'s other blocks changed");
            mine
        } else {
            assert!(b.input == inputs[r], "{what}: rank {r}'s input changed");
            b.data.clone()
        };
        let expect = finalized(dtype, op, &raw[r], world);
        assert!(
            finalized(dtype, op, &got, world) == expect,
            "{what}: rank {r} ends wrong"
        );
    }
}

pub fn check_gather(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_gather_cfg(world, count, dtype, root, &cfg(alg), seed);
}

pub fn check_gather_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) {
    let alg = c.algorithm;
    let what =
        format!("gather {alg:?} world {world} count {count} {dtype:?} root {root} seed {seed}");
    let blk = count * dtype.size();
    let mut rng = case_rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world).map(|_| garbage(&mut rng, blk)).collect();
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
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| gather(r, world, count, dtype, root, c),
        bufs,
        alg.map(Algorithm::name),
    );
    assert_capped(&out, c, dtype, &what);
    assert!(
        out.ranks[root].data == expect,
        "{what}: the root ends wrong"
    );
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(b.input == inputs[r], "{what}: rank {r}'s input changed");
    }
}

pub fn check_scatter(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    alg: Option<Algorithm>,
    seed: u64,
) {
    check_scatter_cfg(world, count, dtype, root, &cfg(alg), seed);
}

pub fn check_scatter_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    root: usize,
    c: &CollectiveConfig,
    seed: u64,
) {
    let alg = c.algorithm;
    let what =
        format!("scatter {alg:?} world {world} count {count} {dtype:?} root {root} seed {seed}");
    let blk = count * dtype.size();
    let mut rng = case_rng(seed, world, count);
    let all = garbage(&mut rng, blk * world);
    let bufs = (0..world)
        .map(|r| {
            let input = if r == root { all.clone() } else { Vec::new() };
            RankBuffers::new(complement(&all[block(r, blk)]), input)
        })
        .collect();
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| scatter(r, world, count, dtype, root, c),
        bufs,
        alg.map(Algorithm::name),
    );
    assert_capped(&out, c, dtype, &what);
    for (r, b) in out.ranks.iter().enumerate() {
        assert!(b.data == all[block(r, blk)], "{what}: rank {r} ends wrong");
    }
}

pub fn check_all_to_all(world: usize, count: usize, dtype: DataType, alg: Algorithm, seed: u64) {
    check_all_to_all_cfg(world, count, dtype, &cfg(Some(alg)), seed);
}

/// All-to-all with `c`, whose `algorithm` must be set.
pub fn check_all_to_all_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    c: &CollectiveConfig,
    seed: u64,
) {
    let alg = c.algorithm.expect("an all-to-all algorithm");
    let what = format!("all_to_all {alg} world {world} count {count} {dtype:?} seed {seed}");
    let blk = count * dtype.size();
    let mut rng = case_rng(seed, world, count);
    let inputs: Vec<Vec<u8>> = (0..world).map(|_| garbage(&mut rng, blk * world)).collect();
    let expect: Vec<Vec<u8>> = (0..world)
        .map(|j| {
            inputs
                .iter()
                .flat_map(|i| i[block(j, blk)].to_vec())
                .collect()
        })
        .collect();
    let bufs = (0..world)
        .map(|r| RankBuffers::new(complement(&expect[r]), inputs[r].clone()))
        .collect();
    let out = run(
        seed,
        dtype,
        ReduceOp::Sum,
        world,
        |r| all_to_all(r, world, count, dtype, c),
        bufs,
        Some(alg.name()),
    );
    assert_capped(&out, c, dtype, &what);
    for (j, b) in out.ranks.iter().enumerate() {
        assert!(b.data == expect[j], "{what}: rank {j} ends wrong");
    }
}

pub fn check_scan(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    exclusive: bool,
    seed: u64,
) {
    check_scan_cfg(world, count, dtype, op, exclusive, &cfg(None), seed);
}

pub fn check_scan_cfg(
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    exclusive: bool,
    c: &CollectiveConfig,
    seed: u64,
) {
    let what = format!(
        "scan exclusive={exclusive} world {world} count {count} {dtype:?} {op:?} seed {seed}"
    );
    let inputs = rank_values(seed, world, count, dtype, op);
    let bufs = in_place(&inputs);
    let out = run(
        seed,
        dtype,
        op,
        world,
        |r| scan(r, world, count, dtype, op, exclusive, c),
        bufs,
        Some("rd"),
    );
    assert_capped(&out, c, dtype, &what);
    for (r, b) in out.ranks.iter().enumerate() {
        let upto = if exclusive { r } else { r + 1 };
        let parts: Vec<&[u8]> = inputs[..upto].iter().map(Vec::as_slice).collect();
        let expect = fold(dtype, op, count * dtype.size(), &parts);
        assert!(b.data == expect, "{what}: rank {r} ends wrong");
    }
}

/// Each rank's input for a reduction of `count` elements: integer values whose sums stay
/// exact in `dtype` (see [`values`]), drawn for this case.
pub fn rank_values(
    seed: u64,
    world: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Vec<Vec<u8>> {
    let mut rng = case_rng(seed, world, count);
    (0..world)
        .map(|r| values(&mut rng, dtype, op, r, count))
        .collect()
}

/// Buffers for an in-place collective: each rank's data is its input.
pub fn in_place(inputs: &[Vec<u8>]) -> Vec<RankBuffers> {
    inputs
        .iter()
        .map(|d| RankBuffers::new(d.clone(), Vec::new()))
        .collect()
}
