//! `nexar worker`: join a multi-process cluster through its seed and run a job as one rank.

use std::io;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nexar_actors::{
    from_env_vars, with_env_overrides, BootstrapError, JoinOptions, NexarError, Node,
};
use nexar_cli::{mesh_addr, node_info, run_smoke_rank};

use crate::{
    affinity, printed, report, Failure, Job, WorkerArgs, EXIT_CHECK_FAILED, SHUTDOWN_TIMEOUT,
};

/// `nexar worker --help`.
pub(crate) const LONG_ABOUT: &str = "\
Join a multi-process cluster through its seed and run a job as one of its ranks.

  nexar worker --join \"$JOIN\" smoke

`smoke` runs this rank's part of every check (all workers of the cluster must run it) and \
prints this rank's results; `bench` runs this rank's part of the benchmark (all workers \
must run it with the same options) and rank 0 prints the table; `info` prints this rank, the world size, the node id and the \
mesh address peers dial; `soak` loops verified all-reduces and carries on after losing \
ranks; `elastic` loops resize points and verified all-reduces while workers join (a seed \
started with --max-world) and leave (SIGTERM). Each worker then reports to the seed \
whether its job succeeded. --trusted-fabric (on every worker) sends data over plaintext \
TCP between the workers: only on a network where nobody untrusted can read or alter \
packets. \
With --json, every line is a JSON object: for `info` and `smoke` the first describes this rank \
(`{\"world\",\"rank\",\"node\",\"addr\"}`) and, for `smoke`, one line per check and a summary \
follow, as for `nexar local`; `bench` prints (on rank 0) one object per row; `soak` one per rank \
(`{\"job\",\"ok\",...}`), `elastic` one per event (`{\"job\",\"event\"}`) and its outcome \
(`{\"job\",\"ok\",...}`).

Without --join, the worker reads how to join from the environment, so launchers just work \
(the rank, world size and addresses are read with --join too):
  NEXAR_JOIN                                    the join string; without it, all of:
    NEXAR_SEED, or MASTER_ADDR and MASTER_PORT  the seed address
    NEXAR_SECRET or NEXAR_SECRET_FILE           the cluster secret (64 hex digits)
    NEXAR_SEED_FINGERPRINT                      the seed certificate's SHA-256 (64 hex digits)
  NEXAR_RANK, RANK or SLURM_PROCID              the rank to ask for
  NEXAR_WORLD_SIZE, WORLD_SIZE or SLURM_NTASKS  checked against the cluster's world size
                                                (not by the elastic job, whose size changes)
  NEXAR_LISTEN, NEXAR_ADVERTISE                 as --listen and --advertise
  NEXAR_LOCAL_WORKERS, LOCAL_WORLD_SIZE,        workers on this host: the runtime gets
    OMPI_COMM_WORLD_LOCAL_SIZE or               CPUs / workers threads (at least 1)
    SLURM_NTASKS_PER_NODE                       unless --threads says otherwise
  NEXAR_LOCAL_RANK, LOCAL_RANK,                 this worker's place among them, which
    OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID picks the CPUs it binds to, where the
                                                count above agrees with the ranks at its
                                                IP (else its place by rank among those;
                                                see --no-bind-cpus)
Options given on the command line override these.

Exit codes:
  0  the job succeeded (smoke: every check passed on this rank)
  1  the job failed on this rank: a smoke check failed, the bench got a wrong result or \
an operation failed, or the soak or elastic loop failed
  2  usage error (bad arguments, or no --join and no launcher environment)
  3  could not join: seed unreachable, wrong secret, the server is not the seed \
(fingerprint mismatch), rank refused, the cluster did not form, or the launcher's world \
size disagrees with the seed's; also a job that panicked";

/// Runtime threads for a worker without `--threads`: the host's `cpus` shared among the
/// workers on this host when a launcher variable (read through `get`) says how many there
/// are, at least 1; `None` (one per CPU) when none does. Several workers each with a
/// thread per CPU wake each other across threads for every message (BENCHMARKS.md).
pub(crate) fn default_threads(cpus: usize, get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    let local = affinity::local_workers(&get)?;
    Some((cpus / local).max(1))
}

/// Binds this worker's threads to CPUs of its own when other workers of the cluster share
/// its host and it runs fewer runtime threads than the CPUs it may use (`--threads`, or a
/// launcher's count of local workers), and no CPU quota sets its share: see `affinity`.
/// Says what it did; a failure to bind is a warning, not an error.
#[cfg(target_os = "linux")]
fn bind_cpus(addrs: &[std::net::SocketAddr], rank: usize) {
    let (index, count) = affinity::host_place(addrs, rank, |k| std::env::var(k).ok());
    if count < 2 {
        return;
    }
    let threads = tokio::runtime::Handle::current().metrics().num_workers();
    let bound = affinity::allowed_cpus().and_then(|allowed| {
        let usable = std::thread::available_parallelism().map_or(allowed.len(), |n| n.get());
        match affinity::cpus_for(&allowed, usable, index, threads) {
            Some(cpus) => affinity::bind_process(&cpus).map(Some),
            None => Ok(None),
        }
    });
    match bound {
        Ok(Some(cpus)) => nexar_cli::say!(
            "bound to CPU {} (worker {index} of {count} on this host; --no-bind-cpus to leave \
             the threads unbound)",
            affinity::cpu_list(&cpus)
        ),
        Ok(None) => {}
        Err(e) => nexar_cli::say!("warning: could not bind this worker's threads to CPUs: {e}"),
    }
}

/// Binding threads to CPUs is for Linux only: elsewhere the threads stay free.
#[cfg(not(target_os = "linux"))]
fn bind_cpus(_addrs: &[std::net::SocketAddr], _rank: usize) {}

/// How often to say that the join is still in progress.
const JOIN_PROGRESS: Duration = Duration::from_secs(5);

/// Runs `nexar worker`.
pub(crate) async fn run(args: &WorkerArgs, json: bool) -> Result<ExitCode, Failure> {
    let (mut opts, launcher) = options(args, |k| std::env::var(k).ok())?;
    opts.config = args.job.node_config();
    opts.config.trusted_fabric = args.trusted_fabric;
    // The workers reach `finish` together (past the closing barrier); leave room within
    // the shutdown bound for the report to the seed and the close.
    opts.config.finish_timeout = SHUTDOWN_TIMEOUT / 2;
    let seed = opts.join.seed;
    let advertise = opts.advertise;
    nexar_cli::say!("joining the cluster through seed {seed}");
    let mut node = join_with_progress(opts)
        .await
        .map_err(|e| join_failure(&e, launcher.rank_from))?;
    let comm = node.communicator();
    let (rank, world) = (comm.rank(), comm.world_size());
    nexar_cli::say!("joined as rank {rank} of {world}");
    // Not for the elastic job: its ranks, and so the workers' places, change as it runs.
    if !args.no_bind_cpus && !matches!(args.job, Job::Elastic { .. }) {
        bind_cpus(node.mesh_addrs(), rank);
    }
    if let Some(mismatch) = launcher.world_mismatch(world, &args.job) {
        finish(node, false).await;
        return Err(Failure::cluster(mismatch));
    }
    let mesh = node
        .local_addr()
        .ok()
        .map(|b| mesh_addr(b, advertise, seed));
    let info = node_info(&node, mesh);
    let mut closing = Some(comm.clone());
    let (ok, result) = match &args.job {
        Job::Elastic {
            iters,
            elems,
            pace_ms,
        } => {
            let opts = nexar_cli::ElasticOptions {
                iters: *iters,
                elems: *elems,
                pace: Duration::from_millis(*pace_ms),
            };
            let stop = stop_on_sigterm()?;
            let mut written = Ok(());
            let outcome = nexar_cli::elastic_rank(&mut node, opts, &stop, |line| {
                if written.is_ok() {
                    let event = serde_json::json!({"job": "elastic", "event": &line});
                    written = crate::say(json, &line, event);
                }
            })
            .await;
            let rank = node.rank();
            let (ok, line) = match outcome {
                Ok(o) if o.left => {
                    closing = None;
                    let text = format!(
                        "elastic: left the cluster at iteration {} (world {} before)",
                        o.iterations, o.world
                    );
                    let value = serde_json::json!({"job": "elastic", "ok": true, "left": true,
                        "iterations": o.iterations, "world": o.world});
                    (true, crate::say(json, &text, value))
                }
                Ok(o) => {
                    closing = Some(node.communicator());
                    let text = format!(
                        "elastic: rank {rank} stopped at iteration {}; world {}",
                        o.iterations, o.world
                    );
                    let value = serde_json::json!({"job": "elastic", "ok": true, "left": false,
                        "rank": rank, "iterations": o.iterations, "world": o.world});
                    (true, crate::say(json, &text, value))
                }
                Err(e) => {
                    closing = Some(node.communicator());
                    let text = format!("elastic: FAIL on node {rank}: {e}");
                    let value = serde_json::json!({"job": "elastic", "ok": false,
                        "rank": rank, "error": e});
                    (false, crate::say(json, &text, value))
                }
            };
            (ok, written.and(line))
        }
        Job::Bench(bench) => match crate::bench::rank(&comm, bench, json).await {
            Ok(outcome) => outcome,
            Err(usage) => {
                finish(node, false).await;
                return Err(usage);
            }
        },
        Job::Smoke => {
            let results = run_smoke_rank(&comm).await;
            let ok = results.iter().all(|r| r.ok());
            let mut out = io::stdout().lock();
            let result = report::info(&mut out, &info, json)
                .and_then(|()| report::smoke(&mut out, &results, Some(rank), json));
            (ok, result)
        }
        Job::Info => (true, report::info(&mut io::stdout().lock(), &info, json)),
        Job::Soak { iters, elems } => {
            match nexar_cli::soak_rank(comm.clone(), *iters, *elems).await {
                Ok(o) => {
                    let world = o.comm.world_size();
                    let text = format!(
                        "soak: rank {rank} finished {} iterations; world {world} after {} \
                         recoveries",
                        o.iterations, o.recoveries
                    );
                    let value = serde_json::json!({"job": "soak", "ok": true, "rank": rank,
                        "iterations": o.iterations, "world": world, "recoveries": o.recoveries});
                    closing = Some(o.comm);
                    (true, crate::say(json, &text, value))
                }
                Err(e) => {
                    let text = format!("soak: FAIL on rank {rank}: {e}");
                    let value = serde_json::json!({"job": "soak", "ok": false, "rank": rank,
                        "error": e.to_string()});
                    (false, crate::say(json, &text, value))
                }
            }
        }
    };
    // Leave together: a rank that closed its connections while a peer still waited for its
    // last messages would fail that peer. (A node that left the cluster is already out.)
    if let Some(comm) = closing {
        match tokio::time::timeout(SHUTDOWN_TIMEOUT, comm.barrier()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => nexar_cli::say!("warning: the closing barrier failed: {e}"),
            Err(_) => nexar_cli::say!(
                "warning: the other ranks did not reach the closing barrier within {} s",
                SHUTDOWN_TIMEOUT.as_secs()
            ),
        }
    }
    finish(node, ok).await;
    printed(result)?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CHECK_FAILED)
    })
}

/// What the launcher's environment said of this worker, for errors that name it.
#[derive(Debug, Default)]
struct Launcher {
    /// The world size it expects, and the variable that said so.
    world: Option<(usize, &'static str)>,
    /// The variable the rank asked for came from (not when `--rank` set it).
    rank_from: Option<&'static str>,
}

impl Launcher {
    /// What is wrong when the launcher's world size is not the `world` this node joined.
    /// Not checked for the elastic job, whose world changes as it runs: a node that joins
    /// it while it runs gets whatever size the resize point that admits it makes, and
    /// leaving then would fail the members' next collective.
    fn world_mismatch(&self, world: usize, job: &Job) -> Option<String> {
        if matches!(job, Job::Elastic { .. }) {
            return None;
        }
        nexar_actors::world_mismatch(self.world, world)
    }
}

/// Join options from `--join` or the launcher environment, with the command line's
/// overrides, and what the launcher said.
fn options(
    args: &WorkerArgs,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(JoinOptions, Launcher), Failure> {
    let env = match &args.join {
        Some(join) => with_env_overrides(join.clone(), env)
            .map_err(|e| Failure::usage(format!("bad launcher variable: {e}")))?,
        None => from_env_vars(env).map_err(|e| {
            Failure::usage(format!(
                "no --join given, and the environment does not say how to join: {e}"
            ))
        })?,
    };
    let mut launcher = Launcher {
        world: env.expected_world.zip(env.world_from),
        rank_from: env.rank_from,
    };
    let mut opts = env.options;
    if let Some(listen) = args.listen {
        opts.listen = listen;
    }
    if let Some(advertise) = &args.advertise {
        // Against the socket the node binds (`[::]` for 0.0.0.0 with an IPv6 seed).
        let listener = opts.mesh_listen();
        opts.advertise = Some(advertise.for_listener(listener).map_err(Failure::usage)?);
    }
    if let Some(rank) = args.rank {
        opts.rank = Some(rank);
        launcher.rank_from = None;
    }
    opts.timeout = Duration::from_secs(args.timeout);
    if opts.advertise.is_some_and(|a| a.port() == 0) {
        return Err(Failure::usage(
            "--advertise needs the port peers dial; give --listen a fixed port and \
             --advertise HOST:THAT_PORT",
        ));
    }
    Ok((opts, launcher))
}

/// [`Node::join`], saying every few seconds that it is still waiting (admission, and then
/// the other workers, can take a while). Bounded by the join's own deadlines.
async fn join_with_progress(opts: JoinOptions) -> Result<Node, NexarError> {
    let started = Instant::now();
    let join = Node::join(opts);
    tokio::pin!(join);
    loop {
        match tokio::time::timeout(JOIN_PROGRESS, &mut join).await {
            Ok(joined) => return joined,
            Err(_) => nexar_cli::say!(
                "still joining: waiting for the seed and the other workers ({} s)",
                started.elapsed().as_secs()
            ),
        }
    }
}

/// What to tell the user when joining failed, and what to do about it.
fn join_failure(e: &NexarError, rank_from: Option<&str>) -> Failure {
    if let NexarError::InvalidArgument(why) = e {
        // An argument the node refuses before it reaches the seed (a rank out of range).
        let from = rank_from.map_or(String::new(), |var| format!(" (from {var})"));
        return Failure::usage(format!("could not join the cluster: {why}{from}"));
    }
    let advice = match e {
        NexarError::Bootstrap(BootstrapError::Refused(reason)) if reason.contains("secret") => {
            "; the join string's secret is not this cluster's: use the join string the seed \
             printed"
                .to_string()
        }
        NexarError::Bootstrap(BootstrapError::Refused(reason)) if reason.contains("rank") => {
            match rank_from {
                Some(var) => format!(
                    "; the rank was asked for by {var} in the environment (a launcher's): pass \
                     --rank, or unset it"
                ),
                None => String::new(),
            }
        }
        NexarError::Bootstrap(BootstrapError::FingerprintMismatch(_)) => {
            "; check the address, or take the join string the seed printed (a restarted seed \
             has a new certificate)"
                .to_string()
        }
        NexarError::Bootstrap(BootstrapError::Formation(_)) => {
            "; every worker must join before the seed's --timeout".to_string()
        }
        NexarError::Bootstrap(BootstrapError::Resize(_)) => {
            "; a node joining a running cluster waits for its members to reach a resize point \
             with room (the elastic job) within the seed's --timeout"
                .to_string()
        }
        _ => String::new(),
    };
    Failure::cluster(format!("could not join the cluster: {e}{advice}"))
}

/// A flag that SIGTERM sets (the elastic job then leaves at its next resize point). A
/// second SIGTERM ends the process at once, as SIGTERM does by default (exit status 143):
/// watching for it replaced that default for good, and a leave that the cluster keeps
/// refusing (its minimum world) would otherwise leave only SIGKILL to stop the worker.
fn stop_on_sigterm() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>, Failure> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::signal::unix::{signal, SignalKind};
    let flag = std::sync::Arc::new(AtomicBool::new(false));
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Failure::cluster(format!("cannot watch for SIGTERM: {e}")))?;
    let set = flag.clone();
    tokio::spawn(async move {
        if term.recv().await.is_some() {
            nexar_cli::say!(
                "SIGTERM: leaving the cluster at the next resize point (a second SIGTERM \
                 exits at once)"
            );
            set.store(true, Ordering::Release);
        }
        if term.recv().await.is_some() {
            nexar_cli::say!("second SIGTERM: exiting now, without leaving the cluster");
            std::process::exit(SIGTERM_EXIT);
        }
    });
    Ok(flag)
}

/// The exit status of a worker ended by a second SIGTERM: a shell's for a process that
/// SIGTERM ended (128 + 15).
const SIGTERM_EXIT: i32 = 143;

/// Reports the job's outcome to the seed and leaves, giving up after a bound.
async fn finish(node: Node, ok: bool) {
    if tokio::time::timeout(SHUTDOWN_TIMEOUT, node.finish(ok))
        .await
        .is_err()
    {
        tracing::warn!("leaving the cluster did not finish within {SHUTDOWN_TIMEOUT:?}");
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    #[test]
    fn threads_are_shared_among_the_workers_a_launcher_reports() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(default_threads(2, env(&[])), None);
        assert_eq!(
            default_threads(2, env(&[("LOCAL_WORLD_SIZE", "4")])),
            Some(1)
        );
        assert_eq!(
            default_threads(16, env(&[("LOCAL_WORLD_SIZE", "4")])),
            Some(4)
        );
        assert_eq!(
            default_threads(16, env(&[("SLURM_NTASKS_PER_NODE", "8")])),
            Some(2)
        );
        // Ours first; unreadable or zero values are ignored.
        assert_eq!(
            default_threads(
                8,
                env(&[("NEXAR_LOCAL_WORKERS", "2"), ("LOCAL_WORLD_SIZE", "8")])
            ),
            Some(4)
        );
        assert_eq!(
            default_threads(8, env(&[("SLURM_NTASKS_PER_NODE", "2(x3)")])),
            None
        );
        assert_eq!(default_threads(8, env(&[("LOCAL_WORLD_SIZE", "0")])), None);
    }

    fn worker_args(args: &[&str]) -> WorkerArgs {
        use clap::Parser;
        let argv = ["nexar", "worker"].into_iter().chain(args.iter().copied());
        match crate::Cli::try_parse_from(argv).map(|cli| cli.command) {
            Ok(crate::Command::Worker(w)) => w,
            other => panic!("not a worker command: {other:?}"),
        }
    }

    #[test]
    fn a_join_string_on_the_command_line_keeps_the_launchers_rank_and_addresses() {
        let join = nexar_actors::JoinString {
            seed: "127.0.0.1:7000".parse().expect("addr"),
            secret: nexar_actors::Secret([1; 32]),
            fingerprint: [2; 32],
        }
        .to_string();
        let launcher = |k: &str| {
            [
                ("RANK", "3"),
                ("WORLD_SIZE", "4"),
                ("NEXAR_LISTEN", "0.0.0.0:9000"),
            ]
            .iter()
            .find(|(name, _)| *name == k)
            .map(|(_, v)| v.to_string())
        };
        let (opts, said) = options(&worker_args(&["--join", &join, "info"]), launcher)
            .map_err(|f| f.message)
            .expect("options");
        assert_eq!(opts.rank, Some(3));
        assert_eq!(
            (said.world, said.rank_from),
            (Some((4, "WORLD_SIZE")), Some("RANK"))
        );
        assert_eq!(opts.listen, "0.0.0.0:9000".parse().expect("addr"));
        // The command line wins over the launcher.
        let args = worker_args(&[
            "--join",
            &join,
            "--rank",
            "1",
            "--listen",
            "127.0.0.1:9001",
            "--advertise",
            "localhost:9001",
            "info",
        ]);
        let (opts, said) = options(&args, launcher)
            .map_err(|f| f.message)
            .expect("options");
        assert_eq!((opts.rank, said.rank_from), (Some(1), None));
        assert_eq!(opts.listen, "127.0.0.1:9001".parse().expect("addr"));
        assert_eq!(
            opts.advertise,
            Some("127.0.0.1:9001".parse().expect("addr"))
        );
        let bad = worker_args(&[
            "--join",
            &join,
            "--listen",
            "127.0.0.1:0",
            "--advertise",
            "::1",
            "info",
        ]);
        let err = options(&bad, |_: &str| None)
            .map(|_| ())
            .expect_err("family");
        assert_eq!(err.code, crate::EXIT_USAGE);
        // With an IPv6 seed, 0.0.0.0 binds [::], which answers IPv6.
        let v6 = nexar_actors::JoinString {
            seed: "[::1]:7000".parse().expect("addr"),
            secret: nexar_actors::Secret([1; 32]),
            fingerprint: [2; 32],
        }
        .to_string();
        let args = worker_args(&[
            "--join",
            &v6,
            "--listen",
            "0.0.0.0:9002",
            "--advertise",
            "[::1]:9002",
            "info",
        ]);
        let (opts, _) = options(&args, |_: &str| None)
            .map_err(|f| f.message)
            .expect("options");
        assert_eq!(opts.advertise, Some("[::1]:9002".parse().expect("addr")));
    }

    /// A launcher's world size that is not the cluster's fails a job, but not the elastic
    /// job, whose world changes as it runs (a node joining it mid-run would otherwise leave
    /// at once and fail the members' next collective).
    #[test]
    fn the_launchers_world_size_is_checked_except_for_the_elastic_job() {
        let launcher = Launcher {
            world: Some((1, "SLURM_NTASKS")),
            rank_from: None,
        };
        let smoke = worker_args(&["smoke"]).job;
        let elastic = worker_args(&["elastic"]).job;
        let said = launcher.world_mismatch(3, &smoke).expect("a mismatch");
        assert!(
            said.contains("SLURM_NTASKS") && said.contains("--world 1"),
            "{said}"
        );
        assert_eq!(launcher.world_mismatch(1, &smoke), None);
        assert_eq!(launcher.world_mismatch(3, &elastic), None);
    }

    #[test]
    fn join_failures_say_what_to_do() {
        let addr: SocketAddr = "127.0.0.1:7000".parse().expect("addr");
        let secret = join_failure(
            &NexarError::Bootstrap(BootstrapError::Refused("wrong cluster secret".into())),
            None,
        );
        assert_eq!(secret.code, crate::EXIT_CLUSTER);
        assert!(secret.message.contains("secret"), "{}", secret.message);
        let fp = join_failure(
            &NexarError::Bootstrap(BootstrapError::FingerprintMismatch(addr)),
            None,
        );
        assert!(fp.message.contains("not the seed"), "{}", fp.message);
        let gone = join_failure(
            &NexarError::Bootstrap(BootstrapError::SeedUnreachable {
                addr,
                reason: "timed out".into(),
            }),
            None,
        );
        assert!(gone.message.contains("unreachable"), "{}", gone.message);
        // A rank another worker holds, asked for by a launcher's variable: named.
        let taken = || {
            NexarError::Bootstrap(BootstrapError::Refused(
                "rank 0 is already taken by another node".into(),
            ))
        };
        let named = join_failure(&taken(), Some("SLURM_PROCID"));
        assert!(named.message.contains("SLURM_PROCID"), "{}", named.message);
        let plain = join_failure(&taken(), None);
        assert!(!plain.message.contains("environment"), "{}", plain.message);
    }
}
