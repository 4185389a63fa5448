//! Shared helpers: integer-valued test data, sequential references, and a runner.

#![allow(dead_code, unreachable_pub)]

use nexar_collectives::{RankBuffers, Schedule, ScheduleError, SimNet, SimOutput};
use nexar_device::{fill_identity, finalize_bytes, reduce_bytes, DataType, ReduceOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn signed(dtype: DataType) -> bool {
    !matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64)
}

/// Encodes small integers as `dtype` elements (exactly representable in every type).
pub fn encode(dtype: DataType, vals: &[i64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DataType::F32 => out.extend((v as f32).to_le_bytes()),
            DataType::F64 => out.extend((v as f64).to_le_bytes()),
            DataType::F16 => out.extend(half::f16::from_f32(v as f32).to_le_bytes()),
            DataType::BF16 => out.extend(half::bf16::from_f32(v as f32).to_le_bytes()),
            DataType::I8 => out.extend((v as i8).to_le_bytes()),
            DataType::I32 => out.extend((v as i32).to_le_bytes()),
            DataType::I64 => out.extend(v.to_le_bytes()),
            DataType::U8 => out.extend((v as u8).to_le_bytes()),
            DataType::U32 => out.extend((v as u32).to_le_bytes()),
            DataType::U64 => out.extend((v as u64).to_le_bytes()),
        }
    }
    out
}

/// `n` integer-valued elements chosen so that any reduction of up to 16 ranks, in any
/// order, is exact in every type (f16 and bf16 included).
pub fn values(rng: &mut StdRng, dtype: DataType, op: ReduceOp, rank: usize, n: usize) -> Vec<u8> {
    let s = signed(dtype);
    let vals: Vec<i64> = (0..n)
        .map(|_| match op {
            ReduceOp::Sum | ReduceOp::Avg => {
                if s {
                    rng.gen_range(-8..=8)
                } else {
                    rng.gen_range(0..=8)
                }
            }
            ReduceOp::Prod => {
                // Magnitude 2 only on ranks 0..4: products stay within +-16.
                let two = rank < 4 && rng.gen_bool(0.3);
                let mag = if two { 2 } else { 1 };
                if s && rng.gen_bool(0.5) {
                    -mag
                } else {
                    mag
                }
            }
            ReduceOp::Min | ReduceOp::Max => {
                if s {
                    rng.gen_range(-100..=100)
                } else {
                    rng.gen_range(0..=200)
                }
            }
        })
        .collect();
    encode(dtype, &vals)
}

/// Random bytes that a collective must overwrite.
pub fn garbage(rng: &mut StdRng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.gen()).collect()
}

/// Sequential reduction of `parts` in order; an empty list gives the identity.
pub fn fold(dtype: DataType, op: ReduceOp, len: usize, parts: &[&[u8]]) -> Vec<u8> {
    let mut acc = vec![0u8; len];
    match parts.split_first() {
        None => fill_identity(dtype, op, &mut acc).unwrap(),
        Some((first, rest)) => {
            acc.copy_from_slice(first);
            for p in rest {
                reduce_bytes(dtype, op, &mut acc, p).unwrap();
            }
        }
    }
    acc
}

/// What the driver does after a reduction with `Avg`.
pub fn finalize(dtype: DataType, op: ReduceOp, buf: &mut [u8], world: usize) {
    finalize_bytes(dtype, op, buf, world).unwrap();
}

/// Builds one schedule per rank and runs them.
pub fn run(
    seed: u64,
    dtype: DataType,
    op: ReduceOp,
    world: usize,
    make: impl Fn(usize) -> Result<Box<dyn Schedule>, ScheduleError>,
    bufs: Vec<RankBuffers>,
    expect_name: Option<&str>,
) -> SimOutput {
    let schedules: Vec<_> = (0..world).map(|r| make(r).unwrap()).collect();
    if let Some(name) = expect_name {
        for s in &schedules {
            assert_eq!(s.name(), name);
        }
    }
    let name = schedules.first().map(|s| s.name()).unwrap_or("");
    match SimNet::new(seed).run(dtype, op, schedules, bufs) {
        Ok(out) => out,
        Err(e) => panic!("{name} world {world} {dtype:?} {op:?} seed {seed}: {e}"),
    }
}

/// Element counts worth testing for `world` ranks.
pub fn counts(world: usize, large: usize) -> Vec<usize> {
    let mut c = vec![0, 1, world.saturating_sub(1), world + 1, 97, large];
    c.sort_unstable();
    c.dedup();
    c
}

/// Valid ops for a dtype.
pub fn ops(dtype: DataType) -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|&op| nexar_device::check_op(dtype, op).is_ok())
        .collect()
}
