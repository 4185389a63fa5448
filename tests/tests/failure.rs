//! A dead peer ends calls that involve it with a typed error within the deadline.

use std::time::{Duration, Instant};

use nexar_actors::{Cluster, NexarError, NodeConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_gives_peer_lost_not_a_hang() {
    let mut config = NodeConfig::default();
    config.heartbeat_interval = Duration::from_millis(50);
    config.heartbeat_timeout = Duration::from_millis(1000);
    config.op_timeout = Duration::from_secs(10);
    let cluster = Cluster::local_with(3, config).await.expect("cluster");
    let comms = cluster.communicators();
    cluster.kill_rank(2).expect("kill");
    let start = Instant::now();
    let mut buf = [0u8; 4];
    // A receive from the dead rank fails with PeerLost (the connection close is noticed at
    // once; heartbeats would catch a silent death within the timeout).
    match comms[0].recv(&mut buf, 2, 0).await {
        Err(NexarError::PeerLost { rank: 2, .. }) => {}
        other => panic!("expected PeerLost from rank 2, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(comms[0].failed_ranks(), vec![2]);
    // Sends to it fail too, and a barrier that needs it ends with an error, not a hang.
    assert!(matches!(
        comms[0].send(&buf, 2, 0).await,
        Err(NexarError::PeerLost { rank: 2, .. })
    ));
    let (a, b) = tokio::join!(comms[0].barrier(), comms[1].barrier());
    assert!(
        a.is_err() && b.is_err(),
        "barrier with a dead rank must fail: {a:?} {b:?}"
    );
    // Point-to-point between the survivors still works.
    comms[0]
        .send(&[1u8, 2, 3, 4], 1, 5)
        .await
        .expect("send between survivors");
    comms[1]
        .recv(&mut buf, 0, 5)
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
    assert!(matches!(
        comm.recv(&mut buf, 0, 3).await,
        Err(NexarError::Timeout { .. })
    ));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "took {took:?}"
    );
}

/// A peer that drops out part-way through a large all-reduce (its call cancelled while
/// its blocks are on the wire, then its node killed) ends the other rank's call with an
/// error well before the deadline: a block cut off mid-stream, or never sent, is an
/// error, not a hang or a result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_collective_whose_peer_drops_out_part_way_fails_in_time() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(30);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    let mut mine = vec![1.0f32; 16 << 20];
    let mut theirs = vec![2.0f32; 16 << 20];
    let start = Instant::now();
    let peer = async {
        let call = comms[1].all_reduce(&mut theirs, nexar_device::ReduceOp::Sum);
        // 64 MiB each way cannot cross encrypted QUIC in 10 ms here (about 2 GB/s).
        let cut = tokio::time::timeout(Duration::from_millis(10), call).await;
        assert!(cut.is_err(), "a 64 MiB all-reduce finished in 10 ms");
        cluster.kill_rank(1).expect("kill");
    };
    let (res, ()) = tokio::join!(
        comms[0].all_reduce(&mut mine, nexar_device::ReduceOp::Sum),
        peer
    );
    assert!(res.is_err(), "expected an error, got {res:?}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
}
