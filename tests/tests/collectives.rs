//! Every collective over real QUIC in-process clusters: worlds 1, 2, 3, 4, 5 and 8,
//! rank-dependent data, uneven counts, every dtype and every op, checked against a
//! sequential reference computed on each rank.

use std::time::Duration;

use nexar_actors::{Algorithm, Cluster, Communicator, NodeConfig};
use nexar_device::ReduceOp;
use nexar_tests::{fold, input, on_all_ranks, TestElement};

const DEADLINE: Duration = Duration::from_secs(300);

fn ops_for<T: TestElement>() -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|op| nexar_device::check_op(T::DTYPE, *op).is_ok())
        .collect()
}

fn same<T: TestElement>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    Err(format!(
        "{what} ({}): {} elements, first difference at {i}: got {:?}, want {:?}",
        T::DTYPE,
        got.len(),
        got.get(i),
        want.get(i)
    ))
}

/// Runs every collective for element type `T` on this rank and checks the result.
async fn check_all<T: TestElement>(
    comm: &Communicator,
    count: usize,
    block: usize,
) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |what: &str| {
        let what = what.to_string();
        move |e: nexar_actors::NexarError| format!("{what} ({}): {e}", T::DTYPE)
    };
    for op in ops_for::<T>() {
        let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, count, op)).collect();
        let total = fold(&inputs, op, world);

        let mut buf = inputs[rank].clone();
        comm.all_reduce(&mut buf, op)
            .await
            .map_err(err(&format!("all_reduce {op}")))?;
        same(&format!("all_reduce {op}"), &buf, &total)?;

        let root = world - 1; // a non-zero root whenever world > 1
        let mut buf = inputs[rank].clone();
        comm.reduce(&mut buf, op, root)
            .await
            .map_err(err(&format!("reduce {op}")))?;
        if rank == root {
            same(&format!("reduce {op} on root"), &buf, &total)?;
        } else {
            same(
                &format!("reduce {op} off root (unchanged)"),
                &buf,
                &inputs[rank],
            )?;
        }

        let blocks: Vec<Vec<T>> = (0..world).map(|r| input(r, block * world, op)).collect();
        let reduced = fold(&blocks, op, world);
        let mut mine = vec![T::from_i64(0); block];
        comm.reduce_scatter(&blocks[rank], &mut mine, op)
            .await
            .map_err(err(&format!("reduce_scatter {op}")))?;
        same(
            &format!("reduce_scatter {op}"),
            &mine,
            &reduced[rank * block..(rank + 1) * block],
        )?;

        if op != ReduceOp::Avg {
            let mut buf = inputs[rank].clone();
            comm.scan(&mut buf, op)
                .await
                .map_err(err(&format!("scan {op}")))?;
            same(&format!("scan {op}"), &buf, &fold(&inputs[..=rank], op, 1))?;
            let mut buf = inputs[rank].clone();
            comm.exclusive_scan(&mut buf, op)
                .await
                .map_err(err(&format!("exclusive_scan {op}")))?;
            let want = if rank == 0 {
                let mut id = vec![T::from_i64(0); count];
                nexar_device::fill_identity(T::DTYPE, op, bytemuck::cast_slice_mut(&mut id))
                    .map_err(|e| e.to_string())?;
                id
            } else {
                fold(&inputs[..rank], op, 1)
            };
            same(&format!("exclusive_scan {op}"), &buf, &want)?;
        }
    }
    let op = ReduceOp::Sum;
    let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, count, op)).collect();
    let root = world / 2;

    let mut buf = inputs[rank].clone();
    comm.broadcast(&mut buf, root)
        .await
        .map_err(err("broadcast"))?;
    same("broadcast", &buf, &inputs[root])?;

    let sends: Vec<Vec<T>> = (0..world).map(|r| input(r, block, op)).collect();
    let concat: Vec<T> = sends.iter().flatten().copied().collect();
    let mut all = vec![T::from_i64(0); block * world];
    comm.all_gather(&sends[rank], &mut all)
        .await
        .map_err(err("all_gather"))?;
    same("all_gather", &all, &concat)?;

    let mut gathered = if rank == root {
        vec![T::from_i64(0); block * world]
    } else {
        Vec::new()
    };
    comm.gather(&sends[rank], &mut gathered, root)
        .await
        .map_err(err("gather"))?;
    if rank == root {
        same("gather", &gathered, &concat)?;
    }

    let big: Vec<Vec<T>> = (0..world)
        .map(|r| input(r + 11, block * world, op))
        .collect();
    let mut piece = vec![T::from_i64(0); block];
    let empty: Vec<T> = Vec::new();
    let send = if rank == root { &big[root] } else { &empty };
    comm.scatter(send, &mut piece, root)
        .await
        .map_err(err("scatter"))?;
    same(
        "scatter",
        &piece,
        &big[root][rank * block..(rank + 1) * block],
    )?;

    let mut recv = vec![T::from_i64(0); block * world];
    comm.all_to_all(&big[rank], &mut recv)
        .await
        .map_err(err("all_to_all"))?;
    let want: Vec<T> = (0..world)
        .flat_map(|i| big[i][rank * block..(rank + 1) * block].to_vec())
        .collect();
    same("all_to_all", &recv, &want)?;
    Ok(())
}

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
    let failures: Vec<String> = res
        .into_iter()
        .enumerate()
        .filter_map(|(rank, r)| r.err().map(|e| format!("rank {rank}: {e}")))
        .collect();
    assert!(
        failures.is_empty(),
        "world {world}:\n{}",
        failures.join("\n")
    );
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
