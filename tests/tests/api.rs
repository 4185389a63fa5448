//! The communicator API beyond single blocking calls: non-blocking and bucketed
//! collectives, split communicators in use together, cancellation, mismatched and bad
//! calls, and the blocking facade.

use std::sync::Arc;
use std::time::Duration;

use nexar_actors::{Cluster, NexarError, NodeConfig, SyncCluster, SyncCommunicator};
use nexar_collectives::Algorithm;
use nexar_device::ReduceOp;
use nexar_tests::{join_within, on_all_ranks, within, STEP_DEADLINE};
use nexar_transport::{TransportError, GAVE_UP_ON_ITS_OWN};

const DEADLINE: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_non_blocking_all_reduces() {
    let cluster = Cluster::local(4).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let rank = comm.rank() as i64;
        let mut pending = Vec::new();
        for k in 0..64i64 {
            // Sizes differ per call so a mix-up between calls would show.
            let len = 1 + (k as usize * 37) % 3000;
            pending.push(comm.all_reduce_nb(vec![rank * 1000 + k; len], ReduceOp::Sum)?);
        }
        for (k, p) in pending.into_iter().enumerate() {
            let k = k as i64;
            let v = p.wait().await?;
            assert_eq!(v.len(), 1 + (k as usize * 37) % 3000);
            assert!(v.iter().all(|x| *x == 6000 + 4 * k), "call {k} wrong");
        }
        // The other owned forms.
        let b = comm.broadcast_nb(vec![rank as f32; 10], 2)?.wait().await?;
        assert_eq!(b, vec![2.0; 10]);
        let g = comm.all_gather_nb(vec![rank as u32; 2])?.wait().await?;
        assert_eq!(g, vec![0, 0, 1, 1, 2, 2, 3, 3]);
        let rs = comm
            .reduce_scatter_nb(vec![1u64; 12], ReduceOp::Sum)?
            .wait()
            .await?;
        assert_eq!(rs, vec![4; 3]);
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("non-blocking collectives");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reduce_many_buckets_tensors() {
    let cluster = Cluster::local(3).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let r = comm.rank() as f32;
        let mut a = vec![r; 5];
        let mut b = vec![r * 2.0; 1000];
        let mut c: Vec<f32> = Vec::new();
        comm.all_reduce_many(&mut [&mut a[..], &mut b[..], &mut c[..]], ReduceOp::Sum)
            .await?;
        assert_eq!(a, vec![3.0; 5]);
        assert_eq!(b, vec![6.0; 1000]);
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("bucketed all-reduce");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parent_and_two_split_children_in_use_together() {
    let cluster = Cluster::local(6).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let rank = comm.rank();
        // Colour by parity, ordered by descending parent rank.
        let child = comm.split((rank % 2) as u32, (100 - rank) as u32).await?;
        assert_eq!(child.world_size(), 3);
        let expected_child_rank = 2 - rank / 2;
        assert_eq!(child.rank(), expected_child_rank);
        assert_ne!(child.id(), comm.id());
        // A second split of the parent: everyone in one child, reversed.
        let all = comm.split(7, (100 - rank) as u32).await?;
        assert_eq!(all.rank(), 5 - rank);
        // Parent, child and the second child run collectives and p2p concurrently with the
        // same user tags.
        let mut p = vec![rank as u64; 1000];
        let mut c = vec![rank as u64; 1000];
        let mut a = vec![1u64; 1000];
        let peer_c = (child.rank() + 1) % 3;
        let from_c = (child.rank() + 2) % 3;
        let mut got_c = [0u64; 1];
        let mine = [rank as u64];
        let (rp, rc, ra, rs, rr) = tokio::join!(
            comm.all_reduce(&mut p, ReduceOp::Sum),
            child.all_reduce(&mut c, ReduceOp::Sum),
            all.all_reduce(&mut a, ReduceOp::Sum),
            child.send(&mine, peer_c, 0),
            child.recv(&mut got_c, from_c, 0),
        );
        rp?;
        rc?;
        ra?;
        rs?;
        rr?;
        assert!(p.iter().all(|x| *x == 15));
        let parity_sum = if rank % 2 == 0 { 6 } else { 9 };
        assert!(c.iter().all(|x| *x == parity_sum));
        assert!(a.iter().all(|x| *x == 6));
        // The child rank `from_c` is parent rank: members are ordered by descending rank.
        let from_parent_rank = comm
            .members()
            .iter()
            .position(|n| *n == child.members()[from_c])
            .expect("member of parent");
        assert_eq!(got_c[0], from_parent_rank as u64);
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("split communicators");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_collective_future_leaves_cluster_working() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(3);
    let cluster = Cluster::local_with(3, config).await.expect("cluster");
    // Rank 2 joins the all-reduce only once rank 0 has dropped its call, so rank 0's call
    // cannot have finished (it needs rank 2's part) when it is dropped, however fast the
    // machine: ranks 0 and 1 get part-way, then rank 0 gives up.
    let dropped = Arc::new(tokio::sync::Notify::new());
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| {
        let dropped = dropped.clone();
        async move {
            let mut big = vec![1.0f32; 4 << 20];
            let mut snapshot = None;
            if comm.rank() == 0 {
                // Let the call run a little (its blocks go out to rank 1), then drop it.
                let r = tokio::time::timeout(
                    Duration::from_millis(100),
                    comm.all_reduce(&mut big, ReduceOp::Sum),
                )
                .await;
                assert!(
                    r.is_err(),
                    "the all-reduce ended before rank 2 joined it: {r:?}"
                );
                // The collective works in `big` itself, so some of it may already hold
                // partial sums; from here on nothing may change it.
                snapshot = Some(big.clone());
                dropped.notify_one();
                // Wait (bounded) until the others have given up on the abandoned
                // collective: a receive that times out consumes nothing, so retrying is
                // safe.
                let mut token = [0u8; 1];
                for peer in 1..3 {
                    let mut tries = 0;
                    loop {
                        match comm.recv(&mut token, peer, 77).await {
                            Ok(()) => break,
                            Err(NexarError::Timeout { .. }) if tries < 10 => tries += 1,
                            Err(e) => return Err(e),
                        }
                    }
                }
            } else {
                if comm.rank() == 2 {
                    dropped.notified().await;
                }
                // The others time out (or finish, if rank 0 had sent all they needed);
                // their late blocks reach rank 0 after its call was dropped.
                let _ = comm.all_reduce(&mut big, ReduceOp::Sum).await;
                comm.send(&[1u8], 0, 77).await?;
            }
            // The caller's buffer is never written after the drop, and the next
            // collectives work everywhere.
            comm.barrier().await?;
            let mut v = vec![comm.rank() as i32; 100];
            comm.all_reduce(&mut v, ReduceOp::Sum).await?;
            assert!(v.iter().all(|x| *x == 3));
            Ok::<_, NexarError>(snapshot.map(|s| s == big))
        }
    })
    .await;
    // Every rank's result is checked; only rank 0 took a snapshot.
    let unchanged = nexar_tests::all_ok("cluster after a dropped collective", res);
    assert_eq!(
        unchanged,
        vec![Some(true), None, None],
        "rank 0's buffer was written after its future was dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_calls_end_in_errors_within_the_deadline() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(2);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    // Within the deadline: the run is bounded by a deadline far past the 2 s op_timeout
    // and under the default one (120 s), so a call that waited for ever, or for the
    // default, fails the test; how soon within that the errors come is not measured.
    let res = on_all_ranks(cluster.communicators(), STEP_DEADLINE, |comm| async move {
        // Same collective, different lengths.
        let mut v = vec![1.0f32; 100 + comm.rank() * 10];
        let a = comm.all_reduce(&mut v, ReduceOp::Sum).await;
        // Different collectives of the same length: must not combine unrelated data.
        let mut w = vec![comm.rank() as f32 + 1.0; 64];
        let b = if comm.rank() == 0 {
            comm.broadcast(&mut w, 0).await
        } else {
            comm.all_reduce(&mut w, ReduceOp::Sum).await
        };
        (a, b, w)
    })
    .await;
    for (rank, (a, b, w)) in res.into_iter().enumerate() {
        // At the deadline the other rank's frames for the call say what went wrong (or
        // that rank, there first, told this one it gave up).
        let other = 1 - rank;
        assert!(
            matches!(
                &a,
                Err(NexarError::CallMismatch { rank: r, .. }) if *r == other
            ) || matches!(
                &a,
                Err(NexarError::Transport(TransportError::TagAbandoned { .. }))
            ),
            "rank {rank}: mismatched lengths: {a:?}"
        );
        // Rank 0, a broadcast root, only sends: it cannot tell that nobody matched its call
        // and succeeds with its buffer unchanged. Rank 1 waits for a matching frame and
        // fails at the deadline, naming the rank that made another call; it never
        // combines the broadcast's data.
        if rank == 1 {
            assert!(
                matches!(&b, Err(NexarError::CallMismatch { rank: 0, .. })),
                "rank {rank}: mismatched collectives: {b:?}"
            );
        }
        assert!(
            w.iter().all(|x| *x == rank as f32 + 1.0),
            "rank {rank}: buffer changed by a mismatched call"
        );
    }
}

/// A split on one rank and a user's all-gather of one `u64` on another are different
/// calls: neither combines the other's data (both end in errors at the deadline), and the
/// splits after them still give every rank the same communicator. (The split's all-gather
/// carried the user's fingerprint, so both returned `Ok`, and its child ids were numbered
/// per rank, so every later split on the two ranks built different communicators.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_never_combines_with_a_users_all_gather() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(2);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), STEP_DEADLINE, |comm| async move {
        let mismatched = if comm.rank() == 0 {
            comm.split(0, 0).await.map(|_| ())
        } else {
            let mut all = [0u64; 2];
            comm.all_gather(&[0u64], &mut all).await
        };
        let child = comm.split(1, comm.rank() as u32).await?;
        child.barrier().await?;
        let mut v = [comm.rank() as u32 + 1];
        child.all_reduce(&mut v, ReduceOp::Sum).await?;
        Ok::<_, NexarError>((mismatched, child.id(), child.world_size(), v[0]))
    })
    .await;
    let res = nexar_tests::all_ok("splits after a mismatched call", res);
    for (rank, (mismatched, _, world, sum)) in res.iter().enumerate() {
        assert!(
            matches!(
                mismatched,
                Err(NexarError::CallMismatch { .. })
                    | Err(NexarError::Transport(TransportError::TagAbandoned { .. }))
            ),
            "rank {rank}: {mismatched:?}"
        );
        assert_eq!((*world, *sum), (2, 3), "rank {rank}");
    }
    assert_eq!(res[0].1, res[1].1, "one child communicator");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_are_typed_errors_on_every_rank() {
    let cluster = Cluster::local(3).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let mut v = vec![1i32; 9];
        assert!(matches!(
            comm.all_reduce(&mut v, ReduceOp::Avg).await,
            Err(NexarError::Schedule(_))
        ));
        assert!(matches!(
            comm.broadcast(&mut v, 3).await,
            Err(NexarError::InvalidRank { rank: 3, world: 3 })
        ));
        assert!(matches!(
            comm.reduce(&mut v, ReduceOp::Sum, 9).await,
            Err(NexarError::InvalidRank { .. })
        ));
        let mut small = vec![0i32; 5];
        assert!(matches!(
            comm.all_gather(&v, &mut small).await,
            Err(NexarError::LengthMismatch { .. })
        ));
        assert!(matches!(
            comm.reduce_scatter(&v[..8], &mut small, ReduceOp::Sum)
                .await,
            Err(NexarError::LengthMismatch { .. })
        ));
        assert!(matches!(
            comm.all_to_all(&v[..8], &mut small[..4]).await,
            Err(NexarError::LengthMismatch { .. })
        ));
        let mut eight = vec![0i32; 8];
        assert!(matches!(
            comm.all_to_all(&v[..8], &mut eight).await,
            Err(NexarError::InvalidArgument(_))
        ));
        assert!(matches!(
            comm.scan(&mut [1.0f32], ReduceOp::Avg).await,
            Err(NexarError::Schedule(_))
        ));
        // Errors detected before any communication leave the sequence in step: a real
        // collective still works afterwards.
        comm.all_reduce(&mut v, ReduceOp::Sum).await?;
        assert!(v.iter().all(|x| *x == 3));
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("bad arguments");
    }
}

#[test]
fn blocking_facade_runs_collectives_from_threads() {
    let cluster = SyncCluster::local(3).expect("cluster");
    let handles: Vec<_> = cluster
        .communicators()
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || {
                let mut v = vec![comm.rank() as f64; 100];
                comm.all_reduce(&mut v, ReduceOp::Avg)?;
                assert!(v.iter().all(|x| *x == 1.0));
                comm.barrier()?;
                let mut all = vec![0u8; 3];
                comm.all_gather(&[comm.rank() as u8], &mut all)?;
                assert_eq!(all, [0, 1, 2]);
                // A ring of zero-copy sends.
                let (rank, next, prev) =
                    (comm.rank(), (comm.rank() + 1) % 3, (comm.rank() + 2) % 3);
                let mine = bytes::Bytes::from(vec![rank as u8; 10]);
                comm.send_bytes(mine, next, 5)?;
                let mut got = [0u8; 10];
                comm.recv(&mut got, prev, 5)?;
                assert_eq!(got, [prev as u8; 10]);
                Ok::<_, NexarError>(())
            })
        })
        .collect();
    for h in handles {
        join_within("a rank's thread", h).expect("blocking collectives");
    }
}

/// The calls the facade has no blocking form of run through `block_on` on its runtime
/// (calling them on `inner()` from plain code would find no runtime).
#[test]
fn blocking_facade_runs_any_call_through_block_on() {
    let cluster = SyncCluster::local(2).expect("cluster");
    let comms = cluster.communicators();
    comms[1]
        .inner()
        .register_rpc(3, |caller, req: bytes::Bytes| async move {
            Ok([req.as_ref(), &[caller as u8]].concat())
        });
    let reply = comms[0]
        .block_on(comms[0].inner().rpc(1, 3, b"hi"))
        .expect("not in a runtime")
        .expect("the reply");
    assert_eq!(reply.as_ref(), b"hi\0");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || {
                let inner = comm.inner();
                comm.block_on(async {
                    inner
                        .all_reduce_nb(vec![1.0f32; 8], ReduceOp::Sum)?
                        .wait()
                        .await
                })?
            })
        })
        .collect();
    for h in handles {
        let v = join_within("a rank's thread", h).expect("all-reduce");
        assert_eq!(v, vec![2.0f32; 8]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_cluster_is_not_built_inside_async_code() {
    assert!(matches!(
        SyncCluster::local(1),
        Err(NexarError::InvalidArgument(_))
    ));
}

/// An in-process cluster of no ranks, or of more than a cluster may have, is a typed error
/// (a world near `usize::MAX` once panicked allocating room for every rank up front).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_world_out_of_range_is_refused() {
    for world in [0, nexar_actors::MAX_WORLD + 1, usize::MAX] {
        match Cluster::local(world).await {
            Err(NexarError::InvalidArgument(why)) => assert!(why.contains("ranks"), "{why}"),
            Err(e) => panic!("world {world}: expected InvalidArgument, got {e}"),
            Ok(_) => panic!("world {world}: a cluster was built"),
        }
    }
}

/// The blocking facade's runtime may go last inside async code (a test's or a server's):
/// it is then shut down in the background, where tokio would panic waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_cluster_dropped_inside_async_code_does_not_panic() {
    let built = join_within(
        "the builder thread",
        std::thread::spawn(|| SyncCluster::local(2)),
    );
    let cluster = built.expect("cluster");
    let comms = cluster.communicators();
    drop(cluster);
    // The communicators hold the runtime last.
    assert!(
        comms[0].barrier().is_err(),
        "blocking calls are refused here"
    );
    assert!(comms[0].block_on(async {}).is_err(), "and so is block_on");
    drop(comms);
}

/// A call that only one rank refuses (here the root of a gather, whose receive buffer
/// alone is checked) uses up its sequence number there too: the next collective lines up
/// again (the senders' blocks for the refused call are discarded) instead of every later
/// call timing out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_on_one_rank_leaves_later_calls_in_step() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(2);
    let cluster = Cluster::local_with(3, config).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let send = [comm.rank() as i32; 4];
        let mut recv = vec![0i32; if comm.rank() == 0 { 5 } else { 0 }];
        let gathered = comm.gather(&send, &mut recv, 0).await;
        let mut v = vec![comm.rank() as i32 + 1; 16];
        let reduced = comm.all_reduce(&mut v, ReduceOp::Sum).await;
        (gathered, reduced, v)
    })
    .await;
    for (rank, (gathered, reduced, v)) in res.into_iter().enumerate() {
        match gathered {
            Err(NexarError::LengthMismatch { .. }) if rank == 0 => {}
            // A sender finishes once the root's transport has its block, or is told the
            // root gave up on the call.
            Ok(()) | Err(NexarError::Transport(TransportError::TagAbandoned { .. }))
                if rank != 0 => {}
            other => panic!("rank {rank}: gather gave {other:?}"),
        }
        reduced.unwrap_or_else(|e| panic!("rank {rank}: the next call failed: {e}"));
        assert!(v.iter().all(|x| *x == 6), "rank {rank}: {v:?}");
    }
}

/// Runs `first` on every rank, then three all-reduces of 4 KiB, which must all succeed;
/// returns each rank's result of `first`. Small messages: a rank drops those of a call it
/// gave up on without a word, where a large one's sender is stopped and fails at once.
async fn later_calls_succeed<F, Fut>(cluster: &Cluster, first: F) -> Vec<Result<(), NexarError>>
where
    F: Fn(nexar_actors::Communicator) -> Fut,
    Fut: std::future::Future<Output = Result<(), NexarError>> + Send + 'static,
{
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| {
        let first = first(comm.clone());
        async move {
            let first = first.await;
            let mut later = Vec::new();
            for _ in 0..3 {
                let mut v = vec![comm.rank() as f32 + 1.0; 1024];
                later.push(comm.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v));
            }
            (first, later)
        }
    })
    .await;
    let world = res.len();
    let sum = (world * (world + 1) / 2) as f32;
    let mut firsts = Vec::new();
    for (rank, (first, later)) in res.into_iter().enumerate() {
        for (i, r) in later.into_iter().enumerate() {
            let v = r.unwrap_or_else(|e| panic!("rank {rank}: later call {i} failed: {e}"));
            assert!(v.iter().all(|x| *x == sum), "rank {rank}: later call {i}");
        }
        firsts.push(first);
    }
    firsts
}

/// A call refused at once on one rank, which the other starts later: the other is told
/// that the first gave up on it and fails it at once, so the calls after it start
/// together. It used to wait for its deadline, and from then on each call ended on the
/// rank that refused before the other started it: every later call failed on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_on_one_rank_fails_at_once_on_the_others() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(2);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    // Rank 0 starts its call once rank 1 has refused its own.
    let refused = Arc::new(tokio::sync::Notify::new());
    let firsts = later_calls_succeed(&cluster, |comm| {
        let refused = refused.clone();
        async move {
            if comm.rank() == 1 {
                let res = comm.all_gather(&[1u32], &mut [0u32; 3]).await;
                refused.notify_one();
                res
            } else {
                within("rank 1's refusal", refused.notified()).await;
                let res = comm.all_gather(&[1u32], &mut [0u32; 2]).await;
                // Told, rather than at its deadline (`Timeout`).
                match &res {
                    Err(NexarError::Transport(TransportError::TagAbandoned { lost, .. })) => {
                        assert_eq!(*lost, GAVE_UP_ON_ITS_OWN)
                    }
                    other => panic!("rank 0: {other:?}"),
                }
                res
            }
        }
    })
    .await;
    assert!(
        matches!(firsts[1], Err(NexarError::LengthMismatch { .. })),
        "{:?}",
        firsts[1]
    );
}

/// A host buffer with one thing changed for a test: the element type it claims to hold,
/// or reductions that fail (a device error).
struct Odd<M> {
    inner: M,
    claims: Option<nexar_device::DataType>,
    reductions_fail: bool,
}

/// A buffer of f32 whose reductions fail.
fn failing_reduce(inner: nexar_device::HostBuffer<f32>) -> Odd<nexar_device::HostBuffer<f32>> {
    Odd {
        inner,
        claims: None,
        reductions_fail: true,
    }
}

impl<M: nexar_device::DeviceMemory> nexar_device::DeviceMemory for Odd<M> {
    fn dtype(&self) -> nexar_device::DataType {
        self.claims.unwrap_or_else(|| self.inner.dtype())
    }
    fn byte_len(&self) -> usize {
        self.inner.byte_len()
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), nexar_device::DeviceError> {
        self.inner.read(offset, dst)
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), nexar_device::DeviceError> {
        self.inner.write(offset, src)
    }
    fn reduce(
        &mut self,
        offset: usize,
        src: &[u8],
        op: ReduceOp,
    ) -> Result<(), nexar_device::DeviceError> {
        if self.reductions_fail {
            return Err(nexar_device::DeviceError::Adapter {
                adapter: "test",
                message: "this buffer's reductions fail".into(),
            });
        }
        self.inner.reduce(offset, src, op)
    }
    fn finalize(&mut self, op: ReduceOp, divisor: usize) -> Result<(), nexar_device::DeviceError> {
        self.inner.finalize(op, divisor)
    }
}

/// A `DeviceMemory` whose length is not a whole number of its elements is refused with
/// an argument error; it used to be rounded down, its last bytes left out of the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_buffer_of_part_elements_is_refused() {
    let cluster = Cluster::local(1).await.expect("cluster");
    let comm = &cluster.communicators()[0];
    // Six bytes that say they hold f32 elements: one and a half.
    let partial = || Odd {
        inner: nexar_device::HostBuffer(vec![0u8; 6]),
        claims: Some(nexar_device::DataType::F32),
        reductions_fail: false,
    };
    let reduced = comm
        .all_reduce_in(partial(), ReduceOp::Sum)
        .await
        .map(|_| ());
    let gathered = comm.all_gather_in(&partial(), partial()).await.map(|_| ());
    for res in [reduced, gathered] {
        assert!(
            matches!(&res, Err(NexarError::InvalidArgument(why)) if why.contains("whole number")),
            "{res:?}"
        );
    }
}

/// A call that fails part-way on one rank over its own device's error tells the others,
/// which fail it at once instead of at their deadline, and the calls after it line up.
/// Such failures (a device's, a frame refused here, a mismatched call's frame) used to
/// tell no one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_error_on_one_rank_fails_the_call_at_once_on_the_others() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(20);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    let firsts = later_calls_succeed(&cluster, |comm| async move {
        let data = nexar_device::HostBuffer(vec![1f32; 16 << 10]);
        if comm.rank() == 1 {
            let res = comm
                .all_reduce_in(failing_reduce(data), ReduceOp::Sum)
                .await
                .map(|_| ());
            assert!(matches!(res, Err(NexarError::Device(_))), "rank 1: {res:?}");
            res
        } else {
            let res = comm.all_reduce_in(data, ReduceOp::Sum).await.map(|_| ());
            // Told, well before its deadline (`Timeout`).
            assert!(
                matches!(
                    &res,
                    Err(NexarError::Transport(TransportError::TagAbandoned { lost, .. }))
                        if *lost == GAVE_UP_ON_ITS_OWN
                ),
                "rank 0: {res:?}"
            );
            res
        }
    })
    .await;
    assert!(firsts.iter().all(Result::is_err), "{firsts:?}");
}

/// A rank late by more than the op timeout: the others gave up on the call at their
/// deadline and said so, and the late one fails it at once when it comes. It used to wait
/// a full op timeout for ranks that had moved on (a ring's steps wait for the ones
/// before, so what they sent before they gave up is not enough), and stay one timeout
/// behind them from then on: every later call failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_late_past_the_op_timeout_falls_back_in_step() {
    let mut config = NodeConfig::default();
    // The late rank must finish the next call before the deadline of the others' (the
    // op timeout after theirs ended).
    config.op_timeout = Duration::from_secs(2);
    config.collectives.algorithm = Some(Algorithm::Ring);
    let cluster = Cluster::local_with(4, config).await.expect("cluster");
    // The late rank starts its call once the others' have ended.
    let ended = Arc::new(tokio::sync::Semaphore::new(0));
    let firsts = later_calls_succeed(&cluster, |comm| {
        let ended = ended.clone();
        async move {
            let late = comm.world_size() - 1;
            if comm.rank() == late {
                let others = late as u32;
                within("the others' first calls", ended.acquire_many(others))
                    .await
                    .expect("semaphore open")
                    .forget();
            }
            let mut v = vec![1f32; 16];
            let res = comm.all_reduce(&mut v, ReduceOp::Sum).await;
            ended.add_permits(1);
            res
        }
    })
    .await;
    // The ranks on time waited for the late one to their deadline, or were told that
    // one of them gave up; the late one was told so.
    for (rank, first) in firsts.iter().enumerate() {
        assert!(
            matches!(
                first,
                Err(NexarError::Timeout { .. }
                    | NexarError::Transport(TransportError::TagAbandoned { .. }))
            ),
            "rank {rank}: {first:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_that_fails_on_one_rank_leaves_later_splits_numbered_alike() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(1);
    let cluster = Cluster::local_with(2, config).await.expect("cluster");
    // Rank 1 starts its first split only once rank 0's has failed (told by this RPC).
    let go = Arc::new(tokio::sync::Notify::new());
    let signal = go.clone();
    cluster.communicators()[1].register_rpc(7, move |_, _| {
        signal.notify_one();
        async { Ok(Vec::new()) }
    });
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| {
        let go = go.clone();
        async move {
            if comm.rank() == 0 {
                let first = comm.split(0, 0).await;
                assert!(first.is_err(), "rank 0's first split: {first:?}");
                comm.rpc_with_timeout(1, 7, &[], DEADLINE).await?;
            } else {
                go.notified().await;
                // Rank 0's frames for it may still arrive: whether it succeeds or not, it
                // used up a split number as on rank 0.
                let _ = comm.split(0, 1).await;
            }
            let child = comm.split(0, comm.rank() as u32).await?;
            let mut ids = [0u64; 2];
            comm.all_gather(&[child.id()], &mut ids).await?;
            assert_eq!(ids[0], ids[1], "the ranks derived different ids");
            child.barrier().await?;
            Ok::<_, NexarError>(())
        }
    })
    .await;
    for r in res {
        r.expect("splits numbered alike");
    }
}

/// Runs `each` on a thread of its own for each rank of a 2-rank blocking cluster (op
/// timeout `op_timeout`): threads outside any runtime, as the blocking facade's are.
/// Returns what each thread returned, in rank order.
fn on_two_blocking_threads<T: Send + 'static>(
    op_timeout: Duration,
    each: fn(SyncCommunicator) -> T,
) -> Vec<T> {
    let mut config = NodeConfig::default();
    config.op_timeout = op_timeout;
    let cluster = SyncCluster::local_with(2, config).expect("cluster");
    let handles: Vec<_> = cluster
        .communicators()
        .into_iter()
        .map(|comm| std::thread::spawn(move || each(comm)))
        .collect();
    handles
        .into_iter()
        .map(|h| join_within("a rank's thread", h))
        .collect()
}

/// A `_nb` call made outside any runtime (from the blocking facade's threads) runs its
/// collective on its node's runtime, and the ranks' later calls pair as before. (It used to
/// take its sequence number, then fail for want of a runtime, leaving the rank a tag ahead
/// of the others for good; a first fix refused it before the number, which left a rank
/// whose call was refused a tag behind those whose calls were not.)
#[test]
fn a_non_blocking_call_outside_a_runtime_runs_on_the_nodes_runtime() {
    let results = on_two_blocking_threads(Duration::from_secs(10), |comm| {
        let value = comm.rank() as f32 + 1.0;
        let pending = comm.inner().all_reduce_nb(vec![value; 8], ReduceOp::Sum)?;
        let from_root = comm.inner().broadcast_nb(vec![value; 4], 1)?;
        let reduced = comm.block_on(pending.wait())??;
        let root = comm.block_on(from_root.wait())??;
        let mut v = vec![value; 8];
        comm.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok::<_, NexarError>((reduced, root, v))
    });
    for result in results {
        let (reduced, root, v) = result.expect("the calls");
        assert_eq!(reduced, vec![3.0f32; 8]);
        assert_eq!(root, vec![2.0f32; 4]);
        assert_eq!(v, vec![3.0f32; 8]);
    }
}

/// `recoveries()` called outside any runtime (through the blocking facade) runs on its
/// node's runtime: with no rank lost it has nothing to give, where it used to answer at
/// once with `InvalidArgument` ("recoveries need a Tokio runtime").
#[test]
fn recoveries_asked_for_outside_a_runtime_run_on_the_nodes_runtime() {
    let mut config = NodeConfig::default();
    config.recovery = nexar_actors::RecoveryPolicy::Automatic;
    let cluster = SyncCluster::local_with(2, config).expect("cluster");
    let comms = cluster.communicators();
    let mut recoveries = comms[0].inner().recoveries();
    // A window for the answer that came at once: none comes with no rank lost.
    let next = comms[0]
        .block_on(async {
            tokio::time::timeout(Duration::from_millis(300), recoveries.next()).await
        })
        .expect("not in a runtime");
    assert!(next.is_err(), "the recoveries ended: {next:?}");
}

/// A `_nb` call refused after it took its sequence number, on a thread outside any
/// runtime, still tells the other ranks it gave up: their part fails at once instead of
/// waiting for it until their deadline (which comes as `Timeout`, 30 s here).
#[test]
fn a_non_blocking_call_refused_outside_a_runtime_tells_the_other_ranks() {
    let results = on_two_blocking_threads(Duration::from_secs(30), |comm| {
        // Rank 0's length does not split into 2 blocks: refused on rank 0 alone.
        let len = if comm.rank() == 0 { 3 } else { 4 };
        let pending = comm
            .inner()
            .reduce_scatter_nb(vec![1f32; len], ReduceOp::Sum);
        match pending {
            Ok(p) => comm.block_on(p.wait()).map(|r| r.map(|_| ())),
            Err(e) => Ok(Err(e)),
        }
    });
    let results: Vec<_> = results.into_iter().map(|r| r.expect("the wait")).collect();
    assert!(
        matches!(results[0], Err(NexarError::InvalidArgument(_))),
        "rank 0: {:?}",
        results[0]
    );
    assert!(
        matches!(
            results[1],
            Err(NexarError::Transport(TransportError::TagAbandoned { .. }))
        ),
        "rank 1 should be told rank 0 gave up, got {:?}",
        results[1]
    );
}
