//! `nexar local bench` and `nexar worker bench`: the options, and running the benchmark on
//! an in-process cluster or on this worker's rank. The measuring is in the library
//! (`nexar_cli::run_bench`), the printing in `report`.

use std::io;
use std::process::ExitCode;

use clap::Args;
use nexar_actors::{Algorithm, Cluster, Communicator, NodeConfig};
use nexar_cli::{
    parse_dtype, parse_ops, parse_size, run_bench, run_bench_rank, BenchOp, BenchOptions, BenchRow,
};
use nexar_device::DataType;

use crate::{report, Failure, EXIT_CHECK_FAILED, EXIT_USAGE};

/// `nexar ... bench --help`.
pub(crate) const LONG_ABOUT: &str = "\
Measure collectives and the transport, nccl-tests style.

For each op and size (--min-bytes, times --step-factor, up to --max-bytes) every rank \
allocates its buffers once, runs --warmup untimed calls, then --iters timed calls, each \
started together after a barrier. A call's time is the slowest rank's; a row shows the \
median (and min/max) over the calls, algbw = size / time, busbw = algbw x nccl-tests' \
factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, gather, scatter \
(n-1)/n; others 1), and whether the result was right on every rank (checked on one \
more, untimed call from restored inputs).

Sizes: all_reduce, broadcast, reduce: the buffer; all_gather: the whole receive buffer; \
reduce_scatter: the whole send buffer; all_to_all: the send buffer; gather: the root's \
whole receive buffer; scatter: the root's whole send buffer (root 0); sendrecv: what each \
rank sends; p2p: one message (rank 0 streams to rank 1); pingpong: one message bounced \
between ranks 0 and 1 (time = half the round trip).

Also per row: CPU microseconds per call (all threads, all processes; for p2p and pingpong \
only the processes of ranks 0 and 1), the payload bytes \
all ranks send per call (from the schedule), CPU seconds per GB sent, efficiency against \
the p2p rows' CPU per GB (eff: for rows of 1 MiB and more, the mean of two p2p streams \
of 4 MiB messages (the cheapest per byte; whatever --max-bytes) measured right before and after the row; for \
smaller rows, the best p2p \
row of 1 MiB and more; --cpu-per-gb C fixes it for every row; eff@sz: the p2p row of the \
same size; run with --ops p2p,... to get them), minor page faults per call, and the peak \
memory growth over the buffers (mem_x). --json prints one object per row.

With `nexar worker`, every worker must run bench with the same options (checked before \
anything runs: a usage error otherwise); rank 0 prints.";

/// A comma-separated list of ops, parsed as one value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OpList(pub(crate) Vec<BenchOp>);

fn op_list(s: &str) -> Result<OpList, String> {
    parse_ops(s).map(OpList)
}

fn at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    count_in(min, usize::MAX)
}

fn count_in(min: usize, max: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |s: &str| match s.parse::<usize>() {
        Ok(n) if n < min => Err(format!("must be at least {min}")),
        Ok(n) if n > max => Err(format!("must be at most {max}")),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("`{s}` is not a count: {e}")),
    }
}

/// A finite rate above zero (a cost per GB of 0, below 0 or NaN makes every efficiency
/// meaningless).
fn positive_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(c) if c.is_finite() && c > 0.0 => Ok(c),
        Ok(_) => Err("must be a finite number above 0".into()),
        Err(e) => Err(format!("`{s}` is not a number: {e}")),
    }
}

/// A size of the sweep: a [`parse_size`] of at least one byte (a sweep from 0 never grows,
/// so it would measure nothing but the barrier).
fn sweep_size(s: &str) -> Result<usize, String> {
    match parse_size(s)? {
        0 => Err("sizes of the sweep start at 1 byte".into()),
        n => Ok(n),
    }
}

fn algorithm(s: &str) -> Result<Algorithm, String> {
    Algorithm::from_name(s).ok_or_else(|| {
        let known: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
        format!("unknown algorithm `{s}`; known: {}", known.join(", "))
    })
}

/// `bench` options. The hidden ones tune the runtime, for experiments.
#[derive(Debug, Clone, PartialEq, Args)]
pub(crate) struct BenchArgs {
    /// Ops to run, comma-separated: all_reduce, broadcast, reduce, all_gather,
    /// reduce_scatter, all_to_all, gather, scatter, barrier, sendrecv, p2p, pingpong; or
    /// all.
    #[arg(
        long,
        value_name = "OPS",
        value_parser = op_list,
        default_value = "all_reduce,broadcast,reduce,all_gather,reduce_scatter,all_to_all,gather,scatter,barrier,sendrecv"
    )]
    pub(crate) ops: OpList,
    /// Smallest size in bytes (suffixes K, M, G: powers of 1024).
    #[arg(long, value_name = "BYTES", default_value = "8", value_parser = sweep_size)]
    pub(crate) min_bytes: usize,
    /// Largest size in bytes.
    #[arg(long, value_name = "BYTES", default_value = "64M", value_parser = sweep_size)]
    pub(crate) max_bytes: usize,
    /// Each size is the previous one times this.
    #[arg(long, value_name = "N", default_value = "4", value_parser = at_least(2))]
    pub(crate) step_factor: usize,
    /// Element type: f32, f64, f16, bf16, i8, i32, i64, u8, u32, u64.
    #[arg(long, value_name = "TYPE", default_value = "f32", value_parser = parse_dtype)]
    pub(crate) dtype: DataType,
    /// Timed calls per op and size (at most 1000000).
    #[arg(
        long,
        value_name = "N",
        default_value = "20",
        value_parser = count_in(1, BenchOptions::MAX_ITERS)
    )]
    pub(crate) iters: usize,
    /// Untimed calls before them (at most 1000000).
    #[arg(
        long,
        value_name = "N",
        default_value = "5",
        value_parser = count_in(0, BenchOptions::MAX_WARMUP)
    )]
    pub(crate) warmup: usize,
    /// Run all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather
    /// and scatter on ZeroCopyBuffers (the *_zero_copy forms: sends read the buffers
    /// themselves) instead of slices (sends copy), and sendrecv's sends as Bytes
    /// (send_bytes, as p2p's).
    #[arg(long)]
    pub(crate) zero_copy: bool,
    /// Run all_gather and reduce_scatter in place, on one buffer (the *_in_place forms,
    /// as nccl-tests' in-place columns), instead of from a send into a receive buffer.
    #[arg(long)]
    pub(crate) in_place: bool,
    /// The transport's CPU seconds per GB for the efficiency column (default: this run's
    /// p2p rows).
    #[arg(long, value_name = "C", value_parser = positive_rate, hide = true)]
    pub(crate) cpu_per_gb: Option<f64>,
    /// Force a collective algorithm where it applies (ring, ring_pipelined, rd, rhd, ...).
    #[arg(long, value_name = "NAME", value_parser = algorithm, hide = true)]
    pub(crate) algorithm: Option<Algorithm>,
    /// TransportConfig::max_udp_payload.
    #[arg(long, value_name = "BYTES", hide = true)]
    pub(crate) max_udp_payload: Option<u16>,
    /// TransportConfig::initial_mtu.
    #[arg(long, value_name = "BYTES", hide = true)]
    pub(crate) initial_mtu: Option<u16>,
    /// TransportConfig::stream_window.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) stream_window: Option<usize>,
    /// TransportConfig::send_window.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) send_window: Option<usize>,
    /// TransportConfig::max_streams.
    #[arg(long, value_name = "N", hide = true)]
    pub(crate) max_streams: Option<u32>,
    /// TransportConfig::socket_buffer_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) socket_buffer: Option<usize>,
    /// TransportConfig::lane_congestion: a congestion control's name, or `system` for the
    /// system's default (so no algorithm named `system` can be chosen here).
    #[arg(long, value_name = "NAME", hide = true)]
    pub(crate) lane_congestion: Option<String>,
    /// TransportConfig::max_ack_delay, in microseconds.
    #[arg(long, value_name = "US", hide = true)]
    pub(crate) max_ack_delay_us: Option<u64>,
    /// CollectiveConfig::tiny_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) tiny_bytes: Option<usize>,
    /// CollectiveConfig::small_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) small_bytes: Option<usize>,
    /// CollectiveConfig::pipeline_threshold_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) pipeline_threshold: Option<usize>,
    /// CollectiveConfig::pipeline_chunk_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) pipeline_chunk: Option<usize>,
    /// CollectiveConfig::max_message_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) max_message: Option<usize>,
    /// CollectiveConfig::window.
    #[arg(long, value_name = "N", hide = true)]
    pub(crate) coll_window: Option<usize>,
    /// NodeConfig::small_message_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) small_message: Option<usize>,
    /// NodeConfig::collective_send_budget_bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, hide = true)]
    pub(crate) send_budget: Option<usize>,
    /// How long, in microseconds, a waiting collective polls for progress before it
    /// sleeps (`NodeConfig::spin_wait`; default: 1000 on a runtime with one worker thread, as with `nexar worker --threads 1`, else 0). Polling costs CPU
    /// while waiting and saves wake-ups: faster with one rank per process, and counted in
    /// the cpu_us and eff% columns.
    #[arg(long, value_name = "US")]
    pub(crate) spin_us: Option<u64>,
}

impl BenchArgs {
    /// The node settings: the defaults with the tuning flags applied.
    pub(crate) fn node_config(&self) -> NodeConfig {
        let mut c = NodeConfig::default();
        let t = &mut c.transport;
        if let Some(v) = self.max_udp_payload {
            t.max_udp_payload = v;
        }
        if let Some(v) = self.max_ack_delay_us {
            t.max_ack_delay = std::time::Duration::from_micros(v);
        }
        if let Some(v) = self.initial_mtu {
            t.initial_mtu = v;
        }
        if let Some(v) = &self.lane_congestion {
            t.lane_congestion = (v != "system").then(|| v.clone());
        }
        if let Some(v) = self.stream_window {
            t.stream_window = u32::try_from(v).unwrap_or(u32::MAX);
        }
        if let Some(v) = self.send_window {
            t.send_window = u32::try_from(v).unwrap_or(u32::MAX);
        }
        if let Some(v) = self.max_streams {
            t.max_streams = v;
        }
        if let Some(v) = self.socket_buffer {
            t.socket_buffer_bytes = v;
        }
        let k = &mut c.collectives;
        k.algorithm = self.algorithm.or(k.algorithm);
        if let Some(v) = self.tiny_bytes {
            k.tiny_bytes = v;
        }
        if let Some(v) = self.small_bytes {
            k.small_bytes = v;
        }
        if let Some(v) = self.pipeline_threshold {
            k.pipeline_threshold_bytes = v;
        }
        if let Some(v) = self.pipeline_chunk {
            k.pipeline_chunk_bytes = v;
        }
        if let Some(v) = self.coll_window {
            k.window = v;
        }
        if let Some(v) = self.max_message {
            k.max_message_bytes = v;
        }
        if let Some(v) = self.small_message {
            c.small_message_bytes = v;
        }
        if let Some(v) = self.send_budget {
            c.collective_send_budget_bytes = v;
        }
        if let Some(v) = self.spin_us {
            c.spin_wait = Some(std::time::Duration::from_micros(v));
        }
        c
    }

    /// What to measure.
    pub(crate) fn options(&self) -> BenchOptions {
        let mut o = BenchOptions::default();
        o.ops = self.ops.0.clone();
        o.min_bytes = self.min_bytes;
        o.max_bytes = self.max_bytes;
        o.step_factor = self.step_factor;
        o.dtype = self.dtype;
        o.iters = self.iters;
        o.warmup = self.warmup;
        o.collectives = self.node_config().collectives;
        o.cpu_per_gb = self.cpu_per_gb;
        o.zero_copy = self.zero_copy;
        o.in_place = self.in_place;
        o
    }
}

/// The exit code for a finished run.
fn verdict(rows: &[BenchRow]) -> ExitCode {
    if rows.iter().all(|r| r.ok) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CHECK_FAILED)
    }
}

/// Runs the benchmark on every rank of an in-process cluster, printing rows as they come.
/// Options out of range or that leave nothing to measure ([`BenchOptions::check`]) are a
/// usage error, before anything is printed.
pub(crate) async fn local(
    cluster: &Cluster,
    args: &BenchArgs,
    json: bool,
) -> (ExitCode, io::Result<()>) {
    let opts = args.options();
    if let Err(e) = opts.check(cluster.world_size()) {
        nexar_cli::say!("error: {e}");
        return (ExitCode::from(EXIT_USAGE), Ok(()));
    }
    let header = report::bench_header(&mut io::stdout().lock(), cluster.world_size(), &opts, json);
    // A closed stdout (`| head`) must not stop the ranks mid-collective: the rows' write
    // errors are dropped here, and the header's is reported.
    let printed = run_bench(cluster.communicators(), &opts, move |row| {
        report::bench_row(&mut io::stdout().lock(), row, json).ok();
    })
    .await;
    match printed {
        Ok(rows) => (verdict(&rows), header),
        Err(e) => {
            nexar_cli::say!("error: the benchmark stopped: {e}");
            (ExitCode::from(EXIT_CHECK_FAILED), header)
        }
    }
}

/// A digest of every bench option (their debug form: the same build prints the same).
fn options_digest(args: &BenchArgs) -> u64 {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(format!("{args:?}").as_bytes());
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// Refuses, on every rank alike (a usage error), a bench whose workers were given other
/// options than rank 0: some mismatches would run silently with mixed settings (forms,
/// polling, transport flags) under rank 0's header, others stop mid-run with an error
/// that does not say why.
async fn same_options(comm: &Communicator, args: &BenchArgs) -> Result<(), Failure> {
    let mut all = vec![0u64; comm.world_size()];
    comm.all_gather(&[options_digest(args)], &mut all)
        .await
        .map_err(|e| {
            Failure::cluster(format!("could not compare the workers' bench options: {e}"))
        })?;
    let differ: Vec<usize> = (1..all.len()).filter(|r| all[*r] != all[0]).collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(Failure::usage(format!(
        "every worker must run `bench` with the same options: rank(s) {differ:?} were given \
         other options than rank 0"
    )))
}

/// Runs this worker's rank of the benchmark; rank 0 prints. Returns whether every result
/// was right, and how printing went; or, for options out of range or that leave nothing
/// to measure on this world ([`BenchOptions::check`]), a usage error before anything runs
/// (every rank finds the same).
pub(crate) async fn rank(
    comm: &Communicator,
    args: &BenchArgs,
    json: bool,
) -> Result<(bool, io::Result<()>), Failure> {
    // Compared first: options that differ may pass the check on some ranks only.
    same_options(comm, args).await?;
    let opts = args.options();
    opts.check(comm.world_size()).map_err(Failure::usage)?;
    let lead = comm.rank() == 0;
    let header = if lead {
        report::bench_header(&mut io::stdout().lock(), comm.world_size(), &opts, json)
    } else {
        Ok(())
    };
    let rows = run_bench_rank(comm, &opts, |row| {
        if lead {
            report::bench_row(&mut io::stdout().lock(), row, json).ok();
        }
    })
    .await;
    Ok(match rows {
        Ok(rows) => (rows.iter().all(|r| r.ok), header),
        Err(e) => {
            nexar_cli::say!("error: the benchmark stopped on rank {}: {e}", comm.rank());
            (false, header)
        }
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command, Job, EXIT_USAGE};

    fn bench(args: &[&str]) -> Result<super::BenchArgs, clap::Error> {
        let cli = Cli::try_parse_from(
            ["nexar", "local", "--world", "2", "bench"]
                .into_iter()
                .chain(args.iter().copied()),
        )?;
        match cli.command {
            Command::Local(local) => match local.job {
                Job::Bench(b) => Ok(*b),
                other => panic!("parsed as {other:?}"),
            },
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn defaults_match_nccl_tests_sweep() {
        let b = bench(&[]).expect("defaults parse");
        let o = b.options();
        assert_eq!(o.ops, nexar_cli::BenchOp::DEFAULT.to_vec());
        assert_eq!(
            (o.min_bytes, o.max_bytes, o.step_factor, o.iters, o.warmup),
            (8, 64 << 20, 4, 20, 5)
        );
        assert_eq!(o.dtype, nexar_device::DataType::F32);
    }

    #[test]
    fn a_sweep_from_or_to_zero_bytes_is_a_usage_error() {
        for flag in ["--min-bytes", "--max-bytes"] {
            let err = bench(&[flag, "0"]).expect_err("a zero size");
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
            assert!(err.to_string().contains("start at 1 byte"), "{err}");
        }
        assert!(bench(&["--min-bytes", "1"]).is_ok());
    }

    /// Every hidden flag is named in BENCHMARKS.md's paragraph on them (`--help` does not
    /// list them, so that paragraph is their only documentation).
    #[test]
    fn every_hidden_flag_is_documented() {
        use clap::Args;
        let doc = include_str!("../../../BENCHMARKS.md");
        let start = doc
            .find("Hidden flags, for experiments only")
            .expect("the paragraph");
        let paragraph = &doc[start..];
        let paragraph = &paragraph[..paragraph.find("\n\n").unwrap_or(paragraph.len())];
        let args = super::BenchArgs::augment_args(clap::Command::new("bench"));
        let hidden: Vec<String> = args
            .get_arguments()
            .filter(|a| a.is_hide_set())
            .filter_map(|a| a.get_long().map(|l| format!("`--{l}")))
            .collect();
        assert!(hidden.len() > 10, "{hidden:?}");
        for flag in hidden {
            assert!(paragraph.contains(&flag), "{flag}` is not in BENCHMARKS.md");
        }
    }

    #[test]
    fn sizes_take_suffixes_and_tuning_reaches_the_config() {
        let b = bench(&[
            "--min-bytes",
            "4K",
            "--max-bytes",
            "1M",
            "--dtype",
            "bf16",
            "--algorithm",
            "ring",
            "--max-udp-payload",
            "4000",
            "--max-ack-delay-us",
            "25000",
            "--max-message",
            "2M",
            "--zero-copy",
            "--in-place",
        ])
        .expect("parse");
        assert_eq!((b.min_bytes, b.max_bytes), (4096, 1 << 20));
        assert!(b.options().zero_copy);
        assert!(b.options().in_place);
        let c = b.node_config();
        assert_eq!(c.transport.max_udp_payload, 4000);
        assert_eq!(
            c.transport.max_ack_delay,
            std::time::Duration::from_millis(25)
        );
        assert_eq!(
            b.options().collectives.algorithm,
            Some(nexar_actors::Algorithm::Ring)
        );
        assert_eq!(c.collectives.max_message_bytes, 2 << 20);
    }

    #[test]
    fn bad_values_are_usage_errors_that_say_why() {
        for (args, says) in [
            (
                &["--ops", "all_reduce,allreduce"][..],
                "unknown op `allreduce`",
            ),
            (&["--max-bytes", "64X"], "unknown size suffix"),
            (&["--iters", "0"], "at least 1"),
            (&["--iters", "100000000000"], "at most 1000000"),
            (&["--warmup", "100000000000"], "at most 1000000"),
            (&["--step-factor", "1"], "at least 2"),
            (&["--dtype", "float"], "unknown dtype"),
        ] {
            match bench(args) {
                Ok(b) => panic!("{args:?} parsed as {b:?}"),
                Err(e) => {
                    assert_eq!(e.exit_code(), i32::from(EXIT_USAGE), "{args:?}: {e}");
                    assert!(e.to_string().contains(says), "{args:?}: {e}");
                }
            }
        }
    }

    /// Workers given different bench options are refused on every rank, before anything
    /// runs (a worker with `--zero-copy` beside one without ran silently under rank 0's
    /// header); the same options pass.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn workers_with_different_bench_options_are_refused() {
        let plain = bench(&["--ops", "barrier"]).expect("args");
        let zero_copy = bench(&["--ops", "barrier", "--zero-copy"]).expect("args");
        assert_eq!(
            super::options_digest(&plain),
            super::options_digest(&bench(&["--ops", "barrier"]).expect("args"))
        );
        assert_ne!(
            super::options_digest(&plain),
            super::options_digest(&zero_copy)
        );
        let cluster = nexar_actors::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        let (a, b) = tokio::join!(
            super::same_options(&comms[0], &plain),
            super::same_options(&comms[1], &zero_copy)
        );
        for (rank, res) in [a, b].into_iter().enumerate() {
            let e = res.expect_err("refused");
            assert_eq!(e.code, EXIT_USAGE, "rank {rank}");
            assert!(e.message.contains("[1]"), "rank {rank}: {}", e.message);
        }
        let (a, b) = tokio::join!(
            super::same_options(&comms[0], &plain),
            super::same_options(&comms[1], &plain)
        );
        assert!(a.is_ok() && b.is_ok());
        cluster.shutdown().await;
    }
}
