//! A long-running job for fault tests: a loop of verified all-reduces that survives the
//! loss of ranks through automatic recovery.
//!
//! Its progress goes to `tracing` at `info` (target `nexar_cli::soak`): a line every
//! [`PROGRESS_EVERY`] iterations and one for each lost peer, so a fault test can strike
//! once the loop is running and tell afterwards where the fault hit it
//! (`nexar --log warn,nexar_cli::soak=info worker ... soak`).

use std::time::{Duration, Instant};

use nexar_actors::{Communicator, NexarError, NodeConfig, RecoveryPolicy};
use nexar_device::ReduceOp;

/// Iterations between two progress events.
const PROGRESS_EVERY: u64 = 500;

/// Node settings for the soak job: automatic recovery and quick failure detection (a
/// killed process sends no close, so heartbeats are what notice it).
pub fn soak_config() -> NodeConfig {
    let mut c = NodeConfig::default();
    c.recovery = RecoveryPolicy::Automatic;
    c.heartbeat_interval = Duration::from_millis(100);
    c.heartbeat_timeout = Duration::from_secs(2);
    c.op_timeout = Duration::from_secs(30);
    c
}

/// What one rank's soak loop ended with.
#[derive(Debug)]
pub struct SoakOutcome {
    /// The communicator in use at the end (smaller after a recovery).
    pub comm: Communicator,
    /// Iterations completed (agreed among the survivors after each recovery).
    pub iterations: u64,
    /// Recoveries this rank went through.
    pub recoveries: usize,
}

/// `elems` f64 zeros, the buffer of a job's all-reduces; `Err` says that the memory could not
/// be had (a count no allocator can serve, or more than the host will lend) where `vec!`
/// would panic or abort the process.
pub(crate) fn f64_buffer(elems: usize) -> Result<Vec<f64>, String> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(elems)
        .map_err(|e| format!("could not allocate {elems} f64 elements: {e}"))?;
    buf.resize(elems, 0.0);
    Ok(buf)
}

/// Runs `iters` all-reduces of `elems` f64 values, checking each result exactly. On a lost
/// peer it takes the rebuilt communicator from automatic recovery, agrees with the other
/// survivors on the iteration to resume from, and goes on.
///
/// Every 500 iterations it logs (`info`) `soak: rank R at iteration I of N
/// (world W); longest all-reduce since the last report: T ms`, the longest being how long a
/// fault stalled the loop; for each lost peer, `soak: rank R lost rank L at iteration I of N;
/// resuming at iteration J on world W`.
///
/// `Err` also when the buffer of `elems` values cannot be allocated (before anything runs).
pub async fn soak_rank(
    comm: Communicator,
    iters: u64,
    elems: usize,
) -> Result<SoakOutcome, String> {
    let mut rec = comm.recoveries();
    let mut comm = comm;
    let mut i = 0u64;
    let mut recoveries = 0;
    let mut buf = f64_buffer(elems)?;
    let mut longest = Duration::ZERO;
    while i < iters {
        buf.fill(i as f64);
        let started = Instant::now();
        match comm.all_reduce(&mut buf, ReduceOp::Sum).await {
            Ok(()) => {
                longest = longest.max(started.elapsed());
                let want = (i * comm.world_size() as u64) as f64;
                if let Some(bad) = buf.iter().find(|x| **x != want) {
                    return Err(format!("iteration {i}: got {bad}, want {want}"));
                }
                i += 1;
                if i % PROGRESS_EVERY == 0 {
                    tracing::info!(
                        "soak: rank {} at iteration {i} of {iters} (world {}); longest \
                         all-reduce since the last report: {} ms",
                        comm.rank(),
                        comm.world_size(),
                        longest.as_millis()
                    );
                    longest = Duration::ZERO;
                }
            }
            Err(NexarError::PeerLost { rank, .. }) => {
                let next = tokio::time::timeout(Duration::from_secs(60), rec.next())
                    .await
                    .map_err(|_| format!("no recovery within 60 s after losing rank {rank}"))?
                    .ok_or("recovery stopped")?
                    .map_err(|e| format!("recovery failed: {e}"))?;
                let mut at = [i];
                next.all_reduce(&mut at, ReduceOp::Max)
                    .await
                    .map_err(|e| format!("resuming after recovery: {e}"))?;
                tracing::info!(
                    "soak: rank {} lost rank {rank} at iteration {i} of {iters}; resuming at \
                     iteration {} on world {}",
                    comm.rank(),
                    at[0],
                    next.world_size()
                );
                i = at[0];
                comm = next;
                recoveries += 1;
            }
            Err(e) => return Err(format!("iteration {i}: {e}")),
        }
    }
    Ok(SoakOutcome {
        comm,
        iterations: i,
        recoveries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_that_cannot_be_had_is_an_error_not_an_abort() {
        assert_eq!(f64_buffer(3), Ok(vec![0.0; 3]));
        // More than any Vec may hold (2^64 bytes), and 4 PiB, beyond any address space.
        for elems in [1usize << 61, 1 << 49] {
            let err = f64_buffer(elems);
            assert!(
                matches!(&err, Err(m) if m.starts_with(&format!(
                    "could not allocate {elems} f64 elements: memory allocation failed"
                ))),
                "{elems}: {err:?}"
            );
        }
    }
}
