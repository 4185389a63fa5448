//! Calls that must fail promptly rather than wait for their deadline: an RPC handler that
//! panics before its future exists, receives queued behind each other, and a message or an
//! RPC request over the receiver's frame limit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nexar_actors::{Cluster, NexarError, Node, NodeConfig, RpcResult, Seed, SeedOptions};
use nexar_tests::seeded::{join_opts, DEADLINE, LOOPBACK};
use nexar_tests::within;

/// A node configuration whose calls wait ten minutes: a call that fails within a test's
/// own (much shorter) bound failed promptly, not at its deadline.
fn patient() -> NodeConfig {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(600);
    config
}

/// A handler that panics in its synchronous part, before its `async` block: the call
/// fails at once with the panicked error, whether the handler runs on another rank (its
/// dispatch used to die with it, and the caller waited for its deadline) or on the
/// caller's own (the panic used to unwind into the caller's task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_handler_that_panics_before_its_future_fails_the_call_promptly() {
    let within = Duration::from_secs(30);
    let cluster = tokio::time::timeout(within, Cluster::local_with(2, patient()))
        .await
        .expect("cluster in time")
        .expect("cluster");
    let comms = cluster.communicators();
    comms[1].register_rpc(7, |_, _| -> std::future::Ready<RpcResult> {
        panic!("the handler's synchronous part panics")
    });
    comms[1].register_rpc(8, |_, _| async { Ok(b"pong".to_vec()) });
    for caller in [0, 1] {
        let call = comms[caller].rpc(1, 7, b"ping");
        let got = tokio::time::timeout(within, call)
            .await
            .unwrap_or_else(|_| panic!("rank {caller}: the call waited for its deadline"));
        assert!(
            matches!(
                got,
                Err(NexarError::RpcFailed {
                    rank: 1,
                    id: 7,
                    panicked: true,
                    ..
                })
            ),
            "rank {caller}: {got:?}"
        );
        // The node serves on.
        let pong = tokio::time::timeout(within, comms[caller].rpc(1, 8, b"ping"))
            .await
            .expect("a reply in time")
            .expect("the next call");
        assert_eq!(pong.as_ref(), b"pong");
    }
    cluster.shutdown().await;
}

/// Receives of one (source, tag) queued behind each other, with nothing sent, each time
/// out `op_timeout` after it was called: the last of twenty used to wait twenty timeouts,
/// one for each receive ahead of it and its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receives_queued_on_one_tag_each_time_out_at_their_own_deadline() {
    let op_timeout = Duration::from_secs(1);
    let mut config = NodeConfig::default();
    config.op_timeout = op_timeout;
    let cluster = tokio::time::timeout(Duration::from_secs(30), Cluster::local_with(2, config))
        .await
        .expect("cluster in time")
        .expect("cluster");
    let comm = cluster.communicators()[1].clone();
    let receives: Vec<_> = (0..20)
        .map(|_| {
            let comm = comm.clone();
            tokio::spawn(async move {
                let start = Instant::now();
                let mut buf = [0u8; 4];
                let res = comm.recv(&mut buf, 0, 3).await;
                (res, start.elapsed())
            })
        })
        .collect();
    // Twenty timeouts in a row would take 20 s; ten are far past one each, however long
    // the machine keeps a receive from its core.
    let bound = 10 * op_timeout;
    let ended = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(receives))
        .await
        .expect("every receive ended within 60 s");
    for (i, r) in ended.into_iter().enumerate() {
        let (res, after) = r.expect("receive task");
        assert!(
            matches!(res, Err(NexarError::Timeout { .. })),
            "receive {i}: {res:?}"
        );
        assert!(after < bound, "receive {i} failed after {after:?}");
    }
    cluster.shutdown().await;
}

/// A message over the receiver's `max_frame_bytes` (the sender's limit is larger, so the
/// sender lets it go) fails its receive at once with `Abandoned` instead of waiting for
/// the receive's deadline, and the next message under the tag is received as the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_receivers_frame_limit_fails_its_receive_at_once() {
    let within = Duration::from_secs(30);
    let nodes = patient_pair_with_frame_limits([1 << 30, 1 << 20], 1 << 20).await;
    let (a, b) = (nodes[0].communicator(), nodes[1].communicator());
    let too_large = vec![7u8; 2 << 20];
    // Sent over QUIC in pieces and refused by the receiver on its header: the send
    // itself may or may not see the refusal.
    let sending = tokio::spawn(async move {
        let _ = a.send(&too_large, 1, 4).await;
        a.send(&[1u8, 2, 3], 1, 4).await.map(|()| a)
    });
    let mut buf = vec![0u8; 2 << 20];
    let first = tokio::time::timeout(within, b.recv(&mut buf, 0, 4))
        .await
        .expect("the receive waited for a refused message");
    assert!(
        matches!(first, Err(NexarError::Abandoned { rank: 0, tag: 4 })),
        "{first:?}"
    );
    let mut next = [0u8; 3];
    tokio::time::timeout(within, b.recv(&mut next, 0, 4))
        .await
        .expect("the next message in time")
        .expect("the next message");
    assert_eq!(next, [1, 2, 3]);
    let _a = tokio::time::timeout(within, sending)
        .await
        .expect("sends in time")
        .expect("send task")
        .expect("the next send");
    finish_all(nodes).await;
}

/// Two nodes joined through a seed, with `patient` calls, the given `max_frame_bytes`
/// (rank 0's first) and messages cut at `max_message` bytes; in rank order.
async fn patient_pair_with_frame_limits(max_frames: [u64; 2], max_message: usize) -> Vec<Node> {
    let seed = Seed::start(LOOPBACK, 2, SeedOptions::default())
        .await
        .expect("seed");
    let joins: Vec<_> = max_frames
        .into_iter()
        .enumerate()
        .map(|(rank, max_frame)| {
            let mut o = join_opts(&seed);
            o.rank = Some(rank);
            o.config = patient();
            o.config.transport.max_frame_bytes = max_frame;
            o.config.collectives.max_message_bytes = max_message;
            tokio::spawn(Node::join(o))
        })
        .collect();
    let mut nodes = Vec::new();
    for j in joins {
        let node = tokio::time::timeout(DEADLINE, j)
            .await
            .expect("join in time")
            .expect("join task")
            .expect("join");
        nodes.push(node);
    }
    nodes.sort_by_key(|n| n.rank());
    nodes
}

/// Finishes every node, within `DEADLINE`.
async fn finish_all(nodes: Vec<Node>) {
    let finishing = futures::future::join_all(nodes.into_iter().map(|n| n.finish(true)));
    tokio::time::timeout(DEADLINE, finishing)
        .await
        .expect("finished in time");
}

/// An RPC request within `MAX_RPC_REQUEST` but over the callee's `max_frame_bytes` (the
/// caller's limit is larger, so it lets the request go) is refused unread by the callee's
/// transport and answered with an error at once, instead of leaving the caller to wait
/// for its deadline; the callee goes on serving requests that fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_request_over_the_callees_frame_limit_fails_at_once() {
    let within = Duration::from_secs(30);
    let limit = 256u64 << 10;
    let nodes = patient_pair_with_frame_limits([1 << 30, limit], 64 << 10).await;
    let (caller, callee) = (nodes[0].communicator(), nodes[1].communicator());
    callee.register_rpc(5, |_, req: Bytes| async move {
        Ok(req.len().to_le_bytes().to_vec())
    });
    // Both calls fail at once. The first may fail on its send instead of the callee's
    // answer: right after the mesh formed, the callee's full receive window (opened when
    // it attached the connection, past the 64 KiB every connection starts with) may not
    // have reached the caller yet, and a write held back by flow control sees the callee
    // stop the stream. By the time the first call has failed either way, the window has
    // reached it (the stop, or the written request, came after), so the second request
    // is queued whole within the send window before the callee can stop it: the refusal
    // comes as the callee's answer.
    let too_large = vec![3u8; 512 << 10];
    for attempt in 0..2 {
        let refused = tokio::time::timeout(within, caller.rpc(1, 5, &too_large))
            .await
            .expect("the call waited for a reply to a refused request");
        match refused {
            Err(NexarError::RpcFailed {
                rank: 1,
                id: 5,
                message,
                panicked: false,
            }) => {
                assert!(message.contains("max_frame_bytes"), "{message}");
                assert!(message.contains(&limit.to_string()), "{message}");
            }
            Err(NexarError::Transport(nexar_transport::TransportError::Send {
                reason, ..
            })) if attempt == 0 && reason.contains("stopped") => {}
            other => panic!("call {attempt}: expected the callee's refusal, got {other:?}"),
        }
    }
    let fits = vec![4u8; 128 << 10];
    let reply = tokio::time::timeout(within, caller.rpc(1, 5, &fits))
        .await
        .expect("a request that fits, in time")
        .expect("a request that fits is served");
    assert_eq!(reply.as_ref(), fits.len().to_le_bytes());
    finish_all(nodes).await;
}

/// A member's connection gets its full receive window once its node attaches it, past
/// the small one every connection starts with: a 4 MiB message to a rank that has not
/// asked for it yet, over an early-arrival budget of 1 MiB (so the receiver's reader
/// leaves it unread, waiting for its receive), is all taken by QUIC and the send returns;
/// the receive later gets it whole. (With the connection left at its first window, the
/// send would wait for the receive, for as long as the receiver made it wait.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_connection_takes_a_message_nobody_reads_yet_past_the_first_window() {
    let within = Duration::from_secs(30);
    let mut config = patient();
    config.transport.early_budget_bytes = 1 << 20;
    let cluster = tokio::time::timeout(within, Cluster::local_with(2, config))
        .await
        .expect("cluster in time")
        .expect("cluster");
    let comms = cluster.communicators();
    let message: Vec<u8> = (0..4 << 20).map(|i| (i % 251) as u8).collect();
    tokio::time::timeout(within, comms[1].send(&message, 0, 9))
        .await
        .expect("the send returned before the receiver asked")
        .expect("send");
    let mut got = vec![0u8; message.len()];
    tokio::time::timeout(within, comms[0].recv(&mut got, 1, 9))
        .await
        .expect("the receive in time")
        .expect("recv");
    assert!(got == message, "the message arrived whole");
}

/// Blocks over `max_frame_bytes` travel cut at `CollectiveConfig::max_message_bytes`:
/// with frames of at most 1 MiB, a gather of blocks of 2 MiB and a few elements, an
/// all-reduce whose ring blocks are 2 MiB, and a broadcast of 4 MiB whose scatter and
/// ring send blocks of 1.33 MiB all end right on every rank. (Before collectives cut their
/// messages, each of these failed with `FrameTooLarge`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collective_blocks_over_the_frame_limit_travel_cut_at_max_message_bytes() {
    let mut config = patient();
    config.transport.max_frame_bytes = 1 << 20;
    config.collectives.max_message_bytes = 1 << 20;
    let cluster = within("cluster", Cluster::local_with(3, config))
        .await
        .expect("cluster");
    let block = (2 << 20) / 4 + 3;
    let calls = cluster.communicators().into_iter().map(|c| {
        tokio::spawn(async move {
            let r = c.rank();
            let send: Vec<f32> = (0..block).map(|i| (r * block + i) as f32).collect();
            let mut gathered = vec![0f32; if r == 0 { 3 * block } else { 0 }];
            c.gather(&send, &mut gathered, 0).await.expect("gather");
            let mut summed = vec![r as f32 + 1.0; 3 * (2 << 20) / 4];
            c.all_reduce(&mut summed, nexar_device::ReduceOp::Sum)
                .await
                .expect("all-reduce");
            let mut cast: Vec<u32> = if r == 1 {
                (0..(4 << 20) / 4).collect()
            } else {
                vec![0; (4 << 20) / 4]
            };
            c.broadcast(&mut cast, 1).await.expect("broadcast");
            (r, gathered, summed, cast)
        })
    });
    for joined in within("every rank's collectives", futures::future::join_all(calls)).await {
        let (r, gathered, summed, cast) = joined.expect("task");
        if r == 0 {
            assert!(
                gathered.iter().enumerate().all(|(i, &x)| x == i as f32),
                "the root's gather"
            );
        }
        assert!(summed.iter().all(|&x| x == 6.0), "rank {r}'s all-reduce");
        assert!(
            cast.iter().enumerate().all(|(i, &x)| x == i as u32),
            "rank {r}'s broadcast"
        );
    }
    within("shutdown", cluster.shutdown()).await;
}

/// A node refuses to start with a `max_message_bytes` over the largest message it may
/// send (its `max_frame_bytes`, less a relay's envelope on a sparse topology), or under
/// `MIN_MESSAGE_BYTES`, and says which setting to change; at the limit it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_a_collective_message_cap_over_what_it_may_send() {
    let refused = |config: NodeConfig| async move {
        match within("a refused start", Cluster::local_with(2, config)).await {
            Err(NexarError::InvalidArgument(why)) => {
                assert!(why.contains("max_message_bytes"), "{why}");
                assert!(why.contains("max_frame_bytes"), "{why}");
            }
            Err(other) => panic!("refused for another reason: {other:?}"),
            Ok(_) => panic!("started"),
        }
    };
    let mut over = patient();
    over.transport.max_frame_bytes = 1 << 20;
    // The default cap (64 MiB) is over it.
    refused(over.clone()).await;
    for tiny in [0, nexar_actors::MIN_MESSAGE_BYTES - 1] {
        let mut small = patient();
        small.collectives.max_message_bytes = tiny;
        refused(small).await;
    }
    let mut sparse = over.clone();
    sparse.topology = nexar_actors::Topology::Hypercube;
    sparse.collectives.max_message_bytes = 1 << 20;
    refused(sparse).await;
    over.collectives.max_message_bytes = 1 << 20;
    let cluster = within("a cluster at the limit", Cluster::local_with(2, over))
        .await
        .expect("cluster");
    within("shutdown", cluster.shutdown()).await;
}

/// A node serves at most `max_rpc_in_flight` requests of one caller at once; past that, a
/// request is refused at once as busy (its handler not called) rather than piling up
/// behind a slow handler, and the count drops as handlers finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_server_serves_at_most_max_rpc_in_flight_requests_of_a_caller() {
    let mut config = patient();
    config.max_rpc_in_flight = 0;
    let refused = within("a cluster refused", Cluster::local_with(1, config.clone())).await;
    assert!(
        matches!(refused, Err(NexarError::InvalidArgument(ref m)) if m.contains("max_rpc_in_flight")),
        "{refused:?}"
    );
    config.max_rpc_in_flight = 2;
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    let entered = Arc::new(tokio::sync::Semaphore::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let (entered, release, calls) = (entered.clone(), release.clone(), calls.clone());
        comms[1].register_rpc(5, move |_caller, req: Bytes| {
            let (entered, release) = (entered.clone(), release.clone());
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                entered.add_permits(1);
                release.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok(req.to_vec())
            }
        });
    }
    let call = |i: u8| {
        let c = comms[0].clone();
        tokio::spawn(async move { c.rpc(1, 5, &[i]).await })
    };
    let held = [call(1), call(2)];
    // Both are in the handler.
    within("two handlers entered", entered.acquire_many(2))
        .await
        .expect("semaphore")
        .forget();
    let refused = within("the third call", call(3)).await.expect("call task");
    match refused {
        Err(NexarError::RpcFailed { message, .. }) => {
            assert!(message.contains("busy"), "{message}")
        }
        other => panic!("expected a busy refusal, got {other:?}"),
    }
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "its handler ran"
    );
    release.add_permits(2);
    for (i, h) in held.into_iter().enumerate() {
        let reply = within("a held call", h).await.expect("call task");
        assert_eq!(reply.expect("served"), vec![i as u8 + 1]);
    }
    // Served again once the others are done.
    release.add_permits(1);
    let reply = once_not_busy(|| comms[0].rpc(1, 5, &[4])).await;
    assert_eq!(reply, vec![4]);
    cluster.shutdown().await;
}

/// Makes `call` until it is not refused as busy (within 30 s), and returns its reply: a
/// handler's place is given back just after its reply is sent, so a call made as soon as
/// that reply arrives may still find the place taken.
async fn once_not_busy<F, Fut>(call: F) -> Bytes
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Bytes, NexarError>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match within("a later call", call()).await {
            Ok(reply) => return reply,
            Err(NexarError::RpcFailed { message, .. }) if message.contains("busy") => {
                assert!(Instant::now() < deadline, "still busy");
                tokio::task::yield_now().await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// A node's calls to itself count among its requests in flight too, for as long as their
/// handlers run, even once the call gave up (a handler runs to its end): a caller timing
/// out against a slow handler of its own cannot pile up handlers either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_to_oneself_count_until_their_handlers_end() {
    let mut config = patient();
    config.max_rpc_in_flight = 1;
    let cluster = Cluster::local_with(1, config).await.expect("cluster");
    let comm = cluster.communicators().remove(0);
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    {
        let release = release.clone();
        comm.register_rpc(5, move |_caller, req: Bytes| {
            let release = release.clone();
            async move {
                release.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok(req.to_vec())
            }
        });
    }
    let gave_up = within(
        "a call that gives up",
        comm.rpc_with_timeout(0, 5, &[1], Duration::from_millis(50)),
    )
    .await;
    assert!(
        matches!(gave_up, Err(NexarError::Timeout { .. })),
        "{gave_up:?}"
    );
    // Its handler still runs: the next call is refused as busy, at once.
    let refused = within("a call while the handler runs", comm.rpc(0, 5, &[2])).await;
    match refused {
        Err(NexarError::RpcFailed { message, .. }) => {
            assert!(message.contains("busy"), "{message}")
        }
        other => panic!("expected a busy refusal, got {other:?}"),
    }
    release.add_permits(2);
    // Once it ends, calls are served again (allow the finished handler's count to drop).
    let reply = once_not_busy(|| comm.rpc(0, 5, &[3])).await;
    assert_eq!(reply, vec![3]);
    cluster.shutdown().await;
}
