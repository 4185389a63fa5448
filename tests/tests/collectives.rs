//! Every collective over real QUIC in-process clusters: worlds 1, 2, 3, 4, 5 and 8,
//! rank-dependent data, uneven counts, every dtype and every op, checked against a
//! sequential reference computed on each rank.

use std::time::Duration;

use nexar_actors::{Algorithm, Cluster, Communicator, NodeConfig};
use nexar_device::ReduceOp;
use nexar_tests::{check_all, on_all_ranks, within};

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
/// with small thresholds so the pipelined algorithms run too, and on 4 ranks recursive
/// doubling, whose sends pass received payloads on in pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_with_a_tiny_send_budget() {
    static SIZES: &[(usize, usize)] = &[(1, 1), (97, 7), (20_011, 517)];
    for world in [2, 3, 4] {
        let mut config = NodeConfig::default();
        config.collective_send_budget_bytes = 2500;
        config.collectives.pipeline_chunk_bytes = 1024;
        config.collectives.small_bytes = 8 << 10;
        config.collectives.pipeline_threshold_bytes = 32 << 10;
        run_world(world, config, SIZES, false).await;
    }
}

/// Sends of more than 1 MiB of copied bytes over QUIC go out in 1 MiB pieces, copied as
/// the send budget lets them: with a budget under one piece, of one piece, and the
/// default, every collective (f32 and i32) ends right where blocks and whole buffers are several
/// pieces long and not a whole number of them (a 2- and 3-rank reduce of 5 MiB and
/// 12 bytes, gathers, scatters and all-to-alls of 3 MiB and 4-byte blocks, a scan, the
/// non-pipelined all-reduce and broadcast).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_sends_go_out_in_pieces_within_any_send_budget() {
    static SIZES: &[(usize, usize)] = &[((5 << 20) / 4 + 3, (3 << 20) / 4 + 1)];
    for (world, budget) in [(2, 4 << 20), (3, 64 << 10), (3, 1 << 20)] {
        let mut config = NodeConfig::default();
        config.collective_send_budget_bytes = budget;
        run_world(world, config, SIZES, false).await;
    }
}

/// Waits that poll first (set explicitly: a multi-threaded runtime does not poll by
/// default) give the same results as those that sleep at once, which the other tests on
/// this runtime run (its default, `spin_wait` zero).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_whether_waits_poll_or_sleep() {
    for world in [3, 4] {
        let mut config = NodeConfig::default();
        config.spin_wait = Some(nexar_actors::AUTO_SPIN_WAIT);
        run_world(world, config, COUNTS, false).await;
    }
}

/// A single-threaded runtime (where waits poll by default) runs a whole cluster.
#[tokio::test(flavor = "current_thread")]
async fn every_collective_on_a_single_threaded_runtime() {
    run_world(3, NodeConfig::default(), COUNTS, false).await;
}

/// Sizes large enough for the automatic choice to pick ring and pipelined algorithms
/// (that a running cluster picks them, as its driver's spans say: algorithm_choice.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_buffers_use_ring_and_pipelined_paths() {
    static SIZES: &[(usize, usize)] = &[(3_000_001, 262_147)];
    // The schedules the runtime builds for these sizes (the same constructors, with the
    // default configuration the cluster runs) are the ring ones.
    let cfg = nexar_collectives::CollectiveConfig::default();
    let f32s = nexar_device::DataType::F32;
    // Three ranks: on 4, 8, 16, ... all-reduce takes rhd at every size.
    let all_reduce = nexar_collectives::all_reduce(0, 3, SIZES[0].0, f32s, ReduceOp::Sum, &cfg)
        .expect("all-reduce schedule");
    assert_eq!(all_reduce.name(), "ring_pipelined");
    let all_gather =
        nexar_collectives::all_gather(0, 3, SIZES[0].1, f32s, &cfg).expect("all-gather schedule");
    assert!(
        all_gather.name().starts_with("ring"),
        "{}",
        all_gather.name()
    );
    run_world(3, NodeConfig::default(), SIZES, false).await;
}

/// On 4, 8, 16, ... ranks all-gather takes recursive doubling at every size, here past the
/// pipeline threshold (messages of one block, then two, each 2 MiB and 12 bytes and more:
/// the slices' sends copy the own block and pass the earlier receive on), and
/// reduce-scatter recursive halving (round 0's two blocks as two messages, the second
/// round passing on the partial it received): 4 ranks, every collective checked, these
/// two among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_all_gather_and_reduce_scatter_on_four_ranks_take_rd_and_rh() {
    static SIZES: &[(usize, usize)] = &[(1_000_003, 524_291)];
    let cfg = nexar_collectives::CollectiveConfig::default();
    let f32s = nexar_device::DataType::F32;
    let s = nexar_collectives::all_gather(0, 4, SIZES[0].1, f32s, &cfg).expect("schedule");
    assert_eq!(s.name(), "rd");
    let s = nexar_collectives::reduce_scatter(0, 4, SIZES[0].1, f32s, ReduceOp::Sum, &cfg)
        .expect("schedule");
    assert_eq!(s.name(), "rh");
    run_world(4, NodeConfig::default(), SIZES, false).await;
}

/// On 8, 16, ... ranks a broadcast between `small_bytes` and the pipeline threshold, of
/// blocks of `broadcast_rd_block_bytes` and more, scatters, then all-gathers by
/// recursive doubling: 8 ranks, 2 MiB and 20 bytes of i32 from roots 0, 3 and 7
/// (relative ranks differ from ranks), right on every rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_on_eight_ranks_gathers_its_scatter_by_recursive_doubling() {
    let count: usize = 524_293;
    let cfg = nexar_collectives::CollectiveConfig::default();
    let i32s = nexar_device::DataType::I32;
    let mut s = nexar_collectives::broadcast(0, 8, count, i32s, 0, &cfg).expect("schedule");
    assert_eq!(s.name(), "scatter_allgather");
    // The root sends 3 scatter messages and one group in each of the 3 rounds; the ring
    // would send 7 blocks after the scatter.
    let mut sends = 0;
    let mut ready = Vec::new();
    while !s.is_done() {
        ready.clear();
        s.poll(&mut ready);
        assert!(!ready.is_empty(), "the root's schedule stalled");
        for a in &ready {
            sends += usize::from(matches!(a, nexar_collectives::Action::Send { .. }));
            s.complete(a.id()).expect("complete");
        }
    }
    assert_eq!(sends, 6, "the root's sends");
    let cluster = Cluster::local(8).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
        for root in [0, 3, 7] {
            let want: Vec<i32> = (0..count).map(|i| (i * 7 + root) as i32).collect();
            let mut v = if comm.rank() == root {
                want.clone()
            } else {
                vec![-1; count]
            };
            comm.broadcast(&mut v, root)
                .await
                .map_err(|e| format!("root {root}: {e}"))?;
            if let Some(i) = (0..count).find(|&i| v[i] != want[i]) {
                return Err(format!(
                    "root {root}: element {i} is {}, want {}",
                    v[i], want[i]
                ));
            }
        }
        Ok::<_, String>(())
    })
    .await;
    nexar_tests::all_ok("8 ranks", res);
    cluster.shutdown().await;
}

/// On 4, 8, 16, ... ranks all-reduce takes recursive halving-doubling at every size (its
/// messages half the buffer and less, cut at `max_message_bytes`): 4 ranks, 12 MiB, every
/// op of f32 and i32, right on every rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_all_reduce_on_four_ranks_takes_rhd() {
    let count = 3_000_001;
    let cfg = nexar_collectives::CollectiveConfig::default();
    let f32s = nexar_device::DataType::F32;
    let s = nexar_collectives::all_reduce(0, 4, count, f32s, ReduceOp::Sum, &cfg)
        .expect("all-reduce schedule");
    assert_eq!(s.name(), "rhd");
    let cluster = Cluster::local(4).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, move |comm| async move {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
            let mut v: Vec<f32> = (0..count).map(|i| ((i + comm.rank()) % 5) as f32).collect();
            comm.all_reduce(&mut v, op)
                .await
                .map_err(|e| format!("{op}: {e}"))?;
            for (i, &x) in v.iter().enumerate() {
                let vals = (0..4).map(|r| ((i + r) % 5) as f32);
                let want = match op {
                    ReduceOp::Sum => vals.sum::<f32>(),
                    ReduceOp::Max => vals.fold(f32::MIN, f32::max),
                    _ => vals.sum::<f32>() / 4.0,
                };
                if x != want {
                    return Err(format!("{op}: element {i} is {x}, want {want}"));
                }
            }
        }
        Ok::<_, String>(())
    })
    .await;
    nexar_tests::all_ok("4 ranks, rhd", res);
    cluster.shutdown().await;
}

/// Element `i` of the Avg tests' shared part: quarters in [-5.5, 5.5], so that the 45
/// consecutive elements of a period all differ.
fn avg_base(i: usize) -> f32 {
    ((i * 7) % 45) as f32 * 0.25 - 5.5
}

/// Element `i` of rank `rank`'s input in the Avg tests: `avg_base(i)` plus an offset of
/// `2 * rank - 5` (-5, -3, -1, 1, 3, 5 on six ranks, summing to zero), so the average over
/// six ranks is exactly `avg_base(i)`. Every input and every partial sum is a multiple of
/// 0.25 of magnitude at most 63 (252 quarters, under bf16's 256), so each sum is exact in
/// f32 and bf16 in any order, and so is the division by six.
fn avg_input(rank: usize, i: usize) -> f32 {
    avg_base(i) + (2 * rank) as f32 - 5.0
}

fn bf16s(v: &[f32]) -> Vec<half::bf16> {
    v.iter().map(|&x| half::bf16::from_f32(x)).collect()
}

fn same_avg<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, want {}",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} is {:?}, want {:?}",
            got[i], want[i]
        )),
    }
}

/// All-reduce lengths and reduce-scatter blocks (per rank) of the Avg tests: empty, one,
/// a few, and sizes past a 45-element period (1001 and 5003 elements, 20 KB of f32).
const AVG_ALL_REDUCE_LENS: [usize; 5] = [0, 1, 7, 1001, 5003];
const AVG_REDUCE_SCATTER_BLOCKS: [usize; 4] = [0, 1, 5, 167];

/// On one rank: starts every Avg all-reduce and reduce-scatter, f32 and bf16, without
/// waiting (all in flight together), then waits for each and checks it exactly.
async fn avg_non_blocking(comm: Communicator) -> Result<(), String> {
    let rank = comm.rank();
    let world = comm.world_size();
    let started = |what: String| move |e: nexar_actors::NexarError| format!("{what}: {e}");
    let mut ar = Vec::new();
    for len in AVG_ALL_REDUCE_LENS {
        let mine: Vec<f32> = (0..len).map(|i| avg_input(rank, i)).collect();
        let what = format!("all_reduce_nb Avg f32 len {len}");
        let f = comm
            .all_reduce_nb(mine.clone(), ReduceOp::Avg)
            .map_err(started(what))?;
        let what = format!("all_reduce_nb Avg bf16 len {len}");
        let b = comm
            .all_reduce_nb(bf16s(&mine), ReduceOp::Avg)
            .map_err(started(what))?;
        ar.push((len, f, b));
    }
    let mut rs = Vec::new();
    for n in AVG_REDUCE_SCATTER_BLOCKS {
        let send: Vec<f32> = (0..n * world).map(|i| avg_input(rank, i)).collect();
        let what = format!("reduce_scatter_nb Avg f32 block {n}");
        let f = comm
            .reduce_scatter_nb(send.clone(), ReduceOp::Avg)
            .map_err(started(what))?;
        let what = format!("reduce_scatter_nb Avg bf16 block {n}");
        let b = comm
            .reduce_scatter_nb(bf16s(&send), ReduceOp::Avg)
            .map_err(started(what))?;
        rs.push((n, f, b));
    }
    for (len, f, b) in ar {
        let want: Vec<f32> = (0..len).map(avg_base).collect();
        let what = format!("all_reduce_nb Avg f32 len {len}");
        let got = within(&what, f.wait())
            .await
            .map_err(started(what.clone()))?;
        same_avg(&what, &got, &want)?;
        let what = format!("all_reduce_nb Avg bf16 len {len}");
        let got = within(&what, b.wait())
            .await
            .map_err(started(what.clone()))?;
        same_avg(&what, &got, &bf16s(&want))?;
    }
    for (n, f, b) in rs {
        // Rank r's block: elements r * n .. (r + 1) * n of the averaged input.
        let want: Vec<f32> = (rank * n..(rank + 1) * n).map(avg_base).collect();
        let what = format!("reduce_scatter_nb Avg f32 block {n}");
        let got = within(&what, f.wait())
            .await
            .map_err(started(what.clone()))?;
        same_avg(&what, &got, &want)?;
        let what = format!("reduce_scatter_nb Avg bf16 block {n}");
        let got = within(&what, b.wait())
            .await
            .map_err(started(what.clone()))?;
        same_avg(&what, &got, &bf16s(&want))?;
    }
    Ok(())
}

/// Element `i` of rank `rank`'s input in the f16 Avg test: `world` times a multiple of 16
/// under 8192, so that dividing by `world` first is exact, every partial sum of the
/// divided inputs is a multiple of 16 under 32768 (exact in f16), and the plain sum of
/// all inputs is past f16's largest finite value, 65504 (three ranks: at least 66384).
fn big_f16(world: usize, rank: usize, i: usize) -> half::f16 {
    let m = 7504.0 - 16.0 * (rank + i % 8) as f32;
    let sign = if i % 3 == 1 { -1.0 } else { 1.0 };
    half::f16::from_f32(sign * world as f32 * m)
}

/// The exact mean of [`big_f16`]'s inputs at element `i`.
fn big_f16_mean(world: usize, i: usize) -> half::f16 {
    let sum: f32 = (0..world).map(|r| big_f16(world, r, i).to_f32()).sum();
    half::f16::from_f32(sum / world as f32)
}

/// On one rank: every entry point that takes `ReduceOp::Avg`, in f16, on inputs whose sum
/// overflows f16 while their mean does not; each result must be the exact mean, and the
/// buffers a call does not return a result in must be as they were.
async fn f16_avg_everywhere(comm: Communicator) -> Result<(), String> {
    use nexar_actors::ZeroCopyBuffer;
    use nexar_device::HostBuffer;
    let (rank, world) = (comm.rank(), comm.world_size());
    let e = |what: &'static str| move |e: nexar_actors::NexarError| format!("{what}: {e}");
    let mine =
        |len: usize| -> Vec<half::f16> { (0..len).map(|i| big_f16(world, rank, i)).collect() };
    let mean =
        |len: usize| -> Vec<half::f16> { (0..len).map(|i| big_f16_mean(world, i)).collect() };
    let root = world - 1;
    for len in [1usize, 1001, 40_000] {
        let want = mean(len);
        let mut buf = mine(len);
        comm.all_reduce(&mut buf, ReduceOp::Avg)
            .await
            .map_err(e("all_reduce"))?;
        same_avg("all_reduce", &buf, &want)?;

        let pending = comm
            .all_reduce_nb(mine(len), ReduceOp::Avg)
            .map_err(e("all_reduce_nb"))?;
        let got = within("all_reduce_nb", pending.wait())
            .await
            .map_err(e("all_reduce_nb"))?;
        same_avg("all_reduce_nb", &got, &want)?;

        let (mut a, mut b) = (mine(len), mine(len + 3));
        comm.all_reduce_many(&mut [&mut a[..], &mut b[..]], ReduceOp::Avg)
            .await
            .map_err(e("all_reduce_many"))?;
        same_avg("all_reduce_many (first)", &a, &want)?;
        same_avg("all_reduce_many (second)", &b, &mean(len + 3))?;

        let mut buf = mine(len);
        comm.reduce(&mut buf, ReduceOp::Avg, root)
            .await
            .map_err(e("reduce"))?;
        let kept = mine(len);
        same_avg("reduce", &buf, if rank == root { &want } else { &kept })?;

        let mut zc = ZeroCopyBuffer::from(mine(len));
        comm.all_reduce_zero_copy(&mut zc, ReduceOp::Avg)
            .await
            .map_err(e("all_reduce_zero_copy"))?;
        same_avg("all_reduce_zero_copy", &zc[..], &want)?;

        let mut zc = ZeroCopyBuffer::from(mine(len));
        comm.reduce_zero_copy(&mut zc, ReduceOp::Avg, root)
            .await
            .map_err(e("reduce_zero_copy"))?;
        same_avg(
            "reduce_zero_copy",
            &zc[..],
            if rank == root { &want } else { &kept },
        )?;

        let got = comm
            .all_reduce_in(HostBuffer(mine(len)), ReduceOp::Avg)
            .await
            .map_err(e("all_reduce_in"))?;
        same_avg("all_reduce_in", &got.0, &want)?;
        let got = comm
            .reduce_in(HostBuffer(mine(len)), ReduceOp::Avg, root)
            .await
            .map_err(e("reduce_in"))?;
        same_avg(
            "reduce_in",
            &got.0,
            if rank == root { &want } else { &kept },
        )?;
    }
    for block in [1usize, 167, 10_000] {
        let send = mine(block * world);
        let whole = mean(block * world);
        let want = &whole[rank * block..(rank + 1) * block];
        let mut recv = vec![half::f16::ZERO; block];
        comm.reduce_scatter(&send, &mut recv, ReduceOp::Avg)
            .await
            .map_err(e("reduce_scatter"))?;
        same_avg("reduce_scatter", &recv, want)?;
        same_avg("reduce_scatter (send)", &send, &mine(block * world))?;

        let pending = comm
            .reduce_scatter_nb(send.clone(), ReduceOp::Avg)
            .map_err(e("reduce_scatter_nb"))?;
        let got = within("reduce_scatter_nb", pending.wait())
            .await
            .map_err(e("reduce_scatter_nb"))?;
        same_avg("reduce_scatter_nb", &got, want)?;

        // In place: block `rank` gets the result, the other blocks stay as they were.
        let mut expect = send.clone();
        expect[rank * block..(rank + 1) * block].copy_from_slice(want);
        let mut buf = send.clone();
        comm.reduce_scatter_in_place(&mut buf, ReduceOp::Avg)
            .await
            .map_err(e("reduce_scatter_in_place"))?;
        same_avg("reduce_scatter_in_place", &buf, &expect)?;
        let mut zc = ZeroCopyBuffer::from(send.clone());
        comm.reduce_scatter_in_place_zero_copy(&mut zc, ReduceOp::Avg)
            .await
            .map_err(e("reduce_scatter_in_place_zero_copy"))?;
        same_avg("reduce_scatter_in_place_zero_copy", &zc[..], &expect)?;

        let zsend = ZeroCopyBuffer::from(send.clone());
        let mut zrecv = ZeroCopyBuffer::from(vec![half::f16::ZERO; block]);
        comm.reduce_scatter_zero_copy(&zsend, &mut zrecv, ReduceOp::Avg)
            .await
            .map_err(e("reduce_scatter_zero_copy"))?;
        same_avg("reduce_scatter_zero_copy", &zrecv[..], want)?;
        same_avg("reduce_scatter_zero_copy (send)", &zsend[..], &send)?;

        let got = comm
            .reduce_scatter_in(
                &HostBuffer(send.clone()),
                HostBuffer(vec![half::f16::ZERO; block]),
                ReduceOp::Avg,
            )
            .await
            .map_err(e("reduce_scatter_in"))?;
        same_avg("reduce_scatter_in", &got.0, want)?;
    }
    Ok(())
}

/// `ReduceOp::Avg` in f16 divides each contribution by the world size before the
/// reduction, so a mean whose plain sum passes 65504 comes out finite and exact (it came
/// out infinite when the sum was divided at the end), through every entry point that takes
/// `Avg`, on 3 and 4 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_avg_of_values_whose_sum_overflows_is_the_mean() {
    for world in [3, 4] {
        let cluster = Cluster::local(world).await.expect("cluster");
        let res = on_all_ranks(cluster.communicators(), DEADLINE, f16_avg_everywhere).await;
        nexar_tests::all_ok(&format!("f16 Avg, {world} ranks"), res);
        cluster.shutdown().await;
    }
}

/// `ReduceOp::Avg` through the non-blocking entry points (`all_reduce_nb`,
/// `reduce_scatter_nb`, which divide by the world size themselves) on six ranks, f32 and
/// bf16, against the exact average: with the default config (recursive doubling, rhd and
/// ring for these sizes), then with every threshold at zero so both run the pipelined
/// ring in 1 KiB chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avg_through_non_blocking_all_reduce_and_reduce_scatter_world_6() {
    let mut pipelined = NodeConfig::default();
    pipelined.collectives.tiny_bytes = 0;
    pipelined.collectives.small_bytes = 0;
    pipelined.collectives.pipeline_threshold_bytes = 0;
    pipelined.collectives.pipeline_chunk_bytes = 1024;
    for (name, config) in [("default", NodeConfig::default()), ("pipelined", pipelined)] {
        let cluster = Cluster::local_with(6, config).await.expect("cluster");
        let res = on_all_ranks(cluster.communicators(), DEADLINE, avg_non_blocking).await;
        nexar_tests::all_ok(&format!("Avg non-blocking, {name} config"), res);
        cluster.shutdown().await;
    }
}
