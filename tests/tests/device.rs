//! Collectives on buffers that live elsewhere (the `DeviceMemory` path): host buffers
//! through the device code path, checked against the ordinary API; and, with the `cuda`
//! feature and a GPU, a 4-rank all-reduce of GPU buffers checked against the CPU result.

use std::time::Duration;

use nexar_actors::{Cluster, NexarError};
use nexar_device::{HostBuffer, ReduceOp};
use nexar_tests::{input, on_all_ranks};

const DEADLINE: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_through_the_device_memory_path_matches_the_host_api() {
    for world in [1usize, 3, 4] {
        // A short call deadline, so a failing rank shows its error instead of the others'
        // waits hitting the test deadline.
        let mut config = nexar_actors::NodeConfig::default();
        config.op_timeout = Duration::from_secs(20);
        let cluster = Cluster::local_with(world, config).await.expect("cluster");
        let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
            let (rank, world) = (comm.rank(), comm.world_size());
            for count in [0usize, 1, 1001, 300_001] {
                let data: Vec<f32> = input(rank, count, ReduceOp::Sum);
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                    let mut want = data.clone();
                    comm.all_reduce(&mut want, op).await?;
                    let got = comm.all_reduce_in(HostBuffer(data.clone()), op).await?;
                    assert_eq!(got.0, want, "all_reduce {op} count {count}");
                }
                let root = world - 1;
                let mut want = data.clone();
                comm.broadcast(&mut want, root).await?;
                assert_eq!(
                    comm.broadcast_in(HostBuffer(data.clone()), root).await?.0,
                    want
                );
                let mut want = data.clone();
                comm.reduce(&mut want, ReduceOp::Sum, root).await?;
                assert_eq!(
                    comm.reduce_in(HostBuffer(data.clone()), ReduceOp::Sum, root)
                        .await?
                        .0,
                    want
                );
                for exclusive in [false, true] {
                    let mut want = data.clone();
                    if exclusive {
                        comm.exclusive_scan(&mut want, ReduceOp::Max).await?;
                    } else {
                        comm.scan(&mut want, ReduceOp::Max).await?;
                    }
                    let got = comm
                        .scan_in(HostBuffer(data.clone()), ReduceOp::Max, exclusive)
                        .await?;
                    assert_eq!(got.0, want, "scan exclusive={exclusive}");
                }
            }
            let block: Vec<i32> = input(rank, 7 * world, ReduceOp::Sum);
            let piece: Vec<i32> = input(rank, 7, ReduceOp::Sum);
            let mut want = vec![0i32; 7 * world];
            comm.all_gather(&piece, &mut want).await?;
            let got = comm
                .all_gather_in(&HostBuffer(piece.clone()), HostBuffer(vec![0; 7 * world]))
                .await?;
            assert_eq!(got.0, want);
            let mut want = vec![0i32; 7];
            comm.reduce_scatter(&block, &mut want, ReduceOp::Sum)
                .await?;
            let got = comm
                .reduce_scatter_in(
                    &HostBuffer(block.clone()),
                    HostBuffer(vec![0; 7]),
                    ReduceOp::Sum,
                )
                .await?;
            assert_eq!(got.0, want);
            let mut want = vec![0i32; 7 * world];
            comm.all_to_all(&block, &mut want).await?;
            let got = comm
                .all_to_all_in(&HostBuffer(block.clone()), HostBuffer(vec![0; 7 * world]))
                .await?;
            assert_eq!(got.0, want);
            let is_root = rank == 0;
            let mut want = vec![0i32; if is_root { 7 * world } else { 0 }];
            comm.gather(&piece, &mut want, 0).await?;
            let got = comm
                .gather_in(
                    &HostBuffer(piece.clone()),
                    HostBuffer(vec![0; want.len()]),
                    0,
                )
                .await?;
            assert_eq!(got.0, want);
            let src = if is_root { block.clone() } else { Vec::new() };
            let mut want = vec![0i32; 7];
            comm.scatter(&src, &mut want, 0).await?;
            let got = comm
                .scatter_in(&HostBuffer(src.clone()), HostBuffer(vec![0; 7]), 0)
                .await?;
            assert_eq!(got.0, want);
            Ok::<_, NexarError>(())
        })
        .await;
        nexar_tests::all_ok(&format!("world {world}"), res);
        cluster.shutdown().await;
    }
}

/// The first CUDA device's adapter, its kernels compiled (not inside a timed call, or a
/// collective's deadline); `None`, saying so, without a device (`gpu-check.sh` fails on
/// that message).
#[cfg(feature = "cuda")]
fn gpu() -> Option<std::sync::Arc<nexar_device::CudaAdapter>> {
    match nexar_device::CudaAdapter::new(0) {
        Ok(a) => {
            a.prepare_kernels().expect("the reduction kernels");
            Some(std::sync::Arc::new(a))
        }
        Err(e) => {
            eprintln!("skipping: no CUDA device: {e}");
            None
        }
    }
}

#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_rank_all_reduce_of_gpu_buffers_matches_the_cpu() {
    use nexar_device::{CudaMemory, DeviceBuffer};

    let Some(adapter) = gpu() else {
        return;
    };
    let cluster = Cluster::local(4).await.expect("cluster");
    let n = 4 << 20;
    let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| {
        let adapter = adapter.clone();
        async move {
            let host: Vec<f32> = input(comm.rank(), n, ReduceOp::Sum);
            let mut want = host.clone();
            comm.all_reduce(&mut want, ReduceOp::Sum).await?;
            let buf = DeviceBuffer::from_host(&adapter, &host)?;
            let mem = CudaMemory::new(adapter.clone(), buf)?;
            let start = std::time::Instant::now();
            let mem = comm.all_reduce_in(mem, ReduceOp::Sum).await?;
            let took = start.elapsed();
            let got = mem.into_inner().to_host()?;
            assert_eq!(got, want);
            if comm.rank() == 0 {
                let bytes = (n * 4) as f64;
                eprintln!(
                    "gpu all_reduce 4 ranks, {} MiB f32: {:?}, busbw {:.2} GB/s",
                    (n * 4) >> 20,
                    took,
                    bytes * 1.5 / took.as_secs_f64() / 1e9
                );
            }
            Ok::<_, NexarError>(())
        }
    })
    .await;
    for r in res {
        r.expect("gpu all-reduce");
    }
}

/// A bf16 reduction of two NaNs of different payloads gives the same bits on every rank
/// of an all-reduce of GPU buffers, and the CPU's: the canonical quiet NaN. A small one
/// pairs ranks that reduce one on the GPU, the other on the CPU; the CUDA kernels used to
/// keep an operand's payload, where the CPU gives `0x7FC0`.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_nans_reduce_to_the_same_bits_on_gpu_buffers_and_the_cpu() {
    use half::bf16;
    use nexar_device::{CudaMemory, DeviceBuffer};

    let Some(adapter) = gpu() else {
        return;
    };
    let cluster = Cluster::local(2).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| {
        let adapter = adapter.clone();
        async move {
            let nan = bf16::from_bits(0x7FC1 + comm.rank() as u16);
            let host = vec![nan, bf16::from_f32(comm.rank() as f32), nan, bf16::ONE];
            for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum, ReduceOp::Avg] {
                let mut want = host.clone();
                comm.all_reduce(&mut want, op).await?;
                let buf = DeviceBuffer::from_host(&adapter, &host)?;
                let mem = CudaMemory::new(adapter.clone(), buf)?;
                let got = comm.all_reduce_in(mem, op).await?.into_inner().to_host()?;
                let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "rank {} {op}", comm.rank());
                assert_eq!(want[0].to_bits(), 0x7FC0, "{op}");
            }
            Ok::<_, NexarError>(())
        }
    })
    .await;
    for r in res {
        r.expect("bf16 NaNs on GPU buffers");
    }
}
