//! Building and dropping clusters must not leak tasks or memory.

use std::time::{Duration, Instant};

use nexar_actors::{Cluster, NexarError};
use nexar_tests::on_all_ranks;

/// This process's resident memory, from `/proc/self/status` (in kB there, whatever the
/// page size); a test that cannot read it fails rather than compare zeros.
fn rss_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb * 1024
}

async fn build_use_drop(i: usize) {
    let cluster = Cluster::local(3).await.expect("cluster");
    let res = on_all_ranks(
        cluster.communicators(),
        Duration::from_secs(60),
        |comm| async move {
            comm.barrier().await?;
            let mut v = [comm.rank() as u32; 64];
            comm.all_reduce(&mut v, nexar_device::ReduceOp::Max).await?;
            assert_eq!(v, [2; 64]);
            Ok::<_, NexarError>(())
        },
    )
    .await;
    for r in res {
        r.unwrap_or_else(|e| panic!("cluster {i}: {e}"));
    }
    if i % 2 == 0 {
        cluster.shutdown().await;
    } else {
        drop(cluster);
    }
}

/// Waits (bounded) until the runtime's live task count drops to `target` or below.
async fn settle(target: usize, limit: Duration) -> usize {
    let metrics = tokio::runtime::Handle::current().metrics();
    let start = Instant::now();
    loop {
        let n = metrics.num_alive_tasks();
        if n <= target || start.elapsed() > limit {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clusters_built_and_dropped_leave_no_tasks_and_no_growth() {
    let baseline_tasks = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    // Warm up allocator arenas and lazy statics before measuring memory: glibc keeps freed
    // memory in per-thread arenas, so resident size climbs in steps over the first
    // clusters and then stays flat. A leak of even one cluster's footprint (~1 MiB) per
    // iteration would add ~50 MiB below.
    for i in 0..10 {
        build_use_drop(i).await;
    }
    settle(baseline_tasks, Duration::from_secs(10)).await;
    let rss_before = rss_bytes();
    for i in 0..50 {
        build_use_drop(i).await;
    }
    let left = settle(baseline_tasks, Duration::from_secs(15)).await;
    assert!(
        left <= baseline_tasks,
        "{left} tasks alive after dropping 50 clusters (baseline {baseline_tasks})"
    );
    let grown = rss_bytes().saturating_sub(rss_before);
    assert!(
        grown < 32 << 20,
        "resident memory grew by {} MiB over 50 clusters",
        grown >> 20
    );
}

/// The communicators of a cluster shut down fail with `Shutdown`, a single rank's too,
/// whose collectives send nothing (they returned `Ok`, where a send failed as documented).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_single_rank_runs_no_more_collectives() {
    let cluster = Cluster::local(1).await.expect("cluster");
    let comm = cluster.communicators().remove(0);
    let mut v = [1.0f32; 4];
    comm.all_reduce(&mut v, nexar_device::ReduceOp::Sum)
        .await
        .expect("a collective before the shutdown");
    cluster.shutdown().await;
    let reduced = comm.all_reduce(&mut v, nexar_device::ReduceOp::Sum).await;
    assert!(matches!(reduced, Err(NexarError::Shutdown)), "{reduced:?}");
    let barrier = comm.barrier().await;
    assert!(matches!(barrier, Err(NexarError::Shutdown)), "{barrier:?}");
    let sent = comm.send(&[1u8], 0, 0).await;
    assert!(matches!(sent, Err(NexarError::Shutdown)), "{sent:?}");
}
