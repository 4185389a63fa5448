//! Cost of the sans-IO schedules (building one and stepping it to completion, as a driver
//! does, with every action completed at once) and of the sparse compression codec.

#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nexar_collectives::{
    all_gather, all_reduce, broadcast, compress, decode, encode, Algorithm, Codec,
    CollectiveConfig, Schedule,
};
use nexar_device::{DataType, ReduceOp};

/// Steps `s` to completion; returns the number of actions issued.
fn drive(mut s: Box<dyn Schedule>) -> usize {
    let mut ready = Vec::new();
    let mut issued = 0;
    loop {
        ready.clear();
        s.poll(&mut ready);
        if ready.is_empty() {
            assert!(s.is_done(), "a schedule stalled with nothing ready");
            return issued;
        }
        issued += ready.len();
        for a in &ready {
            s.complete(a.id()).unwrap();
        }
    }
}

fn schedules(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule");
    let default = CollectiveConfig::default();
    let mut ring = CollectiveConfig::default();
    ring.algorithm = Some(Algorithm::Ring);
    let cases: [(&str, usize, usize, &CollectiveConfig); 5] = [
        ("all_reduce_4KiB", 8, 1 << 10, &default),
        ("all_reduce_4MiB_ring", 8, 1 << 20, &ring),
        ("all_reduce_64MiB_pipelined", 8, 16 << 20, &default),
        ("all_reduce_64MiB_pipelined", 64, 16 << 20, &default),
        ("all_reduce_4MiB_ring", 64, 1 << 20, &ring),
    ];
    for (name, world, count, cfg) in cases {
        g.bench_with_input(BenchmarkId::new(name, world), &world, |b, &world| {
            b.iter(|| {
                let s = all_reduce(3, world, count, DataType::F32, ReduceOp::Sum, cfg).unwrap();
                black_box(drive(s))
            })
        });
    }
    for world in [8, 64] {
        g.bench_with_input(
            BenchmarkId::new("broadcast_4MiB", world),
            &world,
            |b, &w| {
                b.iter(|| {
                    black_box(drive(
                        broadcast(3, w, 1 << 20, DataType::F32, 0, &default).unwrap(),
                    ))
                })
            },
        );
        g.bench_with_input(
            BenchmarkId::new("all_gather_4MiB", world),
            &world,
            |b, &w| {
                b.iter(|| {
                    black_box(drive(
                        all_gather(3, w, (1 << 20) / w, DataType::F32, &default).unwrap(),
                    ))
                })
            },
        );
    }
    g.finish();
}

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec");
    let n = 1 << 20;
    let data: Vec<f32> = (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) % 10_007) as f32 - 5_000.0)
        .collect();
    g.throughput(Throughput::Bytes((n * 4) as u64));
    for ratio in [0.01, 0.1] {
        let codec = Codec::top_k(ratio).unwrap();
        g.bench_with_input(
            BenchmarkId::new("top_k_compress", ratio),
            &codec,
            |b, codec| b.iter(|| black_box(compress(codec, 0, &data).unwrap())),
        );
        let sparse = compress(&codec, 0, &data).unwrap();
        g.bench_with_input(BenchmarkId::new("encode", ratio), &sparse, |b, s| {
            b.iter(|| black_box(encode(s)))
        });
        let wire = encode(&sparse);
        g.bench_with_input(BenchmarkId::new("decode", ratio), &wire, |b, w| {
            b.iter(|| black_box(decode::<f32>(w, n).unwrap()))
        });
    }
    g.finish();
}

criterion_group!(benches, schedules, codec);
criterion_main!(benches);
