//! Every collective over real QUIC in-process clusters: worlds 1, 2, 3, 4, 5 and 8,
//! rank-dependent data, uneven counts, every dtype and every op, checked against a
//! sequential reference computed on each rank.

use std::time::Duration;

use nexar_actors::{Algorithm, Cluster, Communicator, NodeConfig};
use nexar_tests::{check_all, on_all_ranks};

const DEADLINE: Duration = Duration::from_secs(300);

async fn check_every_dtype(comm: Communicator, count: usize, block: usize) -> Result<(), String> {
    check_all::<f32>(&comm, count, block).await?;
    check_all::<f64>(&comm, count, block).await?;
    check_all::<half::f16>(&comm, count, block).await?;
    check_all::<half::bf16>(&comm, count, block).await?;
    check_all::<i8>(&comm, count, block).await?;
    check_all::<i32>(&comm, count, block).await?;
    check_all::<i64>(&comm, count, block).await?;
    check_all::<u8>(&comm, count, block).await?;
    check_all::<u32>(&comm, count, block).await?;
    check_all::<u64>(&comm, count, block).await
}

async fn run_world(
    world: usize,
    config: NodeConfig,
    counts: &'static [(usize, usize)],
    every_dtype: bool,
) {
    let cluster = Cluster::local_with(world, config).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
        for &(count, block) in counts {
            if every_dtype {
                check_every_dtype(comm.clone(), count, block).await?;
            } else {
                check_all::<f32>(&comm, count, block).await?;
                check_all::<i32>(&comm, count, block).await?;
            }
        }
        Ok::<_, String>(())
    })
    .await;
    nexar_tests::all_ok(&format!("world {world}"), res);
    cluster.shutdown().await;
}

/// Uneven counts: 0, 1, a prime, and one that is not a multiple of any world size here.
static COUNTS: &[(usize, usize)] = &[(0, 0), (1, 1), (37, 3), (1001, 7)];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_dtype_and_op_worlds_1_2_3() {
    for world in [1, 2, 3] {
        run_world(world, NodeConfig::default(), COUNTS, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_dtype_and_op_worlds_4_5_8() {
    for world in [4, 5, 8] {
        run_world(world, NodeConfig::default(), COUNTS, true).await;
    }
}

/// Each algorithm forced in turn (collectives that lack it keep their automatic choice),
/// with small pipeline chunks so the pipelined variants really split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_forced_algorithm_over_quic() {
    static SIZES: &[(usize, usize)] = &[(1, 1), (4099, 129)];
    for world in [4, 5] {
        for algorithm in Algorithm::ALL {
            let mut config = NodeConfig::default();
            config.collectives = config.collectives.with_algorithm(algorithm);
            config.collectives.pipeline_chunk_bytes = 1024;
            run_world(world, config, SIZES, false).await;
        }
    }
}

/// A send budget of about two chunks: collectives copy out a few sends at a time and wait
/// for the transport to release them before the next (the deferral path of the driver),
/// with small thresholds so the pipelined algorithms run too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_with_a_tiny_send_budget() {
    static SIZES: &[(usize, usize)] = &[(1, 1), (20_011, 517)];
    for world in [2, 3] {
        let mut config = NodeConfig::default();
        config.collective_send_budget_bytes = 2500;
        config.collectives.pipeline_chunk_bytes = 1024;
        config.collectives.small_bytes = 8 << 10;
        config.collectives.pipeline_threshold_bytes = 32 << 10;
        run_world(world, config, SIZES, false).await;
    }
}

/// Waits that sleep at once (`spin_wait` zero) and waits that poll first (set explicitly:
/// a multi-threaded runtime does not poll by default) give the same results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_whether_waits_poll_or_sleep() {
    for spin in [Duration::ZERO, nexar_actors::AUTO_SPIN_WAIT] {
        for world in [3, 4] {
            let mut config = NodeConfig::default();
            config.spin_wait = Some(spin);
            run_world(world, config, COUNTS, false).await;
        }
    }
}

/// A single-threaded runtime (where waits poll by default) runs a whole cluster.
#[tokio::test(flavor = "current_thread")]
async fn every_collective_on_a_single_threaded_runtime() {
    run_world(3, NodeConfig::default(), COUNTS, false).await;
}

/// Sizes large enough for the automatic choice to pick ring and pipelined algorithms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_buffers_use_ring_and_pipelined_paths() {
    static SIZES: &[(usize, usize)] = &[(3_000_001, 262_147)];
    let cluster = Cluster::local(4).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        check_all::<f32>(&comm, SIZES[0].0, SIZES[0].1).await
    })
    .await;
    for (rank, r) in res.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    cluster.shutdown().await;
}
