//! All-gather and reduce-scatter in place give the two-buffer forms' results, leave a
//! reduce-scatter's other blocks alone, mix with the other forms across ranks (on slices
//! and on zero-copy buffers), and refuse buffers that do not split into equal blocks.

use std::time::Duration;

use nexar_actors::{Cluster, Communicator, NexarError, ZeroCopyBuffer};
use nexar_device::ReduceOp;
use nexar_tests::{all_ok, fold, input, on_all_ranks};

const DEADLINE: Duration = Duration::from_secs(300);

/// How a rank makes its calls.
#[derive(Clone, Copy, Debug)]
enum Form {
    InPlace,
    InPlaceZeroCopy,
    TwoBuffers,
}

/// All-gather of `mine` in `form`; the gathered buffer. In place, the blocks of the
/// other ranks start out as garbage.
async fn all_gather(comm: &Communicator, form: Form, mine: &[f32]) -> Result<Vec<f32>, NexarError> {
    let (rank, world, block) = (comm.rank(), comm.world_size(), mine.len());
    let mut buf = vec![-99.5f32; block * world];
    buf[rank * block..(rank + 1) * block].copy_from_slice(mine);
    match form {
        Form::InPlace => comm.all_gather_in_place(&mut buf).await?,
        Form::InPlaceZeroCopy => {
            let mut z = ZeroCopyBuffer::from(buf);
            comm.all_gather_in_place_zero_copy(&mut z).await?;
            buf = z.into_vec();
        }
        Form::TwoBuffers => comm.all_gather(mine, &mut buf).await?,
    }
    Ok(buf)
}

/// Reduce-scatter of `input` in `form`: the whole buffer afterwards (in place) or
/// `input` with the result written over block `rank` (two buffers), so that both read
/// the same when the in-place form leaves the other blocks alone.
async fn reduce_scatter(
    comm: &Communicator,
    form: Form,
    input: &[f32],
    op: ReduceOp,
) -> Result<Vec<f32>, NexarError> {
    let block = input.len() / comm.world_size();
    let mut buf = input.to_vec();
    match form {
        Form::InPlace => comm.reduce_scatter_in_place(&mut buf, op).await?,
        Form::InPlaceZeroCopy => {
            let mut z = ZeroCopyBuffer::from(buf);
            comm.reduce_scatter_in_place_zero_copy(&mut z, op).await?;
            buf = z.into_vec();
        }
        Form::TwoBuffers => {
            let mut out = vec![0f32; block];
            comm.reduce_scatter(input, &mut out, op).await?;
            let at = comm.rank() * block;
            buf[at..at + block].copy_from_slice(&out);
        }
    }
    Ok(buf)
}

/// Two rounds of all-gather and of reduce-scatter (sum, max, avg) with `block` elements
/// per rank, against a sequential reference.
async fn check(comm: &Communicator, block: usize, form: Form) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let e = |what: &'static str| move |e: NexarError| format!("{what} {form:?}: {e}");
    for round in 0..2 {
        let sends: Vec<Vec<f32>> = (0..world)
            .map(|r| input(r + round, block, ReduceOp::Sum))
            .collect();
        let got = all_gather(comm, form, &sends[rank])
            .await
            .map_err(e("all_gather"))?;
        if got != sends.concat() {
            return Err(format!("all_gather {form:?}, round {round}: wrong result"));
        }
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
            let inputs: Vec<Vec<f32>> = (0..world)
                .map(|r| input(r + round, block * world, op))
                .collect();
            let got = reduce_scatter(comm, form, &inputs[rank], op)
                .await
                .map_err(e("reduce_scatter"))?;
            let mut want = inputs[rank].clone();
            let at = rank * block;
            want[at..at + block].copy_from_slice(&fold(&inputs, op, world)[at..at + block]);
            if got != want {
                return Err(format!(
                    "reduce_scatter {form:?} {op}, round {round}: wrong result or other blocks changed"
                ));
            }
        }
    }
    Ok(())
}

#[tokio::test]
async fn in_place_forms_give_the_two_buffer_results() {
    for world in [2, 3, 4] {
        let cluster = Cluster::local(world).await.expect("cluster");
        // Blocks large enough to stream and to be lent (over 64 KiB), and odd; then small.
        for block in [70_001, 5] {
            for form in [Form::InPlace, Form::InPlaceZeroCopy] {
                let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
                    check(&comm, block, form).await
                })
                .await;
                all_ok(&format!("world {world}, block {block}, {form:?}"), res);
            }
        }
    }
}

/// Blocks over 2 MiB, whose last received pieces and own-block copies are results the
/// driver writes with streaming stores (they bypass the cache; the destination is at an
/// odd offset from any cache line): every form, one rank per form, gives the same result.
#[tokio::test]
async fn blocks_written_with_streaming_stores_give_the_same_results() {
    let cluster = Cluster::local(3).await.expect("cluster");
    let block = 524_289; // 2 MiB and 4 bytes
    let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
        let form = [Form::TwoBuffers, Form::InPlace, Form::InPlaceZeroCopy][comm.rank()];
        check(&comm, block, form).await
    })
    .await;
    all_ok("world 3, blocks of 2 MiB", res);
}

/// One rank per form in the same calls: the forms send the same messages.
#[tokio::test]
async fn in_place_and_two_buffer_forms_mix() {
    let cluster = Cluster::local(3).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let form = [Form::TwoBuffers, Form::InPlace, Form::InPlaceZeroCopy][comm.rank()];
        check(&comm, 40_003, form).await
    })
    .await;
    all_ok("world 3, one form per rank", res);
}

/// A buffer that does not split into `world` equal blocks is refused at the call.
#[tokio::test]
async fn in_place_forms_refuse_buffers_that_do_not_split() {
    let cluster = Cluster::local(2).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let mut odd = vec![1f32; 7];
        let gathered = comm.all_gather_in_place(&mut odd).await;
        let scattered = comm.reduce_scatter_in_place(&mut odd, ReduceOp::Sum).await;
        let mut z = ZeroCopyBuffer::from(odd);
        let zero_copy = comm.all_gather_in_place_zero_copy(&mut z).await;
        [gathered, scattered, zero_copy]
    })
    .await;
    for r in res.into_iter().flatten() {
        match r {
            Err(NexarError::InvalidArgument(m)) => {
                assert!(m.contains("does not split into 2 equal blocks"), "{m}")
            }
            other => panic!("want InvalidArgument, got {other:?}"),
        }
    }
}
