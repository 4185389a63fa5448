//! The smoke checks pass on in-process clusters of several sizes, run for all ranks at once
//! or rank by rank.

use nexar_actors::Cluster;
use nexar_cli::{checks, run_smoke, run_smoke_rank, ClusterInfo};

async fn smoke_passes(world: usize) {
    let cluster = Cluster::local(world).await.expect("cluster forms");
    let results = run_smoke(cluster.communicators()).await;
    assert_eq!(results.len(), checks().len());
    for r in &results {
        assert!(r.ok(), "world {world}: {} failed: {:?}", r.name, r.error);
        assert_eq!(r.ranks, world);
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn smoke_1w() {
    smoke_passes(1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn smoke_2w() {
    smoke_passes(2).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn smoke_3w() {
    smoke_passes(3).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn info_lists_every_rank() {
    let cluster = Cluster::local(3).await.expect("cluster forms");
    let info = ClusterInfo::of(&cluster);
    assert_eq!(info.world, 3);
    for (i, r) in info.ranks.iter().enumerate() {
        assert_eq!(r.rank, i);
        assert!(r.addr.is_some_and(|a| a.ip().is_loopback()), "{r:?}");
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn per_rank_smoke_passes_when_every_rank_runs_it() {
    let cluster = Cluster::local(3).await.expect("cluster forms");
    let tasks: Vec<_> = cluster
        .communicators()
        .into_iter()
        .map(|comm| tokio::spawn(async move { run_smoke_rank(&comm).await }))
        .collect();
    for task in tasks {
        let results = task.await.expect("rank task");
        assert_eq!(results.len(), checks().len());
        for r in &results {
            assert!(r.ok(), "{} failed: {:?}", r.name, r.error);
            assert_eq!(r.ranks, 3);
        }
    }
    cluster.shutdown().await;
}
