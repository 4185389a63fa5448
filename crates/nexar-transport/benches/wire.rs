//! Cost of the wire codec: encoding and decoding a frame header, the per-frame work on
//! both the QUIC path and the trusted-fabric lane.

#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use nexar_transport::{FrameHeader, FrameKind};

fn header(c: &mut Criterion) {
    let mut g = c.benchmark_group("frame_header");
    let cases = [
        (
            "small_fields",
            FrameHeader::new(FrameKind::Data, 1, 2, 3, 4, 4096),
        ),
        (
            "large_fields",
            FrameHeader::new(
                FrameKind::Data,
                u64::MAX - 3,
                u64::MAX / 3,
                0xdead_beef_0000_0001,
                1 << 40,
                1 << 30,
            ),
        ),
    ];
    for (name, h) in cases {
        g.bench_function(format!("encode/{name}"), |b| {
            b.iter(|| black_box(h.encode()))
        });
        let bytes = h.encode();
        g.bench_function(format!("decode/{name}"), |b| {
            b.iter(|| black_box(FrameHeader::decode(&bytes[2..]).unwrap()))
        });
    }
    g.finish();
}

criterion_group!(benches, header);
criterion_main!(benches);
