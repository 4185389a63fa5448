//! Point-to-point messages over real QUIC between in-process ranks.

use std::time::Duration;

use nexar_actors::{Cluster, NexarError};
use nexar_tests::{on_all_ranks, ring_messages, within};

const DEADLINE: Duration = Duration::from_secs(240);

/// Each rank sends a sequence of messages of mixed sizes to its right neighbour under one
/// tag and receives its left neighbour's; every message must arrive intact and in order.
async fn ring_exchange(world: usize, sizes: &'static [usize]) {
    let cluster = Cluster::local(world).await.expect("cluster");
    let results = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
        ring_messages(&comm, sizes, 7).await
    })
    .await;
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_and_integrity_world_2_up_to_64_mib() {
    // A 64 MiB message followed by a 16 B one must still arrive in that order. From 4 MiB
    // (RECV_STREAM_BYTES) messages are written with streaming stores: one of them ends
    // off a cache line.
    static SIZES: &[usize] = &[
        0,
        1,
        16,
        4096,
        65_537,
        1 << 20,
        4 << 20,
        (4 << 20) + 3,
        64 << 20,
        16,
        0,
        3,
    ];
    ring_exchange(2, SIZES).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_and_integrity_worlds_3_to_8() {
    static SIZES: &[usize] = &[0, 1, 16, 4096, 65_537, 1 << 20, 4 << 20, 16, 5];
    for world in 3..=8 {
        ring_exchange(world, SIZES).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_to_self_and_typed_elements() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let comm = cluster.communicators()[0].clone();
    let data: Vec<f64> = (0..100).map(|i| i as f64 * 0.5).collect();
    within("send to self", comm.send(&data, 0, 1))
        .await
        .expect("send to self");
    let mut back = vec![0f64; 100];
    within("recv from self", comm.recv(&mut back, 0, 1))
        .await
        .expect("recv from self");
    assert_eq!(back, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_mismatch_is_a_typed_error_and_next_message_still_arrives() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let comms = cluster.communicators();
    within("first send", comms[0].send(&[1u32, 2, 3], 1, 9))
        .await
        .expect("send");
    within("second send", comms[0].send(&[4u32, 5], 1, 9))
        .await
        .expect("send");
    let mut wrong = [0u32; 2];
    match within("recv of the wrong length", comms[1].recv(&mut wrong, 0, 9)).await {
        Err(NexarError::LengthMismatch {
            expected: 2,
            actual: 3,
            ..
        }) => {}
        other => panic!("expected a length mismatch, got {other:?}"),
    }
    let mut next = [0u32; 2];
    within("recv of the second message", comms[1].recv(&mut next, 0, 9))
        .await
        .expect("second message");
    assert_eq!(next, [4, 5]);
    // A message of no whole number of elements: its lengths are in bytes, and the error
    // says so (it called them elements).
    within("send of odd bytes", comms[0].send(&[1u8; 41], 1, 9))
        .await
        .expect("send");
    let mut words = [0u32; 4];
    match within("recv of odd bytes", comms[1].recv(&mut words, 0, 9)).await {
        Err(e @ NexarError::LengthMismatch { .. }) => assert_eq!(
            e.to_string(),
            "received message (bytes; not whole elements): expected 16, got 41"
        ),
        other => panic!("expected a length mismatch, got {other:?}"),
    }
}

/// A large message whose receive is already posted (the path where the transport hands
/// the receive its stream, to be copied in as it arrives; that the stream is handed over
/// is checked in the transport's own tests) arrives intact, a buffer of the wrong size is
/// a typed error, and the messages after it still arrive, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_with_their_receive_posted_keep_integrity_and_order() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let comms = cluster.communicators();
    let (sender, receiver) = (comms[0].clone(), comms[1].clone());
    let big: Vec<u32> = (0..(2u32 << 20))
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let send_all = {
        let big = big.clone();
        async move {
            // Wait for the receiver's go: its receive of the first message is posted.
            let mut go = [0u8; 1];
            sender.recv(&mut go, 1, 1).await?;
            sender.send(&big, 1, 2).await?;
            sender.send(&big, 1, 2).await?;
            sender.send(&[7u32; 3], 1, 2).await
        }
    };
    let receive_all = async move {
        let mut first = vec![0u32; big.len()];
        let mut short = vec![0u32; big.len() / 2];
        // Polled in order: the first receive registers before the go is sent.
        let (got, went) =
            tokio::join!(receiver.recv(&mut first, 0, 2), receiver.send(&[1u8], 0, 1));
        went?;
        got?;
        assert!(first == big, "first large message differs");
        match receiver.recv(&mut short, 0, 2).await {
            Err(NexarError::LengthMismatch {
                expected, actual, ..
            }) => assert_eq!((expected, actual), (big.len() / 2, big.len())),
            other => panic!("expected a length mismatch, got {other:?}"),
        }
        let mut last = [0u32; 3];
        receiver.recv(&mut last, 0, 2).await?;
        assert_eq!(last, [7, 7, 7]);
        Ok::<(), NexarError>(())
    };
    let (sent, received) = tokio::time::timeout(DEADLINE, async {
        tokio::join!(tokio::spawn(send_all), receive_all)
    })
    .await
    .expect("the large messages were not all sent and received by the deadline");
    sent.expect("sender task").expect("sends");
    received.expect("receives");
    cluster.shutdown().await;
}

/// A large `send` is written while the transport takes it: over QUIC copied out in pieces
/// (within the send budget), over a trusted lane straight from the caller's buffer.
/// Dropped after its first poll, it finishes from a copy in the background and the
/// message still arrives whole, before the next one under the same tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_send_dropped_part_way_still_delivers_its_whole_message_in_order() {
    for trusted in [false, true] {
        let mut config = nexar_actors::NodeConfig::default();
        config.trusted_fabric = trusted;
        // One piece in flight at a time over QUIC: the send has to wait after its first.
        config.collective_send_budget_bytes = 1 << 20;
        let cluster = Cluster::local_with(2, config).await.expect("cluster");
        let comms = cluster.communicators();
        // Over the lane, more than the socket takes without the reader draining it.
        let big: Vec<u64> = (0..(4u64 << 20)).map(|i| i ^ 0x5a5a_5a5a).collect();
        // A zero timeout polls the send once (it writes what it can, then waits) and
        // drops it.
        let dropped = tokio::time::timeout(Duration::ZERO, comms[0].send(&big, 1, 3)).await;
        assert!(
            dropped.is_err(),
            "trusted {trusted}: the send finished in one poll"
        );
        within("the next send", comms[0].send(&[9u64; 2], 1, 3))
            .await
            .expect("next send");
        let mut got = vec![0u64; big.len()];
        tokio::time::timeout(DEADLINE, comms[1].recv(&mut got, 0, 3))
            .await
            .unwrap_or_else(|_| panic!("trusted {trusted}: the dropped send's message never came"))
            .expect("recv");
        assert!(
            got == big,
            "trusted {trusted}: the dropped send's message differs"
        );
        let mut next = [0u64; 2];
        within("recv of the next message", comms[1].recv(&mut next, 0, 3))
            .await
            .expect("recv next");
        assert_eq!(next, [9, 9]);
        cluster.shutdown().await;
    }
}

/// `send_bytes` hands over `Bytes` without a copy: slices of one buffer and the same
/// buffer sent twice arrive intact, in order with plain `send`s under the same tag, over
/// QUIC and over the trusted lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_bytes_shares_one_buffer_and_keeps_the_order() {
    for trusted in [false, true] {
        let mut config = nexar_actors::NodeConfig::default();
        config.trusted_fabric = trusted;
        let cluster = Cluster::local_with(2, config).await.expect("cluster");
        let comms = cluster.communicators();
        let words: Vec<u32> = (0..300_000u32).collect();
        let all = bytes::Bytes::copy_from_slice(bytemuck::cast_slice(&words));
        within("send", comms[0].send(&[7u32; 3], 1, 4))
            .await
            .expect("send");
        within(
            "send_bytes of a slice",
            comms[0].send_bytes(all.slice(4..40), 1, 4),
        )
        .await
        .expect("send_bytes");
        for i in 0..2 {
            within(
                &format!("send_bytes of the whole buffer, {i}"),
                comms[0].send_bytes(all.clone(), 1, 4),
            )
            .await
            .expect("send_bytes");
        }
        let mut head = [0u32; 3];
        within("recv of the plain send", comms[1].recv(&mut head, 0, 4))
            .await
            .expect("recv");
        assert_eq!(head, [7; 3]);
        let mut part = [0u32; 9];
        within("recv of the slice", comms[1].recv(&mut part, 0, 4))
            .await
            .expect("recv");
        assert_eq!(part.to_vec(), (1..10u32).collect::<Vec<_>>());
        for i in 0..2 {
            let mut back = vec![0u32; words.len()];
            within(
                &format!("recv of the whole buffer, {i}"),
                comms[1].recv(&mut back, 0, 4),
            )
            .await
            .expect("recv");
            assert_eq!(back, words, "trusted lane: {trusted}");
        }
        let bad = within(
            "send_bytes to a bad rank",
            comms[0].send_bytes(all.clone(), 2, 4),
        )
        .await;
        assert!(
            matches!(bad, Err(NexarError::InvalidRank { rank: 2, world: 2 })),
            "{bad:?}"
        );
        cluster.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rank_is_rejected() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let comm = cluster.communicators()[0].clone();
    let sent = within("send to a bad rank", comm.send(&[1u8], 5, 0)).await;
    assert!(
        matches!(sent, Err(NexarError::InvalidRank { rank: 5, world: 2 })),
        "{sent:?}"
    );
    let mut b = [0u8];
    let got = within("recv from a bad rank", comm.recv(&mut b, 2, 0)).await;
    assert!(
        matches!(got, Err(NexarError::InvalidRank { rank: 2, world: 2 })),
        "{got:?}"
    );
}

/// In a cluster of two each node's connections to the other take one and a half send
/// windows (nothing else sends to it); with three or more, one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_sole_peer_gets_more_than_one_send_window() {
    let window = nexar_tests::SMALL_SEND_WINDOW;
    let mut config = nexar_actors::NodeConfig::default();
    config.transport.send_window = window as u32;
    let sole = nexar_tests::sole_peer_window(window);
    // Else the two cases below would not differ.
    assert!(
        sole > window,
        "this host's receive buffer holds 1.5 windows"
    );
    for (world, expected) in [(2, sole), (3, window)] {
        let cluster = Cluster::local_with(world, config.clone())
            .await
            .expect("cluster");
        for (rank, comm) in cluster.communicators().iter().enumerate() {
            let peers: Vec<usize> = (0..world).filter(|r| *r != rank).collect();
            let windows = comm.send_windows();
            assert_eq!(
                windows,
                peers.iter().map(|p| (*p, expected)).collect::<Vec<_>>(),
                "world {world}, rank {rank}"
            );
        }
        cluster.shutdown().await;
    }
}

/// A sender far ahead of its receiver with small messages: those past the receiver's
/// early-arrival budget and the sender's overdraft (`max_streams * stream_window`) are
/// dropped there, and their receives fail at once (`Abandoned`), in their places in the
/// sequence; the messages before them arrive whole and in order, and the pair stays in
/// step: the next message arrives. They used to be kept however many came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_messages_past_the_budget_and_the_overdraft_fail_their_receives_in_step() {
    use nexar_transport::EARLY_FRAME_MIN_CHARGE;
    const SENT: u32 = 100;
    let mut config = nexar_actors::NodeConfig::default();
    // 16 frames within the budget and 32 on the overdraft (4 streams of 32 KiB).
    config.transport.early_budget_bytes = 16 * EARLY_FRAME_MIN_CHARGE;
    config.transport.max_streams = 4;
    config.transport.stream_window = 32 << 10;
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    for i in 0..SENT {
        within("a send", comms[0].send(&[i; 8], 1, 3))
            .await
            .expect("send");
    }
    // The sends are queued before the receives start; the last one has been read when
    // the pair's next message, on another tag, has (one stream, in order): whether it
    // was kept, or dropped too, its receive says so.
    within("the marker", comms[0].send(&[SENT], 1, 4))
        .await
        .expect("send");
    let mut marker = [0u32];
    match within("the marker", comms[1].recv(&mut marker, 0, 4)).await {
        Ok(()) => assert_eq!(marker, [SENT]),
        Err(NexarError::Abandoned { rank: 0, tag: 4 }) => {}
        Err(e) => panic!("the marker: {e}"),
    }
    let mut kept = 0;
    for i in 0..SENT {
        let mut got = [u32::MAX; 8];
        match within("a receive", comms[1].recv(&mut got, 0, 3)).await {
            Ok(()) => {
                assert_eq!(kept, i, "message {i} arrived after a dropped one");
                assert_eq!(got, [i; 8], "message {i}");
                kept += 1;
            }
            Err(NexarError::Abandoned { rank: 0, tag: 3 }) => {}
            Err(e) => panic!("message {i}: {e}"),
        }
    }
    assert_eq!(
        kept, 48,
        "16 messages within the budget and 32 on the overdraft"
    );
    within("the next send", comms[0].send(&[7; 8], 1, 3))
        .await
        .expect("send");
    let mut next = [0u32; 8];
    within("the next receive", comms[1].recv(&mut next, 0, 3))
        .await
        .expect("recv");
    assert_eq!(next, [7; 8]);
    cluster.shutdown().await;
}
