//! The smoke test: every communicator operation, run on all ranks at once and verified
//! against values computed locally.
//!
//! A [`Check`] is a named per-rank async function. [`run_check`] spawns it once per
//! communicator under a shared deadline and folds the per-rank outcomes into one
//! [`CheckResult`]; [`run_smoke`] does that for every check in order.

mod checks;
mod verify;

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use nexar_actors::Communicator;

/// Deadline for one check on all ranks together.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(60);

/// What a per-rank check returns: `Err` carries a human-readable reason.
type RankFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// One named smoke check: a function every rank of a communicator runs together.
#[derive(Clone, Copy)]
pub struct Check {
    /// Short name, unique among [`checks`], used in reports (e.g. `"all_reduce"`).
    pub name: &'static str,
    run: fn(Communicator) -> RankFuture,
}

impl Check {
    /// Runs this check's part for one rank. Every rank of `comm` must call it (the checks
    /// use collectives); `Err` says what failed or did not match on this rank.
    pub async fn run_rank(&self, comm: Communicator) -> Result<(), String> {
        (self.run)(comm).await
    }
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Check")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Every smoke check, in the order [`run_smoke`] runs them.
pub fn checks() -> Vec<Check> {
    // Non-capturing closures coerce to `fn` pointers; boxing erases each async fn's type.
    vec![
        Check {
            name: "p2p_ring",
            run: |c| Box::pin(checks::p2p_ring(c)),
        },
        Check {
            name: "barrier",
            run: |c| Box::pin(checks::barrier(c)),
        },
        Check {
            name: "all_reduce",
            run: |c| Box::pin(checks::all_reduce(c)),
        },
        Check {
            name: "broadcast",
            run: |c| Box::pin(checks::broadcast(c)),
        },
        Check {
            name: "reduce",
            run: |c| Box::pin(checks::reduce(c)),
        },
        Check {
            name: "all_gather",
            run: |c| Box::pin(checks::all_gather(c)),
        },
        Check {
            name: "reduce_scatter",
            run: |c| Box::pin(checks::reduce_scatter(c)),
        },
        Check {
            name: "gather",
            run: |c| Box::pin(checks::gather(c)),
        },
        Check {
            name: "scatter",
            run: |c| Box::pin(checks::scatter(c)),
        },
        Check {
            name: "all_to_all",
            run: |c| Box::pin(checks::all_to_all(c)),
        },
        Check {
            name: "scan",
            run: |c| Box::pin(checks::scan(c)),
        },
        Check {
            name: "exclusive_scan",
            run: |c| Box::pin(checks::exclusive_scan(c)),
        },
        Check {
            name: "split",
            run: |c| Box::pin(checks::split(c)),
        },
    ]
}

/// The outcome of one check across all ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckResult {
    /// The check's name ([`Check::name`]).
    pub name: &'static str,
    /// How many ranks ran it.
    pub ranks: usize,
    /// Wall-clock time from starting the first rank to the last rank finishing.
    pub elapsed: Duration,
    /// `None` on success; otherwise the first failing rank's reason, prefixed with its
    /// rank, and how many other ranks failed.
    pub error: Option<String>,
}

impl CheckResult {
    /// Whether every rank passed.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// Runs `check` on every communicator concurrently (one tokio task per rank) and waits
/// for all of them, each under `timeout`.
///
/// A rank that fails early can leave the others waiting in a collective until the
/// deadline; after a failure the communicators may also be out of step, so later checks
/// on the same communicators can fail as a consequence.
pub async fn run_check(check: &Check, comms: &[Communicator], timeout: Duration) -> CheckResult {
    let started = Instant::now();
    let tasks: Vec<_> = comms
        .iter()
        .map(|comm| {
            let (check, comm) = (*check, comm.clone());
            let rank = comm.rank();
            let task = tokio::spawn(async move {
                match tokio::time::timeout(timeout, check.run_rank(comm)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(format!("timed out after {} s", timeout.as_secs_f64())),
                }
            });
            (rank, task)
        })
        .collect();
    let mut failures = Vec::new();
    for (rank, task) in tasks {
        let outcome = task
            .await
            .unwrap_or_else(|e| Err(format!("task failed: {e}")));
        if let Err(reason) = outcome {
            failures.push(format!("rank {rank}: {reason}"));
        }
    }
    let error = match failures.len() {
        0 => None,
        1 => failures.pop(),
        n => Some(format!("{} (and {} more ranks)", failures[0], n - 1)),
    };
    CheckResult {
        name: check.name,
        ranks: comms.len(),
        elapsed: started.elapsed(),
        error,
    }
}

/// Runs every check in [`checks`] on `comms` (one communicator per rank, all of the same
/// group) with [`CHECK_TIMEOUT`] each, and returns one result per check, in order.
pub async fn run_smoke(comms: Vec<Communicator>) -> Vec<CheckResult> {
    let mut results = Vec::new();
    for check in checks() {
        let result = run_check(&check, &comms, CHECK_TIMEOUT).await;
        tracing::debug!(
            check = result.name,
            ok = result.ok(),
            ms = result.elapsed.as_millis(),
            "smoke check done"
        );
        results.push(result);
    }
    results
}

/// Runs this process's part of every check in [`checks`] on `comm`, in order, each under
/// [`CHECK_TIMEOUT`]: the single-rank counterpart of [`run_smoke`] for a process that
/// holds one rank of a multi-process cluster. Every other rank must run it too, in the same
/// order, or the checks wait for them until the deadline.
///
/// Each result's `ranks` is the communicator's world size, and its `error` is this rank's
/// reason prefixed with its rank (as in [`run_check`]).
pub async fn run_smoke_rank(comm: &Communicator) -> Vec<CheckResult> {
    let rank = comm.rank();
    let mut results = Vec::new();
    for check in checks() {
        let started = Instant::now();
        let outcome = match tokio::time::timeout(CHECK_TIMEOUT, check.run_rank(comm.clone())).await
        {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("timed out after {} s", CHECK_TIMEOUT.as_secs_f64())),
        };
        let result = CheckResult {
            name: check.name,
            ranks: comm.world_size(),
            elapsed: started.elapsed(),
            error: outcome.err().map(|reason| format!("rank {rank}: {reason}")),
        };
        tracing::debug!(
            check = result.name,
            ok = result.ok(),
            ms = result.elapsed.as_millis(),
            "smoke check done on this rank"
        );
        results.push(result);
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;
    use nexar_actors::Cluster;

    #[tokio::test(flavor = "multi_thread")]
    async fn failures_and_timeouts_name_the_rank() {
        let cluster = Cluster::local(2).await.expect("cluster forms");
        let comms = cluster.communicators();
        let fails_on_1 = Check {
            name: "fails_on_1",
            run: |c| {
                Box::pin(async move {
                    if c.rank() == 1 {
                        Err("bad value".into())
                    } else {
                        Ok(())
                    }
                })
            },
        };
        let result = run_check(&fails_on_1, &comms, CHECK_TIMEOUT).await;
        assert_eq!((result.name, result.ranks), ("fails_on_1", 2));
        assert_eq!(result.error.as_deref(), Some("rank 1: bad value"));

        // Nobody sends, so every rank waits for its deadline.
        let hangs = Check {
            name: "hangs",
            run: |c| {
                Box::pin(async move {
                    let mut buf = [0u8; 1];
                    c.recv(&mut buf, 0, 99).await.map_err(|e| e.to_string())
                })
            },
        };
        let result = run_check(&hangs, &comms, Duration::from_millis(200)).await;
        assert_eq!(
            result.error.as_deref(),
            Some("rank 0: timed out after 0.2 s (and 1 more ranks)")
        );
        cluster.shutdown().await;
    }

    #[test]
    fn check_names_are_unique() {
        let mut names: Vec<_> = checks().iter().map(|c| c.name).collect();
        let len = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), len);
    }
}
