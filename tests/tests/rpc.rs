//! RPC between ranks, and the compressed all-reduce.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use nexar_actors::{Cluster, Codec, NexarError, NodeConfig, Residual};
use nexar_device::ReduceOp;
use nexar_tests::{on_all_ranks, within, STEP_DEADLINE};
use tokio::sync::Notify;

const DEADLINE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_are_matched_to_their_replies() {
    let cluster = Cluster::local(3).await.expect("cluster");
    for comm in cluster.communicators() {
        let me = comm.rank();
        comm.register_rpc(1, move |caller, req: Bytes| async move {
            let mut out = vec![me as u8, caller as u8];
            out.extend_from_slice(&req);
            Ok(out)
        });
    }
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let mut calls = Vec::new();
        for i in 0..60u32 {
            let comm = comm.clone();
            calls.push(tokio::spawn(async move {
                let target = (i as usize) % 3;
                let payload = i.to_le_bytes();
                let reply = comm.rpc(target, 1, &payload).await?;
                assert_eq!(reply[0] as usize, target);
                assert_eq!(reply[1] as usize, comm.rank());
                assert_eq!(&reply[2..], &payload);
                Ok::<_, NexarError>(())
            }));
        }
        for c in calls {
            c.await.expect("call task")?;
        }
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("rpc");
    }
}

/// A handler's reply may carry the callee's `max_frame_bytes` less the reply's status
/// byte: one of exactly that many bytes arrives, one byte more is refused with an error
/// that names the limit it went past (it named the frame's limit, the reply's size, and
/// so the same number twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_is_refused_just_past_the_most_a_reply_carries() {
    let frame = 64u64 << 10;
    let mut config = NodeConfig::default();
    config.transport.max_frame_bytes = frame;
    config.collectives.max_message_bytes = frame as usize;
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    comms[1].register_rpc(1, |_, req: Bytes| async move {
        let n = u32::from_le_bytes(req[..4].try_into().map_err(|_| "a length")?);
        Ok(vec![7u8; n as usize])
    });
    let most = frame - 1;
    let reply = within(
        "the largest reply",
        comms[0].rpc(1, 1, &(most as u32).to_le_bytes()),
    )
    .await
    .expect("a reply of the most a reply carries");
    assert_eq!(reply.len() as u64, most);
    match within(
        "a reply too large",
        comms[0].rpc(1, 1, &(frame as u32).to_le_bytes()),
    )
    .await
    {
        Err(NexarError::RpcFailed { message, .. }) => {
            assert!(
                message.contains(&format!("reply of {frame} bytes exceeds the {most} bytes")),
                "{message}"
            );
        }
        other => panic!("expected the reply refused, got {other:?}"),
    }
    cluster.shutdown().await;
}

/// An `op_timeout` far past [`STEP_DEADLINE`]: a call that ends within the step deadline
/// did not end at the library's call deadline.
const FAR_OP_TIMEOUT: Duration = Duration::from_secs(10 * STEP_DEADLINE.as_secs());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_ids_errors_and_panics_are_typed_and_the_server_keeps_serving() {
    let mut config = NodeConfig::default();
    config.op_timeout = FAR_OP_TIMEOUT;
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    let server = &comms[1];
    server.register_rpc(2, |_, _| async {
        Err::<Vec<u8>, _>("bad request".to_string())
    });
    server.register_rpc(3, |_, req: Bytes| async move {
        if req.is_empty() {
            panic!("handler bug");
        }
        Ok(req.to_vec())
    });
    let client = &comms[0];
    // Typed errors arrive at once, not at the call deadline: each call is bounded by the
    // step deadline, far under the op_timeout.
    let unknown = within("call to an unknown id", client.rpc(1, 99, b"x")).await;
    assert!(
        matches!(unknown, Err(NexarError::RpcUnknown { rank: 1, id: 99 })),
        "{unknown:?}"
    );
    match within("call to a failing handler", client.rpc(1, 2, b"x")).await {
        Err(NexarError::RpcFailed {
            message,
            panicked: false,
            ..
        }) => assert_eq!(message, "bad request"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    let panicked = within("call to a panicking handler", client.rpc(1, 3, b"")).await;
    assert!(
        matches!(panicked, Err(NexarError::RpcFailed { panicked: true, .. })),
        "{panicked:?}"
    );
    assert_eq!(
        within("call after the panic", client.rpc(1, 3, b"still here"))
            .await
            .expect("served")
            .as_ref(),
        b"still here"
    );
    server.unregister_rpc(3);
    let gone = within("call to an unregistered id", client.rpc(1, 3, b"x")).await;
    assert!(
        matches!(gone, Err(NexarError::RpcUnknown { .. })),
        "{gone:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_blocks_neither_other_calls_nor_messages_and_timeouts_are_per_call() {
    // Calls without a timeout of their own wait up to op_timeout: far past the step
    // deadline, so one held up behind the slow handler fails the test.
    let mut config = NodeConfig::default();
    config.op_timeout = FAR_OP_TIMEOUT;
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let comms = cluster.communicators();
    let gate = Arc::new(Notify::new());
    let g = gate.clone();
    comms[1].register_rpc(10, move |_, _| {
        let g = g.clone();
        async move {
            g.notified().await;
            Ok(b"late".to_vec())
        }
    });
    comms[1].register_rpc(11, |_, _| async { Ok(b"fast".to_vec()) });
    // A call whose handler never finishes in time: only that call times out, at its own
    // 300 ms (the node's op_timeout is far past the step deadline).
    let r = within(
        "a call with a 300 ms timeout",
        comms[0].rpc_with_timeout(1, 10, b"", Duration::from_millis(300)),
    )
    .await;
    assert!(matches!(r, Err(NexarError::Timeout { .. })), "{r:?}");
    // Meanwhile the slow handler is still parked; other calls and messages flow.
    assert_eq!(
        within("a fast call", comms[0].rpc(1, 11, b""))
            .await
            .expect("fast call")
            .as_ref(),
        b"fast"
    );
    within("send", comms[1].send(&[5u8], 0, 3))
        .await
        .expect("send");
    let mut b = [0u8];
    within("recv", comms[0].recv(&mut b, 1, 3))
        .await
        .expect("recv");
    assert_eq!(b, [5]);
    let slow = {
        let c = comms[0].clone();
        tokio::spawn(async move { c.rpc(1, 10, b"").await })
    };
    // Release the parked handlers (the timed-out call's and this one's).
    let release = async {
        loop {
            gate.notify_waiters();
            if slow.is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(DEADLINE, release)
        .await
        .expect("slow call released");
    assert_eq!(
        slow.await.expect("task").expect("slow call").as_ref(),
        b"late"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_all_reduce_matches_the_sum_of_compressed_contributions() {
    let cluster = Cluster::local(4).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let n = 1000;
        let data = |r: usize, step: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 7 + r * 13 + step * 3) % 101) as f32 - 50.0) / 8.0)
                .collect()
        };
        let codec = Codec::top_k(0.1).map_err(NexarError::from)?;
        let mut residual = Residual::<f32>::new(n);
        // Every rank replays every rank's compression locally to get the expected sum.
        let mut residuals: Vec<Residual<f32>> = (0..4).map(|_| Residual::new(n)).collect();
        for step in 0..3 {
            let mut buf = data(comm.rank(), step);
            comm.all_reduce_compressed(&mut buf, &codec, &mut residual)
                .await?;
            let mut want = vec![0f32; n];
            for (r, res) in residuals.iter_mut().enumerate() {
                let s =
                    nexar_actors::compress_with_feedback(&codec, step as u64, &data(r, step), res)
                        .map_err(NexarError::from)?;
                nexar_actors::accumulate(&mut want, &s).map_err(NexarError::from)?;
            }
            assert_eq!(buf, want, "step {step}");
            let mut check = buf.clone();
            comm.all_reduce(&mut check, ReduceOp::Max).await?;
            assert_eq!(check, buf, "ranks disagree at step {step}");
        }
        let mut short = vec![0f32; 10];
        assert!(matches!(
            comm.all_reduce_compressed(&mut short, &codec, &mut residual)
                .await,
            Err(NexarError::LengthMismatch { .. })
        ));
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("compressed all-reduce");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_compressed_all_reduce_changes_nothing_and_keeps_the_ranks_in_step() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(1);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    // Rank 0 waits, through this RPC, until rank 1's call has failed.
    let failed = Arc::new(Notify::new());
    let signal = failed.clone();
    cluster.communicators()[1].register_rpc(7, move |_, _| {
        let failed = signal.clone();
        async move {
            failed.notified().await;
            Ok(Vec::new())
        }
    });
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| {
        let failed = failed.clone();
        async move {
            let (rank, n) = (comm.rank(), 64);
            let codec = Codec::top_k(0.25).map_err(NexarError::from)?;
            let mut buf: Vec<f32> = (0..n).map(|i| (i + rank) as f32).collect();
            let before = buf.clone();
            // Rank 0's residual has the wrong length: refused at once. Rank 1's call then
            // has nobody to exchange with and fails at its deadline.
            let mut residual = Residual::<f32>::new(if rank == 0 { n - 1 } else { n });
            let held = residual.clone();
            let r = comm
                .all_reduce_compressed(&mut buf, &codec, &mut residual)
                .await;
            assert!(r.is_err(), "rank {rank}: {r:?}");
            assert_eq!(buf, before, "rank {rank}: the buffer changed");
            assert_eq!(residual, held, "rank {rank}: the residual changed");
            if rank == 0 {
                comm.rpc_with_timeout(1, 7, &[], DEADLINE).await?;
            } else {
                failed.notify_one();
            }
            // Both used up the call's number: the next calls pair up.
            for i in 0..4u64 {
                let mut all = [0u64; 2];
                comm.all_gather(&[i * 10 + rank as u64], &mut all).await?;
                assert_eq!(all, [i * 10, i * 10 + 1], "call {i}");
            }
            Ok::<_, NexarError>(())
        }
    })
    .await;
    for r in res {
        r.expect("ranks in step after a refused call");
    }
}

/// An RPC handler is dropped with its communicator: one registered on a split
/// communicator goes when the split's last clone does (handlers used to stay for the
/// node's lifetime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_is_dropped_with_its_communicator() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let splits = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        comm.split(0, 0).await
    })
    .await;
    let (gone_tx, gone) = tokio::sync::oneshot::channel::<()>();
    let split = splits
        .into_iter()
        .next()
        .expect("rank 0's split")
        .expect("split");
    split.register_rpc(1, move |_, req: Bytes| {
        let _held = &gone_tx;
        async move { Ok(req.to_vec()) }
    });
    drop(split);
    assert_dropped(gone, "the handler outlives its communicator").await;
}

/// A handler that holds its own communicator is dropped when the node shuts down, and
/// with it the node's state (the handler, its communicator and the node held each
/// other for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_holding_its_communicator_is_dropped_at_shutdown() {
    handler_holding_its_communicator_is_dropped(false).await;
}

/// A handler registered once the node has shut down (by a task that still held a
/// communicator) is dropped at once: holding its own communicator, it would keep the node's
/// state for good, the shutdown's clean-up having run already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_registered_after_shutdown_is_dropped() {
    handler_holding_its_communicator_is_dropped(true).await;
}

/// Registers on rank 0 a handler that holds rank 0's communicator, before the cluster's
/// shutdown or after it (`late`), and checks that it is dropped once the communicator is.
async fn handler_holding_its_communicator_is_dropped(late: bool) {
    let cluster = Cluster::local(2).await.expect("cluster");
    let comm = cluster.communicators().swap_remove(0);
    let cluster = if late {
        cluster.shutdown().await;
        None
    } else {
        Some(cluster)
    };
    let (gone_tx, gone) = tokio::sync::oneshot::channel::<()>();
    let held = comm.clone();
    comm.register_rpc(1, move |_, _| {
        let _held = (&gone_tx, &held);
        async move { Ok(Vec::new()) }
    });
    drop(comm);
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    assert_dropped(
        gone,
        &format!(
            "the handler (registered after the shutdown: {late}) outlives the node's shutdown"
        ),
    )
    .await;
}

/// A call to one's own rank whose handler the node's shutdown cancels ends with
/// `Shutdown`, as every other call then does, not as a handler's failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_to_oneself_cut_by_shutdown_ends_as_shutdown() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let comm = cluster.communicators().swap_remove(0);
    let (started_tx, mut started) = tokio::sync::mpsc::channel::<()>(1);
    comm.register_rpc(1, move |_, _| {
        let started = started_tx.clone();
        async move {
            let _ = started.send(()).await;
            // Far past every deadline of this test: only a cancellation ends it.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(Vec::new())
        }
    });
    let call = tokio::spawn({
        let comm = comm.clone();
        async move {
            comm.rpc_with_timeout(0, 1, b"", Duration::from_secs(3600))
                .await
        }
    });
    tokio::time::timeout(DEADLINE, started.recv())
        .await
        .expect("the handler did not start within the deadline")
        .expect("the handler started");
    drop(comm);
    cluster.shutdown().await;
    let ended = tokio::time::timeout(DEADLINE, call)
        .await
        .expect("the call did not end within the deadline")
        .expect("the call's task");
    assert!(matches!(ended, Err(NexarError::Shutdown)), "{ended:?}");
}

/// A handler call still running when the node shuts down is cancelled: its future, and
/// what it holds (here its own communicator, and so the node's state), are dropped with
/// the node instead of running on after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_handler_call_is_cancelled_at_shutdown() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let comms = cluster.communicators();
    let (started_tx, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let (gone_tx, gone) = tokio::sync::oneshot::channel::<()>();
    let gone_tx = std::sync::Arc::new(std::sync::Mutex::new(Some(gone_tx)));
    let held = comms[1].clone();
    comms[1].register_rpc(1, move |_, _| {
        let started = started_tx.clone();
        let guard = gone_tx.lock().expect("lock").take();
        let held = held.clone();
        async move {
            let _held = (guard, held);
            let _ = started.send(()).await;
            // Far past every deadline of this test: only a cancellation ends it.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(Vec::new())
        }
    });
    let caller = comms[0].clone();
    let call = tokio::spawn(async move {
        caller
            .rpc_with_timeout(1, 1, b"", Duration::from_secs(3600))
            .await
    });
    tokio::time::timeout(DEADLINE, started.recv())
        .await
        .expect("the handler did not start within the deadline")
        .expect("the handler started");
    drop(comms);
    cluster.shutdown().await;
    assert_dropped(
        gone,
        "the running handler call outlives the node's shutdown",
    )
    .await;
    // The caller's node shut down too: its call ends with an error, not at its deadline.
    let ended = tokio::time::timeout(DEADLINE, call)
        .await
        .expect("the call did not end within the deadline")
        .expect("the call's task");
    assert!(ended.is_err(), "{ended:?}");
}

/// Asserts that the sender of `gone`, which something under test holds, is dropped
/// within the deadline; `else_msg` says what outlived what otherwise.
async fn assert_dropped(gone: tokio::sync::oneshot::Receiver<()>, else_msg: &str) {
    let dropped = tokio::time::timeout(DEADLINE, gone).await;
    assert!(matches!(dropped, Ok(Err(_))), "{else_msg}");
}
