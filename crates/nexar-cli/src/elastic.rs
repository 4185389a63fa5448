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

/// The report of a resize point that failed on every member alike
/// ([`BootstrapError::Resize`]: the seed refused, or a joiner could not be reached): the
/// members keep their communicator, and the job goes on in it.
fn failed_point(i: u64, why: &str) -> String {
    format!(
        "elastic: iteration {i}: the resize point failed, the members go on as they were: {why}"
    )
}

/// Runs the elastic loop on `node`. Each iteration passes a resize point (leaving, when
/// the previous iteration found `stop` set), agrees with the other members on the iteration
/// number and on who is asked to stop, and checks an all-reduce of `rank + 1` against
/// `w(w+1)/2` for the world `w`. A resize point that fails on every member alike (the
/// seed refused it, or a joiner could not be reached) is reported and the job goes on in
/// the communicator it had; any other failure ends the loop with `Err`. A node starts right after a resize point (formation, or
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
                    // The point failed alike on every member, which keep their
                    // communicator: this node is still a member, and leaves at the next.
                    Err(NexarError::Bootstrap(BootstrapError::Resize(why))) => {
                        report(failed_point(i, &why));
                    }
                    // The point failed on every member alike: the others return too.
                    Err(e) => return Err(format!("iteration {i}: leaving: {e}")),
                }
            } else {
                match node.resize().await {
                    Ok(_) => {}
                    Err(NexarError::Bootstrap(BootstrapError::Resize(why))) => {
                        report(failed_point(i, &why));
                    }
                    Err(e) => return Err(format!("iteration {i}: resize point: {e}")),
                }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use nexar_actors::{JoinOptions, Node, NodeConfig, Seed, SeedOptions};

    use super::{elastic_rank, ElasticOptions};

    const DEADLINE: Duration = Duration::from_secs(60);

    fn opts(seed: &Seed) -> JoinOptions {
        let mut o = JoinOptions::new(seed.join_string().clone());
        o.listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        o.timeout = Duration::from_secs(20);
        o.config = NodeConfig::default();
        o.config.connect_timeout = Duration::from_secs(2);
        o
    }

    /// A resize point that fails on every member alike (a joiner nobody can reach) leaves
    /// the members as they were, and the job goes on to its last iteration (it used to end
    /// on every member, with an error, at that point).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resize_point_that_fails_everywhere_alike_does_not_end_the_job() {
        let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let mut so = SeedOptions::default();
        so.max_world = Some(3);
        let seed = Seed::start(loopback, 2, so).await.expect("seed");
        let joins = [
            tokio::spawn(Node::join(opts(&seed))),
            tokio::spawn(Node::join(opts(&seed))),
        ];
        let mut nodes = Vec::new();
        for j in joins {
            let node = tokio::time::timeout(DEADLINE, j)
                .await
                .expect("join deadline")
                .expect("join task")
                .expect("join");
            nodes.push(node);
        }
        // A joiner that advertises a socket that never answers: the members cannot dial it,
        // so the first resize point fails on both.
        let silent = UdpSocket::bind(loopback).expect("silent socket");
        let mut o = opts(&seed);
        o.advertise = Some(silent.local_addr().expect("addr"));
        let joiner = tokio::spawn(Node::join(o));
        tokio::time::timeout(DEADLINE, seed.wait_queued(1))
            .await
            .expect("queued within the deadline")
            .expect("seed running");
        let settings = ElasticOptions {
            iters: 3,
            elems: 16,
            pace: Duration::ZERO,
        };
        let lines = Arc::new(Mutex::new(Vec::new()));
        let runs: Vec<_> = nodes
            .into_iter()
            .map(|mut node| {
                let lines = lines.clone();
                tokio::spawn(async move {
                    let stop = AtomicBool::new(false);
                    let outcome = elastic_rank(&mut node, settings, &stop, |l| {
                        lines.lock().unwrap().push(l)
                    })
                    .await;
                    node.finish(outcome.is_ok()).await;
                    outcome
                })
            })
            .collect();
        for run in runs {
            let outcome = tokio::time::timeout(DEADLINE, run)
                .await
                .expect("the job did not end within the deadline")
                .expect("job task");
            let outcome = outcome.expect("the job ended on the failed resize point");
            assert_eq!((outcome.iterations, outcome.world), (3, 2));
        }
        let lines = lines.lock().unwrap().clone();
        let failed = lines
            .iter()
            .filter(|l| l.contains("the resize point failed"))
            .count();
        assert_eq!(failed, 2, "{lines:?}");
        let joined = tokio::time::timeout(DEADLINE, joiner)
            .await
            .expect("the joiner's end")
            .expect("joiner task");
        assert!(joined.is_err(), "the unreachable joiner got in");
        drop(silent);
    }
}
