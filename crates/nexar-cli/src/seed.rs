//! `nexar seed`: start a cluster's seed, print its join string, and serve the cluster.
//!
//! Only the join string goes to stdout (with `--json`, also the final summary), so
//! `JOIN=$( (nexar seed ... &) | head -1)` captures it; progress and the summary go to
//! stderr. Once the reader of stdout is gone, later writes to it fail with a broken pipe
//! (Rust ignores SIGPIPE), which the seed ignores so it keeps serving its workers.

use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use nexar_actors::{JoinString, Secret, Seed, SeedOptions};
use nexar_cli::{wait_finished_with_progress, wait_formed_with_progress, PROGRESS_POLL};

use crate::{printed, report, Failure, SeedArgs, EXIT_CHECK_FAILED};

/// `nexar seed --help`.
pub(crate) const LONG_ABOUT: &str = "\
Start the seed of a multi-process cluster of --world workers.

The seed prints the join string alone on the first line of standard output and flushes it; \
everything else (progress, the summary) goes to standard error, unless --json puts the \
summary on standard output as one JSON object after the join string. Capture the join \
string with:

  JOIN=$( (nexar seed --listen 0.0.0.0:7000 --advertise 10.0.0.1 --world 4 &) | head -1)

The join string holds the cluster secret: hand it to workers the way you would a password \
(NEXAR_JOIN in their environment keeps it out of `ps`). The secret is random unless \
--secret-file or NEXAR_SECRET (64 hex digits) gives one.

The seed waits up to --timeout seconds for every worker to join and the mesh to form, then \
serves the cluster until every worker has reported its job done (or left), prints a summary \
with every rank's mesh address, and exits.

With --max-world above --world the cluster is elastic: workers that join after formation \
wait (at most --timeout seconds) until the members reach a resize point with room for them \
(`nexar worker ... elastic` passes one every iteration); members may leave gracefully at a \
resize point as long as --min-world remain. The seed exits once every node that took part \
has reported.

Exit codes:
  0  every worker reported success
  1  at least one worker reported failure or left without reporting
  2  usage error (bad arguments, unreadable or malformed secret)
  3  the seed could not start, or the cluster did not form in time (the error names the \
missing ranks)";

/// Parses a secret: 64 hex digits, surrounding whitespace ignored. `source` names where it
/// came from, for the error.
fn parse_secret(text: &str, source: &str) -> Result<Secret, Failure> {
    let hex = text.trim();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Failure::usage(format!(
            "{source} must hold the cluster secret as 64 hex digits (e.g. from `openssl rand -hex 32`)"
        )));
    }
    Secret::from_hex(hex).map_err(|e| Failure::usage(format!("{source}: {e}")))
}

/// The secret from `--secret-file`, else `NEXAR_SECRET`, else `None` (the seed makes one).
fn secret(file: Option<&Path>) -> Result<Option<Secret>, Failure> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Failure::usage(format!("cannot read --secret-file {}: {e}", path.display()))
        })?;
        return parse_secret(&text, &format!("--secret-file {}", path.display())).map(Some);
    }
    match std::env::var("NEXAR_SECRET") {
        Ok(text) => parse_secret(&text, "NEXAR_SECRET").map(Some),
        Err(_) => Ok(None),
    }
}

/// Runs `nexar seed`.
pub(crate) async fn run(args: &SeedArgs, json: bool) -> Result<ExitCode, Failure> {
    let max_world = args.max_world.unwrap_or(args.world);
    if args.min_world > args.world || max_world < args.world {
        return Err(Failure::usage(format!(
            "world bounds must satisfy --min-world ({}) <= --world ({}) <= --max-world ({max_world})",
            args.min_world, args.world
        )));
    }
    let advertise = match &args.advertise {
        Some(a) => Some(a.for_listener(args.listen).map_err(Failure::usage)?),
        None => None,
    };
    let mut opts = SeedOptions::default();
    opts.secret = secret(args.secret_file.as_deref())?;
    opts.advertise = advertise.filter(|a| a.port() != 0);
    opts.formation_timeout = Duration::from_secs(args.timeout);
    opts.min_world = args.min_world;
    opts.max_world = args.max_world;
    let seed = Seed::start(args.listen, args.world, opts)
        .await
        .map_err(|e| match e {
            // Arguments the CLI lets through and the seed refuses (a world past the most a
            // peer list can carry): a usage error, as the CLI's own checks are.
            nexar_actors::NexarError::InvalidArgument(why) => Failure::usage(why),
            e => Failure::cluster(format!("could not start the seed on {}: {e}", args.listen)),
        })?;
    let bound = seed
        .local_addr()
        .map_err(|e| Failure::cluster(format!("the seed's address cannot be read: {e}")))?;
    let mut join: JoinString = seed.join_string().clone();
    if let Some(ip) = advertise.filter(|a| a.port() == 0) {
        join.seed = SocketAddr::new(ip.ip(), bound.port());
    }
    printed(print_join(&join))?;
    if bound.ip().is_unspecified() && args.advertise.is_none() {
        nexar_cli::say!(
            "warning: listening on all interfaces, but the join string names {}, which only \
             workers on this host can reach; pass --advertise with this host's address",
            join.seed
        );
    }
    nexar_cli::say!(
        "seed listening on {bound} for {} workers (join within {} s); workers join with: \
         nexar worker --join <the line above> smoke",
        args.world,
        args.timeout
    );
    let world = args.world;
    let formed = wait_formed_with_progress(&seed, PROGRESS_POLL, |admitted| {
        nexar_cli::say!("waiting for workers: {}/{world} joined", admitted.len());
    })
    .await;
    if let Err(e) = formed {
        // The workers that came are told why, before the seed goes.
        seed.close().await;
        return Err(Failure::cluster(format!(
            "{e} (after {} s; start the missing workers with the join string, check that \
             they can reach {} over UDP, or raise --timeout)",
            args.timeout, join.seed
        )));
    }
    nexar_cli::say!("cluster formed: {world}/{world} joined; serving until every worker is done");
    let report = wait_finished_with_progress(&seed, PROGRESS_POLL, |queued| {
        nexar_cli::say!("nodes waiting to join at the next resize point: {queued}");
    })
    .await;
    // Nodes still waiting to join are told the job finished, before the seed goes.
    seed.close().await;
    let report = report.map_err(|e| Failure::cluster(e.to_string()))?;
    // A reader that took only the join string is gone: ignore a broken pipe here too.
    if json {
        printed(report::seed(&mut io::stdout().lock(), &report, true))?;
    } else {
        printed(report::seed(&mut io::stderr().lock(), &report, false))?;
    }
    Ok(if report.succeeded() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CHECK_FAILED)
    })
}

/// Prints the join string alone on a line and flushes, so a reader gets it at once.
fn print_join(join: &JoinString) -> io::Result<()> {
    let mut out = io::stdout().lock();
    writeln!(out, "{join}")?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_64_hex_digits() {
        let hex = "ab".repeat(32);
        assert!(parse_secret(&format!(" {hex}\n"), "test").is_ok());
        for bad in ["", "abc", &"zz".repeat(32), &"ab".repeat(33)] {
            match parse_secret(bad, "NEXAR_SECRET") {
                Err(f) => assert!(f.message.contains("64 hex digits"), "{}", f.message),
                Ok(_) => panic!("{bad:?} accepted"),
            }
        }
    }
}
