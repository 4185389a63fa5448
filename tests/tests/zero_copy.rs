//! Collectives on `ZeroCopyBuffer`s (sends read the buffer itself, no copy) give the same
//! results as the slice forms, interoperate with them, and leave their buffers reusable.

use std::time::Duration;

use nexar_actors::{Cluster, Communicator, ZeroCopyBuffer};
use nexar_device::ReduceOp;
use nexar_tests::{all_ok, fold, input, on_all_ranks};

const DEADLINE: Duration = Duration::from_secs(300);

/// Every zero-copy collective on this rank, three times on the same buffers (each round
/// writes new inputs once the previous round's loans are back), checked against a
/// sequential reference. With `slices`, the all-reduces use the slice form instead, and
/// must still match the other ranks' zero-copy calls.
async fn check(
    comm: &Communicator,
    count: usize,
    block: usize,
    slices: bool,
) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let e = |what: &'static str| move |e: nexar_actors::NexarError| format!("{what}: {e}");
    let mut buf = ZeroCopyBuffer::from(vec![0f32; count]);
    let mut gathered = ZeroCopyBuffer::from(vec![0f32; block * world]);
    let mut mine = ZeroCopyBuffer::from(vec![0f32; block]);
    for round in 0..3 {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r + round, count, op)).collect();
            buf.writable().await.copy_from_slice(&inputs[rank]);
            if slices {
                let mut v = inputs[rank].clone();
                comm.all_reduce(&mut v, op).await.map_err(e("all_reduce"))?;
                buf.as_mut_slice().copy_from_slice(&v);
            } else {
                comm.all_reduce_zero_copy(&mut buf, op)
                    .await
                    .map_err(e("all_reduce_zero_copy"))?;
            }
            if buf[..] != fold(&inputs, op, world)[..] {
                return Err(format!("all_reduce {op}, round {round}: wrong result"));
            }
        }
        let root = (round + 1) % world;
        let want = input::<f32>(root + 7, count, ReduceOp::Sum);
        buf.writable().await.copy_from_slice(&if rank == root {
            want.clone()
        } else {
            vec![0.0; count]
        });
        comm.broadcast_zero_copy(&mut buf, root)
            .await
            .map_err(e("broadcast_zero_copy"))?;
        if buf[..] != want[..] {
            return Err(format!(
                "broadcast from {root}, round {round}: wrong result"
            ));
        }

        // Reduce: the root gets the result, the others' buffers stay their inputs (they
        // are only lent, never written).
        let root = (round + 2) % world;
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let inputs: Vec<Vec<f32>> = (0..world)
                .map(|r| input(r + round + 5, count, op))
                .collect();
            buf.writable().await.copy_from_slice(&inputs[rank]);
            if slices {
                let mut v = inputs[rank].clone();
                comm.reduce(&mut v, op, root).await.map_err(e("reduce"))?;
                buf.as_mut_slice().copy_from_slice(&v);
            } else {
                comm.reduce_zero_copy(&mut buf, op, root)
                    .await
                    .map_err(e("reduce_zero_copy"))?;
            }
            let want = if rank == root {
                fold(&inputs, op, world)
            } else {
                inputs[rank].clone()
            };
            if buf[..] != want[..] {
                return Err(format!(
                    "reduce {op} to {root}, round {round}: wrong result"
                ));
            }
        }

        let sends: Vec<Vec<f32>> = (0..world)
            .map(|r| input(r + round, block, ReduceOp::Sum))
            .collect();
        let send = ZeroCopyBuffer::from(sends[rank].clone());
        comm.all_gather_zero_copy(&send, &mut gathered)
            .await
            .map_err(e("all_gather_zero_copy"))?;
        if gathered[..] != sends.concat()[..] {
            return Err(format!("all_gather, round {round}: wrong result"));
        }

        let blocks: Vec<Vec<f32>> = (0..world)
            .map(|r| input(r + round, block * world, ReduceOp::Sum))
            .collect();
        let send = ZeroCopyBuffer::from(blocks[rank].clone());
        comm.reduce_scatter_zero_copy(&send, &mut mine, ReduceOp::Sum)
            .await
            .map_err(e("reduce_scatter_zero_copy"))?;
        let total = fold(&blocks, ReduceOp::Sum, world);
        if mine[..] != total[rank * block..(rank + 1) * block] {
            return Err(format!("reduce_scatter, round {round}: wrong result"));
        }

        let big: Vec<Vec<f32>> = (0..world)
            .map(|r| input(r + round + 11, block * world, ReduceOp::Sum))
            .collect();
        let root = round % world;
        let send = ZeroCopyBuffer::from(big[rank].clone());
        let mut all = ZeroCopyBuffer::from(vec![0f32; block * world]);
        comm.gather_zero_copy(&ZeroCopyBuffer::from(sends[rank].clone()), &mut all, root)
            .await
            .map_err(e("gather_zero_copy"))?;
        if rank == root && all[..] != sends.concat()[..] {
            return Err(format!("gather to {root}, round {round}: wrong result"));
        }
        let mut piece = ZeroCopyBuffer::from(vec![0f32; block]);
        comm.scatter_zero_copy(&send, &mut piece, root)
            .await
            .map_err(e("scatter_zero_copy"))?;
        if piece[..] != big[root][rank * block..(rank + 1) * block] {
            return Err(format!("scatter from {root}, round {round}: wrong result"));
        }
        comm.all_to_all_zero_copy(&send, &mut all)
            .await
            .map_err(e("all_to_all_zero_copy"))?;
        let want: Vec<f32> = (0..world)
            .flat_map(|i| big[i][rank * block..(rank + 1) * block].to_vec())
            .collect();
        if all[..] != want[..] {
            return Err(format!("all_to_all, round {round}: wrong result"));
        }
        // The send buffers are dropped here, maybe with loans out: those keep the
        // memory alive until the transport lets go.
    }
    Ok(())
}

#[tokio::test]
async fn zero_copy_collectives_give_the_slice_results_and_stay_reusable() {
    for world in [2, 3, 4] {
        let cluster = Cluster::local(world).await.expect("cluster");
        // Large enough to stream (blocks over 256 KiB) and odd, so blocks are uneven;
        // then small.
        for (count, block) in [(300_001, 70_001), (37, 5)] {
            let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
                check(&comm, count, block, false).await
            })
            .await;
            all_ok(&format!("world {world}, {count} elements"), res);
        }
    }
}

/// Blocks of 2 MiB and more, written with streaming stores where nothing reads them
/// again during the call (own blocks, last received blocks, broadcast leaves), in the
/// zero-copy forms and, on one rank, the slice forms.
#[tokio::test]
async fn blocks_written_with_streaming_stores_are_right() {
    let cluster = Cluster::local(3).await.expect("cluster");
    // All-reduce blocks of 1.2 MB, all-gather and all-to-all blocks of 2 MiB and 4 bytes.
    let (count, block) = (900_001, 524_289);
    let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
        let slices = comm.rank() == 2;
        check(&comm, count, block, slices).await
    })
    .await;
    all_ok("world 3, blocks of 2 MiB", res);
}

/// A rank calling the slice form meets ranks calling the zero-copy form: the calls match.
#[tokio::test]
async fn zero_copy_and_slice_forms_interoperate() {
    let cluster = Cluster::local(3).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let slices = comm.rank() == 1;
        check(&comm, 200_003, 3, slices).await
    })
    .await;
    all_ok("world 3, rank 1 on slices", res);
}

/// Wrong lengths are refused at the call, before anything is sent, as in the slice forms.
#[tokio::test]
async fn zero_copy_forms_refuse_wrong_lengths() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let send = ZeroCopyBuffer::from(vec![1f32; 8]);
        let mut short = ZeroCopyBuffer::from(vec![0f32; 15]);
        let gathered = comm.all_gather_zero_copy(&send, &mut short).await;
        let mut uneven = ZeroCopyBuffer::from(vec![0f32; 5]);
        let scattered = comm
            .reduce_scatter_zero_copy(&send, &mut uneven, ReduceOp::Sum)
            .await;
        let bad_root = comm.broadcast_zero_copy(&mut short, 2).await;
        let bad_reduce_root = comm.reduce_zero_copy(&mut short, ReduceOp::Sum, 2).await;
        (gathered, scattered, bad_root, bad_reduce_root)
    })
    .await;
    for (gathered, scattered, bad_root, bad_reduce_root) in res {
        assert!(
            matches!(
                gathered,
                Err(nexar_actors::NexarError::LengthMismatch { .. })
            ),
            "{gathered:?}"
        );
        assert!(
            matches!(
                scattered,
                Err(nexar_actors::NexarError::LengthMismatch { .. })
            ),
            "{scattered:?}"
        );
        assert!(
            matches!(
                bad_root,
                Err(nexar_actors::NexarError::InvalidRank { rank: 2, world: 2 })
            ),
            "broadcast from root 2 of 2 ranks: {bad_root:?}"
        );
        assert!(
            matches!(
                bad_reduce_root,
                Err(nexar_actors::NexarError::InvalidRank { rank: 2, world: 2 })
            ),
            "reduce to root 2 of 2 ranks: {bad_reduce_root:?}"
        );
    }
}

/// Reduce's ring reduce-scatter then gather (`rsg`, chosen by size from 8 MiB; forced
/// here at a smaller size) through the zero-copy and device-memory paths: the root's
/// gather receives into ranges its ring sends may still hold on loan, and non-roots
/// reduce onto a base held in device memory. Odd counts, a root in the middle.
#[tokio::test]
async fn reduce_scatter_gather_reduce_through_zero_copy_and_device_memory() {
    use nexar_collectives::Algorithm;
    use nexar_device::HostBuffer;
    let mut config = nexar_actors::NodeConfig::default();
    config.collectives.algorithm = Some(Algorithm::ReduceScatterGather);
    for count in [20_011usize, 300_007] {
        let chosen = nexar_collectives::reduce(
            0,
            3,
            count,
            nexar_device::DataType::F32,
            ReduceOp::Sum,
            1,
            &config.collectives,
        )
        .expect("schedule");
        assert_eq!(chosen.name(), "rsg", "{count} elements");
    }
    let cluster = Cluster::local_with(3, config).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let (rank, world) = (comm.rank(), comm.world_size());
        let root = 1;
        for count in [20_011usize, 300_007] {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r + 3, count, op)).collect();
                let want = if rank == root {
                    fold(&inputs, op, world)
                } else {
                    inputs[rank].clone()
                };
                let mut buf = ZeroCopyBuffer::from(inputs[rank].clone());
                comm.reduce_zero_copy(&mut buf, op, root)
                    .await
                    .map_err(|e| format!("reduce_zero_copy {op}: {e}"))?;
                if buf[..] != want[..] {
                    return Err(format!("reduce_zero_copy {op}, {count}: wrong result"));
                }
                let got = comm
                    .reduce_in(HostBuffer(inputs[rank].clone()), op, root)
                    .await
                    .map_err(|e| format!("reduce_in {op}: {e}"))?;
                if rank == root && got.0 != want {
                    return Err(format!("reduce_in {op}, {count}: wrong result"));
                }
            }
        }
        Ok(())
    })
    .await;
    all_ok("world 3, rsg reduce", res);
}
