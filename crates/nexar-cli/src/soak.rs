//! A long-running job for fault tests: a loop of verified all-reduces that survives the
//! loss of ranks through automatic recovery.

use std::time::Duration;

use nexar_actors::{Communicator, NexarError, NodeConfig, RecoveryPolicy};
use nexar_device::ReduceOp;

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
    while i < iters {
        buf.fill(i as f64);
        match comm.all_reduce(&mut buf, ReduceOp::Sum).await {
            Ok(()) => {
                let want = (i * comm.world_size() as u64) as f64;
                if let Some(bad) = buf.iter().find(|x| **x != want) {
                    return Err(format!("iteration {i}: got {bad}, want {want}"));
                }
                i += 1;
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
