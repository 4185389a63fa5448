//! Shared helpers for nexar's workspace integration tests (in `tests/tests/`).

use std::future::Future;
use std::time::Duration;

/// Runs `f(comm)` on every rank concurrently and returns the results in rank order.
/// Panics if a rank's task panics or the whole run exceeds `deadline`.
pub async fn on_all_ranks<F, Fut, T>(
    comms: Vec<nexar_actors::Communicator>,
    deadline: Duration,
    f: F,
) -> Vec<T>
where
    F: Fn(nexar_actors::Communicator) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let handles: Vec<_> = comms.into_iter().map(|c| tokio::spawn(f(c))).collect();
    let all = async {
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            out.push(h.await.expect("rank task panicked"));
        }
        out
    };
    tokio::time::timeout(deadline, all)
        .await
        .expect("ranks did not finish before the deadline")
}

/// Deterministic test pattern: byte `i` of message `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

use nexar_device::{Element, ReduceOp};

/// Element types the tests build from small integers. Every value used is exactly
/// representable in every type, so float results can be compared exactly.
pub trait TestElement: Element {
    /// Converts a small integer (wrapping for unsigned types).
    fn from_i64(v: i64) -> Self;
}

macro_rules! test_ints {
    ($($t:ty),*) => {$(
        impl TestElement for $t {
            fn from_i64(v: i64) -> Self { v as $t }
        }
    )*};
}
test_ints!(i8, i32, i64, u8, u32, u64);

impl TestElement for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}
impl TestElement for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}
impl TestElement for half::f16 {
    fn from_i64(v: i64) -> Self {
        half::f16::from_f64(v as f64)
    }
}
impl TestElement for half::bf16 {
    fn from_i64(v: i64) -> Self {
        half::bf16::from_f64(v as f64)
    }
}

/// Rank-dependent input: element `i` of rank `rank` (products stay powers of two).
pub fn input<T: TestElement>(rank: usize, len: usize, op: ReduceOp) -> Vec<T> {
    (0..len)
        .map(|i| {
            let v = if op == ReduceOp::Prod {
                [-1i64, 1, 2][(rank * 5 + i * 7) % 3]
            } else {
                ((rank * 7 + i * 3 + 1) % 9) as i64 - 4
            };
            T::from_i64(v)
        })
        .collect()
}

/// Sequential reference: `op` folded over `inputs` in rank order (Avg finalised).
pub fn fold<T: TestElement>(inputs: &[Vec<T>], op: ReduceOp, divisor: usize) -> Vec<T> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        nexar_device::reduce_slice(op, &mut acc, x).expect("reference reduce");
    }
    nexar_device::finalize_slice(op, &mut acc, divisor).expect("reference finalize");
    acc
}
