//! A job for elastic-membership tests: a loop of resize points and verified all-reduces.
//! Nodes that join through the seed enter at the next resize point; a node asked to stop
//! (SIGTERM, in `nexar worker`) leaves gracefully at the next one; when every member asks
//! at the same point, the job ends for all of them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nexar_actors::{BootstrapError, NexarError, Node};
use nexar_device::ReduceOp;

/// Settings of the elastic job.
#[derive(Clone, Copy, Debug)]
pub struct ElasticOptions {
    /// Iterations (agreed among the members) after which the job ends.
    pub iters: u64,
    /// f64 elements per all-reduce.
    pub elems: usize,
    /// Pause between iterations (stands for the work of a training step).
    pub pace: Duration,
}

/// How one node's elastic loop ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticOutcome {
    /// The agreed iteration reached.
    pub iterations: u64,
    /// World size of the last communicator this node was in.
    pub world: usize,
    /// True when this node left the cluster (it is no longer a member).
    pub left: bool,
}

/// Runs the elastic loop on `node`. Each iteration passes a resize point (leaving, when
/// the previous iteration found `stop` set), agrees with the other members on the iteration
/// number and on who is asked to stop, and checks an all-reduce of `rank + 1` against
/// `w(w+1)/2` for the world `w`. A node starts right after a resize point (formation, or
/// the resize point that admitted it), so its first iteration skips the resize point and
/// a node joining late is in step with the members. `report` gets a line whenever the
/// world this node sees changes, and when a leave is refused. `Err` also when the buffer
/// of `opts.elems` values cannot be allocated (before the first iteration).
pub async fn elastic_rank(
    node: &mut Node,
    opts: ElasticOptions,
    stop: &AtomicBool,
    mut report: impl FnMut(String),
) -> Result<ElasticOutcome, String> {
    let mut i = 0u64;
    let mut seen_world = 0;
    let mut buf = crate::soak::f64_buffer(opts.elems)?;
    let mut first = true;
    let mut leave = false;
    loop {
        if !first {
            if leave {
                let world = node.communicator().world_size();
                match node.leave().await {
                    Ok(()) => {
                        return Ok(ElasticOutcome {
                            iterations: i,
                            world,
                            left: true,
                        })
                    }
                    // The point passed; this node is a member of the new communicator.
                    Err(NexarError::Bootstrap(BootstrapError::LeaveRefused(why))) => {
                        report(format!("elastic: iteration {i}: staying: {why}"));
                    }
                    // The point failed on every member alike: the others return too.
                    Err(e) => return Err(format!("iteration {i}: leaving: {e}")),
                }
            } else {
                node.resize()
                    .await
                    .map_err(|e| format!("iteration {i}: resize point: {e}"))?;
            }
        }
        first = false;
        let comm = node.communicator();
        let (rank, world) = (comm.rank(), comm.world_size());
        let asked = stop.load(Ordering::Acquire);
        let mut all = vec![0u64; 2 * world];
        comm.all_gather(&[i, u64::from(asked)], &mut all)
            .await
            .map_err(|e| format!("iteration {i}: agreeing on the iteration: {e}"))?;
        i = all.chunks_exact(2).map(|c| c[0]).max().unwrap_or(i);
        let stopping = all.chunks_exact(2).filter(|c| c[1] != 0).count();
        if i >= opts.iters || stopping == world {
            return Ok(ElasticOutcome {
                iterations: i,
                world,
                left: false,
            });
        }
        leave = asked;
        buf.fill((rank + 1) as f64);
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .await
            .map_err(|e| format!("iteration {i}: all_reduce: {e}"))?;
        let want = (world * (world + 1) / 2) as f64;
        if let Some(bad) = buf.iter().find(|x| **x != want) {
            return Err(format!(
                "iteration {i}: all_reduce gave {bad}, want {want} in a world of {world}"
            ));
        }
        if world != seen_world {
            report(format!(
                "elastic: iteration {i} rank {rank} world {world} all_reduce ok"
            ));
            seen_world = world;
        }
        i += 1;
        tokio::time::sleep(opts.pace).await;
    }
}
