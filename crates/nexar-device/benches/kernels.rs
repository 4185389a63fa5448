//! Throughput of the reduction kernels against a plain copy of the same bytes, and of
//! `copy_bytes` against `memcpy` where the destination starts 0 or 16 bytes past the
//! source modulo 4096 (the second is where glibc's `rep movsb` crawls on AMD CPUs).
//!
//! Throughput is the size of one buffer per iteration: a reduction reads `dst` and `src` and
//! writes `dst` (3 bytes of traffic per byte reported), a copy reads one and writes one
//! (2 per byte), so a reduction "at memory speed" reports about 2/3 of the copy figure.

#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nexar_device::{
    copy_bytes, copy_bytes_streaming, reduce_bytes, reduce_onto_bytes, reduce_onto_bytes_streaming,
    DataType, ReduceOp,
};

/// In the L1 cache, past the L2 cache of a core here (2 MiB), and a large collective's
/// buffer (`bench/tables.py ceiling` takes its copy and reduction speeds from here).
const SIZES: [(usize, &str); 3] = [(64 << 10, "64KiB"), (4 << 20, "4MiB"), (64 << 20, "64MiB")];

/// `reduce_onto_bytes` and its streaming form.
type Onto =
    fn(DataType, ReduceOp, &mut [u8], &[u8], &[u8]) -> Result<(), nexar_device::DeviceError>;

/// A received piece: one 65000-byte datagram's stream data, about (a multiple of 8 here).
const PIECE: usize = 64_960;

/// An 8-byte-aligned byte buffer with one spare byte, so `offset` 1 gives an unaligned view.
fn buffer(len: usize, seed: u64) -> Vec<u64> {
    (0..len / 8 + 1)
        .map(|i| {
            // Small, finite values for every type: no NaN or subnormal slow paths.
            (i as u64 ^ seed).wrapping_mul(0x0101_0101_0101_0101) & 0x3F3F_3F3F_3F3F_3F3F
        })
        .collect()
}

fn bytes(words: &[u64], offset: usize, len: usize) -> &[u8] {
    &bytemuck::cast_slice(words)[offset..offset + len]
}

fn bytes_mut(words: &mut [u64], offset: usize, len: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut(words)[offset..offset + len]
}

fn kernels(c: &mut Criterion) {
    let cases = [
        (DataType::F32, ReduceOp::Sum, 0, "f32_sum"),
        (DataType::F64, ReduceOp::Sum, 0, "f64_sum"),
        (DataType::BF16, ReduceOp::Sum, 0, "bf16_sum"),
        (DataType::F16, ReduceOp::Sum, 0, "f16_sum"),
        (DataType::I32, ReduceOp::Sum, 0, "i32_sum"),
        (DataType::F32, ReduceOp::Max, 0, "f32_max"),
        (DataType::F32, ReduceOp::Sum, 1, "f32_sum_unaligned_src"),
        (DataType::BF16, ReduceOp::Sum, 1, "bf16_sum_unaligned_src"),
    ];
    for (len, label) in SIZES {
        let mut group = c.benchmark_group(format!("kernels/{label}"));
        group.throughput(Throughput::Bytes(len as u64));
        let src = buffer(len, 1);
        let mut dst = buffer(len, 2);
        for (dtype, op, src_offset, name) in cases {
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    // Sum keeps growing the values; fine for timing (no traps, and finite
                    // floats stay finite long enough at these magnitudes or saturate to inf,
                    // which costs the same).
                    reduce_bytes(
                        dtype,
                        op,
                        bytes_mut(&mut dst, 0, len),
                        black_box(bytes(&src, src_offset, len)),
                    )
                    .unwrap();
                })
            });
        }
        group.bench_function(BenchmarkId::from_parameter("f32_sum_unaligned_both"), |b| {
            b.iter(|| {
                reduce_bytes(
                    DataType::F32,
                    ReduceOp::Sum,
                    bytes_mut(&mut dst, 1, len),
                    black_box(bytes(&src, 3, len)),
                )
                .unwrap();
            })
        });
        // Reduce-scatter's receive: a block of the rank's input, reduced with a received
        // piece (unaligned, as it usually is) into the output. One fused pass against a
        // copy of the base followed by the reduction.
        let base = buffer(len, 3);
        // The same into a result nothing reads soon: streaming stores.
        for (name, kernel) in [
            ("f32_sum_onto", reduce_onto_bytes as Onto),
            ("f32_sum_onto_streaming", reduce_onto_bytes_streaming),
        ] {
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    kernel(
                        DataType::F32,
                        ReduceOp::Sum,
                        bytes_mut(&mut dst, 0, len),
                        bytes(&base, 0, len),
                        black_box(bytes(&src, 1, len)),
                    )
                    .unwrap();
                })
            });
        }
        // Reduce-scatter's receive as a collective runs it: a received message's pieces
        // (one datagram's worth each, just decrypted, so in the cache) reduced with the
        // rank's input into the result, through the cache and with streaming stores.
        let piece = buffer(PIECE, 4);
        for (name, kernel) in [
            ("f32_sum_onto_pieces", reduce_onto_bytes as Onto),
            ("f32_sum_onto_pieces_streaming", reduce_onto_bytes_streaming),
        ] {
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    for at in (0..len).step_by(PIECE) {
                        let n = PIECE.min(len - at);
                        kernel(
                            DataType::F32,
                            ReduceOp::Sum,
                            bytes_mut(&mut dst, at, n),
                            bytes(&base, at, n),
                            black_box(bytes(&piece, 0, n)),
                        )
                        .unwrap();
                    }
                })
            });
        }
        group.bench_function(
            BenchmarkId::from_parameter("f32_sum_copy_then_reduce"),
            |b| {
                b.iter(|| {
                    copy_bytes(bytes_mut(&mut dst, 0, len), bytes(&base, 0, len));
                    reduce_bytes(
                        DataType::F32,
                        ReduceOp::Sum,
                        bytes_mut(&mut dst, 0, len),
                        black_box(bytes(&src, 1, len)),
                    )
                    .unwrap();
                })
            },
        );
        // The copy to compare with is `copy_bytes`: these two buffers are allocated one
        // after the other, which puts `dst` 16 bytes past `src` modulo 4096, where
        // `memcpy` crawls on AMD CPUs (the `copy/` group).
        group.bench_function(BenchmarkId::from_parameter("copy"), |b| {
            b.iter(|| {
                copy_bytes(bytes_mut(&mut dst, 0, len), black_box(bytes(&src, 0, len)));
            })
        });
        // What a large receive into a result costs: the copy with streaming stores.
        group.bench_function(BenchmarkId::from_parameter("copy_streaming"), |b| {
            b.iter(|| {
                copy_bytes_streaming(bytes_mut(&mut dst, 0, len), black_box(bytes(&src, 0, len)));
            })
        });
        group.finish();
    }
}

fn copies(c: &mut Criterion) {
    for (len, label) in SIZES {
        let mut group = c.benchmark_group(format!("copy/{label}"));
        group.throughput(Throughput::Bytes(len as u64));
        // Source at byte 0 of one buffer, destination `skew` bytes past the next multiple
        // of 4096 after it, so the two differ by `skew` modulo 4096.
        let apart = len.next_multiple_of(4096) + 4096;
        let mut words = buffer(apart + len + 64, 3);
        for skew in [0, 16] {
            let (src, dst) = bytemuck::cast_slice_mut::<u64, u8>(&mut words).split_at_mut(apart);
            let (src, dst) = (&src[..len], &mut dst[skew..skew + len]);
            group.bench_function(BenchmarkId::new("memcpy", skew), |b| {
                b.iter(|| dst.copy_from_slice(black_box(&*src)))
            });
            group.bench_function(BenchmarkId::new("copy_bytes", skew), |b| {
                b.iter(|| copy_bytes(dst, black_box(&*src)))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, kernels, copies);
criterion_main!(benches);
