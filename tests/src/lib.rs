//! Shared helpers for nexar's workspace integration tests (in `tests/tests/`).

pub mod faults;
pub mod seeded;

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

/// Deadline a test gives one call, or one step, that must end on its own: well under the
/// library's default `op_timeout` (120 s), so that a call waiting that out fails here, with
/// a message naming it, rather than at the library's deadline (or never).
pub const STEP_DEADLINE: Duration = Duration::from_secs(60);

/// Joins a thread that must end on its own (one making blocking calls); panics naming
/// `what` if it has not ended within [`STEP_DEADLINE`], or if it panicked.
pub fn join_within<T>(what: &str, thread: std::thread::JoinHandle<T>) -> T {
    let deadline = std::time::Instant::now() + STEP_DEADLINE;
    while !thread.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not done within {STEP_DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    thread
        .join()
        .unwrap_or_else(|_| panic!("{what}: the thread panicked"))
}

/// Awaits `fut`; panics naming `what` if it has not finished within [`STEP_DEADLINE`].
pub async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(STEP_DEADLINE, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: not done within {STEP_DEADLINE:?}"))
}

/// Waits until `done()` holds, looking every 2 ms, for at most [`STEP_DEADLINE`]; panics
/// with `what()` (read at the deadline, so it can say how far things got) otherwise.
pub async fn until(what: impl Fn() -> String, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + STEP_DEADLINE;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "{}", what());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
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

use nexar_actors::Communicator;
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

/// Sequential reference: `op` folded over `inputs` in rank order (Avg finalised; in f16
/// each input divided by `divisor` first and then summed, as `ReduceOp::Avg` says).
pub fn fold<T: TestElement>(inputs: &[Vec<T>], op: ReduceOp, divisor: usize) -> Vec<T> {
    if f16_avg::<T>(op) {
        let scaled: Vec<Vec<T>> = inputs
            .iter()
            .map(|x| {
                let mut x = x.clone();
                nexar_device::finalize_slice(op, &mut x, divisor).expect("reference scaling");
                x
            })
            .collect();
        return fold(&scaled, ReduceOp::Sum, 1);
    }
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        nexar_device::reduce_slice(op, &mut acc, x).expect("reference reduce");
    }
    nexar_device::finalize_slice(op, &mut acc, divisor).expect("reference finalize");
    acc
}

/// The reduce ops defined for `T`.
fn ops_for<T: TestElement>() -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|op| nexar_device::check_op(T::DTYPE, *op).is_ok())
        .collect()
}

/// Whether `op` on `T` is f16's Avg, which divides each contribution before the sum: the
/// divided inputs are not all exact, so the result's rounding depends on the order the
/// algorithm adds them in.
fn f16_avg<T: TestElement>(op: ReduceOp) -> bool {
    op == ReduceOp::Avg && T::DTYPE == nexar_device::DataType::F16
}

/// `got == want`, but for f16's Avg ([`f16_avg`]) within 2^-6 per element: [`input`]'s
/// values are at most 4 in magnitude, so each rounding of a sum of divided inputs (under
/// 4) is at most 2^-10, and `world` ranks round `world - 1` times in the result and as
/// often in the reference (under 2^-6 up to 8 ranks). A contribution lost or counted
/// twice moves an element by at least 1 / `world`.
fn same_for<T: TestElement>(op: ReduceOp, what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if !f16_avg::<T>(op) || got.len() != want.len() {
        return same(what, got, want);
    }
    let (g, w): (&[half::f16], &[half::f16]) =
        (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    let off = |(a, b): (&half::f16, &half::f16)| {
        let d = (a.to_f32() - b.to_f32()).abs();
        d.is_nan() || d > 1.0 / 64.0
    };
    match g.iter().zip(w).position(off) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what} (f16): element {i} is {}, want {} within 2^-6",
            g[i], w[i]
        )),
    }
}

fn same<T: TestElement>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    Err(format!(
        "{what} ({}): {} elements, first difference at {i}: got {:?}, want {:?}",
        T::DTYPE,
        got.len(),
        got.get(i),
        want.get(i)
    ))
}

/// Runs every collective for element type `T` on this rank with `count` elements (and
/// `block` per rank for the per-rank collectives) and checks each result against a
/// sequential reference.
pub async fn check_all<T: TestElement>(
    comm: &Communicator,
    count: usize,
    block: usize,
) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |what: &str| {
        let what = what.to_string();
        move |e: nexar_actors::NexarError| format!("{what} ({}): {e}", T::DTYPE)
    };
    for op in ops_for::<T>() {
        let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, count, op)).collect();
        let total = fold(&inputs, op, world);

        let mut buf = inputs[rank].clone();
        comm.all_reduce(&mut buf, op)
            .await
            .map_err(err(&format!("all_reduce {op}")))?;
        same_for(op, &format!("all_reduce {op}"), &buf, &total)?;

        let root = world - 1; // a non-zero root whenever world > 1
        let mut buf = inputs[rank].clone();
        comm.reduce(&mut buf, op, root)
            .await
            .map_err(err(&format!("reduce {op}")))?;
        if rank == root {
            same_for(op, &format!("reduce {op} on root"), &buf, &total)?;
        } else {
            same(
                &format!("reduce {op} off root (unchanged)"),
                &buf,
                &inputs[rank],
            )?;
        }

        let blocks: Vec<Vec<T>> = (0..world).map(|r| input(r, block * world, op)).collect();
        let reduced = fold(&blocks, op, world);
        let mut mine = vec![T::from_i64(0); block];
        comm.reduce_scatter(&blocks[rank], &mut mine, op)
            .await
            .map_err(err(&format!("reduce_scatter {op}")))?;
        same_for(
            op,
            &format!("reduce_scatter {op}"),
            &mine,
            &reduced[rank * block..(rank + 1) * block],
        )?;

        if op != ReduceOp::Avg {
            let mut buf = inputs[rank].clone();
            comm.scan(&mut buf, op)
                .await
                .map_err(err(&format!("scan {op}")))?;
            same(&format!("scan {op}"), &buf, &fold(&inputs[..=rank], op, 1))?;
            let mut buf = inputs[rank].clone();
            comm.exclusive_scan(&mut buf, op)
                .await
                .map_err(err(&format!("exclusive_scan {op}")))?;
            let want = if rank == 0 {
                let mut id = vec![T::from_i64(0); count];
                nexar_device::fill_identity(T::DTYPE, op, bytemuck::cast_slice_mut(&mut id))
                    .map_err(|e| e.to_string())?;
                id
            } else {
                fold(&inputs[..rank], op, 1)
            };
            same(&format!("exclusive_scan {op}"), &buf, &want)?;
        }
    }
    let op = ReduceOp::Sum;
    let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, count, op)).collect();
    let root = world / 2;

    let mut buf = inputs[rank].clone();
    comm.broadcast(&mut buf, root)
        .await
        .map_err(err("broadcast"))?;
    same("broadcast", &buf, &inputs[root])?;

    let sends: Vec<Vec<T>> = (0..world).map(|r| input(r, block, op)).collect();
    let concat: Vec<T> = sends.iter().flatten().copied().collect();
    let mut all = vec![T::from_i64(0); block * world];
    comm.all_gather(&sends[rank], &mut all)
        .await
        .map_err(err("all_gather"))?;
    same("all_gather", &all, &concat)?;

    let mut gathered = if rank == root {
        vec![T::from_i64(0); block * world]
    } else {
        Vec::new()
    };
    comm.gather(&sends[rank], &mut gathered, root)
        .await
        .map_err(err("gather"))?;
    if rank == root {
        same("gather", &gathered, &concat)?;
    }

    let big: Vec<Vec<T>> = (0..world)
        .map(|r| input(r + 11, block * world, op))
        .collect();
    let mut piece = vec![T::from_i64(0); block];
    let empty: Vec<T> = Vec::new();
    let send = if rank == root { &big[root] } else { &empty };
    comm.scatter(send, &mut piece, root)
        .await
        .map_err(err("scatter"))?;
    same(
        "scatter",
        &piece,
        &big[root][rank * block..(rank + 1) * block],
    )?;

    let mut recv = vec![T::from_i64(0); block * world];
    comm.all_to_all(&big[rank], &mut recv)
        .await
        .map_err(err("all_to_all"))?;
    let want: Vec<T> = (0..world)
        .flat_map(|i| big[i][rank * block..(rank + 1) * block].to_vec())
        .collect();
    same("all_to_all", &recv, &want)?;
    Ok(())
}

/// Unwraps every rank's result, panicking with the errors of all failing ranks at once
/// (the first failure alone often hides the cause: its peers' errors name it).
pub fn all_ok<T, E: std::fmt::Display>(context: &str, results: Vec<Result<T, E>>) -> Vec<T> {
    let mut ok = Vec::with_capacity(results.len());
    let mut failures = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => ok.push(v),
            Err(e) => failures.push(format!("rank {rank}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{context}:\n{}", failures.join("\n"));
    ok
}

/// A raw client holding node `as_node`'s own certificate and key, connected to rank
/// `target` of `cluster`: for tests that send hand-made frames as that node. Keep the
/// endpoint alive as long as the connection.
pub async fn impostor(
    cluster: &nexar_actors::Cluster,
    as_node: u64,
    target: usize,
) -> (
    nexar_transport::Endpoint,
    nexar_transport::Connection,
    nexar_transport::NodeIdentity,
) {
    use nexar_transport::{Endpoint, NodeId, TransportConfig};
    let identity = cluster
        .identity(as_node as usize)
        .expect("a rank of the cluster")
        .clone();
    let local = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 0));
    let ep = Endpoint::bind(local, &identity, TransportConfig::default()).expect("bind");
    let conn = ep
        .connect(cluster.addrs()[target], NodeId(target as u64))
        .await
        .expect("connect with a cluster certificate");
    (ep, conn, identity)
}

/// Sends messages of `sizes` (in order, under `tag`) from this rank to its right neighbour
/// while receiving its left neighbour's, and checks every one arrives intact and in
/// order (the contents are [`pattern`]s of the sender's rank and the message index).
pub async fn ring_messages(
    comm: &nexar_actors::Communicator,
    sizes: &'static [usize],
    tag: u64,
) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    let sender = {
        let comm = comm.clone();
        tokio::spawn(async move {
            for (i, &len) in sizes.iter().enumerate() {
                comm.send(&pattern((rank * 1000 + i) as u64, len), right, tag)
                    .await?;
            }
            Ok::<_, nexar_actors::NexarError>(())
        })
    };
    for (i, &len) in sizes.iter().enumerate() {
        let mut buf = vec![0u8; len];
        comm.recv(&mut buf, left, tag)
            .await
            .map_err(|e| format!("message {i} ({len} B): {e}"))?;
        if buf != pattern((left * 1000 + i) as u64, len) {
            return Err(format!(
                "message {i} ({len} B) from rank {left} corrupted or out of order"
            ));
        }
    }
    sender
        .await
        .map_err(|e| format!("sender task: {e}"))?
        .map_err(|e| format!("send: {e}"))
}

/// A send window small enough that the receive buffer of a host with Linux's default cap
/// (208 KiB) holds one and a half of it.
pub const SMALL_SEND_WINDOW: u64 = 128 << 10;

/// The send window a node gives its sole peer when its own is `window`: one and a half
/// windows, as far as this host's receive buffer holds them (a node asks for 8 MiB, which
/// the kernel caps at `net.core.rmem_max`), and never less than one.
pub fn sole_peer_window(window: u64) -> u64 {
    let cap = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(u64::MAX);
    let usable = cap.min(nexar_actors::TransportConfig::default().socket_buffer_bytes as u64);
    (window + window / 2).min(usable).max(window)
}

/// Why a node closes a connection whose certificate is not the one its membership pins
/// (`attach` in nexar-actors' node.rs).
pub const PIN_REFUSAL: &str = "not the certificate this node holds in the membership";

/// True when a connection ended as a node's pin check ends one: closed with
/// [`PIN_REFUSAL`], or, when that close's one packet was lost (a busy machine's loopback
/// drops datagrams), answered with a stateless reset at this side's next packet, the node
/// having dropped the connection by then.
pub fn closed_by_pin_check(closed: &quinn::ConnectionError) -> bool {
    match closed {
        quinn::ConnectionError::ApplicationClosed(c) => c.reason.as_ref() == PIN_REFUSAL.as_bytes(),
        quinn::ConnectionError::Reset => true,
        _ => false,
    }
}
