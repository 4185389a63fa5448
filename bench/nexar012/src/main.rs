//! The nexar 0.1.2 crate's in-process all-reduce, timed like `nexar bench`: every rank
//! passes a barrier before each call, a call's time is the slowest rank's, and the row
//! reports the median over the timed calls; busbw = size / time x 2(n-1)/n.
//!
//! cargo run --release -- WORLD SIZE_BYTES [ITERS]   (NEXAR012_NO_BARRIER=1: no barriers)

use std::sync::Arc;
use std::time::Instant;

use nexar::{BufferRef, CpuAdapter, DataType, Host, NexarClient, ReduceOp};

#[tokio::main]
async fn main() -> nexar::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric arguments: WORLD SIZE_BYTES [ITERS]"))
        .collect();
    let (world, bytes, iters) = (args[0], args[1], args.get(2).copied().unwrap_or(10));
    let count = bytes / 4;
    // 0.1.2's barrier fails once its heartbeats start (a known bug of that crate):
    // NEXAR012_NO_BARRIER=1 times back-to-back calls instead.
    let barrier = std::env::var_os("NEXAR012_NO_BARRIER").is_none();
    let clients: Vec<Arc<NexarClient>> =
        NexarClient::bootstrap_local(world as u32, Arc::new(CpuAdapter::new()))
            .await?
            .into_iter()
            .map(Arc::new)
            .collect();
    let mut tasks = Vec::new();
    for c in clients {
        tasks.push(tokio::spawn(async move {
            let rank = c.rank() as usize;
            let mut data = vec![rank as f32 + 1.0; count];
            let mut times = Vec::new();
            for i in 0..iters + 3 {
                data.fill(rank as f32 + 1.0);
                if barrier {
                    c.barrier().await?;
                }
                let start = Instant::now();
                // SAFETY: `data` outlives the call and is not touched during it.
                let mut buf =
                    unsafe { BufferRef::<Host>::new(data.as_mut_ptr() as u64, count * 4) };
                c.all_reduce_host(&mut buf, count, DataType::F32, ReduceOp::Sum)
                    .await?;
                if i >= 3 {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            let want = (world * (world + 1) / 2) as f32;
            let ok = data.iter().all(|x| *x == want);
            nexar::Result::Ok((times, ok))
        }));
    }
    let mut per_rank = Vec::new();
    for t in tasks {
        per_rank.push(t.await.expect("rank task")?);
    }
    let ok = per_rank.iter().all(|(_, ok)| *ok);
    let mut slowest: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|(t, _)| t[i]).fold(0.0, f64::max))
        .collect();
    slowest.sort_by(f64::total_cmp);
    // The lower of the middle two, as `nexar bench` takes it.
    let median = slowest[(iters.max(1) - 1) / 2];
    let busbw = bytes as f64 / median / 1e9 * 2.0 * (world - 1) as f64 / world as f64;
    println!(
        "nexar-0.1.2 all_reduce world {world} bytes {bytes}: median {:.1} us, busbw {busbw:.3} GB/s, check {}",
        median * 1e6,
        if ok { "ok" } else { "WRONG" }
    );
    Ok(())
}
