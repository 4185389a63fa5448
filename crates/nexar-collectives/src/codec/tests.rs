#![allow(clippy::unwrap_used)]

use half::{bf16, f16};
use nexar_device::DataType;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

fn from_f64<T: CompressElement>(x: f64) -> T {
    T::narrow(T::Wide::from_f64(x))
}

fn to_f64<T: CompressElement>(x: T) -> f64 {
    x.widen().to_f64()
}

fn random_vec<T: CompressElement>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n).map(|_| from_f64(rng.gen_range(-4.0..4.0))).collect()
}

/// Few distinct magnitudes, so that the threshold is usually tied.
fn tied_vec<T: CompressElement>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| from_f64(f64::from(rng.gen_range(-3i32..=3))))
        .collect()
}

/// Top-k by a full sort on (magnitude descending, index ascending).
fn reference_top_k<T: CompressElement>(data: &[T], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..data.len() as u32).collect();
    order.sort_by(|&a, &b| {
        let (ma, mb) = (
            data[a as usize].widen().abs(),
            data[b as usize].widen().abs(),
        );
        mb.total_cmp(&ma).then(a.cmp(&b))
    });
    order.truncate(k);
    order.sort_unstable();
    order
}

fn check_top_k<T: CompressElement>() {
    let mut rng = StdRng::seed_from_u64(1);
    for n in [1, 2, 7, 100, 1000, 4097] {
        for ratio in [0.001, 0.01, 0.1, 0.5, 0.99, 1.0] {
            let codec = Codec::top_k(ratio).unwrap();
            let k = codec.k(n);
            for data in [random_vec::<T>(&mut rng, n), tied_vec::<T>(&mut rng, n)] {
                let s = compress(&codec, 0, &data).unwrap();
                assert_eq!(s.nnz(), k);
                assert_eq!(
                    s.indices(),
                    reference_top_k(&data, k),
                    "n {n} ratio {ratio}"
                );
                for (&i, &v) in s.indices().iter().zip(s.values()) {
                    assert_eq!(v, data[i as usize]);
                }
            }
        }
    }
}

#[test]
fn top_k_picks_the_k_largest_magnitudes() {
    check_top_k::<f32>();
    check_top_k::<f64>();
    check_top_k::<f16>();
    check_top_k::<bf16>();
}

#[test]
fn top_k_sends_nan_and_infinities_first() {
    let data = [1.0f32, f32::NAN, -f32::INFINITY, 3.0, -0.0];
    let s = compress(&Codec::top_k(0.4).unwrap(), 0, &data).unwrap();
    assert_eq!(s.indices(), [1, 2]);
}

#[test]
fn ratio_is_validated_and_k_rounds_up() {
    for bad in [0.0, -0.5, 1.0001, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            Codec::top_k(bad),
            Err(CodecError::InvalidRatio(_))
        ));
        assert!(Codec::random_k(bad, 3).is_err());
    }
    let c = Codec::top_k(0.1).unwrap();
    assert_eq!(
        (c.k(0), c.k(1), c.k(9), c.k(10), c.k(11), c.k(1000)),
        (0, 1, 1, 1, 2, 100)
    );
    assert_eq!(Codec::top_k(1.0).unwrap().k(5), 5);
    assert_eq!(Codec::top_k(1e-12).unwrap().k(5), 1);
    // Decimal ratios whose f64 product lands a hair above a whole number.
    for (ratio, n, k) in [
        (0.07, 100, 7),
        (0.14, 100, 14),
        (0.55, 100, 55),
        (0.56, 100, 56),
    ] {
        assert_eq!(Codec::top_k(ratio).unwrap().k(n), k, "{ratio} of {n}");
    }
    assert_eq!(Codec::top_k(0.071).unwrap().k(100), 8);
    assert_eq!(c.wire_bytes(1000, DataType::F32), 12 + 100 * 8);
    assert_eq!(c.wire_bytes(1000, DataType::BF16), 12 + 100 * 6);
}

#[test]
fn empty_tensor_compresses_to_nothing() {
    let codec = Codec::random_k(0.5, 1).unwrap();
    let s = compress::<f32>(&codec, 0, &[]).unwrap();
    assert!(s.is_empty() && s.nnz() == 0);
    let bytes = encode(&s);
    assert_eq!(bytes.len(), codec.wire_bytes(0, DataType::F32));
    assert_eq!(decode::<f32>(&bytes, 0).unwrap(), s);
}

#[test]
fn random_k_is_reproducible_and_varies_by_step_and_seed() {
    let data: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let codec = Codec::random_k(0.05, 42).unwrap();
    let a = compress(&codec, 7, &data).unwrap();
    assert_eq!(a.nnz(), 50);
    assert_eq!(a, compress(&codec, 7, &data).unwrap());
    assert_ne!(a.indices(), compress(&codec, 8, &data).unwrap().indices());
    let other_seed = Codec::random_k(0.05, 43).unwrap();
    assert_ne!(
        a.indices(),
        compress(&other_seed, 7, &data).unwrap().indices()
    );
    // Indices do not depend on the values or the element type.
    let halves: Vec<f16> = vec![f16::ONE; 1000];
    assert_eq!(compress(&codec, 7, &halves).unwrap().indices(), a.indices());
    // Sparse invariants hold (strictly increasing, in range).
    assert!(Sparse::new(1000, a.indices().to_vec(), a.values().to_vec()).is_ok());
}

#[test]
fn random_k_is_unbiased_and_uniform() {
    let n = 200;
    let calls = 4000;
    let mut rng = StdRng::seed_from_u64(5);
    let data: Vec<f64> = random_vec(&mut rng, n);
    let codec = Codec::random_k(0.1, 9).unwrap();
    let mut mean = vec![0.0f64; n];
    let mut hits = vec![0u32; n];
    for step in 0..calls {
        let s = compress(&codec, step, &data).unwrap();
        for &i in s.indices() {
            hits[i as usize] += 1;
        }
        accumulate(&mut mean, &s).unwrap();
    }
    mean.iter_mut().for_each(|m| *m /= calls as f64);
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = mean.iter().zip(&data).map(|(m, x)| m - x).collect();
    // Expected relative error sqrt((n/k - 1) / calls) = 0.047.
    let rel = norm(&diff) / norm(&data);
    assert!(rel < 0.08, "relative error of the mean {rel}");
    // Each index is kept with probability k/n = 0.1: 400 of 4000, sd 19.
    assert!(hits.iter().all(|&h| (300..500).contains(&h)), "{hits:?}");
}

#[test]
fn random_k_with_feedback_sends_unscaled_values() {
    let data = vec![2.0f32; 100];
    let codec = Codec::random_k(0.1, 1).unwrap();
    let mut r = Residual::new(100);
    let s = compress_with_feedback(&codec, 0, &data, &mut r).unwrap();
    assert!(s.values().iter().all(|&v| v == 2.0));
    let unbiased = compress(&codec, 0, &data).unwrap();
    assert_eq!(unbiased.indices(), s.indices());
    assert!(unbiased.values().iter().all(|&v| v == 20.0));
}

/// Over many calls, everything sent plus the final residual is the sum of the inputs.
fn check_feedback_conserves<T: CompressElement>(codec: Codec, tol: f64) {
    let n = 300;
    let mut rng = StdRng::seed_from_u64(11);
    let mut residual = Residual::<T>::new(n);
    let mut inputs = vec![0.0f64; n];
    let mut sent = vec![0.0f64; n];
    for step in 0..50 {
        let x: Vec<T> = random_vec(&mut rng, n);
        for (s, &v) in inputs.iter_mut().zip(&x) {
            *s += to_f64(v);
        }
        let sparse = compress_with_feedback(&codec, step, &x, &mut residual).unwrap();
        assert_eq!(sparse.nnz(), codec.k(n));
        for (&i, &v) in sparse.indices().iter().zip(sparse.values()) {
            sent[i as usize] += to_f64(v);
        }
    }
    let worst = (0..n)
        .map(|i| (sent[i] + residual.as_slice()[i].to_f64() - inputs[i]).abs())
        .fold(0.0, f64::max);
    assert!(worst <= tol, "{:?} {codec:?}: off by {worst}", T::DTYPE);
    // And it did delay something.
    assert!(residual.as_slice().iter().any(|r| r.to_f64() != 0.0));
}

#[test]
fn error_feedback_loses_nothing() {
    for codec in [
        Codec::top_k(0.1).unwrap(),
        Codec::random_k(0.05, 3).unwrap(),
    ] {
        check_feedback_conserves::<f64>(codec, 1e-11);
        check_feedback_conserves::<f32>(codec, 1e-3);
        check_feedback_conserves::<f16>(codec, 1e-3);
        check_feedback_conserves::<bf16>(codec, 1e-3);
    }
}

/// An infinite input that is sent leaves nothing behind: the next call sends the largest
/// of the others (its residual used to become NaN, which ranks first and was sent on
/// every later call, crowding the rest out).
#[test]
fn a_non_finite_value_sent_leaves_a_zero_residual() {
    let codec = Codec::top_k(0.5).unwrap();
    let mut r = Residual::<f32>::new(2);
    let first = compress_with_feedback(&codec, 0, &[f32::INFINITY, 1.0], &mut r).unwrap();
    assert_eq!(first.indices(), [0]);
    assert_eq!(r.as_slice(), [0.0, 1.0]);
    let second = compress_with_feedback(&codec, 1, &[0.0, 1.0], &mut r).unwrap();
    assert_eq!((second.indices(), second.values()), (&[1][..], &[2.0][..]));
    // An f16 sum past its range goes out as infinity, and leaves 0 too: 40000 kept
    // back, then 40000 more.
    let mut h = Residual::<f16>::new(2);
    let f = f16::from_f32;
    let first = compress_with_feedback(&codec, 0, &[f(40000.0), f(50000.0)], &mut h).unwrap();
    assert_eq!(first.indices(), [1]);
    let over = compress_with_feedback(&codec, 1, &[f(40000.0), f(1.0)], &mut h).unwrap();
    assert_eq!(over.indices(), [0]);
    assert!(over.values()[0].is_infinite());
    assert_eq!(h.as_slice(), [0.0, 1.0]);
}

#[test]
fn feedback_rejects_wrong_residual_length_untouched() {
    let mut r = Residual::<f32>::new(3);
    let codec = Codec::top_k(0.5).unwrap();
    compress_with_feedback(&codec, 0, &[1.0, 2.0, 3.0], &mut r).unwrap();
    let before = r.clone();
    assert_eq!(
        compress_with_feedback(&codec, 1, &[1.0, 2.0], &mut r),
        Err(CodecError::LengthMismatch {
            expected: 2,
            actual: 3
        })
    );
    assert_eq!(r, before);
    r.reset();
    assert!(r.as_slice().iter().all(|&x| x == 0.0));
}

fn check_round_trip<T: CompressElement>() {
    let mut rng = StdRng::seed_from_u64(3);
    for n in [1, 5, 257] {
        let data: Vec<T> = random_vec(&mut rng, n);
        for codec in [
            Codec::top_k(0.3).unwrap(),
            Codec::random_k(0.3, 8).unwrap(),
            Codec::top_k(1.0).unwrap(),
        ] {
            let s = compress(&codec, 1, &data).unwrap();
            let bytes = encode(&s);
            assert_eq!(bytes.len(), codec.wire_bytes(n, T::DTYPE));
            assert_eq!(bytes.len(), s.encoded_len());
            let back = decode::<T>(&bytes, n).unwrap();
            assert_eq!(back.indices(), s.indices());
            // Bitwise, so NaN payloads would count too.
            let bits = |v: &[T]| -> Vec<u8> {
                let mut out = Vec::new();
                v.iter().for_each(|x| x.write_le(&mut out));
                out
            };
            assert_eq!(bits(back.values()), bits(s.values()));
        }
    }
}

#[test]
fn encode_decode_round_trip() {
    check_round_trip::<f32>();
    check_round_trip::<f64>();
    check_round_trip::<f16>();
    check_round_trip::<bf16>();
}

#[test]
fn encoding_layout_is_little_endian() {
    let s = Sparse::new(5, vec![1, 4], vec![1.0f32, -2.0]).unwrap();
    let mut expect = vec![5, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 4, 0, 0, 0];
    expect.extend_from_slice(&1.0f32.to_le_bytes());
    expect.extend_from_slice(&(-2.0f32).to_le_bytes());
    assert_eq!(encode(&s), expect);
}

/// A hand-built f32 encoding: header fields, indices, `values` f32 values.
fn raw(count: u32, k: u32, tag: u8, indices: &[u32], values: usize) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(&k.to_le_bytes());
    b.extend_from_slice(&[tag, 0, 0, 0]);
    indices
        .iter()
        .for_each(|i| b.extend_from_slice(&i.to_le_bytes()));
    (0..values).for_each(|v| b.extend_from_slice(&(v as f32).to_le_bytes()));
    b
}

#[test]
fn decode_rejects_malformed_input() {
    use CodecError::*;
    let good = raw(10, 2, 1, &[3, 7], 2);
    assert_eq!(decode::<f32>(&good, 10).unwrap().indices(), [3, 7]);
    let dec = |b: &[u8]| decode::<f32>(b, 10).unwrap_err();

    assert_eq!(
        dec(&good[..5]),
        Truncated {
            needed: 12,
            actual: 5
        }
    );
    assert_eq!(
        dec(&good[..good.len() - 1]),
        Truncated {
            needed: 28,
            actual: 27
        }
    );
    let mut extra = good.clone();
    extra.push(0);
    assert_eq!(
        dec(&extra),
        TrailingBytes {
            expected: 28,
            actual: 29
        }
    );
    assert_eq!(
        dec(&raw(10, 11, 1, &[0; 11], 11)),
        TooManyEntries { k: 11, len: 10 }
    );
    assert_eq!(
        dec(&raw(10, 2, 1, &[3, 10], 2)),
        IndexOutOfRange { index: 10, len: 10 }
    );
    assert_eq!(
        dec(&raw(10, 2, 1, &[3, u32::MAX], 2)),
        IndexOutOfRange {
            index: u32::MAX,
            len: 10
        }
    );
    assert_eq!(dec(&raw(10, 2, 1, &[4, 4], 2)), DuplicateIndex { index: 4 });
    assert_eq!(
        dec(&raw(10, 2, 1, &[5, 4], 2)),
        UnsortedIndices {
            previous: 5,
            index: 4
        }
    );
    assert_eq!(
        dec(&raw(11, 2, 1, &[3, 7], 2)),
        CountMismatch {
            expected: 10,
            actual: 11
        }
    );
    assert_eq!(
        dec(&raw(10, 2, 3, &[3, 7], 2)),
        DataTypeMismatch {
            expected: DataType::F32,
            found: 3
        }
    );
    let mut reserved = good.clone();
    reserved[10] = 1;
    assert_eq!(dec(&reserved), ReservedNonZero);
    // Where several problems coincide, the first in the documented order is reported:
    // the type before the count, the count before `k`, `k` before the length.
    assert_eq!(
        dec(&raw(11, 2, 3, &[3, 7], 2)),
        DataTypeMismatch {
            expected: DataType::F32,
            found: 3
        }
    );
    let mut reserved_and_count = raw(11, 2, 1, &[3, 7], 2);
    reserved_and_count[9] = 1;
    assert_eq!(dec(&reserved_and_count), ReservedNonZero);
    assert_eq!(
        dec(&raw(11, 12, 1, &[], 0)),
        CountMismatch {
            expected: 10,
            actual: 11
        }
    );
    assert_eq!(
        dec(&raw(10, 11, 1, &[], 0)),
        TooManyEntries { k: 11, len: 10 }
    );
    // A huge k with a short body is caught by length before anything is allocated.
    assert_eq!(
        decode::<f32>(&raw(u32::MAX, u32::MAX, 1, &[], 0), u32::MAX as usize).unwrap_err(),
        Truncated {
            needed: 12 + u32::MAX as usize * 8,
            actual: 12
        }
    );
    // Same size, other type: the tag tells f16 from bf16.
    let h = encode(&Sparse::new(3, vec![0], vec![f16::ONE]).unwrap());
    assert_eq!(
        decode::<bf16>(&h, 3).unwrap_err(),
        DataTypeMismatch {
            expected: DataType::BF16,
            found: 3
        }
    );
}

#[test]
fn sparse_new_validates() {
    use CodecError::*;
    assert_eq!(
        Sparse::new(4, vec![0, 1], vec![1.0f32]).unwrap_err(),
        LengthMismatch {
            expected: 2,
            actual: 1
        }
    );
    assert_eq!(
        Sparse::new(4, vec![0, 4], vec![1.0f32, 2.0]).unwrap_err(),
        IndexOutOfRange { index: 4, len: 4 }
    );
    assert_eq!(
        Sparse::new(4, vec![2, 2], vec![1.0f32, 2.0]).unwrap_err(),
        DuplicateIndex { index: 2 }
    );
    assert_eq!(
        Sparse::new(1, vec![0, 0], vec![1.0f32, 2.0]).unwrap_err(),
        TooManyEntries { k: 2, len: 1 }
    );
    let s = Sparse::new(4, vec![1, 3], vec![1.0f32, 2.0]).unwrap();
    assert_eq!(s.to_dense(), [0.0, 1.0, 0.0, 2.0]);
}

#[test]
fn accumulate_adds_and_checks_length() {
    let s = Sparse::new(4, vec![1, 3], vec![1.5f32, -2.0]).unwrap();
    let mut dense = [1.0f32; 4];
    accumulate(&mut dense, &s).unwrap();
    assert_eq!(dense, [1.0, 2.5, 1.0, -1.0]);
    let mut short = [0.0f32; 3];
    assert_eq!(
        accumulate(&mut short, &s),
        Err(CodecError::LengthMismatch {
            expected: 3,
            actual: 4
        })
    );
    assert_eq!(short, [0.0; 3]);
}

#[test]
fn accumulate_half_types_round_to_nearest_even_through_f32() {
    let mut rng = StdRng::seed_from_u64(4);
    for _ in 0..2000 {
        let (a, b) = (rng.gen::<u16>(), rng.gen::<u16>());
        let (fa, fb) = (f16::from_bits(a), f16::from_bits(b));
        let mut d = [fa];
        accumulate(&mut d, &Sparse::new(1, vec![0], vec![fb]).unwrap()).unwrap();
        let want = f16::from_f32(fa.to_f32() + fb.to_f32());
        assert!(d[0].to_bits() == want.to_bits() || (d[0].is_nan() && want.is_nan()));
        let (ba, bb) = (bf16::from_bits(a), bf16::from_bits(b));
        let mut d = [ba];
        accumulate(&mut d, &Sparse::new(1, vec![0], vec![bb]).unwrap()).unwrap();
        let want = bf16::from_f32(ba.to_f32() + bb.to_f32());
        assert!(d[0].to_bits() == want.to_bits() || (d[0].is_nan() && want.is_nan()));
    }
}

proptest! {
    // A fixed seed: the same cases on every run (a failure found once is found again).
    #![proptest_config(ProptestConfig {
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x006e_6578_6172),
        ..ProptestConfig::default()
    })]

    #[test]
    fn decode_never_panics_on_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..128),
        expected in 0usize..64,
    ) {
        let _ = decode::<f32>(&bytes, expected);
        let _ = decode::<f16>(&bytes, expected);
        let _ = decode::<f64>(&bytes, expected);
    }

    /// Plausible headers, so that the body checks are reached too.
    #[test]
    fn decode_never_panics_past_the_header(
        count in 0u32..16,
        k in 0u32..20,
        body in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut bytes = raw(count, k, 1, &[], 0);
        bytes.extend_from_slice(&body);
        if let Ok(s) = decode::<f32>(&bytes, count as usize) {
            prop_assert_eq!(encode(&s), bytes);
        }
    }

    #[test]
    fn any_valid_sparse_round_trips(
        mask in proptest::collection::vec(any::<Option<u16>>(), 0..64),
    ) {
        let (indices, values): (Vec<u32>, Vec<bf16>) = mask
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.map(|v| (i as u32, bf16::from_bits(v))))
            .unzip();
        let s = Sparse::new(mask.len(), indices, values).unwrap();
        let back = decode::<bf16>(&encode(&s), mask.len()).unwrap();
        prop_assert_eq!(back.indices(), s.indices());
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(back.values()), bits(s.values()));
    }
}
