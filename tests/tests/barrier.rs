//! Barriers over real QUIC: repeated for many heartbeat intervals, and under bulk load.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nexar_actors::{Cluster, NexarError, NodeConfig};
use nexar_tests::{on_all_ranks, pattern};

const DEADLINE: Duration = Duration::from_secs(240);

/// No rank leaves a barrier before every rank has entered it: each rank counts itself in
/// before it calls the barrier and, once out, finds every rank counted. In each round one
/// rank comes last on purpose, once all the others have counted themselves in (and so are
/// in their barrier, or about to be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_for_every_world_size() {
    const ROUNDS: usize = 5;
    for world in 1..=8 {
        let cluster = Cluster::local(world).await.expect("cluster");
        let entered: Arc<Vec<AtomicUsize>> =
            Arc::new((0..ROUNDS).map(|_| AtomicUsize::new(0)).collect());
        let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| {
            let entered = entered.clone();
            async move {
                let world = comm.world_size();
                for (round, count) in entered.iter().enumerate() {
                    if comm.rank() == round % world {
                        // Last in: once every other rank has counted itself in.
                        while count.load(Ordering::SeqCst) < world - 1 {
                            tokio::task::yield_now().await;
                        }
                        for _ in 0..10 {
                            tokio::task::yield_now().await;
                        }
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    comm.barrier().await?;
                    assert_eq!(
                        count.load(Ordering::SeqCst),
                        world,
                        "rank {} left round {round}'s barrier before every rank entered it",
                        comm.rank()
                    );
                }
                Ok::<_, NexarError>(())
            }
        })
        .await;
        for r in res {
            r.expect("barrier");
        }
        cluster.shutdown().await;
    }
}

/// Barriers keep completing for far longer than the heartbeat interval: heartbeats and
/// other control traffic never disturb them, and nobody is declared dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_repeated_across_many_heartbeat_intervals() {
    let mut config = NodeConfig::default();
    config.heartbeat_interval = Duration::from_millis(20);
    // No rank dies here, so nothing needs a short heartbeat timeout: the default (5 s)
    // keeps a healthy rank that a loaded machine starves for a moment from being declared
    // lost.
    let cluster = Cluster::local_with(5, config).await.expect("cluster");
    // At least 40 heartbeat intervals (0.8 s) of back-to-back barriers, however many
    // that takes.
    let span = Duration::from_millis(800);
    let counts = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
        let start = Instant::now();
        let mut n = 0u64;
        // Every rank must run the same number of barriers: rank 0 decides when to stop
        // (once the span has passed) and tells the others through a broadcast after each
        // round of 10.
        loop {
            for _ in 0..10 {
                comm.barrier().await?;
                n += 1;
            }
            let mut go = [u8::from(start.elapsed() < span)];
            comm.broadcast(&mut go, 0).await?;
            if go[0] == 0 {
                break;
            }
        }
        assert!(
            comm.failed_ranks().is_empty(),
            "a peer was declared lost: {:?}",
            comm.failed_ranks()
        );
        Ok::<_, NexarError>(n)
    })
    .await;
    let counts: Vec<_> = counts
        .into_iter()
        .map(|r| r.expect("barrier loop"))
        .collect();
    assert!(
        counts.iter().all(|c| *c == counts[0]),
        "ranks ran different numbers of barriers: {counts:?}"
    );
}

/// While ranks 0 and 1 stream 256 MiB to each other, barriers among all ranks keep
/// completing and no heartbeat timeout declares anyone dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barriers_complete_during_bulk_streaming() {
    let mut config = NodeConfig::default();
    config.heartbeat_interval = Duration::from_millis(100);
    // The default: a rank starved by the streams on 2 cores is still alive.
    config.heartbeat_timeout = Duration::from_secs(5);
    let cluster = Cluster::local_with(4, config).await.expect("cluster");
    const CHUNK: usize = 4 << 20;
    const CHUNKS: usize = 64; // 256 MiB each way
    let results = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let rank = comm.rank();
        let streamer = (rank < 2).then(|| {
            let comm = comm.clone();
            tokio::spawn(async move {
                let peer = 1 - rank;
                let payload = pattern(rank as u64, CHUNK);
                let tx = {
                    let comm = comm.clone();
                    let payload = payload.clone();
                    tokio::spawn(async move {
                        for _ in 0..CHUNKS {
                            comm.send(&payload, peer, 99).await?;
                        }
                        Ok::<_, NexarError>(())
                    })
                };
                let expect = pattern(peer as u64, CHUNK);
                let mut buf = vec![0u8; CHUNK];
                for i in 0..CHUNKS {
                    comm.recv(&mut buf, peer, 99).await?;
                    assert!(buf == expect, "chunk {i} corrupted");
                }
                tx.await.expect("sender panicked")?;
                Ok::<_, NexarError>(())
            })
        });
        // Barriers run until the streamers are done (rank 0 and 1 report through a
        // broadcast of "still streaming" every round).
        let mut barriers = 0u64;
        let mut during = 0u64;
        loop {
            comm.barrier().await?;
            barriers += 1;
            let busy = streamer.as_ref().is_some_and(|s| !s.is_finished());
            let mut flags = [u8::from(busy); 1];
            let mut all = [0u8; 4];
            comm.all_gather(&flags, &mut all).await?;
            flags[0] = all[0] | all[1];
            if flags[0] == 0 || barriers > 100_000 {
                break;
            }
            during += 1;
        }
        if let Some(s) = streamer {
            s.await.expect("streamer panicked")?;
        }
        assert!(
            comm.failed_ranks().is_empty(),
            "rank {rank} saw lost peers {:?}",
            comm.failed_ranks()
        );
        Ok::<_, NexarError>(during)
    })
    .await;
    for (rank, r) in results.into_iter().enumerate() {
        let during = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            during > 0,
            "rank {rank}: no barrier completed while streaming"
        );
    }
    cluster.shutdown().await;
}
