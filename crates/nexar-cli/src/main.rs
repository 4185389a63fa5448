//! `nexar`: run jobs on nexar clusters from the command line.
//!
//! This file parses arguments, sets up logging and the runtime, and maps outcomes to exit
//! codes; the jobs themselves live in the `nexar_cli` library, the multi-process commands
//! in `seed` and `worker`, and printing in `report`.

mod affinity;
mod bench;
mod report;
mod seed;
mod worker;

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bench::BenchArgs;
use clap::{Args, Parser, Subcommand};
use nexar_actors::{Cluster, JoinString, NodeConfig};
use nexar_cli::{run_smoke, Advertise, ClusterInfo};
use tracing_subscriber::EnvFilter;

/// Exit code when any smoke check fails (or, for `nexar seed`, any worker reported failure).
const EXIT_CHECK_FAILED: u8 = 1;
/// Exit code for usage and setup errors (clap uses 2 for bad arguments too).
const EXIT_USAGE: u8 = 2;
/// Exit code when a cluster could not be started, joined or formed.
const EXIT_CLUSTER: u8 = 3;
/// How long to wait for a cluster to close its connections before exiting anyway.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

const LONG_ABOUT: &str = "\
Run jobs on nexar clusters: a distributed MPI-class runtime over QUIC.

`nexar local --world N smoke` starts N in-process ranks (each a full node with its own QUIC \
endpoint on 127.0.0.1) and verifies every operation on them; `nexar local --world N bench` \
measures them, nccl-tests style (see `nexar local bench --help`).

A multi-process cluster has one seed and N workers, on one host or many. The seed prints a \
join string (seed address, cluster secret, certificate fingerprint) alone on the first line \
of standard output; every worker joins with it:

  JOIN=$( (nexar seed --listen 0.0.0.0:7000 --advertise HOST --world 4 &) | head -1)
  nexar worker --join \"$JOIN\" smoke        # on each of the 4 worker hosts

Workers started by torchrun or SLURM can omit --join and read NEXAR_JOIN (or NEXAR_SEED or \
MASTER_ADDR+MASTER_PORT, with NEXAR_SECRET or NEXAR_SECRET_FILE and NEXAR_SEED_FINGERPRINT) \
and RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS from the environment (SLURM sets no seed \
address: give NEXAR_SEED); see `nexar worker --help`.

Exit codes:
  0  success (smoke: every check passed; bench: every result was right; seed: every \
worker reported success)
  1  at least one smoke check failed (bench: a wrong result, or an operation failed; seed: \
at least one worker reported failure)
  2  usage or setup error (bad arguments, bad log filter, no join string)
  3  the cluster could not be started, joined or formed (seed unreachable, wrong secret, \
fingerprint mismatch, formation deadline passed)";

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(name = "nexar", version, about = "Run jobs on nexar clusters", long_about = LONG_ABOUT)]
struct Cli {
    /// Print machine-readable output: one JSON object per line (`nexar seed`: after the
    /// join string, which stays the first line).
    #[arg(long, global = true)]
    json: bool,
    /// Log filter for stderr, e.g. `info` or `nexar_actors=debug` (overrides RUST_LOG;
    /// default: RUST_LOG, else `warn`).
    #[arg(long, global = true, value_name = "LEVEL")]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a job on an in-process cluster: every rank is a full node on 127.0.0.1.
    Local(LocalArgs),
    /// Start the seed of a multi-process cluster: print the join string, admit the workers,
    /// and serve until every worker reports its job done.
    #[command(long_about = seed::LONG_ABOUT)]
    Seed(SeedArgs),
    /// Join a multi-process cluster through its seed and run a job as one of its ranks.
    #[command(long_about = worker::LONG_ABOUT)]
    Worker(WorkerArgs),
}

#[derive(Debug, Args)]
struct LocalArgs {
    /// Number of ranks (at least 1).
    #[arg(long, global = true, default_value_t = 4, value_parser = parse_world)]
    world: usize,
    /// Send data over a plaintext TCP lane between the nodes (bound to their authenticated
    /// QUIC session) instead of QUIC with TLS: much less CPU per byte, but readable and
    /// alterable by anyone on the network. Only for trusted fabrics; every node of the
    /// cluster must pass it.
    #[arg(long, global = true)]
    trusted_fabric: bool,
    #[command(subcommand)]
    job: Job,
}

#[derive(Debug, Args)]
struct SeedArgs {
    /// UDP address to listen on for workers, e.g. `0.0.0.0:7000`; port 0 picks a free port
    /// (the join string carries the real one).
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,
    /// Number of workers, that is ranks, in the cluster (at least 1).
    #[arg(long, value_parser = parse_world)]
    world: usize,
    /// Address workers dial, put in the join string: `HOST:PORT`, or an IP or host name
    /// (resolved here) to use with the bound port (default: the listen address; 127.0.0.1
    /// when listening on all interfaces).
    #[arg(long, value_name = "ADDR", value_parser = Advertise::parse)]
    advertise: Option<Advertise>,
    /// File holding the cluster secret as 64 hex digits (default: NEXAR_SECRET, else a
    /// fresh random secret).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
    /// Seconds for every worker to join and the mesh to form (and the longest a node that
    /// joins the running cluster waits for a resize point).
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = parse_secs)]
    timeout: u64,
    /// Smallest world a graceful leave may leave behind (default 1).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_world)]
    min_world: usize,
    /// Largest world (default: --world, a fixed size). When larger, workers may join the
    /// running cluster; they enter at the members' next resize point.
    #[arg(long, value_name = "N", value_parser = parse_world)]
    max_world: Option<usize>,
}

#[derive(Debug, Args)]
struct WorkerArgs {
    /// The join string `nexar seed` printed (default: from the environment, see below).
    #[arg(long, value_name = "STRING", value_parser = JoinParser)]
    join: Option<JoinString>,
    /// UDP address of this worker's mesh endpoint (default: NEXAR_LISTEN, else `0.0.0.0:0`).
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// `HOST:PORT` peers should dial to reach this worker, when the address the seed sees it
    /// from is wrong (NAT); use with a fixed --listen port (default: NEXAR_ADVERTISE, an
    /// `IP:PORT`).
    #[arg(long, value_name = "ADDR", value_parser = Advertise::parse)]
    advertise: Option<Advertise>,
    /// Ask the seed for this rank (default: NEXAR_RANK, RANK or SLURM_PROCID; else the seed
    /// picks the lowest free rank).
    #[arg(long, value_name = "R")]
    rank: Option<usize>,
    /// Seconds to reach the seed and be admitted; formation then has the seed's deadline.
    #[arg(long, value_name = "SECS", default_value_t = 20, value_parser = parse_secs)]
    timeout: u64,
    /// Runtime worker threads (default: one per CPU, or the CPUs shared among the workers
    /// on this host when the launcher says how many: see below). With several workers on
    /// one host, use `--threads 1`: no wake-ups across threads, and collectives then poll briefly
    /// before sleeping (`NodeConfig::spin_wait`). 4 workers on 2 cores, all-reduce: 4 KiB
    /// in 103-127 us with 1 thread against 384-458 us with 2, 4 MiB busbw 0.55-0.65 GB/s
    /// against 0.36-0.39 (QUIC; BENCHMARKS.md). At most 1024.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Leave this worker's threads free to run on any CPU. By default (on Linux) a worker
    /// that runs fewer runtime threads than the CPUs it may use, on a host with other
    /// workers of the cluster (ranks whose addresses have its IP), binds its threads to
    /// CPUs of its own, round robin by its place among them (see below), as `mpirun
    /// --bind-to core` does: 8 workers on 2 cores spent 13-19% less CPU per byte on 1-4
    /// MiB all-reduces and broadcasts (BENCHMARKS.md). Not under a CPU quota smaller than
    /// those CPUs (a container's), nor for the elastic job. Pass it when another job shares
    /// the host's CPUs.
    #[arg(long)]
    no_bind_cpus: bool,
    /// Send data over a plaintext TCP lane between the nodes (bound to their authenticated
    /// QUIC session) instead of QUIC with TLS: much less CPU per byte, but readable and
    /// alterable by anyone on the network. Only for trusted fabrics; every node of the
    /// cluster must pass it.
    #[arg(long, global = true)]
    trusted_fabric: bool,
    #[command(subcommand)]
    job: Job,
}

#[derive(Debug, Clone, PartialEq, Subcommand)]
enum Job {
    /// Run every operation on all ranks and verify the results (exit 1 if any check fails).
    Smoke,
    /// Print the world size and each rank's node id and listen address.
    Info,
    /// Measure collectives and the transport, nccl-tests style: time, algbw, busbw, a
    /// result check, CPU and memory per operation and size (exit 1 on a wrong result).
    #[command(long_about = bench::LONG_ABOUT)]
    Bench(Box<BenchArgs>),
    /// A loop of verified all-reduces that survives lost ranks through automatic recovery
    /// (for fault tests: kill a worker and the others go on with the survivors).
    Soak {
        /// All-reduces to run (at least 1).
        #[arg(long, default_value_t = 2000, value_parser = positive::<u64>)]
        iters: u64,
        /// f64 elements per all-reduce (at least 1).
        #[arg(long, default_value_t = 1024, value_parser = positive::<usize>)]
        elems: usize,
    },
    /// A loop of resize points and verified all-reduces for elastic membership (worker
    /// only): workers that join through a seed started with --max-world enter at the next
    /// resize point; SIGTERM makes a worker leave gracefully at the next one (or, when
    /// every member got it, ends the job for all), and a second SIGTERM ends it at once
    /// (exit 143; the others see it lost). Prints a line whenever the world changes.
    Elastic {
        /// Iterations after which the job ends (at least 1).
        #[arg(long, default_value_t = 100_000, value_parser = positive::<u64>)]
        iters: u64,
        /// f64 elements per all-reduce (at least 1).
        #[arg(long, default_value_t = 1024, value_parser = positive::<usize>)]
        elems: usize,
        /// Milliseconds between iterations (the work of a step).
        #[arg(long, default_value_t = 20)]
        pace_ms: u64,
    },
}

impl Job {
    /// The node settings the job runs with (the bench's tuning flags; else the defaults).
    fn node_config(&self) -> NodeConfig {
        match self {
            Job::Bench(args) => args.node_config(),
            Job::Soak { .. } => nexar_cli::soak_config(),
            Job::Smoke | Job::Info | Job::Elastic { .. } => NodeConfig::default(),
        }
    }
}

fn parse_world(s: &str) -> Result<usize, String> {
    let world: usize = s
        .parse()
        .map_err(|e| format!("`{s}` is not a rank count: {e}"))?;
    if world == 0 {
        return Err("a cluster needs at least one rank (--world >= 1)".into());
    }
    Ok(world)
}

/// Parses a count of at least 1: a loop over no iterations or no elements would check
/// nothing and still report success.
fn positive<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + PartialEq + From<u8>,
    T::Err: std::fmt::Display,
{
    let n: T = s
        .parse()
        .map_err(|e| format!("`{s}` is not a count: {e}"))?;
    if n == T::from(0) {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

fn parse_secs(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("the timeout must be at least 1 second".into()),
        Ok(secs) => Ok(secs),
        Err(e) => Err(format!("`{s}` is not a number of seconds: {e}")),
    }
}

/// Parses `--join` with an error that does not repeat the value: clap's own message for a
/// bad value quotes it, and a join string holds the cluster secret.
#[derive(Clone)]
struct JoinParser;

impl clap::builder::TypedValueParser for JoinParser {
    type Value = JoinString;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<JoinString, clap::Error> {
        let bad = |why: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid --join: {why}\n"),
            )
            .with_cmd(cmd)
        };
        let text = value.to_str().ok_or_else(|| bad("not UTF-8".into()))?;
        text.parse()
            .map_err(|e: nexar_actors::BootstrapError| bad(e.to_string()))
    }
}

/// Why a command stopped early: what to tell the user, and the exit code.
#[derive(Debug)]
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    /// A usage or setup error (exit 2).
    fn usage(message: impl Into<String>) -> Failure {
        Failure {
            code: EXIT_USAGE,
            message: message.into(),
        }
    }

    /// The cluster could not be started, joined or formed (exit 3).
    fn cluster(message: impl Into<String>) -> Failure {
        Failure {
            code: EXIT_CLUSTER,
            message: message.into(),
        }
    }
}

fn main() -> ExitCode {
    // Exits with 2 on bad arguments, 0 for --help and --version.
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(failure) => {
            nexar_cli::say!("error: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

/// Keeps freed heap memory in the process instead of handing it back to the kernel at
/// every free (glibc's default trims the heap top above 128 KiB and serves large blocks
/// with fresh mappings, moving both thresholds with the traffic), so steady-state
/// collectives reuse pages instead of faulting fresh ones in: quinn copies every received datagram into a new buffer, and at 64 MiB per call
/// that was thousands of minor faults per call (BENCHMARKS.md). Applications embedding
/// nexar can do the same with `MALLOC_TRIM_THRESHOLD_` or a caching allocator.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets an allocator parameter; called before any thread
        // starts.
        // Setting the trim threshold freezes glibc's sliding mmap threshold at 128 KiB, so
        // raise that too: blocks up to 32 MiB (frames, chunks, pooled copies) come from
        // the heap and are reused.
        let set = unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20)
                + libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20)
        };
        if set != 2 {
            tracing::debug!("mallopt was refused");
        }
    }
}

/// The most runtime threads `nexar worker --threads` takes: more only costs memory and
/// wake-ups, and an absurd count would make the runtime's start panic instead of failing
/// with a usage error.
const MAX_WORKER_THREADS: usize = 1024;

/// tokio's variable for its count of runtime threads, which every command honours (a
/// worker's `--threads`, or its launcher's count of workers on the host, first).
const WORKER_THREADS_VAR: &str = "TOKIO_WORKER_THREADS";

/// The runtime threads [`WORKER_THREADS_VAR`]'s value asks for (`None` when unset), or
/// why it is refused: not a number from 1 to [`MAX_WORKER_THREADS`].
fn env_worker_threads(value: Option<&std::ffi::OsStr>) -> Result<Option<usize>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    value
        .to_str()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=MAX_WORKER_THREADS).contains(n))
        .map(Some)
        .ok_or_else(|| {
            format!(
                "{WORKER_THREADS_VAR} must be a number from 1 to {MAX_WORKER_THREADS}, not {value:?}"
            )
        })
}

/// Runs the command; `Err` says why it stopped and with which exit code.
fn run(cli: Cli) -> Result<ExitCode, Failure> {
    init_logging(cli.log.as_deref()).map_err(Failure::usage)?;
    if std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_none() {
        keep_freed_memory();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // Checked here: tokio reads it itself where no count is given, and panics on a bad one.
    let mut threads = env_worker_threads(std::env::var_os(WORKER_THREADS_VAR).as_deref())
        .map_err(Failure::usage)?;
    if let Command::Worker(WorkerArgs { threads: flag, .. }) = &cli.command {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        match flag {
            Some(n) if !(1..=MAX_WORKER_THREADS).contains(n) => {
                return Err(Failure::usage(format!(
                    "--threads must be from 1 to {MAX_WORKER_THREADS}, not {n}"
                )))
            }
            Some(n) => threads = Some(*n),
            None => {
                if let Some(n) = worker::default_threads(cpus, |k| std::env::var(k).ok()) {
                    threads = Some(n);
                }
            }
        }
    }
    if let Some(n) = threads {
        builder.worker_threads(n);
    }
    let runtime = builder
        .enable_all()
        .build()
        .map_err(|e| Failure::usage(format!("could not start the async runtime: {e}")))?;
    match cli.command {
        Command::Local(args) => runtime.block_on(local(&args, cli.json)),
        Command::Seed(args) => runtime.block_on(seed::run(&args, cli.json)),
        Command::Worker(args) => {
            // On a worker thread, next to the connection tasks it talks to, rather than
            // on the main thread: fewer wake-ups across threads.
            let json = cli.json;
            runtime.block_on(async move {
                tokio::spawn(async move { worker::run(&args, json).await })
                    .await
                    .unwrap_or_else(|e| Err(Failure::cluster(format!("the job panicked: {e}"))))
            })
        }
    }
}

fn init_logging(spec: Option<&str>) -> Result<(), String> {
    let filter = match spec {
        Some(spec) => {
            EnvFilter::try_new(spec).map_err(|e| format!("invalid --log filter `{spec}`: {e}"))?
        }
        None => match std::env::var("RUST_LOG") {
            Ok(env) => EnvFilter::try_new(&env)
                .map_err(|e| format!("invalid RUST_LOG filter `{env}`: {e}"))?,
            Err(_) => EnvFilter::new("warn"),
        },
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .try_init()
        .map_err(|e| format!("could not set up logging: {e}"))
}

/// Maps the outcome of writing results to stdout: a closed pipe (`nexar ... | head`) is
/// the reader's choice, not our failure.
fn printed(result: io::Result<()>) -> Result<(), Failure> {
    match result {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => {
            Err(Failure::usage(format!("could not write output: {e}")))
        }
        _ => Ok(()),
    }
}

/// Says that a rank's soak failed, and why.
fn soak_failed(json: bool, error: String) -> io::Result<()> {
    say(
        json,
        &format!("soak: FAIL: {error}"),
        serde_json::json!({"job": "soak", "ok": false, "error": error}),
    )
}

/// Writes one line of a job's progress to stdout: `text`, or with `--json` the object
/// `value`. A closed stdout is an error here (not a panic, as `println!` would make it);
/// [`printed`] decides what it means.
fn say(json: bool, text: &str, value: serde_json::Value) -> io::Result<()> {
    use io::Write;
    let mut out = io::stdout().lock();
    if json {
        writeln!(out, "{value}")
    } else {
        writeln!(out, "{text}")
    }
}

async fn local(args: &LocalArgs, json: bool) -> Result<ExitCode, Failure> {
    // Refused before any node starts, so there is nothing to shut down.
    if let Job::Elastic { .. } = args.job {
        return Err(Failure::usage(
            "the elastic job needs a seed: run it with `nexar seed --max-world N` and \
             `nexar worker ... elastic`",
        ));
    }
    let mut config = args.job.node_config();
    config.trusted_fabric = args.trusted_fabric;
    let cluster = Cluster::local_with(args.world, config).await.map_err(|e| {
        Failure::cluster(format!(
            "could not start a {}-rank local cluster: {e}",
            args.world
        ))
    })?;
    let (code, result) = match &args.job {
        // Refused above, before the cluster started.
        Job::Elastic { .. } => (ExitCode::from(EXIT_USAGE), Ok(())),
        Job::Bench(bench) => bench::local(&cluster, bench, json).await,
        Job::Smoke => {
            let results = run_smoke(cluster.communicators()).await;
            let code = if results.iter().all(|r| r.ok()) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_CHECK_FAILED)
            };
            (
                code,
                report::smoke(&mut io::stdout().lock(), &results, None, json),
            )
        }
        Job::Info => (
            ExitCode::SUCCESS,
            report::info(&mut io::stdout().lock(), &ClusterInfo::of(&cluster), json),
        ),
        Job::Soak { iters, elems } => {
            let tasks: Vec<_> = cluster
                .communicators()
                .into_iter()
                .map(|c| tokio::spawn(nexar_cli::soak_rank(c, *iters, *elems)))
                .collect();
            let mut ok = true;
            let mut result = Ok(());
            for t in tasks {
                let line = match t.await {
                    Ok(Ok(o)) => say(
                        json,
                        &format!(
                            "soak: rank {} finished {} iterations",
                            o.comm.rank(),
                            o.iterations
                        ),
                        serde_json::json!({"job": "soak", "ok": true, "rank": o.comm.rank(),
                            "iterations": o.iterations}),
                    ),
                    Ok(Err(e)) => {
                        ok = false;
                        soak_failed(json, e.to_string())
                    }
                    Err(e) => {
                        ok = false;
                        soak_failed(json, e.to_string())
                    }
                };
                result = result.and(line);
            }
            (
                if ok {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(EXIT_CHECK_FAILED)
                },
                result,
            )
        }
    };
    if tokio::time::timeout(SHUTDOWN_TIMEOUT, cluster.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("cluster shutdown did not finish within {SHUTDOWN_TIMEOUT:?}");
    }
    printed(result)?;
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nexar").chain(args.iter().copied()))
    }

    /// tokio's thread-count variable is checked before the runtime starts: a count out of
    /// range, or not a number, is a usage error (tokio would panic on it).
    #[test]
    fn the_runtime_thread_variable_takes_only_a_count_in_range() {
        use std::ffi::OsStr;
        assert_eq!(env_worker_threads(None), Ok(None));
        assert_eq!(env_worker_threads(Some(OsStr::new("3"))), Ok(Some(3)));
        assert_eq!(env_worker_threads(Some(OsStr::new("1024"))), Ok(Some(1024)));
        for bad in ["0", "1025", "-1", "two", "", "18446744073709551616"] {
            let refused = env_worker_threads(Some(OsStr::new(bad)));
            assert!(
                refused
                    .as_ref()
                    .is_err_and(|e| e.contains(WORKER_THREADS_VAR)),
                "{bad:?}: {refused:?}"
            );
        }
    }

    #[test]
    fn world_defaults_to_four() {
        let cli = parse(&["local", "smoke"]).map_err(|e| e.to_string());
        let Ok(Cli {
            command: Command::Local(args),
            json: false,
            log: None,
        }) = cli
        else {
            panic!("unexpected parse: {cli:?}");
        };
        assert_eq!((args.world, &args.job), (4, &Job::Smoke));
    }

    #[test]
    fn global_flags_go_anywhere() {
        let cli = parse(&["local", "--world", "3", "info", "--json", "--log", "debug"])
            .map_err(|e| e.to_string());
        let Ok(Cli {
            command: Command::Local(args),
            json: true,
            log: Some(log),
        }) = cli
        else {
            panic!("unexpected parse: {cli:?}");
        };
        assert_eq!(
            (args.world, &args.job, log.as_str()),
            (3, &Job::Info, "debug")
        );
    }

    #[test]
    fn bad_arguments_are_usage_errors() {
        for args in [
            &["local", "--world", "0", "smoke"][..],
            &["local", "--world", "x", "smoke"],
            &["local"],
            &["bench"],
        ] {
            match parse(args) {
                Ok(cli) => panic!("{args:?} parsed as {cli:?}"),
                Err(e) => assert_eq!(e.exit_code(), i32::from(EXIT_USAGE), "{args:?}: {e}"),
            }
        }
        let err = parse(&["local", "--world", "0", "smoke"])
            .map(|_| ())
            .map_err(|e| e.to_string());
        assert!(
            matches!(&err, Err(msg) if msg.contains("at least one rank")),
            "{err:?}"
        );
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    /// A bad `--join` is a usage error that does not print the string: it holds the
    /// secret (one `/` too many put it in the address, which the error used to quote, and
    /// clap quotes a bad value whole).
    #[test]
    fn a_bad_join_string_is_refused_without_being_printed() {
        let secret = "ab".repeat(32);
        let fp = "cd".repeat(32);
        for join in [
            format!("nexar://127.0.0.1:1/{secret}/{fp}/"),
            format!("nexar://127.0.0.1:1/{secret}"),
            format!("nexar:/127.0.0.1:1/{secret}/{fp}"),
        ] {
            let parsed = Cli::try_parse_from(["nexar", "worker", "--join", &join, "smoke"]);
            let e = parsed.expect_err("a bad join string").to_string();
            assert!(e.contains("--join") && !e.contains(&secret[..16]), "{e}");
        }
        let good = format!("nexar://127.0.0.1:1/{secret}/{fp}");
        let parsed = Cli::try_parse_from(["nexar", "worker", "--join", &good, "smoke"]);
        assert!(parsed.is_ok(), "{parsed:?}");
    }

    /// Every `nexar seed` command the README and BENCHMARKS.md give inline with options
    /// parses (placeholders filled in): two lacked a required option.
    #[test]
    fn the_docs_seed_commands_parse() {
        let docs = [
            include_str!("../../../README.md"),
            include_str!("../../../BENCHMARKS.md"),
        ];
        let mut seen = 0;
        for doc in docs {
            let text = doc.replace('\n', " ");
            for cmd in text.split('`').skip(1).step_by(2) {
                if !cmd.starts_with("nexar seed --") || cmd.contains("--help") {
                    continue;
                }
                let filled = cmd
                    .replace("ADDR", "127.0.0.1:7000")
                    .replace("HOST", "127.0.0.1")
                    .replace(" N", " 4");
                let argv = filled.split_whitespace();
                match Cli::try_parse_from(argv) {
                    Ok(Cli {
                        command: Command::Seed(_),
                        ..
                    }) => seen += 1,
                    other => panic!("`{cmd}` does not parse as a seed: {other:?}"),
                }
            }
        }
        assert!(seen >= 3, "{seen} seed commands found");
    }
}
