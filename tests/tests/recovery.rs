//! Failure watch, shrink to the survivors, and the Abort policy.

use std::time::Duration;

use nexar_actors::{Cluster, NexarError, NodeConfig, RecoveryPolicy};
use nexar_device::ReduceOp;
use nexar_tests::faults::{relayed_cluster, Faults};
use nexar_tests::{check_all, on_all_ranks};

fn fast_detection() -> NodeConfig {
    let mut c = NodeConfig::default();
    c.heartbeat_interval = Duration::from_millis(50);
    c.heartbeat_timeout = Duration::from_millis(1000);
    c.op_timeout = Duration::from_secs(20);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_see_the_failure_shrink_and_run_every_collective() {
    let cluster = Cluster::local_with(5, fast_detection())
        .await
        .expect("cluster");
    let comms = cluster.communicators();
    let mut watches: Vec<_> = comms.iter().map(|c| c.failures()).collect();
    cluster.kill_rank(3).expect("kill");
    let survivors: Vec<_> = comms
        .into_iter()
        .enumerate()
        .filter(|(r, _)| *r != 3)
        .map(|(_, c)| c)
        .collect();
    for (i, w) in watches.iter_mut().enumerate().filter(|(r, _)| *r != 3) {
        let seen = tokio::time::timeout(Duration::from_secs(20), w.changed())
            .await
            .expect("loss noticed");
        assert_eq!(seen.expect("watch"), vec![3], "rank {i}");
    }
    let res = on_all_ranks(survivors, Duration::from_secs(120), |comm| async move {
        let old = comm.rank();
        let small = comm.shrink().await?;
        assert_eq!(small.world_size(), 4);
        assert_eq!(small.rank(), if old > 3 { old - 1 } else { old });
        check_all::<f32>(&small, 1001, 7)
            .await
            .map_err(NexarError::InvalidArgument)?;
        check_all::<i64>(&small, 37, 3)
            .await
            .map_err(NexarError::InvalidArgument)?;
        let mut v = vec![1u32; 100];
        small.all_reduce(&mut v, ReduceOp::Sum).await?;
        assert!(v.iter().all(|x| *x == 4));
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("shrunk communicator");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_policy_fails_every_call_fast() {
    let mut c = fast_detection();
    c.recovery = RecoveryPolicy::Abort;
    let cluster = Cluster::local_with(4, c).await.expect("cluster");
    let comms = cluster.communicators();
    let mut w = comms[0].failures();
    cluster.kill_rank(2).expect("kill");
    tokio::time::timeout(Duration::from_secs(20), w.changed())
        .await
        .expect("loss noticed")
        .expect("watch");
    let start = std::time::Instant::now();
    // Calls between survivors, not involving rank 2, fail too under Abort.
    let mut b = [0u8; 1];
    assert!(matches!(
        comms[0].send(&[1u8], 1, 0).await,
        Err(NexarError::PeerLost { rank: 2, .. })
    ));
    assert!(matches!(
        comms[0].recv(&mut b, 1, 0).await,
        Err(NexarError::PeerLost { rank: 2, .. })
    ));
    assert!(matches!(
        comms[0].barrier().await,
        Err(NexarError::PeerLost { .. })
    ));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_recovery_continues_a_loop_of_all_reduces_with_the_survivors() {
    let mut c = fast_detection();
    c.recovery = RecoveryPolicy::Automatic;
    let cluster = Cluster::local_with(5, c).await.expect("cluster");
    let comms = cluster.communicators();
    let recoveries: Vec<_> = comms.iter().map(|c| c.recoveries()).collect();
    let victim = comms[4].clone();
    let mut tasks = Vec::new();
    for (comm, mut rec) in comms.into_iter().zip(recoveries).take(4) {
        tasks.push(tokio::spawn(async move {
            let mut comm = comm;
            let mut done_after_loss = 0;
            let mut i = 0u64;
            while i < 10_000 {
                let mut v = vec![i as f64; 4096];
                match comm.all_reduce(&mut v, ReduceOp::Sum).await {
                    Ok(()) => {
                        let want = (i * comm.world_size() as u64) as f64;
                        assert!(v.iter().all(|x| *x == want), "iteration {i} wrong");
                        i += 1;
                        if comm.world_size() == 4 {
                            done_after_loss += 1;
                            if done_after_loss == 20 {
                                return Ok::<_, NexarError>(comm.world_size());
                            }
                        }
                    }
                    Err(NexarError::PeerLost { .. }) => {
                        let next = tokio::time::timeout(Duration::from_secs(30), rec.next())
                            .await
                            .expect("recovery in time")
                            .expect("recovery stream")?;
                        // Survivors may have got as far as different iterations (one whose
                        // part of the schedule was already complete finished it): agree on
                        // where to resume, as a real training loop would.
                        let mut at = [i];
                        next.all_reduce(&mut at, ReduceOp::Max).await?;
                        i = at[0];
                        comm = next;
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(NexarError::InvalidArgument(
                "the loop never saw the failure".into(),
            ))
        }));
    }
    // Let the loop run a little, then kill rank 4 (it simply stops taking part).
    let mut v = vec![0f64; 4096];
    for i in 0..5u64 {
        v.fill(i as f64);
        victim
            .all_reduce(&mut v, ReduceOp::Sum)
            .await
            .expect("victim's early iterations");
    }
    cluster.kill_rank(4).expect("kill");
    for t in tasks {
        let world = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("deadline")
            .expect("task")
            .expect("loop");
        assert_eq!(world, 4);
    }
}

/// A rank that goes silent longer than the heartbeat timeout (every link to it cut) and
/// then comes back: the others declare it lost and go on as three; the slow rank, finding
/// itself alone, gets `QuorumLost` from its recovery instead of carrying on as a cluster
/// of one, and nothing it sends after coming back reaches the survivors' communicator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_rank_that_comes_back_neither_rejoins_nor_splits_the_cluster() {
    let clean = Faults {
        loss: 0.0,
        delay: Duration::ZERO,
        jitter: Duration::ZERO,
        duplicate: 0.0,
        seed: 1,
    };
    let (cluster, links) = relayed_cluster(4, fast_detection(), clean, |a, b| a == 3 || b == 3)
        .await
        .expect("cluster");
    assert_eq!(
        links.len(),
        6,
        "both connections of each of rank 3's three pairs"
    );
    let comms = cluster.communicators();
    let res = on_all_ranks(comms.clone(), Duration::from_secs(60), |c| async move {
        let mut v = vec![1u32; 256];
        c.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v[0])
    })
    .await;
    for r in res {
        assert_eq!(r.expect("all_reduce before the stall"), 4);
    }
    let mut watches: Vec<_> = comms.iter().map(|c| c.failures()).collect();

    // Rank 3 stalls: nothing in or out, past the heartbeat timeout.
    for l in &links {
        l.set_cut(true);
    }
    for (rank, w) in watches.iter_mut().enumerate() {
        let want = if rank == 3 { vec![0, 1, 2] } else { vec![3] };
        let mut seen = Vec::new();
        while seen != want {
            seen = tokio::time::timeout(Duration::from_secs(20), w.changed())
                .await
                .unwrap_or_else(|_| panic!("rank {rank}: loss not noticed (saw {seen:?})"))
                .expect("watch");
        }
    }
    // And comes back.
    for l in &links {
        l.set_cut(false);
    }
    let slow = comms[3].clone();
    let survivors: Vec<_> = comms.into_iter().take(3).collect();
    let (slow_shrink, small) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(30), slow.shrink()),
        on_all_ranks(survivors, Duration::from_secs(60), |c| async move {
            let small = c.shrink().await?;
            Ok::<_, NexarError>(small)
        })
    );
    match slow_shrink.expect("the slow rank's recovery ends in time") {
        Err(NexarError::QuorumLost { survivors, world }) => {
            assert_eq!((survivors, world), (1, 4))
        }
        other => panic!("the slow rank must not form a cluster of its own: {other:?}"),
    }
    let small: Vec<_> = small
        .into_iter()
        .map(|r| r.expect("the survivors shrink"))
        .collect();
    // The slow rank's calls on the old communicator fail; it reaches nobody.
    let mut v = vec![1u32; 256];
    assert!(matches!(
        tokio::time::timeout(
            Duration::from_secs(30),
            slow.all_reduce(&mut v, ReduceOp::Sum)
        )
        .await
        .expect("fails in time"),
        Err(NexarError::PeerLost { .. })
    ));
    assert!(slow.send(&[7u8], 0, 1).await.is_err());
    let res = on_all_ranks(small.clone(), Duration::from_secs(60), |c| async move {
        assert_eq!(c.world_size(), 3);
        for _ in 0..20 {
            let mut v = vec![c.rank() as u32 + 1; 4096];
            c.all_reduce(&mut v, ReduceOp::Sum).await?;
            assert!(v.iter().all(|x| *x == 6));
        }
        check_all::<f64>(&c, 1001, 7)
            .await
            .map_err(NexarError::InvalidArgument)?;
        Ok::<_, NexarError>(c.failed_ranks())
    })
    .await;
    for r in res {
        assert!(r.expect("the survivors go on").is_empty());
    }
    cluster.shutdown().await;
}

/// One cut link in a mesh of five: ranks 3 and 4 each suspect the other, run a shrink the
/// others are not in, and find no quorum. Their decisions (each leaves out four ranks)
/// must not reach the others as something to adopt: ranks 0, 1 and 2, shrinking after
/// them, agree among themselves and go on as three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_without_a_quorum_is_not_adopted_by_the_others() {
    let clean = Faults {
        loss: 0.0,
        delay: Duration::ZERO,
        jitter: Duration::ZERO,
        duplicate: 0.0,
        seed: 3,
    };
    let (cluster, links) = relayed_cluster(5, fast_detection(), clean, |a, b| {
        (a, b) == (3, 4) || (a, b) == (4, 3)
    })
    .await
    .expect("cluster");
    let comms = cluster.communicators();
    let mut watches: Vec<_> = comms[3..].iter().map(|c| c.failures()).collect();
    for l in &links {
        l.set_cut(true);
    }
    for (i, w) in watches.iter_mut().enumerate() {
        let seen = tokio::time::timeout(Duration::from_secs(20), w.changed())
            .await
            .expect("the cut is noticed")
            .expect("watch");
        assert_eq!(seen, vec![4 - i], "rank {} sees its peer lost", 3 + i);
    }
    let res = on_all_ranks(comms, Duration::from_secs(60), |c| async move {
        let rank = c.rank();
        if rank >= 3 {
            let alone = c.shrink().await;
            assert!(
                matches!(alone, Err(NexarError::QuorumLost { .. })),
                "rank {rank}: {alone:?}"
            );
            // Sent after the shrink: by the time it arrives, so (in all likelihood) has
            // anything the shrink sent.
            for r in 0..3 {
                c.send(&[rank as u8], r, 99).await?;
            }
            return Ok(None);
        }
        let mut done = [0u8; 1];
        for from in [3, 4] {
            c.recv(&mut done, from, 99).await?;
        }
        let small = c.shrink().await?;
        let mut v = vec![1u32; 64];
        small.all_reduce(&mut v, ReduceOp::Sum).await?;
        assert!(v.iter().all(|x| *x == 3));
        Ok::<_, NexarError>(Some(small.world_size()))
    })
    .await;
    for (rank, r) in res.into_iter().enumerate() {
        let world = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(world, (rank < 3).then_some(3), "rank {rank}");
    }
    cluster.shutdown().await;
}

/// Shutting the node down ends the waits on its failure watch and on automatic
/// recovery (which used to wait, and keep the node's state alive, for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_failure_watches_and_recoveries() {
    let mut config = fast_detection();
    config.recovery = RecoveryPolicy::Automatic;
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    let mut watch = comms[0].failures();
    let mut recoveries = comms[1].recoveries();
    let waiting = tokio::spawn(async move { watch.changed().await });
    cluster.shutdown().await;
    let ended = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the watch wakes up")
        .expect("task");
    assert!(matches!(ended, Err(NexarError::Shutdown)), "{ended:?}");
    let next = tokio::time::timeout(Duration::from_secs(10), recoveries.next())
        .await
        .expect("recoveries end");
    assert!(next.is_none(), "{next:?}");
}

/// Timing settings at their extremes: a zero heartbeat interval is refused, and a
/// heartbeat timeout of `Duration::MAX` (never declare a peer lost) lets a shrink run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_timing_settings_are_refused_or_work() {
    let mut zero = NodeConfig::default();
    zero.heartbeat_interval = Duration::ZERO;
    assert!(matches!(
        Cluster::local_with(2, zero).await,
        Err(NexarError::InvalidArgument(_))
    ));
    let mut never = NodeConfig::default();
    never.heartbeat_timeout = Duration::MAX;
    never.connect_timeout = Duration::MAX;
    let cluster = Cluster::local_with(2, never).await.expect("cluster");
    let res = on_all_ranks(
        cluster.communicators(),
        Duration::from_secs(60),
        |c| async move {
            let same = c.shrink().await?;
            Ok::<_, NexarError>(same.world_size())
        },
    )
    .await;
    for r in res {
        assert_eq!(r.expect("shrink"), 2);
    }
    cluster.shutdown().await;
}
