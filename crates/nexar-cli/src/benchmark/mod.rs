//! `nexar bench`: nccl-tests style measurements of every collective and of the transport.
//!
//! Every rank runs the same loop ([`run_bench_rank`]); [`run_bench`] runs it on all ranks
//! of an in-process cluster. Per operation and size, each rank allocates its buffers once,
//! runs `warmup` untimed calls, then `iters` timed calls, each started together after a
//! barrier and timed on every rank; a call's time is the slowest rank's, and a row reports
//! the median (and min and max) over the calls. Then, outside the timing and the CPU
//! window, the inputs are restored and one more call is made, untimed, whose result is
//! checked on every rank.
//!
//! Around the timed loop each process also reads its CPU time, minor page faults and peak
//! resident memory (see `probe`), and each rank counts the payload bytes its schedule
//! sends (see `plan`), so a row says what moving the bytes cost, not only how fast.

mod case;
mod options;
mod plan;
mod probe;

use std::time::Instant;

use nexar_actors::{Communicator, NexarError};
use nexar_device::{DataType, ReduceOp};

pub(crate) use case::BenchElem;
use case::{Case, Forms};
use probe::Counters;

pub use options::{parse_dtype, parse_ops, parse_size, sizes, BenchOp, BenchOptions};

/// One row of the table: one operation at one size, as rank 0 reports it for the world.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct BenchRow {
    /// The operation.
    pub op: BenchOp,
    /// Size in bytes (see [`BenchOp`] for what it counts); per message for p2p.
    pub bytes: usize,
    /// Elements of `dtype` in `bytes`.
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// Ranks in the communicator.
    pub world: usize,
    /// Distinct processes the ranks live in whose CPU the row counts: all of them, but
    /// for p2p and pingpong only those of ranks 0 and 1 (the others only wait).
    pub processes: usize,
    /// The algorithm the schedule chose (`"ring"`, `"rhd"`, ...; `"stream"` for p2p).
    pub algorithm: &'static str,
    /// Timed calls.
    pub iters: usize,
    /// Median over the calls of the slowest rank's time, in microseconds (per message for
    /// p2p, half the round trip for pingpong).
    pub time_us: f64,
    /// Fastest call, same units.
    pub min_us: f64,
    /// Slowest call, same units.
    pub max_us: f64,
    /// `bytes / time_us`, in GB/s (10^9 bytes per second).
    pub algbw_gbps: f64,
    /// `algbw_gbps` times nccl-tests' factor ([`BenchOp::bus_factor`]).
    pub busbw_gbps: f64,
    /// Whether the result was right on every rank (checked on one more call after the timed
    /// ones, from restored inputs).
    pub ok: bool,
    /// Why not, when this rank's result was wrong (other ranks print theirs to stderr).
    pub error: Option<String>,
    /// CPU seconds per call, summed over the processes: every thread, from before the
    /// first timed call to after the last, less [`Self::barrier_cpu_s`].
    pub cpu_s: Option<f64>,
    /// CPU seconds per call of the barrier that starts each call, measured alone right
    /// after the timed loop (as many barriers, back to back) and taken off `cpu_s`: it is
    /// the bench's, not the operation's. Back-to-back barriers wait less than one after a
    /// call, where ranks arrive apart, so this is if anything too small.
    pub barrier_cpu_s: Option<f64>,
    /// Payload bytes all ranks together sent per call, from the schedule.
    pub wire_bytes: u64,
    /// `cpu_s` per 10^9 `wire_bytes`.
    pub cpu_s_per_gb: Option<f64>,
    /// `wire_bytes x c / cpu_s`, where c ([`Self::c_s_per_gb`]) is the transport's CPU
    /// seconds per GB; 1.0 means as cheap per byte as raw transport.
    pub efficiency: Option<f64>,
    /// The c [`Self::efficiency`] used: `--cpu-per-gb` if given; else, for a row of 1 MiB
    /// and more in a run with p2p, the mean of two p2p streams of 4 MiB messages measured
    /// right before and right after the row (so a VM whose speed drifts during the run
    /// moves both sides alike); else the run's best p2p row of 1 MiB and more.
    pub c_s_per_gb: Option<f64>,
    /// The same against this run's p2p row of the same size of the sweep (so with the
    /// same buffer footprint: moving 64 MiB costs the transport more per byte than 1 MiB,
    /// which stays in cache), also where this row's `bytes` are below it, rounded down to
    /// whole blocks (see [`BenchOp`]); `None` without one.
    pub efficiency_at_size: Option<f64>,
    /// Minor page faults per call, summed over the processes.
    pub minflt_per_iter: Option<f64>,
    /// The largest peak resident memory (VmHWM) of a process during the row, in bytes.
    pub peak_rss_bytes: Option<u64>,
    /// Bytes of benchmark buffers in that process.
    pub user_bytes: u64,
    /// That process's peak growth over its resident memory before the buffers were
    /// allocated, divided by its buffer bytes (1.0: nothing beyond the buffers); `None`
    /// under 1 MiB of buffers, where page granularity and the runtime's churn dominate.
    pub mem_ratio: Option<f64>,
}

/// Runs every operation and size of `opts` on this rank; every rank of `comm` must call it
/// with the same options. Returns the rows (the same on every rank) and calls `on_row` as
/// each is done. A wrong result is a row with `ok == false`; `Err` means the options are
/// out of range or would measure nothing ([`BenchOptions::check`], on every rank before
/// anything runs: `InvalidArgument`), that a rank could not allocate a row's buffers
/// (`InvalidArgument` on every rank, where the allocation would have aborted the process),
/// or that an operation failed (a peer lost, a timeout), after which the ranks are out of
/// step.
pub async fn run_bench_rank(
    comm: &Communicator,
    opts: &BenchOptions,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, NexarError> {
    opts.check(comm.world_size())
        .map_err(NexarError::InvalidArgument)?;
    let mut rows = Vec::new();
    let mut yardstick = Yardstick::new(opts.cpu_per_gb, opts.ops.contains(&BenchOp::P2p));
    for &op in &opts.ops {
        let sizes = if op == BenchOp::Barrier {
            vec![0]
        } else {
            opts.sizes()
        };
        for bytes in sizes {
            let bracket = yardstick.brackets(op, bytes);
            let before = p2p_now(comm, opts, bracket).await?;
            let Some(mut row) = measure_any(comm, op, bytes, opts).await? else {
                continue;
            };
            let after = p2p_now(comm, opts, bracket).await?;
            fail_on_bad_bracket(&mut row, &[&before, &after]);
            let cost = |b: Option<BenchRow>| b.and_then(|r| r.cpu_s_per_gb).filter(|c| *c > 0.0);
            yardstick.rate(&mut row, bytes, mean_of(cost(before), cost(after)));
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Collective rows of at least this size (the efficiency target's) are bracketed by p2p
/// streams (see [`BenchRow::c_s_per_gb`]).
const BRACKET_BYTES: usize = 1 << 20;

/// Message size of the bracketing p2p streams: the size whose stream is cheapest per byte
/// here (session 44's tables: 4 MiB, 4-13% cheaper than 1 MiB in each of the six), so
/// that c is the transport's best, not a dearer stream that flatters the efficiency.
/// (Until session 47 the streams sent 1 MiB messages, which cost 1.01-1.20x the run's
/// best.)
const BRACKET_STREAM_BYTES: usize = 4 << 20;

/// The transport's CPU cost per GB that collective rows are held against: measured around
/// each row of [`BRACKET_BYTES`] and more, and learnt from the run's p2p rows (which run
/// first) for the rest and for the same-size figure.
#[derive(Debug, Default)]
struct Yardstick {
    /// `--cpu-per-gb`, which overrides the measured c.
    fixed: Option<f64>,
    /// Whether p2p runs in this run, so that collective rows are bracketed.
    bracketing: bool,
    /// The lowest p2p CPU s/GB at 1 MiB and more.
    best: Option<f64>,
    /// p2p CPU s/GB by the size of the sweep the row was run at (which the row's own size
    /// may be below: see [`Self::rate`]).
    by_size: std::collections::HashMap<usize, f64>,
}

impl Yardstick {
    fn new(fixed: Option<f64>, bracketing: bool) -> Yardstick {
        Yardstick {
            fixed,
            bracketing,
            ..Yardstick::default()
        }
    }

    /// Whether the row of `op` at `bytes` gets p2p streams measured right before and after
    /// it (the same answer on every rank, as the options are the same).
    fn brackets(&self, op: BenchOp, bytes: usize) -> bool {
        self.bracketing
            && self.fixed.is_none()
            && !op.is_pair()
            && op != BenchOp::Barrier
            && bytes >= BRACKET_BYTES
    }

    /// Learns from a p2p row; fills in a collective row's efficiencies, against `adjacent`
    /// (the p2p cost measured around it) where there is one. `swept` is the size of the
    /// sweep the row was run at: rows are matched by it, not by their own size, which
    /// all_gather and the other ops in blocks round down to a multiple of the world's
    /// elements (4092 bytes of f32 on 3 ranks for 4096).
    fn rate(&mut self, row: &mut BenchRow, swept: usize, adjacent: Option<f64>) {
        let cost = row.cpu_s_per_gb.filter(|c| *c > 0.0);
        if row.op == BenchOp::P2p {
            if let Some(c) = cost {
                self.by_size.insert(swept, c);
                if row.bytes >= 1 << 20 {
                    self.best = Some(self.best.map_or(c, |b| b.min(c)));
                }
            }
            return;
        }
        if row.wire_bytes == 0 || row.op.is_pair() {
            return;
        }
        // The row's c, also where its CPU could not be told apart from its barriers' (a
        // few short calls): then it has no efficiency.
        row.c_s_per_gb = self.fixed.or(adjacent).or(self.best);
        let Some(cpu) = row.cpu_s.filter(|c| *c > 0.0) else {
            return;
        };
        let gb = row.wire_bytes as f64 / 1e9;
        row.efficiency = row.c_s_per_gb.map(|c| gb * c / cpu);
        row.efficiency_at_size = self.by_size.get(&swept).map(|c| gb * c / cpu);
    }
}

/// The p2p stream of [`BRACKET_STREAM_BYTES`] messages, measured now on every rank when `wanted`
/// (`None` otherwise, or on a single rank); its CPU seconds per GB set the row's c.
async fn p2p_now(
    comm: &Communicator,
    opts: &BenchOptions,
    wanted: bool,
) -> Result<Option<BenchRow>, NexarError> {
    if !wanted {
        return Ok(None);
    }
    measure_any(comm, BenchOp::P2p, BRACKET_STREAM_BYTES, opts).await
}

/// A row whose bracketing p2p streams got a wrong result fails too: the run's exit code
/// then says so, and its c came from a broken stream.
fn fail_on_bad_bracket(row: &mut BenchRow, brackets: &[&Option<BenchRow>]) {
    let bad = brackets.iter().filter_map(|b| b.as_ref()).find(|b| !b.ok);
    if let Some(bad) = bad {
        row.ok = false;
        row.error.get_or_insert_with(|| {
            let why = bad.error.as_deref().unwrap_or("a wrong result");
            format!("the p2p stream measured around this row failed its check: {why}")
        });
    }
}

/// The mean of the readings there are.
fn mean_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some((a + b) / 2.0),
        (a, b) => a.or(b),
    }
}

/// Runs [`run_bench_rank`] on every communicator of an in-process cluster at once and
/// returns rank 0's rows; `on_row` gets each row as rank 0 finishes it. `Err` says why the
/// options were refused ([`BenchOptions::check`], before anything runs), or names the
/// first rank whose operation failed.
pub async fn run_bench(
    comms: Vec<Communicator>,
    opts: &BenchOptions,
    on_row: impl FnMut(&BenchRow) + Send + 'static,
) -> Result<Vec<BenchRow>, String> {
    if let Some(comm) = comms.first() {
        opts.check(comm.world_size())?;
    }
    let mut tasks = tokio::task::JoinSet::new();
    let mut on_row = Some(on_row);
    for comm in comms {
        let opts = opts.clone();
        let rank = comm.rank();
        if rank == 0 {
            let Some(mut report) = on_row.take() else {
                continue;
            };
            tasks.spawn(async move {
                let rows = run_bench_rank(&comm, &opts, |r| report(r)).await;
                (rank, rows)
            });
        } else {
            tasks.spawn(async move { (rank, run_bench_rank(&comm, &opts, |_| {}).await) });
        }
    }
    let mut out = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((0, Ok(rows))) => out = rows,
            Ok((_, Ok(_))) => {}
            // Dropping the set aborts the other ranks, which would only wait for a timeout.
            Ok((rank, Err(e))) => return Err(format!("rank {rank}: {e}")),
            Err(e) => return Err(format!("a rank's task failed: {e}")),
        }
    }
    Ok(out)
}

/// [`measure`] for the element type of `opts.dtype`.
async fn measure_any(
    comm: &Communicator,
    op: BenchOp,
    bytes: usize,
    opts: &BenchOptions,
) -> Result<Option<BenchRow>, NexarError> {
    use half::{bf16, f16};
    match opts.dtype {
        DataType::F32 => measure::<f32>(comm, op, bytes, opts).await,
        DataType::F64 => measure::<f64>(comm, op, bytes, opts).await,
        DataType::F16 => measure::<f16>(comm, op, bytes, opts).await,
        DataType::BF16 => measure::<bf16>(comm, op, bytes, opts).await,
        DataType::I8 => measure::<i8>(comm, op, bytes, opts).await,
        DataType::I32 => measure::<i32>(comm, op, bytes, opts).await,
        DataType::I64 => measure::<i64>(comm, op, bytes, opts).await,
        DataType::U8 => measure::<u8>(comm, op, bytes, opts).await,
        DataType::U32 => measure::<u32>(comm, op, bytes, opts).await,
        DataType::U64 => measure::<u64>(comm, op, bytes, opts).await,
    }
}

/// Buffers smaller than this (per process) get no memory ratio.
const MEM_RATIO_MIN_BYTES: u64 = 1 << 20;

/// Marks a missing reading in the exchanged statistics.
const NONE: u64 = u64::MAX;

/// This process among the ranks' readings: a number drawn at random once per process.
/// Process ids would do on one host, but repeat across hosts (the first process of every
/// container is 1), and ranks of different processes counted as one would add up to one
/// process's CPU time.
fn process_token() -> u64 {
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        // `RandomState`'s keys come from the operating system's randomness.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    })
}

/// What each rank contributes to a row, exchanged with one all_gather.
#[derive(Clone, Copy, Debug)]
struct RankStats {
    /// The rank's process, as [`process_token`] names it.
    pid: u64,
    cpu_ns: u64,
    barrier_cpu_ns: u64,
    minflt: u64,
    peak: u64,
    base: u64,
    user_bytes: u64,
    ok: u64,
    wire_bytes: u64,
}

impl RankStats {
    const LEN: usize = 9;

    fn encode(&self) -> [u64; Self::LEN] {
        [
            self.pid,
            self.cpu_ns,
            self.barrier_cpu_ns,
            self.minflt,
            self.peak,
            self.base,
            self.user_bytes,
            self.ok,
            self.wire_bytes,
        ]
    }

    fn decode(w: &[u64]) -> RankStats {
        RankStats {
            pid: w[0],
            cpu_ns: w[1],
            barrier_cpu_ns: w[2],
            minflt: w[3],
            peak: w[4],
            base: w[5],
            user_bytes: w[6],
            ok: w[7],
            wire_bytes: w[8],
        }
    }
}

/// Measures one (op, size) on this rank; `None` when the size leaves nothing to move for
/// this op (the same on every rank).
async fn measure<T: BenchElem>(
    comm: &Communicator,
    op: BenchOp,
    bytes: usize,
    opts: &BenchOptions,
) -> Result<Option<BenchRow>, NexarError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    // Every rank of a process resets the peak before any of them allocates.
    comm.barrier().await?;
    let reset = probe::reset_peak();
    let base = probe::rss();
    comm.barrier().await?;
    let forms = Forms {
        zero_copy: opts.zero_copy,
        in_place: opts.in_place,
    };
    let case = match Case::<T>::new(op, bytes, rank, world, forms) {
        Ok(None) => return Ok(None),
        made => made,
    };
    // A rank that could not allocate its buffers says so, and every rank stops with it
    // (rather than the others waiting for it in the first call).
    let mut short = [u64::from(case.is_err())];
    comm.all_reduce(&mut short, ReduceOp::Max).await?;
    let mut case = match case {
        Err(e) => return Err(NexarError::InvalidArgument(e)),
        Ok(Some(case)) if short[0] == 0 => case,
        Ok(_) => {
            return Err(NexarError::InvalidArgument(format!(
                "{op} at {bytes} bytes: another rank could not allocate its \
                 buffers"
            )))
        }
    };
    let plan = plan::plan(
        op,
        rank,
        world,
        case.count(),
        T::DTYPE,
        case.burst(),
        &opts.collectives,
    )
    .map_err(NexarError::InvalidArgument)?;
    for _ in 0..opts.warmup {
        comm.barrier().await?;
        case.run(comm).await?;
    }
    let mut times = Vec::with_capacity(opts.iters);
    comm.barrier().await?;
    let before = Counters::now();
    for _ in 0..opts.iters {
        comm.barrier().await?;
        let start = Instant::now();
        case.run(comm).await?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    comm.barrier().await?;
    let spent = before.until(Counters::now());
    let peak = peak_since_reset(reset, probe::peak_rss());
    // The window above held `iters + 1` barriers: one before each call and one after.
    let barriers = barrier_cpu_ns(comm, opts.iters + 1).await?;
    // The check: one more call from restored inputs (the timed calls ran on what the
    // calls before them left), outside the window, as restoring them costs each rank a
    // pass over its buffers that is the bench's, not the operation's.
    case.reset().await;
    comm.barrier().await?;
    case.run(comm).await?;
    let checked = case.verify();
    if let Err(e) = &checked {
        crate::say!("check failed: {e}");
    }

    let mut all_times = vec![0f64; opts.iters * world];
    comm.all_gather(&times, &mut all_times).await?;
    let mine = RankStats {
        pid: process_token(),
        cpu_ns: spent.cpu_ns.unwrap_or(NONE),
        barrier_cpu_ns: barriers.unwrap_or(NONE),
        minflt: spent.minflt.unwrap_or(NONE),
        peak: peak.unwrap_or(NONE),
        base: base.unwrap_or(NONE),
        user_bytes: case.user_bytes() as u64,
        ok: u64::from(checked.is_ok()),
        wire_bytes: plan.wire_bytes,
    };
    let mut all_stats = vec![0u64; RankStats::LEN * world];
    comm.all_gather(&mine.encode(), &mut all_stats).await?;
    let stats: Vec<RankStats> = all_stats
        .chunks_exact(RankStats::LEN)
        .map(RankStats::decode)
        .collect();

    // A call's time is the slowest rank's; units per message (p2p) or one way (pingpong).
    let per = match op {
        BenchOp::P2p => case.burst() as f64,
        BenchOp::PingPong => 2.0,
        _ => 1.0,
    };
    let mut per_call: Vec<f64> = (0..opts.iters)
        .map(|i| {
            (0..world)
                .map(|r| all_times[r * opts.iters + i])
                .fold(0.0, f64::max)
                / per
        })
        .collect();
    per_call.sort_by(f64::total_cmp);
    let time_us = median(&per_call);
    let size = case.bytes();
    let algbw = if time_us > 0.0 {
        size as f64 / (time_us * 1e-6) / 1e9
    } else {
        0.0
    };
    let process = process_totals(&taking_part(op, &stats));
    let iters = opts.iters as f64;
    let wire_bytes: u64 = stats.iter().map(|s| s.wire_bytes).sum();
    let barrier_cpu_s = process.barrier_cpu_ns.map(|ns| ns as f64 / 1e9 / iters);
    let cpu_s = cpu_per_call(process.cpu_ns, process.barrier_cpu_ns, iters);
    let cpu_s_per_gb = cpu_s.filter(|_| wire_bytes > 0).map(|cpu| {
        // The p2p loop streams `burst` messages per call: CPU per call over bytes per call.
        cpu / (wire_bytes as f64 / 1e9)
    });
    Ok(Some(BenchRow {
        op,
        bytes: size,
        count: case.count(),
        dtype: T::DTYPE,
        world,
        processes: process.count,
        algorithm: plan.algorithm,
        iters: opts.iters,
        time_us,
        min_us: per_call.first().copied().unwrap_or(0.0),
        max_us: per_call.last().copied().unwrap_or(0.0),
        algbw_gbps: algbw,
        busbw_gbps: algbw * op.bus_factor(world),
        ok: stats.iter().all(|s| s.ok == 1),
        error: checked.err(),
        cpu_s,
        barrier_cpu_s,
        wire_bytes,
        cpu_s_per_gb,
        efficiency: None,
        c_s_per_gb: None,
        efficiency_at_size: None,
        minflt_per_iter: process.minflt.map(|f| f as f64 / iters),
        peak_rss_bytes: process.peak,
        user_bytes: process.user_bytes,
        mem_ratio: process.mem_ratio,
    }))
}

/// The peak resident memory read after the loop, if `reset` (the peak was reset before
/// the buffers were allocated): else VmHWM still holds the process's lifetime peak, which
/// says nothing about this row, and the row reports no peak and no memory ratio.
fn peak_since_reset(reset: bool, peak: Option<u64>) -> Option<u64> {
    peak.filter(|_| reset)
}

/// CPU seconds per call of a timed loop of `iters` calls that took `loop_ns`, less the
/// `barrier_ns` its barriers took alone (never below zero).
fn cpu_per_call(loop_ns: Option<u64>, barrier_ns: Option<u64>, iters: f64) -> Option<f64> {
    let (all, barriers) = (loop_ns?, barrier_ns?);
    Some(all.saturating_sub(barriers) as f64 / 1e9 / iters)
}

/// CPU nanoseconds of this process over `n` barriers back to back (after one more, so all
/// ranks start together).
async fn barrier_cpu_ns(comm: &Communicator, n: usize) -> Result<Option<u64>, NexarError> {
    comm.barrier().await?;
    let before = Counters::now();
    for _ in 0..n {
        comm.barrier().await?;
    }
    Ok(before.until(Counters::now()).cpu_ns)
}

/// The median of sorted values (the lower one of the middle two).
fn median(sorted: &[f64]) -> f64 {
    sorted
        .get((sorted.len().max(1) - 1) / 2)
        .copied()
        .unwrap_or(0.0)
}

/// Per-process readings folded over the processes.
#[derive(Debug, Default, PartialEq)]
struct ProcessTotals {
    count: usize,
    cpu_ns: Option<u64>,
    barrier_cpu_ns: Option<u64>,
    minflt: Option<u64>,
    peak: Option<u64>,
    user_bytes: u64,
    mem_ratio: Option<f64>,
}

/// The readings of the processes that take part in `op`: for p2p and pingpong, those of
/// ranks 0 and 1 (with every rank they hold), since the others only wait in the next
/// barrier meanwhile, polling on a one-thread runtime (their CPU is not the transport's);
/// for every other op, all. Ranks sharing a process with rank 0 or 1 cannot be told apart
/// from it: in one process, every rank counts.
fn taking_part(op: BenchOp, stats: &[RankStats]) -> Vec<RankStats> {
    let pair: Vec<u64> = match op {
        BenchOp::P2p | BenchOp::PingPong => stats.iter().take(2).map(|s| s.pid).collect(),
        _ => return stats.to_vec(),
    };
    stats
        .iter()
        .filter(|s| pair.contains(&s.pid))
        .copied()
        .collect()
}

/// Ranks in one process read the same process-wide counters over nearly the same window:
/// take each process's largest reading once, and add the processes up. Memory is reported
/// for the process that grew most relative to its buffers.
fn process_totals(stats: &[RankStats]) -> ProcessTotals {
    let mut pids: Vec<u64> = stats.iter().map(|s| s.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let known = |v: u64| (v != NONE).then_some(v);
    let mut t = ProcessTotals {
        count: pids.len(),
        cpu_ns: Some(0),
        barrier_cpu_ns: Some(0),
        minflt: Some(0),
        ..ProcessTotals::default()
    };
    for pid in pids {
        let ranks: Vec<&RankStats> = stats.iter().filter(|s| s.pid == pid).collect();
        let max_of = |f: fn(&RankStats) -> u64| -> Option<u64> {
            ranks.iter().map(|s| known(f(s))).max().flatten()
        };
        t.cpu_ns = t.cpu_ns.zip(max_of(|s| s.cpu_ns)).map(|(a, b)| a + b);
        t.barrier_cpu_ns = t
            .barrier_cpu_ns
            .zip(max_of(|s| s.barrier_cpu_ns))
            .map(|(a, b)| a + b);
        t.minflt = t.minflt.zip(max_of(|s| s.minflt)).map(|(a, b)| a + b);
        let user: u64 = ranks.iter().map(|s| s.user_bytes).sum();
        let base = ranks.iter().filter_map(|s| known(s.base)).min();
        let peak = max_of(|s| s.peak);
        // Below a few MiB of buffers, page granularity and the runtime's own churn drown
        // the ratio.
        let ratio = match (peak, base) {
            (Some(p), Some(b)) if user >= MEM_RATIO_MIN_BYTES => {
                Some(p.saturating_sub(b) as f64 / user as f64)
            }
            _ => None,
        };
        if t.mem_ratio.is_none() || ratio > t.mem_ratio {
            t.mem_ratio = ratio;
            t.peak = peak;
            t.user_bytes = user;
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(pid: u64, cpu_ns: u64, peak: u64, base: u64, user: u64) -> RankStats {
        RankStats {
            pid,
            cpu_ns,
            barrier_cpu_ns: if cpu_ns == NONE { NONE } else { cpu_ns / 10 },
            minflt: 10,
            peak,
            base,
            user_bytes: user,
            ok: 1,
            wire_bytes: 0,
        }
    }

    #[test]
    fn ranks_of_one_process_count_once() {
        let t = process_totals(&[
            stats(7, 100, 300 << 20, 100 << 20, 100 << 20),
            stats(7, 120, 310 << 20, 90 << 20, 100 << 20),
            stats(9, 50, 200 << 20, 100 << 20, 100 << 20),
        ]);
        assert_eq!(t.count, 2);
        assert_eq!(t.cpu_ns, Some(170));
        assert_eq!(t.barrier_cpu_ns, Some(12 + 5));
        assert_eq!(t.minflt, Some(20));
        // pid 7: (310 - 90) / 200 = 1.1; pid 9: 100 / 100 = 1.0.
        assert_eq!(
            (t.peak, t.user_bytes, t.mem_ratio),
            (Some(310 << 20), 200 << 20, Some(1.1))
        );
    }

    /// A p2p or pingpong row counts the processes of ranks 0 and 1 alone (the others
    /// only wait meanwhile); every other op counts all of them.
    #[test]
    fn pair_ops_count_only_the_pairs_processes() {
        let four = [
            stats(1, 100, 0, 0, 0),
            stats(2, 100, 0, 0, 0),
            stats(3, 40, 0, 0, 0),
            stats(4, 40, 0, 0, 0),
        ];
        for (op, cpu, count) in [
            (BenchOp::P2p, 200, 2),
            (BenchOp::PingPong, 200, 2),
            (BenchOp::AllReduce, 280, 4),
            (BenchOp::SendRecv, 280, 4),
        ] {
            let t = process_totals(&taking_part(op, &four));
            assert_eq!((t.cpu_ns, t.count), (Some(cpu), count), "{op}");
        }
        // Ranks 0 and 2 in one process, 1 and 3 in another: both processes count.
        let two = [
            stats(1, 100, 0, 0, 0),
            stats(2, 90, 0, 0, 0),
            stats(1, 100, 0, 0, 0),
            stats(2, 90, 0, 0, 0),
        ];
        let t = process_totals(&taking_part(BenchOp::P2p, &two));
        assert_eq!((t.cpu_ns, t.count), (Some(190), 2));
    }

    #[test]
    fn missing_readings_stay_missing() {
        let t = process_totals(&[stats(7, NONE, NONE, NONE, 100)]);
        assert_eq!(
            (t.cpu_ns, t.barrier_cpu_ns, t.mem_ratio),
            (None, None, None)
        );
        assert_eq!(cpu_per_call(t.cpu_ns, Some(5), 2.0), None);
    }

    #[test]
    fn calls_are_charged_without_their_barriers() {
        let close = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() < 1e-12);
        // 10 calls in 3 ms, 1 ms of it barriers: 0.2 ms per call.
        assert!(close(
            cpu_per_call(Some(3_000_000), Some(1_000_000), 10.0),
            2e-4
        ));
        // Barriers measured alone that came out dearer than the whole loop: nothing left.
        assert!(close(cpu_per_call(Some(1_000), Some(2_000), 10.0), 0.0));
        assert_eq!(cpu_per_call(Some(1_000), None, 10.0), None);
    }

    fn row(op: BenchOp, bytes: usize, cpu_s: f64, wire_bytes: u64) -> BenchRow {
        BenchRow {
            op,
            bytes,
            count: bytes / 4,
            dtype: DataType::F32,
            world: 4,
            processes: 1,
            algorithm: "ring",
            iters: 1,
            time_us: 1.0,
            min_us: 1.0,
            max_us: 1.0,
            algbw_gbps: 1.0,
            busbw_gbps: 1.0,
            ok: true,
            error: None,
            cpu_s: Some(cpu_s),
            barrier_cpu_s: None,
            wire_bytes,
            cpu_s_per_gb: Some(cpu_s / (wire_bytes as f64 / 1e9)),
            efficiency: None,
            c_s_per_gb: None,
            efficiency_at_size: None,
            minflt_per_iter: None,
            peak_rss_bytes: None,
            user_bytes: 0,
            mem_ratio: None,
        }
    }

    /// A row fails when a p2p stream measured around it got a wrong result (it used to
    /// pass, with its c taken from the broken stream, and the run exited 0).
    #[test]
    fn a_row_fails_with_the_p2p_stream_around_it() {
        let stream = |ok: bool| {
            let mut r = row(BenchOp::P2p, 1 << 20, 0.5, 1_000_000_000);
            r.ok = ok;
            Some(r)
        };
        let mut fine = row(BenchOp::AllReduce, 4 << 20, 1.0, 1_000_000_000);
        fail_on_bad_bracket(&mut fine, &[&stream(true), &None]);
        assert!(fine.ok && fine.error.is_none(), "{fine:?}");
        for brackets in [[&stream(false), &stream(true)], [&None, &stream(false)]] {
            let mut r = row(BenchOp::AllReduce, 4 << 20, 1.0, 1_000_000_000);
            fail_on_bad_bracket(&mut r, &brackets);
            assert!(!r.ok, "{r:?}");
            assert!(
                r.error.as_deref().is_some_and(|e| e.contains("p2p stream")),
                "{r:?}"
            );
        }
    }

    #[test]
    fn collectives_are_held_against_the_best_p2p_and_the_same_size() {
        let mut y = Yardstick::new(None, false);
        // p2p: 0.5 s/GB at 256 KiB (too small to be the best), 0.6 at 1 MiB, 0.9 at 64 MiB.
        for (bytes, cpu) in [(256 << 10, 0.5), (1 << 20, 0.6), (64 << 20, 0.9)] {
            let mut p = row(BenchOp::P2p, bytes, cpu, 1_000_000_000);
            y.rate(&mut p, bytes, None);
            assert_eq!((p.efficiency, p.efficiency_at_size), (None, None));
        }
        // A collective moving 2 GB per call for 1.5 CPU-s: 1.2 s of p2p at the best c,
        // 1.8 s at the 64 MiB p2p's.
        let mut ar = row(BenchOp::AllReduce, 64 << 20, 1.5, 2_000_000_000);
        y.rate(&mut ar, 64 << 20, None);
        let close = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() < 1e-9);
        assert!(close(ar.efficiency, 0.8), "{:?}", ar.efficiency);
        assert!(close(ar.c_s_per_gb, 0.6), "{:?}", ar.c_s_per_gb);
        assert!(
            close(ar.efficiency_at_size, 1.2),
            "{:?}",
            ar.efficiency_at_size
        );
        // No p2p row of 4 MiB: no same-size figure.
        let mut ag = row(BenchOp::AllGather, 4 << 20, 1.0, 1_000_000_000);
        y.rate(&mut ag, 4 << 20, None);
        assert!(close(ag.efficiency, 0.6));
        assert_eq!(ag.efficiency_at_size, None);
        // A p2p cost measured around the row replaces the best, not the same-size one.
        let mut bracketed = row(BenchOp::AllReduce, 64 << 20, 1.5, 2_000_000_000);
        y.rate(&mut bracketed, 64 << 20, Some(0.75));
        assert!(
            close(bracketed.efficiency, 1.0),
            "{:?}",
            bracketed.efficiency
        );
        assert!(close(bracketed.c_s_per_gb, 0.75));
        assert!(close(bracketed.efficiency_at_size, 1.2));
        // --cpu-per-gb overrides both the best p2p and a bracketing one, not the same-size one.
        let mut fixed = Yardstick::new(Some(1.0), true);
        fixed.rate(
            &mut row(BenchOp::P2p, 4 << 20, 0.7, 1_000_000_000),
            4 << 20,
            None,
        );
        let mut rs = row(BenchOp::ReduceScatter, 4 << 20, 1.0, 1_000_000_000);
        fixed.rate(&mut rs, 4 << 20, Some(0.5));
        assert!(close(rs.efficiency, 1.0));
        assert!(close(rs.efficiency_at_size, 0.7));
        // Pair ops and rows without CPU readings get none.
        let mut pp = row(BenchOp::PingPong, 4 << 20, 1.0, 1_000_000_000);
        y.rate(&mut pp, 4 << 20, Some(0.5));
        assert_eq!((pp.efficiency, pp.efficiency_at_size), (None, None));
        let mut unread = row(BenchOp::AllReduce, 64 << 20, 1.0, 1_000_000_000);
        unread.cpu_s = None;
        y.rate(&mut unread, 64 << 20, None);
        assert_eq!((unread.efficiency, unread.efficiency_at_size), (None, None));
    }

    #[test]
    fn rows_in_blocks_find_the_p2p_row_of_their_sweep_size() {
        // On 3 ranks, all_gather's 4096 bytes of f32 round down to 1023 elements.
        let mut y = Yardstick::new(None, false);
        y.rate(&mut row(BenchOp::P2p, 4096, 0.5, 1_000_000_000), 4096, None);
        let mut ag = row(BenchOp::AllGather, 4092, 1.0, 1_000_000_000);
        ag.world = 3;
        y.rate(&mut ag, 4096, None);
        assert_eq!(ag.efficiency_at_size, Some(0.5));
    }

    #[test]
    fn a_peak_that_was_not_reset_is_no_reading() {
        assert_eq!(peak_since_reset(true, Some(300 << 20)), Some(300 << 20));
        assert_eq!(peak_since_reset(true, None), None);
        // VmHWM would be the process's lifetime peak: no peak, and so no ratio.
        let peak = peak_since_reset(false, Some(300 << 20)).unwrap_or(NONE);
        let t = process_totals(&[stats(7, 100, peak, 100 << 20, 100 << 20)]);
        assert_eq!((t.peak, t.mem_ratio), (None, None));
    }

    #[test]
    fn rows_from_one_mib_are_bracketed_when_p2p_runs() {
        let y = Yardstick::new(None, true);
        assert!(y.brackets(BenchOp::AllReduce, 1 << 20));
        assert!(y.brackets(BenchOp::SendRecv, 64 << 20));
        assert!(!y.brackets(BenchOp::AllReduce, (1 << 20) - 4));
        for op in [BenchOp::P2p, BenchOp::PingPong, BenchOp::Barrier] {
            assert!(!y.brackets(op, 4 << 20), "{op}");
        }
        assert!(!Yardstick::new(None, false).brackets(BenchOp::AllReduce, 4 << 20));
        assert!(!Yardstick::new(Some(1.0), true).brackets(BenchOp::AllReduce, 4 << 20));
        assert_eq!(mean_of(Some(1.0), Some(2.0)), Some(1.5));
        assert_eq!(mean_of(None, Some(2.0)), Some(2.0));
        assert_eq!(mean_of(None, None), None);
    }

    #[test]
    fn median_of_sorted() {
        assert_eq!(median(&[1.0, 2.0, 3.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.0);
        assert_eq!(median(&[]), 0.0);
    }
}
