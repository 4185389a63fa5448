//! Collectives over a link with 5% loss, 20 ms delay, reordering and duplicates.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Mutex;
use std::time::Duration;

use nexar_actors::{Cluster, NexarError, NodeConfig};
use nexar_tests::faults::{Faults, FaultyLink};
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
    let links = Mutex::new(Vec::new());
    let cluster = Cluster::local_with_dialer(
        4,
        NodeConfig::default(),
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        |a, b, addr| {
            if (a, b) == (0, 1) || (a, b) == (1, 0) {
                let mut f = faults;
                f.seed += a as u64;
                let link = FaultyLink::start(addr, f).expect("relay");
                let relay = link.addr();
                links.lock().expect("links").push(link);
                relay
            } else {
                addr
            }
        },
    )
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
    let links = links.into_inner().expect("links");
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
