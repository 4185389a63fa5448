//! Failure watch, shrink to the survivors, and the Abort policy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nexar_actors::{Cluster, Communicator, NexarError, NodeConfig, RecoveryPolicy};
use nexar_device::ReduceOp;
use nexar_tests::faults::{relayed_cluster, Faults};
use nexar_tests::{check_all, on_all_ranks, within, STEP_DEADLINE};

/// For tests that kill a rank. `Cluster::kill_rank` closes the rank's connections, so the
/// others see the loss at once: heartbeats stay at their defaults (a 5 s timeout), which
/// keep a healthy rank that a loaded machine starves for a moment from being declared
/// lost too (these tests assert exact lost sets).
fn kill_detection() -> NodeConfig {
    let mut c = NodeConfig::default();
    c.op_timeout = Duration::from_secs(20);
    c
}

/// For tests that cut links silently, where only heartbeats can tell a peer is gone. Their
/// timeout is as long as these tests allow: 5 s (the default), under the 10 s QUIC idle
/// timeout (so that heartbeats, not QUIC, detect the silence); a shrink waits twice that
/// for a silent rank, well within the tests' 60 s deadlines. The op_timeout is far past
/// those deadlines, which bound every wait here.
fn silent_loss_detection() -> NodeConfig {
    let mut c = NodeConfig::default();
    c.heartbeat_interval = Duration::from_millis(100);
    c.heartbeat_timeout = Duration::from_secs(5);
    c.op_timeout = FAR_OP_TIMEOUT;
    c
}

/// An `op_timeout` far past [`STEP_DEADLINE`]: a call that ends within the step deadline
/// did not end at the library's call deadline.
const FAR_OP_TIMEOUT: Duration = Duration::from_secs(10 * STEP_DEADLINE.as_secs());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_see_the_failure_shrink_and_run_every_collective() {
    let cluster = Cluster::local_with(5, kill_detection())
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
        let seen = within(&format!("rank {i} noticing the loss"), w.changed()).await;
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

/// [`kill_detection`] under `policy`.
fn under(policy: RecoveryPolicy) -> NodeConfig {
    let mut c = kill_detection();
    c.recovery = policy;
    c
}

/// A cluster of `world` ranks under the Abort policy. Calls must fail fast: within the
/// step deadline, far under its op_timeout, so none fails by waiting out its deadline.
async fn abort_cluster(world: usize) -> Cluster {
    let mut c = under(RecoveryPolicy::Abort);
    c.op_timeout = FAR_OP_TIMEOUT;
    Cluster::local_with(world, c).await.expect("cluster")
}

/// Kills `rank` of `cluster` and waits until `comm` has noticed.
async fn kill_noticed(cluster: &Cluster, comm: &Communicator, rank: usize) {
    let mut w = comm.failures();
    cluster.kill_rank(rank).expect("kill");
    within("the loss noticed", w.changed())
        .await
        .expect("watch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_policy_fails_every_call_fast() {
    let cluster = abort_cluster(4).await;
    let comms = cluster.communicators();
    let served = Arc::new(AtomicUsize::new(0));
    for comm in &comms[..2] {
        let served = served.clone();
        comm.register_rpc(1, move |_, _| {
            served.fetch_add(1, Ordering::SeqCst);
            async { Ok(Vec::new()) }
        });
    }
    kill_noticed(&cluster, &comms[0], 2).await;
    // RPC too, to a survivor and to oneself, before any handler runs.
    for rank in [1, 0] {
        let called = within("an RPC between survivors", comms[0].rpc(rank, 1, b"x")).await;
        assert!(
            matches!(called, Err(NexarError::PeerLost { rank: 2, .. })),
            "{called:?}"
        );
    }
    assert_eq!(
        served.load(Ordering::SeqCst),
        0,
        "a handler ran after the abort"
    );
    // Calls between survivors, not involving rank 2, fail too under Abort.
    let mut b = [0u8; 1];
    let sent = within("a send between survivors", comms[0].send(&[1u8], 1, 0)).await;
    assert!(
        matches!(sent, Err(NexarError::PeerLost { rank: 2, .. })),
        "{sent:?}"
    );
    let got = within("a receive between survivors", comms[0].recv(&mut b, 1, 0)).await;
    assert!(
        matches!(got, Err(NexarError::PeerLost { rank: 2, .. })),
        "{got:?}"
    );
    let barrier = within("a barrier", comms[0].barrier()).await;
    assert!(
        matches!(barrier, Err(NexarError::PeerLost { .. })),
        "{barrier:?}"
    );
}

/// Under Abort, calls on a communicator that the lost node is not a member of fail with
/// `Aborted`, naming the node (they used to say `PeerLost` with rank `usize::MAX`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_policy_names_a_lost_node_outside_the_communicator() {
    let cluster = abort_cluster(3).await;
    let comms = cluster.communicators();
    let lost = comms[2].members()[2].0;
    let splits = on_all_ranks(comms.clone(), STEP_DEADLINE, |comm| async move {
        comm.split(u32::from(comm.rank() == 2), 0).await
    })
    .await;
    let pair = splits
        .into_iter()
        .next()
        .expect("rank 0's split")
        .expect("split");
    assert_eq!(pair.world_size(), 2);
    let singles = on_all_ranks(comms.clone(), STEP_DEADLINE, |comm| async move {
        comm.split(comm.rank() as u32, 0).await
    })
    .await;
    let alone = singles
        .into_iter()
        .next()
        .expect("rank 0's split")
        .expect("a split of one");
    assert_eq!(alone.world_size(), 1);
    kill_noticed(&cluster, &comms[0], 2).await;
    let sent = within("a send on the pair", pair.send(&[1u8], 1, 0)).await;
    assert!(
        matches!(&sent, Err(NexarError::Aborted { node, .. }) if *node == lost),
        "{sent:?}"
    );
    let barrier = within("a barrier on the pair", pair.barrier()).await;
    assert!(
        matches!(&barrier, Err(NexarError::Aborted { node, .. }) if *node == lost),
        "{barrier:?}"
    );
    // A call with no message to send, on a communicator of one rank, fails too (it
    // returned Ok).
    let alone = within("a call alone", alone.barrier()).await;
    assert!(
        matches!(&alone, Err(NexarError::Aborted { node, .. }) if *node == lost),
        "{alone:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_recovery_continues_a_loop_of_all_reduces_with_the_survivors() {
    let cluster = Cluster::local_with(5, under(RecoveryPolicy::Automatic))
        .await
        .expect("cluster");
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
        within(
            &format!("the victim's iteration {i}"),
            victim.all_reduce(&mut v, ReduceOp::Sum),
        )
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

/// One broken link (ranks 0 and 1 no longer reach each other; both reach rank 2): the
/// ends each declare the other lost and their all-reduce fails; each then tells rank 2
/// that it gave up on the collective, so rank 2's part fails within a heartbeat timeout
/// with `PeerLostElsewhere` for one of them, not at its far-off `op_timeout` (as it did).
/// Rank 2 still declares no one lost: a loss stays known where it is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collective_broken_by_one_link_fails_promptly_on_the_ranks_that_still_reach_both_ends() {
    let clean = Faults::clean(3);
    let (cluster, links) = relayed_cluster(3, silent_loss_detection(), clean, |a, b| a + b == 1)
        .await
        .expect("cluster");
    assert_eq!(links.len(), 2, "both connections between ranks 0 and 1");
    for l in &links {
        l.set_cut(true);
    }
    // 1 MiB: a ring over three ranks, in which rank 2's second step needs what rank 1
    // got from rank 0.
    let res = on_all_ranks(cluster.communicators(), STEP_DEADLINE, |c| async move {
        let mut v = vec![1f32; 1 << 18];
        Ok::<_, NexarError>(c.all_reduce(&mut v, ReduceOp::Sum).await)
    })
    .await;
    let res: Vec<_> = res.into_iter().map(|r| r.expect("rank task")).collect();
    for (rank, other) in [(0, 1), (1, 0)] {
        assert!(
            matches!(&res[rank], Err(NexarError::PeerLost { rank: r, .. }) if *r == other),
            "rank {rank}: {:?}",
            res[rank]
        );
    }
    assert!(
        matches!(&res[2], Err(NexarError::PeerLostElsewhere { rank, by }) if *rank + *by == 1),
        "rank 2: {:?}",
        res[2]
    );
    let comms = cluster.communicators();
    assert!(
        comms[2].failed_ranks().is_empty(),
        "{:?}",
        comms[2].failed_ranks()
    );
    drop(links);
}

/// A rank that goes silent longer than the heartbeat timeout (every link to it cut) and
/// then comes back: the others declare it lost and go on as three; the slow rank, finding
/// itself alone, gets `QuorumLost` from its recovery instead of carrying on as a cluster
/// of one, and nothing it sends after coming back reaches the survivors' communicator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_rank_that_comes_back_neither_rejoins_nor_splits_the_cluster() {
    let clean = Faults::clean(1);
    let (cluster, links) =
        relayed_cluster(4, silent_loss_detection(), clean, |a, b| a == 3 || b == 3)
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
            seen = within(
                &format!("rank {rank} noticing the stall (saw {seen:?})"),
                w.changed(),
            )
            .await
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
    let sent = within("the slow rank's send", slow.send(&[7u8], 0, 1)).await;
    assert!(sent.is_err(), "{sent:?}");
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
///
/// On one thread, so that the order below is certain (see the comment on the markers).
#[tokio::test(flavor = "current_thread")]
async fn a_decision_without_a_quorum_is_not_adopted_by_the_others() {
    let clean = Faults::clean(3);
    let (cluster, links) = relayed_cluster(5, silent_loss_detection(), clean, |a, b| {
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
        let seen = within(&format!("rank {} noticing the cut", 3 + i), w.changed())
            .await
            .expect("watch");
        assert_eq!(seen, vec![4 - i], "rank {} sees its peer lost", 3 + i);
    }
    let res = on_all_ranks(comms, STEP_DEADLINE, |c| async move {
        let rank = c.rank();
        if rank >= 3 {
            let alone = c.shrink().await;
            assert!(
                matches!(alone, Err(NexarError::QuorumLost { .. })),
                "rank {rank}: {alone:?}"
            );
            // These markers must reach ranks 0-2 after anything the shrink sent them, or
            // they could shrink before a decision was there to refuse. The rounds' reports
            // were sent before `shrink` returned; a decision would be announced by tasks
            // that `shrink` spawns and does not wait for, and no public call can tell when
            // those have sent it. So the order is made certain instead: on this one-thread
            // runtime, yielding runs every task already spawned before this one resumes
            // (`tokio::task::yield_now`), and the announcing task's first step takes its
            // turn (FIFO) on the one stream that carries this rank's small messages to
            // each peer, in order (`Communicator::send`: messages of 64 KiB or less share
            // one stream); the marker takes its turn after it. Ranks 0-2 shrink only once
            // they have both markers, so any decision is in their mailboxes by then.
            tokio::task::yield_now().await;
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
    // Nothing dies or goes silent here: default heartbeats.
    let mut config = NodeConfig::default();
    config.recovery = RecoveryPolicy::Automatic;
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    let mut watch = comms[0].failures();
    let mut recoveries = comms[1].recoveries();
    // The nodes stop one after the other, so the second may see the first go before it
    // stops itself: a loss on its watch, and under automatic recovery a recovery that
    // fails for want of a quorum (1 of 2). Both must still end at the shutdown.
    let waiting = tokio::spawn(async move {
        let mut changes = 0;
        loop {
            match watch.changed().await {
                Ok(lost) if changes == 0 && lost == [1] => changes += 1,
                other => return other,
            }
        }
    });
    cluster.shutdown().await;
    let ended = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the watch wakes up")
        .expect("task");
    assert!(matches!(ended, Err(NexarError::Shutdown)), "{ended:?}");
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        let mut seen = Vec::new();
        while let Some(r) = recoveries.next().await {
            seen.push(r.map(|c| c.world_size()));
        }
        seen
    })
    .await
    .expect("recoveries end");
    assert!(
        seen.len() <= 1
            && seen.iter().all(|r| matches!(
                r,
                Err(NexarError::QuorumLost {
                    survivors: 1,
                    world: 2
                })
            )),
        "{seen:?}"
    );
}

/// Timing settings at their extremes: a zero heartbeat interval is refused, and so is a
/// heartbeat timeout under two intervals (which declared healthy peers lost); one of
/// `Duration::MAX` (never declare a peer lost) lets a shrink run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_timing_settings_are_refused_or_work() {
    let mut zero = NodeConfig::default();
    zero.heartbeat_interval = Duration::ZERO;
    assert!(matches!(
        Cluster::local_with(2, zero).await,
        Err(NexarError::InvalidArgument(_))
    ));
    for timeout in [
        Duration::ZERO,
        Duration::from_millis(100),
        Duration::from_millis(499),
    ] {
        let mut short = NodeConfig::default();
        short.heartbeat_timeout = timeout;
        match Cluster::local_with(2, short).await {
            Err(NexarError::InvalidArgument(e)) => assert!(e.contains("heartbeat_timeout"), "{e}"),
            other => panic!("a heartbeat timeout of {timeout:?} was taken: {other:?}"),
        }
    }
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

/// Automatic recovery also recovers from a loss known before `recoveries` was called
/// (its watch used to be taken later, in its task, so such a loss counted as seen and
/// the rank never shrank).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_recovery_takes_a_loss_known_before_it_was_asked_for() {
    let cluster = Cluster::local_with(3, under(RecoveryPolicy::Automatic))
        .await
        .expect("cluster");
    let comms = cluster.communicators();
    let mut watches: Vec<_> = comms.iter().take(2).map(|c| c.failures()).collect();
    cluster.kill_rank(2).expect("kill");
    for w in &mut watches {
        within("the loss noticed", w.changed())
            .await
            .expect("watch");
    }
    let mut recoveries: Vec<_> = comms.iter().take(2).map(|c| c.recoveries()).collect();
    for rec in &mut recoveries {
        let next = within("a recovery", rec.next())
            .await
            .expect("a rebuilt communicator")
            .expect("shrink");
        assert_eq!(next.world_size(), 2);
    }
}
