//! Collectives over a link with 5% loss, 20 ms delay, reordering and duplicates.

use std::time::Duration;

use nexar_actors::{NexarError, NodeConfig};
use nexar_tests::faults::{relayed_cluster, Faults};
use nexar_tests::{check_all, on_all_ranks};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_complete_correctly_over_a_lossy_slow_link() {
    let faults = Faults {
        loss: 0.05,
        delay: Duration::from_millis(20),
        jitter: Duration::from_millis(5),
        duplicate: 0.01,
        seed: 7,
    };
    // Both connections between ranks 0 and 1 (each dials the other) go through relays.
    let (cluster, links) = relayed_cluster(4, NodeConfig::default(), faults, |a, b| {
        (a, b) == (0, 1) || (a, b) == (1, 0)
    })
    .await
    .expect("cluster over a lossy link");
    let res = on_all_ranks(
        cluster.communicators(),
        Duration::from_secs(240),
        |comm| async move {
            for (count, block) in [(1, 1), (1001, 7), (70_000, 3000)] {
                check_all::<f32>(&comm, count, block).await?;
            }
            comm.barrier()
                .await
                .map_err(|e: NexarError| e.to_string())?;
            assert!(comm.failed_ranks().is_empty());
            Ok::<_, String>(())
        },
    )
    .await;
    for (rank, r) in res.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    let dropped: u64 = links
        .iter()
        .map(|l| l.stats().dropped.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    let seen: u64 = links
        .iter()
        .map(|l| l.stats().seen.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    assert!(
        dropped > 0 && seen > 100,
        "the relays saw {seen} datagrams and dropped {dropped}"
    );
}
