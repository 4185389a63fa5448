//! What `nexar bench` measures: the operations, the size sweep and their parsing.

use nexar_actors::CollectiveConfig;
use nexar_device::DataType;

/// One benchmarked operation: a row of the table per size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BenchOp {
    /// `all_reduce` (sum); size = the in-place buffer.
    AllReduce,
    /// `broadcast` from rank 0; size = the buffer.
    Broadcast,
    /// `reduce` (sum) to rank 0; size = the buffer.
    Reduce,
    /// `all_gather`; size = the whole receive buffer (nccl-tests' convention).
    AllGather,
    /// `reduce_scatter` (sum); size = the whole send buffer.
    ReduceScatter,
    /// `all_to_all`; size = the send buffer (and the receive buffer).
    AllToAll,
    /// `gather` to rank 0; size = the root's whole receive buffer (as all_gather).
    Gather,
    /// `scatter` from rank 0; size = the root's whole send buffer (as reduce_scatter).
    Scatter,
    /// `barrier`; one row, size 0.
    Barrier,
    /// Every rank sends `size` bytes to rank + 1 and receives from rank - 1 at once.
    SendRecv,
    /// Rank 0 streams messages of `size` bytes to rank 1: the transport's throughput and
    /// CPU cost per byte, the ceiling for the collectives.
    P2p,
    /// Rank 0 and rank 1 bounce one message of `size` bytes; time = half the round trip.
    PingPong,
}

impl BenchOp {
    /// Every operation, in the order `--ops all` runs them.
    pub const ALL: [BenchOp; 12] = [
        BenchOp::P2p,
        BenchOp::PingPong,
        BenchOp::AllReduce,
        BenchOp::Broadcast,
        BenchOp::Reduce,
        BenchOp::AllGather,
        BenchOp::ReduceScatter,
        BenchOp::AllToAll,
        BenchOp::Gather,
        BenchOp::Scatter,
        BenchOp::Barrier,
        BenchOp::SendRecv,
    ];

    /// What runs when `--ops` is not given: the collectives and send/recv.
    pub const DEFAULT: [BenchOp; 10] = [
        BenchOp::AllReduce,
        BenchOp::Broadcast,
        BenchOp::Reduce,
        BenchOp::AllGather,
        BenchOp::ReduceScatter,
        BenchOp::AllToAll,
        BenchOp::Gather,
        BenchOp::Scatter,
        BenchOp::Barrier,
        BenchOp::SendRecv,
    ];

    /// The name used by `--ops` and in reports (`"all_reduce"`, `"p2p"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::AllToAll => "all_to_all",
            BenchOp::Gather => "gather",
            BenchOp::Scatter => "scatter",
            BenchOp::Barrier => "barrier",
            BenchOp::SendRecv => "sendrecv",
            BenchOp::P2p => "p2p",
            BenchOp::PingPong => "pingpong",
        }
    }

    /// Parses a [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<BenchOp> {
        BenchOp::ALL.into_iter().find(|op| op.name() == s)
    }

    /// nccl-tests' bus-bandwidth factor for `world` ranks: busbw = algbw x factor, so that
    /// busbw is comparable across world sizes and with the link speed. 0 for `barrier`.
    /// gather and scatter take all_gather's, as in nccl-tests: the root's link carries
    /// `(n - 1) / n` of the buffer.
    pub fn bus_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather
            | BenchOp::ReduceScatter
            | BenchOp::AllToAll
            | BenchOp::Gather
            | BenchOp::Scatter => (n - 1.0) / n,
            BenchOp::Broadcast
            | BenchOp::Reduce
            | BenchOp::SendRecv
            | BenchOp::P2p
            | BenchOp::PingPong => 1.0,
            BenchOp::Barrier => 0.0,
        }
    }

    /// The reduce op name for the report (`"sum"`), or `"none"`.
    pub const fn redop(self) -> &'static str {
        match self {
            BenchOp::AllReduce | BenchOp::Reduce | BenchOp::ReduceScatter => "sum",
            _ => "none",
        }
    }

    /// True for the operations whose buffer is one block per rank (all_gather,
    /// reduce_scatter, all_to_all, gather, scatter): their size is rounded down to a
    /// multiple of the world's elements.
    pub(crate) const fn has_blocks(self) -> bool {
        matches!(
            self,
            BenchOp::AllGather
                | BenchOp::ReduceScatter
                | BenchOp::AllToAll
                | BenchOp::Gather
                | BenchOp::Scatter
        )
    }

    /// True for the operations that only ranks 0 and 1 take part in.
    pub const fn is_pair(self) -> bool {
        matches!(self, BenchOp::P2p | BenchOp::PingPong)
    }
}

impl std::fmt::Display for BenchOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a `nexar bench` run measures. Every rank must use the same options.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct BenchOptions {
    /// Operations, in order (p2p and pingpong always run first, so their CPU cost per GB
    /// is known when the collectives' efficiency is computed).
    pub ops: Vec<BenchOp>,
    /// Smallest size in bytes (default 8; at most `max_bytes`).
    pub min_bytes: usize,
    /// Largest size in bytes (default 64 MiB).
    pub max_bytes: usize,
    /// Each size is the previous one times this (default 4; at least 2).
    pub step_factor: usize,
    /// Element type (default f32).
    pub dtype: DataType,
    /// Timed iterations per row (default 20; 1 to [`Self::MAX_ITERS`]).
    pub iters: usize,
    /// Untimed iterations before them (default 5; at most [`Self::MAX_WARMUP`]).
    pub warmup: usize,
    /// The collective configuration the ranks run with, to name the algorithm and count
    /// the bytes each rank sends (it must match the nodes' `NodeConfig::collectives`).
    pub collectives: CollectiveConfig,
    /// The transport's CPU seconds per GB moved (c) for the efficiency column; `None`
    /// takes it from this run's `p2p` rows of 1 MiB and more (the lowest).
    pub cpu_per_gb: Option<f64>,
    /// Run all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather and
    /// scatter on [`ZeroCopyBuffer`](nexar_actors::ZeroCopyBuffer)s (their `*_zero_copy` forms),
    /// whose sends read the buffers themselves, instead of on slices, whose sends copy
    /// (default false).
    pub zero_copy: bool,
    /// Run all_gather and reduce_scatter in place, on one buffer (their `*_in_place`
    /// forms, MPI's `MPI_IN_PLACE`; nccl-tests' in-place columns) instead of from a send
    /// buffer into a receive buffer (default false).
    pub in_place: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            ops: BenchOp::DEFAULT.to_vec(),
            min_bytes: 8,
            max_bytes: 64 << 20,
            step_factor: 4,
            dtype: DataType::F32,
            iters: 20,
            warmup: 5,
            collectives: CollectiveConfig::default(),
            cpu_per_gb: None,
            zero_copy: false,
            in_place: false,
        }
    }
}

impl BenchOptions {
    /// The most timed calls a row may have: every rank keeps each call's time and gathers
    /// everyone's (`iters x world` of them), so a count beyond any real use must be
    /// refused, not abort the process when that memory cannot be had.
    pub const MAX_ITERS: usize = 1_000_000;

    /// The most call times a rank gathers per row (`iters x world`): 32 MiB of them, on
    /// every rank (in one process, on every rank of it).
    pub const MAX_GATHERED_TIMES: usize = 4 << 20;

    /// The most untimed calls before them: a count beyond any real use would keep every
    /// row warming up for hours, so it is refused as `--iters` beyond [`Self::MAX_ITERS`] is.
    pub const MAX_WARMUP: usize = 1_000_000;

    /// The sizes of the sweep: `min_bytes`, times `step_factor`, ... up to `max_bytes`.
    pub fn sizes(&self) -> Vec<usize> {
        sizes(self.min_bytes, self.max_bytes, self.step_factor)
    }

    /// Checks the options for a run on `world` ranks: `Err` says, with the command line's
    /// flag names, why they are out of range (`min_bytes` above `max_bytes`, `iters` not
    /// within 1 to [`Self::MAX_ITERS`], `warmup` above [`Self::MAX_WARMUP`]) or why they
    /// would measure nothing (`"nothing to measure: ..."`: every op that moves data needs
    /// more ranks, or more bytes than the sweep's largest size, for one element, or one per
    /// rank where the buffer is in blocks). `barrier` always has its row, but does not make
    /// up for data ops that have none; asked for alone, it is measured.
    pub fn check(&self, world: usize) -> Result<(), String> {
        if self.min_bytes > self.max_bytes {
            return Err(format!(
                "--min-bytes ({}) is above --max-bytes ({})",
                self.min_bytes, self.max_bytes
            ));
        }
        if !(1..=Self::MAX_ITERS).contains(&self.iters) {
            return Err(format!(
                "--iters must be 1 to {} (got {})",
                Self::MAX_ITERS,
                self.iters
            ));
        }
        if self.iters.saturating_mul(world) > Self::MAX_GATHERED_TIMES {
            return Err(format!(
                "--iters {} on {world} ranks: every rank would gather {} call times (at \
                 most {}); use fewer iterations",
                self.iters,
                self.iters.saturating_mul(world),
                Self::MAX_GATHERED_TIMES
            ));
        }
        if self.warmup > Self::MAX_WARMUP {
            return Err(format!(
                "--warmup must be 0 to {} (got {})",
                Self::MAX_WARMUP,
                self.warmup
            ));
        }
        let largest = self.sizes().last().copied().unwrap_or(0);
        let esz = self.dtype.size();
        // barrier has its row at any size: what was asked for is measured if the ops that
        // move data (all of them but barrier, when there are any) have a row among them.
        // Rows only get larger along the sweep: an op measures something if its largest
        // size does.
        let data: Vec<BenchOp> = self
            .ops
            .iter()
            .copied()
            .filter(|&op| op != BenchOp::Barrier)
            .collect();
        if data.is_empty()
            || data
                .iter()
                .any(|&op| super::case::elements(op, largest, world, esz).is_some())
        {
            return Ok(());
        }
        let dtype = self.dtype.name();
        let why: Vec<String> = data
            .iter()
            .map(|&op| {
                if op.is_pair() && world < 2 {
                    format!("{op} needs 2 ranks, the world has {world}")
                } else {
                    let (least, each) = if op.has_blocks() {
                        (esz * world, " per rank")
                    } else {
                        (esz, "")
                    };
                    format!(
                        "{op} needs {least} bytes (one {dtype}{each}), the sweep stops at \
                         {largest}"
                    )
                }
            })
            .collect();
        Err(format!("nothing to measure: {}", why.join("; ")))
    }
}

/// `min`, `min * step`, ... while at most `max` (just `[min]` when `max < min`).
pub fn sizes(min: usize, max: usize, step: usize) -> Vec<usize> {
    let mut out = vec![min];
    let mut s = min;
    while let Some(next) = s.checked_mul(step.max(2)) {
        if next > max || s == 0 {
            break;
        }
        out.push(next);
        s = next;
    }
    out
}

/// Parses a byte count: digits with an optional binary suffix `K`, `M` or `G` (also `KiB`,
/// `KB`, ... and lower case; all powers of 1024), e.g. `8`, `1K`, `64M`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let n: usize = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 8, 4K, 64M, 1G)"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => {
            return Err(format!(
                "`{s}`: unknown size suffix `{suffix}` (use K, M or G)"
            ))
        }
    };
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// Parses a comma-separated list of [`BenchOp`] names; `all` means [`BenchOp::ALL`].
/// Duplicates are dropped; p2p and pingpong move to the front.
pub fn parse_ops(s: &str) -> Result<Vec<BenchOp>, String> {
    let mut ops = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let found: Vec<BenchOp> = if name == "all" {
            BenchOp::ALL.to_vec()
        } else {
            let op = BenchOp::from_name(name).ok_or_else(|| {
                let known: Vec<&str> = BenchOp::ALL.iter().map(|o| o.name()).collect();
                format!(
                    "unknown op `{name}`; known ops: {}, or all",
                    known.join(", ")
                )
            })?;
            vec![op]
        };
        for op in found {
            if !ops.contains(&op) {
                ops.push(op);
            }
        }
    }
    if ops.is_empty() {
        return Err("--ops needs at least one op".into());
    }
    ops.sort_by_key(|op| !op.is_pair());
    Ok(ops)
}

/// Parses a data type name (`f32`, `f64`, `f16`, `bf16`, `i8`, `i32`, `i64`, `u8`, `u32`,
/// `u64`).
pub fn parse_dtype(s: &str) -> Result<DataType, String> {
    DataType::ALL
        .into_iter()
        .find(|d| d.name() == s)
        .ok_or_else(|| {
            let known: Vec<&str> = DataType::ALL.iter().map(|d| d.name()).collect();
            format!("unknown dtype `{s}`; known: {}", known.join(", "))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        for bad in ["", "K", "4X", "-1", "1.5M", "4 M"] {
            assert!(parse_size(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn sweep_multiplies_up_to_max() {
        assert_eq!(sizes(8, 1024, 4), vec![8, 32, 128, 512]);
        assert_eq!(sizes(8, 8, 4), vec![8]);
        assert_eq!(sizes(1 << 20, 4 << 20, 2), vec![1 << 20, 2 << 20, 4 << 20]);
        assert_eq!(sizes(16, 8, 4), vec![16]);
        // 8 x 4^k never lands on 64 MiB: like nccl-tests, the sweep stops below the max.
        assert_eq!(BenchOptions::default().sizes().last(), Some(&(32 << 20)));
    }

    #[test]
    fn ops_parse_dedup_and_put_p2p_first() {
        assert_eq!(
            parse_ops("all_reduce,barrier,all_reduce"),
            Ok(vec![BenchOp::AllReduce, BenchOp::Barrier])
        );
        assert_eq!(
            parse_ops("all_reduce,p2p"),
            Ok(vec![BenchOp::P2p, BenchOp::AllReduce])
        );
        assert_eq!(parse_ops("all").map(|o| o.len()), Ok(BenchOp::ALL.len()));
        let err = parse_ops("all_reduce,allreduce");
        assert!(
            matches!(&err, Err(m) if m.contains("unknown op `allreduce`") && m.contains("all_gather")),
            "{err:?}"
        );
        assert!(parse_ops(",").is_err());
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(BenchOp::Broadcast.bus_factor(8), 1.0);
        assert_eq!(BenchOp::Barrier.bus_factor(8), 0.0);
    }

    #[test]
    fn out_of_range_options_are_refused_with_the_flags_names() {
        let o = BenchOptions::default();
        assert_eq!(o.check(2), Ok(()));
        let mut upside_down = o.clone();
        (upside_down.min_bytes, upside_down.max_bytes) = (16, 8);
        assert_eq!(
            upside_down.check(2),
            Err("--min-bytes (16) is above --max-bytes (8)".into())
        );
        let mut iters = o.clone();
        for (n, fine) in [(0, false), (1, true), (BenchOptions::MAX_ITERS, true)] {
            iters.iters = n;
            assert_eq!(iters.check(2).is_ok(), fine, "{n}");
        }
        iters.iters = 100_000_000_000;
        let err = iters.check(2);
        assert!(
            matches!(&err, Err(m) if m.contains("--iters must be 1 to 1000000")),
            "{err:?}"
        );
        let mut warmup = o.clone();
        for (n, fine) in [(0, true), (BenchOptions::MAX_WARMUP, true)] {
            warmup.warmup = n;
            assert_eq!(warmup.check(2).is_ok(), fine, "{n}");
        }
        warmup.warmup = 100_000_000_000;
        assert_eq!(
            warmup.check(2),
            Err("--warmup must be 0 to 1000000 (got 100000000000)".into())
        );
    }

    #[test]
    fn iterations_times_ranks_are_bounded() {
        let o = BenchOptions {
            iters: BenchOptions::MAX_ITERS,
            ..BenchOptions::default()
        };
        assert_eq!(o.check(4), Ok(()));
        let e = o.check(64).expect_err("64 million call times per rank");
        assert!(e.starts_with("--iters 1000000 on 64 ranks"), "{e}");
    }

    #[test]
    fn a_run_that_would_measure_nothing_says_why() {
        let mut o = BenchOptions {
            ops: vec![BenchOp::P2p],
            ..BenchOptions::default()
        };
        assert_eq!(
            o.check(1),
            Err("nothing to measure: p2p needs 2 ranks, the world has 1".into())
        );
        assert_eq!(o.check(2), Ok(()));
        // One op with rows is enough.
        o.ops = vec![BenchOp::P2p, BenchOp::AllReduce];
        assert_eq!(o.check(1), Ok(()));
        // 8 bytes of f32 are two elements: not one per rank on 3 ranks.
        (o.ops, o.min_bytes, o.max_bytes) = (vec![BenchOp::AllGather], 8, 8);
        assert_eq!(
            o.check(3),
            Err(
                "nothing to measure: all_gather needs 12 bytes (one f32 per rank), the sweep \
                 stops at 8"
                    .into()
            )
        );
        assert_eq!(o.check(2), Ok(()));
        o.ops = vec![BenchOp::Barrier];
        assert_eq!(o.check(1), Ok(()));
    }

    #[test]
    fn barrier_alone_does_not_make_a_run_that_measures_no_data() {
        // The default ops on 4 ranks with 2 bytes: barrier would be the only row.
        let mut o = BenchOptions {
            min_bytes: 2,
            max_bytes: 2,
            ..BenchOptions::default()
        };
        let err = o.check(4);
        assert!(
            matches!(&err, Err(m) if m.starts_with("nothing to measure: all_reduce needs 4 \
                bytes (one f32), the sweep stops at 2") && !m.contains("barrier")),
            "{err:?}"
        );
        // f64 at 4 bytes: under one element.
        (o.dtype, o.min_bytes, o.max_bytes) = (DataType::F64, 4, 4);
        let err = o.check(4);
        assert!(
            matches!(&err, Err(m) if m.contains("all_reduce needs 8 bytes (one f64)")),
            "{err:?}"
        );
        // p2p and barrier on one rank: p2p cannot run.
        let mut pair = BenchOptions {
            ops: vec![BenchOp::P2p, BenchOp::Barrier],
            ..BenchOptions::default()
        };
        assert_eq!(
            pair.check(1),
            Err("nothing to measure: p2p needs 2 ranks, the world has 1".into())
        );
        assert_eq!(pair.check(2), Ok(()));
        // Barrier asked for alone is measured at any size.
        (pair.ops, pair.min_bytes, pair.max_bytes) = (vec![BenchOp::Barrier], 1, 1);
        assert_eq!(pair.check(4), Ok(()));
        // One data op with rows is still enough.
        (o.ops, o.dtype) = (vec![BenchOp::Barrier, BenchOp::Broadcast], DataType::U8);
        assert_eq!(o.check(4), Ok(()));
    }

    #[test]
    fn dtypes_parse_by_name() {
        assert_eq!(parse_dtype("bf16"), Ok(DataType::BF16));
        assert!(parse_dtype("float").is_err());
    }
}
