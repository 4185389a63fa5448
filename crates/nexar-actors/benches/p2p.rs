//! Point-to-point throughput and latency between two ranks of an in-process cluster over
//! real QUIC on loopback. Prints medians (and min/max) over repeated runs.
//!
//! `cargo bench -p nexar-actors --bench p2p` (options: `-- --iters N --payload BYTES
//! --stream-window MIB`), used to choose `TransportConfig`'s defaults.

use std::time::{Duration, Instant};

use nexar_actors::{Cluster, Communicator, NodeConfig};

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn one_way(a: &Communicator, b: &Communicator, bytes: usize, msgs: usize) -> Duration {
    let payload = vec![0xA5u8; bytes];
    let b2 = b.clone();
    let start = Instant::now();
    let rx = tokio::spawn(async move {
        let mut buf = vec![0u8; bytes];
        for _ in 0..msgs {
            b2.recv(&mut buf, 0, 1).await.expect("recv");
        }
    });
    for _ in 0..msgs {
        a.send(&payload, 1, 1).await.expect("send");
    }
    rx.await.expect("receiver");
    start.elapsed()
}

async fn ping_pong(a: &Communicator, b: &Communicator, rounds: usize) -> Vec<Duration> {
    let b2 = b.clone();
    let echo = tokio::spawn(async move {
        let mut buf = [0u8; 8];
        for _ in 0..rounds {
            b2.recv(&mut buf, 0, 2).await.expect("recv");
            b2.send(&buf, 0, 2).await.expect("send");
        }
    });
    let mut rtts = Vec::with_capacity(rounds);
    let mut buf = [0u8; 8];
    for i in 0..rounds {
        let t = Instant::now();
        a.send(&(i as u64).to_le_bytes(), 1, 2).await.expect("send");
        a.recv(&mut buf, 1, 2).await.expect("recv");
        rtts.push(t.elapsed());
    }
    echo.await.expect("echo");
    rtts
}

fn arg(name: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != name).nth(1)
}

fn main() {
    let iters: usize = arg("--iters").and_then(|s| s.parse().ok()).unwrap_or(7);
    let mut config = NodeConfig::default();
    if let Some(p) = arg("--payload").and_then(|s| s.parse().ok()) {
        config.transport.max_udp_payload = p;
    }
    if let Some(w) = arg("--stream-window").and_then(|s| s.parse::<u32>().ok()) {
        config.transport.stream_window = w << 20;
    }
    println!(
        "config: max UDP payload {} B, stream window {} MiB, {} streams",
        config.transport.max_udp_payload,
        config.transport.stream_window >> 20,
        config.transport.max_streams
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let cluster = Cluster::local_with(2, config).await.expect("cluster");
        let comms = cluster.communicators();
        let (a, b) = (&comms[0], &comms[1]);
        one_way(a, b, 4 << 20, 16).await; // warm-up: MTU discovery, windows
        println!("{:>10} {:>6} {:>12} {:>12} {:>12}", "size", "msgs", "median GB/s", "min GB/s", "max GB/s");
        for (bytes, msgs) in [(4usize << 20, 64usize), (64 << 20, 4)] {
            let mut times: Vec<Duration> = Vec::new();
            for _ in 0..iters {
                times.push(one_way(a, b, bytes, msgs).await);
            }
            let total = (bytes * msgs) as f64;
            let gbps = |d: Duration| total / d.as_secs_f64() / 1e9;
            let med = median(&mut times);
            println!(
                "{:>10} {:>6} {:>12.3} {:>12.3} {:>12.3}",
                bytes,
                msgs,
                gbps(med),
                gbps(times[times.len() - 1]),
                gbps(times[0])
            );
        }
        let mut rtts = ping_pong(a, b, 2000).await;
        let med = median(&mut rtts);
        println!(
            "8 B ping-pong over 2000 rounds: median one-way latency {:.1} us (round trip {:.1} us, p10 {:.1} us, p90 {:.1} us)",
            med.as_secs_f64() * 1e6 / 2.0,
            med.as_secs_f64() * 1e6,
            rtts[rtts.len() / 10].as_secs_f64() * 1e6,
            rtts[rtts.len() * 9 / 10].as_secs_f64() * 1e6
        );
        cluster.shutdown().await;
    });
}
