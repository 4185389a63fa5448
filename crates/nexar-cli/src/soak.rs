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

/// Runs `iters` all-reduces of `elems` f64 values, checking each result exactly. On a lost
/// peer it takes the rebuilt communicator from automatic recovery, agrees with the other
/// survivors on the iteration to resume from, and goes on.
///
/// Every 500 iterations it logs (`info`) `soak: rank R at iteration I of N
/// (world W); longest all-reduce since the last report: T ms`, the longest being how long a
/// fault stalled the loop; for each lost peer, `soak: rank R lost rank L at iteration I of N;
/// resuming at iteration J on world W`.
pub async fn soak_rank(
    comm: Communicator,
    iters: u64,
    elems: usize,
) -> Result<SoakOutcome, String> {
    let mut rec = comm.recoveries();
    let mut comm = comm;
    let mut i = 0u64;
    let mut recoveries = 0;
    let mut buf = vec![0f64; elems];
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
