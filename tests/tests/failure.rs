//! A dead peer ends calls that involve it with a typed error within the deadline.

use std::time::{Duration, Instant};

use nexar_actors::{Algorithm, Cluster, NexarError, NodeConfig};
use nexar_tests::{within, STEP_DEADLINE};
use nexar_transport::TransportError;

/// An `op_timeout` far past [`STEP_DEADLINE`]: a call that ends with an error within the
/// step deadline did not end at the library's deadline.
const FAR_OP_TIMEOUT: Duration = Duration::from_secs(10 * STEP_DEADLINE.as_secs());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_gives_peer_lost_not_a_hang() {
    // Default heartbeats: `kill_rank` closes the rank's connections, so its loss is seen
    // at once; a short heartbeat timeout could declare a healthy but starved rank lost.
    let mut config = NodeConfig::default();
    config.op_timeout = FAR_OP_TIMEOUT;
    let cluster = Cluster::local_with(3, config).await.expect("cluster");
    let comms = cluster.communicators();
    cluster.kill_rank(2).expect("kill");
    let mut buf = [0u8; 4];
    // A receive from the dead rank fails with PeerLost (the connection close is noticed at
    // once; heartbeats would catch a silent death within the timeout), long before the
    // call's own deadline.
    match within("receive from the dead rank", comms[0].recv(&mut buf, 2, 0)).await {
        Err(NexarError::PeerLost { rank: 2, .. }) => {}
        other => panic!("expected PeerLost from rank 2, got {other:?}"),
    }
    assert_eq!(comms[0].failed_ranks(), vec![2]);
    // Sends to it fail too, and a barrier that needs it ends with an error, not a hang.
    let sent = within("send to the dead rank", comms[0].send(&buf, 2, 0)).await;
    assert!(
        matches!(sent, Err(NexarError::PeerLost { rank: 2, .. })),
        "{sent:?}"
    );
    let (a, b) = within("barriers with a dead rank", async {
        tokio::join!(comms[0].barrier(), comms[1].barrier())
    })
    .await;
    assert!(
        a.is_err() && b.is_err(),
        "barrier with a dead rank must fail: {a:?} {b:?}"
    );
    // Point-to-point between the survivors still works.
    within(
        "send between survivors",
        comms[0].send(&[1u8, 2, 3, 4], 1, 5),
    )
    .await
    .expect("send between survivors");
    within("recv between survivors", comms[1].recv(&mut buf, 0, 5))
        .await
        .expect("recv between survivors");
    assert_eq!(buf, [1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_with_no_sender_times_out_at_the_deadline() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_millis(300);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comm = cluster.communicators()[1].clone();
    let mut buf = [0u8; 1];
    let start = Instant::now();
    // Bounded by the step deadline, far past the 300 ms op_timeout: a receive that
    // ignored its deadline fails here.
    let got = within(
        "a receive with no sender, 300 ms op_timeout",
        comm.recv(&mut buf, 0, 3),
    )
    .await;
    assert!(matches!(got, Err(NexarError::Timeout { .. })), "{got:?}");
    // Not before its deadline either (a lower bound: a slow machine only adds to it).
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(300), "took {took:?}");
}

/// A peer that dies part-way through a large all-reduce (its node killed while both
/// calls run, once some of its blocks have arrived) ends the other rank's call with the loss, well
/// before the deadline: a block cut off mid-stream, or never sent, is an error naming the
/// lost peer or its connection, not a hang or a result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_collective_whose_peer_drops_out_part_way_fails_in_time() {
    let mut config = NodeConfig::default();
    // Well before the deadline: an error within the step deadline is not the call's
    // own deadline.
    config.op_timeout = FAR_OP_TIMEOUT;
    // A ring (what 64 MiB on 2 ranks gets anyway): a rank sends its second half-round only
    // once it has its peer's first, so neither call can finish while the other has not
    // started, whatever the speed.
    config.collectives.algorithm = Some(Algorithm::RingPipelined);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    let mut mine = vec![1.0f32; 16 << 20];
    // Rank 1's call runs on (it is not cancelled, which would tell rank 0 that it gave
    // up on the call, a path of its own) until its node dies under it.
    let theirs = tokio::spawn({
        let comm = comms[1].clone();
        async move {
            let mut theirs = vec![2.0f32; 16 << 20];
            comm.all_reduce(&mut theirs, nexar_device::ReduceOp::Sum)
                .await
        }
    });
    // Rank 1's node dies once 8 MiB of its blocks have reached rank 0: the calls are under
    // way, and far from done (each rank receives 64 MiB in all).
    let before = cluster.quic_bytes_received_per_rank()[0];
    let killer = async {
        nexar_tests::until(
            || "rank 0 received no 8 MiB from rank 1".to_string(),
            || cluster.quic_bytes_received_per_rank()[0] >= before + (8 << 20),
        )
        .await;
        cluster.kill_rank(1).expect("kill");
    };
    let (res, ()) = within("rank 0's all-reduce after its peer dropped out", async {
        tokio::join!(
            comms[0].all_reduce(&mut mine, nexar_device::ReduceOp::Sum),
            killer
        )
    })
    .await;
    // The loss as this node saw it, or its connection's end as the transport saw it.
    assert!(
        matches!(
            &res,
            Err(NexarError::PeerLost { rank: 1, .. }
                | NexarError::Transport(
                    TransportError::ConnectionLost { .. }
                        | TransportError::Send { .. }
                        | TransportError::Truncated { .. }
                ))
        ),
        "expected rank 1's loss, got {res:?}"
    );
    let theirs = within("rank 1's call on its dead node", theirs)
        .await
        .expect("rank 1's task");
    assert!(
        theirs.is_err(),
        "rank 1's call outlived its node: {theirs:?}"
    );
}
