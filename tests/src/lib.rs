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
