//! `nexar worker`: join a multi-process cluster through its seed and run a job as one rank.

use std::io;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nexar_actors::{from_env_vars, BootstrapError, JoinOptions, NexarError, Node};
use nexar_cli::{mesh_addr, node_info, run_smoke_rank};

use crate::{printed, report, Failure, Job, WorkerArgs, EXIT_CHECK_FAILED, SHUTDOWN_TIMEOUT};

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
With --json, the first line describes this rank (`{\"world\",\"rank\",\"node\",\"addr\"}`) and, for \
`smoke`, one line per check and a summary follow, as for `nexar local`.

Without --join, the worker reads how to join from the environment, so launchers just work:
  NEXAR_JOIN                                    the join string; without it, all of:
    NEXAR_SEED, or MASTER_ADDR and MASTER_PORT  the seed address
    NEXAR_SECRET or NEXAR_SECRET_FILE           the cluster secret (64 hex digits)
    NEXAR_SEED_FINGERPRINT                      the seed certificate's SHA-256 (64 hex digits)
  NEXAR_RANK, RANK or SLURM_PROCID              the rank to ask for
  NEXAR_WORLD_SIZE, WORLD_SIZE or SLURM_NTASKS  checked against the seed's world size
  NEXAR_LISTEN, NEXAR_ADVERTISE                 as --listen and --advertise
  NEXAR_LOCAL_WORKERS, LOCAL_WORLD_SIZE,        workers on this host: the runtime gets
    OMPI_COMM_WORLD_LOCAL_SIZE or               CPUs / workers threads (at least 1)
    SLURM_NTASKS_PER_NODE                       unless --threads says otherwise
Options given on the command line override these.

Exit codes:
  0  the job succeeded (smoke: every check passed on this rank)
  1  a smoke check failed on this rank
  2  usage error (bad arguments, or no --join and no launcher environment)
  3  could not join: seed unreachable, wrong secret, the server is not the seed \
(fingerprint mismatch), rank refused, or the cluster did not form";

/// Launcher variables that say how many workers share this host, in order of precedence.
const LOCAL_WORKERS_VARS: [&str; 4] = [
    "NEXAR_LOCAL_WORKERS",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
];

/// Runtime threads for a worker without `--threads`: the host's `cpus` shared among the
/// workers on this host when a launcher variable (read through `get`) says how many there
/// are, at least 1; `None` (one per CPU) when none does. Several workers each with a
/// thread per CPU wake each other across threads for every message (BENCHMARKS.md).
pub(crate) fn default_threads(cpus: usize, get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    let local = LOCAL_WORKERS_VARS
        .iter()
        .find_map(|k| get(k).and_then(|v| v.trim().parse::<usize>().ok()))
        .filter(|n| *n > 0)?;
    Some((cpus / local).max(1))
}

/// How often to say that the join is still in progress.
const JOIN_PROGRESS: Duration = Duration::from_secs(5);

/// Runs `nexar worker`.
pub(crate) async fn run(args: &WorkerArgs, json: bool) -> Result<ExitCode, Failure> {
    let (mut opts, expected_world) = options(args)?;
    opts.config = args.job.node_config();
    opts.config.trusted_fabric = args.trusted_fabric;
    let seed = opts.join.seed;
    let advertise = opts.advertise;
    eprintln!("joining the cluster through seed {seed}");
    let mut node = join_with_progress(opts)
        .await
        .map_err(|e| join_failure(&e))?;
    let comm = node.communicator();
    let (rank, world) = (comm.rank(), comm.world_size());
    eprintln!("joined as rank {rank} of {world}");
    if let Some(expected) = expected_world.filter(|w| *w != world) {
        finish(node, false).await;
        return Err(Failure::cluster(format!(
            "the launcher says the world has {expected} ranks, but the seed's cluster has \
             {world}; start the seed with --world {expected} or fix the launcher"
        )));
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
            let outcome = nexar_cli::elastic_rank(&mut node, opts, &stop, |line| {
                println!("{line}");
            })
            .await;
            match outcome {
                Ok(o) if o.left => {
                    println!(
                        "elastic: left the cluster at iteration {} (world {} before)",
                        o.iterations, o.world
                    );
                    closing = None;
                    (true, Ok(()))
                }
                Ok(o) => {
                    println!(
                        "elastic: rank {} stopped at iteration {}; world {}",
                        node.rank(),
                        o.iterations,
                        o.world
                    );
                    closing = Some(node.communicator());
                    (true, Ok(()))
                }
                Err(e) => {
                    println!("elastic: FAIL on node {}: {e}", node.rank());
                    closing = Some(node.communicator());
                    (false, Ok(()))
                }
            }
        }
        Job::Bench(bench) => crate::bench::rank(&comm, bench, json).await,
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
                    println!(
                        "soak: rank {rank} finished {} iterations; world {} after {} recoveries",
                        o.iterations,
                        o.comm.world_size(),
                        o.recoveries
                    );
                    closing = Some(o.comm);
                    (true, Ok(()))
                }
                Err(e) => {
                    println!("soak: FAIL on rank {rank}: {e}");
                    (false, Ok(()))
                }
            }
        }
    };
    // Leave together: a rank that closed its connections while a peer still waited for its
    // last messages would fail that peer. (A node that left the cluster is already out.)
    if let Some(comm) = closing {
        match tokio::time::timeout(SHUTDOWN_TIMEOUT, comm.barrier()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("warning: the closing barrier failed: {e}"),
            Err(_) => eprintln!(
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

/// Join options from `--join` or the launcher environment, with the command line's
/// overrides, and the world size the launcher expects.
fn options(args: &WorkerArgs) -> Result<(JoinOptions, Option<usize>), Failure> {
    let (mut opts, expected_world) = match &args.join {
        Some(join) => (JoinOptions::new(join.clone()), None),
        None => {
            let env = from_env_vars(|k| std::env::var(k).ok()).map_err(|e| {
                Failure::usage(format!(
                    "no --join given, and the environment does not say how to join: {e}"
                ))
            })?;
            (env.options, env.expected_world)
        }
    };
    if let Some(listen) = args.listen {
        opts.listen = listen;
    }
    if let Some(advertise) = args.advertise {
        opts.advertise = Some(advertise);
    }
    if let Some(rank) = args.rank {
        opts.rank = Some(rank);
    }
    opts.timeout = Duration::from_secs(args.timeout);
    if opts.advertise.is_some_and(|a| a.port() == 0) {
        return Err(Failure::usage(
            "--advertise needs the port peers dial; give --listen a fixed port and \
             --advertise HOST:THAT_PORT",
        ));
    }
    Ok((opts, expected_world))
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
            Err(_) => eprintln!(
                "still joining: waiting for the seed and the other workers ({} s)",
                started.elapsed().as_secs()
            ),
        }
    }
}

/// What to tell the user when joining failed, and what to do about it.
fn join_failure(e: &NexarError) -> Failure {
    let advice = match e {
        NexarError::Bootstrap(BootstrapError::Refused(reason)) if reason.contains("secret") => {
            "; the join string's secret is not this cluster's: use the join string the seed \
             printed"
        }
        NexarError::Bootstrap(BootstrapError::FingerprintMismatch(_)) => {
            "; check the address, or take the join string the seed printed (a restarted seed \
             has a new certificate)"
        }
        NexarError::Bootstrap(BootstrapError::Formation(_)) => {
            "; every worker must join before the seed's --timeout"
        }
        _ => "",
    };
    Failure::cluster(format!("could not join the cluster: {e}{advice}"))
}

/// A flag that SIGTERM sets (the elastic job then leaves at its next resize point).
fn stop_on_sigterm() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>, Failure> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::signal::unix::{signal, SignalKind};
    let flag = std::sync::Arc::new(AtomicBool::new(false));
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Failure::cluster(format!("cannot watch for SIGTERM: {e}")))?;
    let set = flag.clone();
    tokio::spawn(async move {
        if term.recv().await.is_some() {
            eprintln!("SIGTERM: leaving the cluster at the next resize point");
            set.store(true, Ordering::Release);
        }
    });
    Ok(flag)
}

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

    #[test]
    fn join_failures_say_what_to_do() {
        let addr: SocketAddr = "127.0.0.1:7000".parse().expect("addr");
        let secret = join_failure(&NexarError::Bootstrap(BootstrapError::Refused(
            "wrong cluster secret".into(),
        )));
        assert_eq!(secret.code, crate::EXIT_CLUSTER);
        assert!(secret.message.contains("secret"), "{}", secret.message);
        let fp = join_failure(&NexarError::Bootstrap(BootstrapError::FingerprintMismatch(
            addr,
        )));
        assert!(fp.message.contains("not the seed"), "{}", fp.message);
        let gone = join_failure(&NexarError::Bootstrap(BootstrapError::SeedUnreachable {
            addr,
            reason: "timed out".into(),
        }));
        assert!(gone.message.contains("unreachable"), "{}", gone.message);
    }
}
