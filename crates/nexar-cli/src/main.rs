//! `nexar`: run jobs on nexar clusters from the command line.
//!
//! This file parses arguments, sets up logging and the runtime, and maps outcomes to exit
//! codes; the jobs themselves live in the `nexar_cli` library and printing in `report`.

mod report;

use std::io;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use nexar_actors::Cluster;
use nexar_cli::{run_smoke, ClusterInfo};
use tracing_subscriber::EnvFilter;

/// Exit code when any smoke check fails.
const EXIT_CHECK_FAILED: u8 = 1;
/// Exit code for usage and setup errors (clap uses 2 for bad arguments too).
const EXIT_SETUP: u8 = 2;
/// How long to wait for a cluster to close its connections before exiting anyway.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

const LONG_ABOUT: &str = "\
Run jobs on nexar clusters: a distributed MPI-class runtime over QUIC.

`nexar local --world N smoke` starts N in-process ranks (each a full node with its own QUIC \
endpoint on 127.0.0.1) and verifies every operation on them.

Exit codes:
  0  success (for smoke: every check passed)
  1  at least one smoke check failed
  2  usage or setup error (bad arguments, bad log filter, cluster could not be formed)";

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(name = "nexar", version, about = "Run jobs on nexar clusters", long_about = LONG_ABOUT)]
struct Cli {
    /// Print machine-readable output: one JSON object per line.
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
}

#[derive(Debug, Args)]
struct LocalArgs {
    /// Number of ranks (at least 1).
    #[arg(long, global = true, default_value_t = 4, value_parser = parse_world)]
    world: usize,
    #[command(subcommand)]
    job: Job,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Subcommand)]
enum Job {
    /// Run every operation on all ranks and verify the results (exit 1 if any check fails).
    Smoke,
    /// Print the world size and each rank's node id and listen address.
    Info,
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

fn main() -> ExitCode {
    // Exits with 2 on bad arguments, 0 for --help and --version.
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_SETUP)
        }
    }
}

/// Runs the command; `Err` is a setup error, reported with exit code 2.
fn run(cli: Cli) -> Result<ExitCode, String> {
    init_logging(cli.log.as_deref())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("could not start the async runtime: {e}"))?;
    match cli.command {
        Command::Local(args) => runtime.block_on(local(&args, cli.json)),
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

async fn local(args: &LocalArgs, json: bool) -> Result<ExitCode, String> {
    let cluster = Cluster::local(args.world)
        .await
        .map_err(|e| format!("could not start a {}-rank local cluster: {e}", args.world))?;
    let (code, printed) = match args.job {
        Job::Smoke => {
            let results = run_smoke(cluster.communicators()).await;
            let code = if results.iter().all(|r| r.ok()) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_CHECK_FAILED)
            };
            (
                code,
                report::smoke(&mut io::stdout().lock(), &results, json),
            )
        }
        Job::Info => (
            ExitCode::SUCCESS,
            report::info(&mut io::stdout().lock(), &ClusterInfo::of(&cluster), json),
        ),
    };
    if tokio::time::timeout(SHUTDOWN_TIMEOUT, cluster.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("cluster shutdown did not finish within {SHUTDOWN_TIMEOUT:?}");
    }
    match printed {
        // A closed pipe (`nexar ... | head`) is the reader's choice, not our failure.
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => {
            Err(format!("could not write output: {e}"))
        }
        _ => Ok(code),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nexar").chain(args.iter().copied()))
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
        assert_eq!((args.world, args.job), (4, Job::Smoke));
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
            (args.world, args.job, log.as_str()),
            (3, Job::Info, "debug")
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
                Err(e) => assert_eq!(e.exit_code(), i32::from(EXIT_SETUP), "{args:?}: {e}"),
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
}
