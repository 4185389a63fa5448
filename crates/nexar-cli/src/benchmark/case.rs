//! One benchmark case on one rank: its buffers, allocated once per size and reused by every
//! iteration, one call of the operation, and the check of the last call's result.
//!
//! Rank `r` holds `v(r, i)` at element `i`, an integer from 1 to 4 drawn from a hash of
//! `(r, i)`: small, so sums are exact in every type and the expected value is computed,
//! not received; without a period, so a block delivered to the wrong place or rank does
//! not pass for the right one. In half precision only the first ranks contribute to a
//! reduction (64 in bf16, 512 in f16; the others hold 0), as sums of more would pass the
//! integers those types hold exactly and round in an order each algorithm sets.

use bytes::Bytes;
use half::{bf16, f16};
use nexar_actors::{Communicator, NexarError, ZeroCopyBuffer};
use nexar_device::{Element, ReduceOp};

use super::BenchOp;

/// Tag of the bench's point-to-point messages (sendrecv, p2p, pingpong); ASCII "bench".
const TAG: u64 = 0x62_65_6e_63_68;

/// An element type the bench can fill with small integers and compare exactly.
pub(crate) trait BenchElem: Element + Copy {
    /// The element equal to `v` (wrapping for narrow integers, as their sums do).
    fn from_u32(v: u32) -> Self;

    /// Ranks that contribute non-zero values ([`v`]): all of them, except in half
    /// precision, whose sums of 1-4 per rank stay exact only up to 2048 (f16) and 256
    /// (bf16), so that a ring's rank-by-rank sums never round.
    const SUMMED_RANKS: usize = usize::MAX;
}

macro_rules! bench_elem {
    ($($t:ty => |$v:ident| $e:expr $(; summed $n:expr)?),* $(,)?) => {$(
        impl BenchElem for $t {
            fn from_u32($v: u32) -> Self {
                $e
            }
            $(const SUMMED_RANKS: usize = $n;)?
        }
    )*};
}

bench_elem! {
    f32 => |v| v as f32,
    f64 => |v| f64::from(v),
    f16 => |v| f16::from_f32(v as f32); summed 2048 / 4,
    bf16 => |v| bf16::from_f32(v as f32); summed 256 / 4,
    i8 => |v| v as i8,
    i32 => |v| v as i32,
    i64 => |v| i64::from(v),
    u8 => |v| v as u8,
    u32 => |v| v,
    u64 => |v| u64::from(v),
}

/// The value rank `r` holds at element `i` for `op`: 1 to 4, from a hash of `(r, i)`;
/// for a reduction, on the first [`BenchElem::SUMMED_RANKS`] ranks only (0 on the
/// others), so that every partial sum, in whatever order an algorithm adds, is an integer
/// the type holds exactly. (Ops that only move data keep every rank's values: a block of
/// zeros from a rank past the limit would pass for one never delivered.)
fn v<T: BenchElem>(op: BenchOp, r: usize, i: usize) -> u32 {
    let reduces = matches!(
        op,
        BenchOp::AllReduce | BenchOp::Reduce | BenchOp::ReduceScatter
    );
    if !reduces || r < T::SUMMED_RANKS {
        1 + (mix(r, i) >> 62) as u32
    } else {
        0
    }
}

/// splitmix64's finaliser over `(r, i)`: every bit of either moves the top bits.
fn mix(r: usize, i: usize) -> u64 {
    let mut z = ((r as u64) << 40 ^ i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// [`v`] as an element of `T`.
fn elem<T: BenchElem>(op: BenchOp, r: usize, i: usize) -> T {
    T::from_u32(v::<T>(op, r, i))
}

/// Which forms of the collectives a bench calls.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Forms {
    /// all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather and
    /// scatter in their zero-copy forms (sends read the buffers themselves) instead of on
    /// slices (sends copy), and sendrecv's sends handed over as `Bytes` (`send_bytes`), as
    /// p2p's always are.
    pub(crate) zero_copy: bool,
    /// all_gather and reduce_scatter in place, on one buffer.
    pub(crate) in_place: bool,
}

/// Buffers and geometry of one (op, size) on one rank.
pub(crate) struct Case<T: BenchElem> {
    op: BenchOp,
    rank: usize,
    world: usize,
    /// Elements of the size as the bench counts it (see [`BenchOp`]).
    count: usize,
    /// Messages per p2p iteration.
    burst: usize,
    /// The send or in-place buffer.
    a: ZeroCopyBuffer<T>,
    /// The receive buffer (empty where the op has none).
    b: ZeroCopyBuffer<T>,
    forms: Forms,
    /// The bytes of `a`, sent by reference: p2p's rank 0, and sendrecv in the zero-copy
    /// form (empty otherwise).
    streamed: Bytes,
}

impl<T: BenchElem> Case<T> {
    /// Allocates and fills the buffers for `bytes`, rounded as [`elements`] says; `Ok(None)`
    /// where it says so (the same on every rank). `Err` says that the memory could not be
    /// had (a size no allocator can serve, or more than the host will lend), rather than
    /// aborting the process.
    pub(crate) fn new(
        op: BenchOp,
        bytes: usize,
        rank: usize,
        world: usize,
        forms: Forms,
    ) -> Result<Option<Case<T>>, String> {
        let esz = T::DTYPE.size();
        let Some(count) = elements(op, bytes, world, esz) else {
            return Ok(None);
        };
        let no_memory = |e: std::collections::TryReserveError| {
            format!(
                "could not allocate the buffers of {op} at {bytes} bytes ({count} \
                 x {}): {e}",
                T::DTYPE.name()
            )
        };
        let fill = |r: usize, n: usize| try_vec(n, |i| elem(op, r, i));
        let zeros = |n: usize| try_vec(n, |_| T::from_u32(0));
        let none = || Ok(Vec::new());
        let block = count / world;
        let (a, b) = match op {
            BenchOp::AllGather if forms.in_place => {
                let mut a = zeros(count);
                if let Ok(a) = &mut a {
                    for (i, x) in a[rank * block..(rank + 1) * block].iter_mut().enumerate() {
                        *x = elem(op, rank, i);
                    }
                }
                (a, none())
            }
            BenchOp::ReduceScatter if forms.in_place => (fill(rank, count), none()),
            BenchOp::AllReduce | BenchOp::Reduce => (fill(rank, count), none()),
            BenchOp::Broadcast if rank == 0 => (fill(0, count), none()),
            BenchOp::Broadcast => (zeros(count), none()),
            BenchOp::AllGather => (fill(rank, block), zeros(count)),
            BenchOp::ReduceScatter => (fill(rank, count), zeros(block)),
            BenchOp::AllToAll | BenchOp::SendRecv => (fill(rank, count), zeros(count)),
            // Only the root holds the whole buffer.
            BenchOp::Gather if rank == 0 => (fill(rank, block), zeros(count)),
            BenchOp::Gather => (fill(rank, block), none()),
            BenchOp::Scatter if rank == 0 => (fill(0, count), zeros(block)),
            BenchOp::Scatter => (none(), zeros(block)),
            BenchOp::Barrier => (none(), none()),
            // The p2p sender only sends (`streamed`), so it holds no receive buffer: the
            // last call's reset would touch every page of an unused one.
            BenchOp::P2p if rank == 0 => (fill(0, count), none()),
            BenchOp::P2p | BenchOp::PingPong => match rank {
                0 => (fill(0, count), zeros(count)),
                1 => (none(), zeros(count)),
                _ => (none(), none()),
            },
        };
        let (a, b) = (a.map_err(no_memory)?, b.map_err(no_memory)?);
        let streamed = if op == BenchOp::P2p || (op == BenchOp::SendRecv && forms.zero_copy) {
            let src = bytemuck::cast_slice::<T, u8>(&a);
            let mut copy = Vec::new();
            copy.try_reserve_exact(src.len()).map_err(no_memory)?;
            copy.extend_from_slice(src);
            Bytes::from(copy)
        } else {
            Bytes::new()
        };
        Ok(Some(Case {
            op,
            rank,
            world,
            count,
            burst: burst(count * esz),
            a: a.into(),
            b: b.into(),
            forms,
            streamed,
        }))
    }

    /// Elements of the size.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Bytes of the size.
    pub(crate) fn bytes(&self) -> usize {
        self.count * T::DTYPE.size()
    }

    /// Messages one p2p iteration streams (1 for every other op).
    pub(crate) fn burst(&self) -> usize {
        if self.op == BenchOp::P2p {
            self.burst
        } else {
            1
        }
    }

    /// Bytes of the buffers this rank allocated.
    pub(crate) fn user_bytes(&self) -> usize {
        (self.a.len() + self.b.len()) * T::DTYPE.size() + self.streamed.len()
    }

    /// True for all_gather and reduce_scatter in place (one buffer, `a`).
    fn placed(&self) -> bool {
        self.forms.in_place && matches!(self.op, BenchOp::AllGather | BenchOp::ReduceScatter)
    }

    /// Restores the inputs and blanks the outputs, so the next call's result can be
    /// checked (in-place reductions compound from one call to the next). Waits for the
    /// transport to return what zero-copy calls lent it, so nothing is copied.
    pub(crate) async fn reset(&mut self) {
        let op = self.op;
        let rank = self.rank;
        let block = self.count / self.world;
        let placed = self.placed();
        match self.op {
            BenchOp::AllGather if placed => {
                for (i, x) in self.a.writable().await.iter_mut().enumerate() {
                    if i / block != rank {
                        *x = T::from_u32(0);
                    }
                }
            }
            BenchOp::ReduceScatter if placed => {
                let a = self.a.writable().await;
                for (i, x) in a[rank * block..(rank + 1) * block].iter_mut().enumerate() {
                    *x = elem(op, rank, rank * block + i);
                }
            }
            BenchOp::AllReduce | BenchOp::Reduce => {
                for (i, x) in self.a.writable().await.iter_mut().enumerate() {
                    *x = elem(op, rank, i);
                }
            }
            BenchOp::Broadcast if rank != 0 => self.a.writable().await.fill(T::from_u32(0)),
            _ => self.b.writable().await.fill(T::from_u32(0)),
        }
    }

    /// Runs the operation once.
    pub(crate) async fn run(&mut self, comm: &Communicator) -> Result<(), NexarError> {
        let (rank, world) = (self.rank, self.world);
        let sum = ReduceOp::Sum;
        let placed = self.placed();
        let (za, zb) = (&mut self.a, &mut self.b);
        if self.forms.zero_copy {
            match self.op {
                BenchOp::AllGather if placed => {
                    return comm.all_gather_in_place_zero_copy(za).await
                }
                BenchOp::ReduceScatter if placed => {
                    return comm.reduce_scatter_in_place_zero_copy(za, sum).await
                }
                BenchOp::AllReduce => return comm.all_reduce_zero_copy(za, sum).await,
                BenchOp::Broadcast => return comm.broadcast_zero_copy(za, 0).await,
                BenchOp::Reduce => return comm.reduce_zero_copy(za, sum, 0).await,
                BenchOp::AllGather => return comm.all_gather_zero_copy(za, zb).await,
                BenchOp::ReduceScatter => return comm.reduce_scatter_zero_copy(za, zb, sum).await,
                BenchOp::AllToAll => return comm.all_to_all_zero_copy(za, zb).await,
                BenchOp::Gather => return comm.gather_zero_copy(za, zb, 0).await,
                BenchOp::Scatter => return comm.scatter_zero_copy(za, zb, 0).await,
                _ => {}
            }
        }
        // Never lent outside the zero-copy forms: written in place.
        let (a, b) = (za.as_mut_slice(), zb.as_mut_slice());
        match self.op {
            BenchOp::AllReduce => comm.all_reduce(a, sum).await,
            BenchOp::Broadcast => comm.broadcast(a, 0).await,
            BenchOp::Reduce => comm.reduce(a, sum, 0).await,
            BenchOp::AllGather if placed => comm.all_gather_in_place(a).await,
            BenchOp::ReduceScatter if placed => comm.reduce_scatter_in_place(a, sum).await,
            BenchOp::AllGather => comm.all_gather(a, b).await,
            BenchOp::ReduceScatter => comm.reduce_scatter(a, b, sum).await,
            BenchOp::AllToAll => comm.all_to_all(a, b).await,
            BenchOp::Gather => comm.gather(a, b, 0).await,
            BenchOp::Scatter => comm.scatter(a, b, 0).await,
            BenchOp::Barrier => comm.barrier().await,
            BenchOp::SendRecv => {
                let next = (rank + 1) % world;
                let prev = (rank + world - 1) % world;
                // The zero-copy form hands the transport the input's bytes, as p2p does: the
                // transport's cost with every rank sending and receiving at once.
                let send = async {
                    if self.streamed.is_empty() {
                        comm.send(a, next, TAG).await
                    } else {
                        comm.send_bytes(self.streamed.clone(), next, TAG).await
                    }
                };
                let (sent, received) = tokio::join!(send, comm.recv(b, prev, TAG));
                sent.and(received)
            }
            BenchOp::P2p => {
                // The transport's ceiling: rank 0 streams the same bytes, handed over
                // without a copy per message (`send_bytes`).
                for _ in 0..self.burst {
                    match rank {
                        0 => comm.send_bytes(self.streamed.clone(), 1, TAG).await?,
                        1 => comm.recv(b, 0, TAG).await?,
                        _ => {}
                    }
                }
                Ok(())
            }
            BenchOp::PingPong => match rank {
                0 => {
                    comm.send(a, 1, TAG).await?;
                    comm.recv(b, 1, TAG).await
                }
                1 => {
                    comm.recv(b, 0, TAG).await?;
                    comm.send(b, 0, TAG).await
                }
                _ => Ok(()),
            },
        }
    }

    /// Checks the result of the last call after a [`reset`](Self::reset); `Err` names the
    /// first wrong element.
    pub(crate) fn verify(&self) -> Result<(), String> {
        let (op, rank, world) = (self.op, self.rank, self.world);
        let sum = |i: usize| (0..world).map(|r| v::<T>(op, r, i)).sum::<u32>();
        let block = self.count / world;
        let (got, expected): (&[T], Box<dyn Fn(usize) -> u32>) = match self.op {
            BenchOp::AllGather if self.placed() => {
                (&self.a, Box::new(move |i| v::<T>(op, i / block, i % block)))
            }
            // The other blocks keep this rank's input.
            BenchOp::ReduceScatter if self.placed() => (
                &self.a,
                Box::new(move |i| {
                    if i / block == rank {
                        sum(i)
                    } else {
                        v::<T>(op, rank, i)
                    }
                }),
            ),
            BenchOp::AllReduce => (&self.a, Box::new(sum)),
            BenchOp::Reduce if rank == 0 => (&self.a, Box::new(sum)),
            BenchOp::Reduce => (&self.a, Box::new(move |i| v::<T>(op, rank, i))),
            BenchOp::Broadcast => (&self.a, Box::new(|i| v::<T>(op, 0, i))),
            BenchOp::AllGather => (&self.b, Box::new(move |i| v::<T>(op, i / block, i % block))),
            BenchOp::ReduceScatter => (&self.b, Box::new(move |i| sum(rank * block + i))),
            BenchOp::AllToAll => (
                &self.b,
                Box::new(move |i| v::<T>(op, i / block, rank * block + i % block)),
            ),
            // Non-roots' receive buffers are empty.
            BenchOp::Gather => (&self.b, Box::new(move |i| v::<T>(op, i / block, i % block))),
            BenchOp::Scatter => (&self.b, Box::new(move |i| v::<T>(op, 0, rank * block + i))),
            BenchOp::SendRecv => {
                let prev = (rank + world - 1) % world;
                (&self.b, Box::new(move |i| v::<T>(op, prev, i)))
            }
            BenchOp::P2p if rank == 0 => return Ok(()),
            BenchOp::P2p | BenchOp::PingPong => (&self.b, Box::new(|i| v::<T>(op, 0, i))),
            BenchOp::Barrier => return Ok(()),
        };
        match got
            .iter()
            .enumerate()
            .find(|(i, x)| **x != T::from_u32(expected(*i)))
        {
            None => Ok(()),
            Some((i, x)) => Err(format!(
                "rank {rank}: {} element {i} is {x:?}, expected {}",
                self.op,
                expected(i)
            )),
        }
    }
}

/// Elements of `esz` bytes that `op` moves at the sweep size `bytes` on `world` ranks:
/// `bytes` rounded down to whole elements, and for all_gather, reduce_scatter, all_to_all,
/// gather and scatter to a multiple of `world` elements; 0 for barrier. `None` when that
/// leaves nothing to move, or for a pair op on a single rank.
pub(crate) fn elements(op: BenchOp, bytes: usize, world: usize, esz: usize) -> Option<usize> {
    let mut count = bytes / esz.max(1);
    if op.has_blocks() {
        count -= count % world.max(1);
    }
    if op == BenchOp::Barrier {
        Some(0)
    } else if count == 0 || (op.is_pair() && world < 2) {
        None
    } else {
        Some(count)
    }
}

/// `n` elements, element `i` being `f(i)`; `Err` when the memory cannot be had (where
/// `vec!` and `collect` would abort the process).
fn try_vec<E>(
    n: usize,
    f: impl FnMut(usize) -> E,
) -> Result<Vec<E>, std::collections::TryReserveError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)?;
    v.extend((0..n).map(f));
    Ok(v)
}

/// Messages per p2p iteration: enough to stream about 16 MiB, at most 256.
fn burst(bytes: usize) -> usize {
    ((16 << 20) / bytes.max(1)).clamp(1, 256)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`Case::new`] where the memory is there.
    fn new_case<T: BenchElem>(
        op: BenchOp,
        bytes: usize,
        rank: usize,
        world: usize,
        forms: Forms,
    ) -> Option<Case<T>> {
        Case::new(op, bytes, rank, world, forms).expect("memory for a small case")
    }

    #[test]
    fn buffers_that_cannot_be_had_are_an_error_not_an_abort() {
        // More than any Vec may hold, and 4 PiB, beyond any address space.
        for bytes in [usize::MAX, 1 << 52] {
            for op in [BenchOp::AllReduce, BenchOp::AllToAll, BenchOp::P2p] {
                let err = Case::<f32>::new(op, bytes, 0, 2, Forms::default()).err();
                assert!(
                    err.as_ref().is_some_and(|e| e.starts_with(&format!(
                        "could not allocate the buffers of {op} at {bytes} bytes"
                    ))),
                    "{op} {bytes}: {err:?}"
                );
            }
        }
    }

    #[test]
    fn sizes_round_to_whole_blocks() {
        let c = new_case::<f32>(BenchOp::AllGather, 1000, 0, 3, Forms::default()).expect("case");
        assert_eq!((c.count(), c.bytes()), (249, 996));
        assert!(new_case::<f32>(BenchOp::AllGather, 8, 0, 4, Forms::default()).is_none());
        assert!(new_case::<f32>(BenchOp::P2p, 8, 0, 1, Forms::default()).is_none());
        let b = new_case::<f32>(BenchOp::Barrier, 8, 0, 4, Forms::default()).expect("barrier");
        assert_eq!(b.bytes(), 0);
    }

    #[tokio::test]
    async fn in_place_cases_check_and_reset_their_one_buffer() {
        let placed = Forms {
            zero_copy: false,
            in_place: true,
        };
        // All-gather, rank 1 of 2: block 0 is missing until filled in.
        let mut g = new_case::<f32>(BenchOp::AllGather, 64, 1, 2, placed).expect("case");
        assert!(g.b.is_empty());
        assert!(g.verify().is_err());
        for (i, x) in g.a.as_mut_slice()[..8].iter_mut().enumerate() {
            *x = v::<f32>(BenchOp::AllReduce, 0, i) as f32;
        }
        assert_eq!(g.verify(), Ok(()));
        g.reset().await;
        assert!(g.verify().is_err());
        // Reduce-scatter, rank 0 of 2: block 0 must hold the sums, block 1 its input.
        let mut r = new_case::<f32>(BenchOp::ReduceScatter, 64, 0, 2, placed).expect("case");
        assert!(r.verify().is_err());
        for (i, x) in r.a.as_mut_slice()[..8].iter_mut().enumerate() {
            *x = (v::<f32>(BenchOp::AllReduce, 0, i) + v::<f32>(BenchOp::AllReduce, 1, i)) as f32;
        }
        assert_eq!(r.verify(), Ok(()));
        r.a.as_mut_slice()[15] += 1.0;
        assert!(r.verify().is_err(), "another block changed");
        r.a.as_mut_slice()[15] -= 1.0;
        r.reset().await;
        assert!(r.verify().is_err());
    }

    #[tokio::test]
    async fn only_the_root_holds_the_whole_gather_or_scatter_buffer() {
        let f = Forms::default();
        let root = new_case::<f32>(BenchOp::Gather, 96, 0, 3, f).expect("case");
        let leaf = new_case::<f32>(BenchOp::Gather, 96, 2, 3, f).expect("case");
        assert_eq!((root.a.len(), root.b.len()), (8, 24));
        assert_eq!((leaf.a.len(), leaf.b.len()), (8, 0));
        assert_eq!(leaf.user_bytes(), 32);
        let mut root = root;
        assert!(root.verify().is_err(), "nothing gathered yet");
        for (i, x) in root.b.as_mut_slice().iter_mut().enumerate() {
            *x = v::<f32>(BenchOp::AllReduce, i / 8, i % 8) as f32;
        }
        assert_eq!(root.verify(), Ok(()));
        root.reset().await;
        assert!(root.verify().is_err());
        let source = new_case::<f32>(BenchOp::Scatter, 96, 0, 3, f).expect("case");
        let mut dest = new_case::<f32>(BenchOp::Scatter, 96, 1, 3, f).expect("case");
        assert_eq!((source.a.len(), source.b.len()), (24, 8));
        assert_eq!((dest.a.len(), dest.b.len()), (0, 8));
        assert!(dest.verify().is_err(), "nothing scattered yet");
        dest.b.as_mut_slice().copy_from_slice(&source.a[8..16]);
        assert_eq!(dest.verify(), Ok(()), "block 1 of the root's buffer");
    }

    /// Right values in the wrong place fail the check: a scatter's block 0 where block 1
    /// belongs, and all-reduce sums shifted by one block (with values of period 4, both
    /// passed).
    #[test]
    fn verify_catches_a_block_in_the_wrong_place() {
        let f = Forms::default();
        let root = new_case::<f32>(BenchOp::Scatter, 4096, 0, 4, f).expect("case");
        let mut dest = new_case::<f32>(BenchOp::Scatter, 4096, 1, 4, f).expect("case");
        dest.b.as_mut_slice().copy_from_slice(&root.a[..256]);
        assert!(dest.verify().is_err(), "block 0 passed for block 1");
        dest.b.as_mut_slice().copy_from_slice(&root.a[256..512]);
        assert_eq!(dest.verify(), Ok(()));
        let mut c = new_case::<f32>(BenchOp::AllReduce, 4096, 0, 4, f).expect("case");
        let sum = |i: usize| {
            (0..4)
                .map(|r| v::<f32>(BenchOp::AllReduce, r, i))
                .sum::<u32>() as f32
        };
        for (i, x) in c.a.as_mut_slice().iter_mut().enumerate() {
            *x = sum((i + 256) % 1024);
        }
        assert!(c.verify().is_err(), "sums shifted by a block passed");
        for (i, x) in c.a.as_mut_slice().iter_mut().enumerate() {
            *x = sum(i);
        }
        assert_eq!(c.verify(), Ok(()));
        // Every value from 1 to 4 comes up.
        for want in 1..=4 {
            assert!(
                (0..64).any(|i| v::<f32>(BenchOp::AllReduce, 0, i) == want),
                "{want}"
            );
        }
    }

    #[tokio::test]
    async fn verify_catches_a_missing_result() {
        let mut c = new_case::<f32>(BenchOp::AllReduce, 64, 0, 2, Forms::default()).expect("case");
        assert!(c.verify().is_err());
        // What a 2-rank sum leaves on rank 0.
        for (i, x) in c.a.as_mut_slice().iter_mut().enumerate() {
            *x = (v::<f32>(BenchOp::AllReduce, 0, i) + v::<f32>(BenchOp::AllReduce, 1, i)) as f32;
        }
        assert_eq!(c.verify(), Ok(()));
        c.reset().await;
        assert!(c.verify().is_err());
    }

    /// In bf16 every rank of an op that only moves data holds non-zero values, the 65th
    /// too: a block of rank 64 never delivered (left at zero) fails the check (it passed,
    /// as values past the 64 ranks that reductions sum were zero for every op).
    #[test]
    fn half_precision_checks_every_ranks_block_of_a_data_move() {
        let world = 65;
        let mut c = new_case::<bf16>(
            BenchOp::AllGather,
            2 * 4 * world,
            0,
            world,
            Forms::default(),
        )
        .expect("case");
        let block = 4;
        for (i, x) in c.b.as_mut_slice().iter_mut().enumerate() {
            *x = bf16::from_f32(v::<bf16>(BenchOp::AllGather, i / block, i % block) as f32);
        }
        assert_eq!(c.verify(), Ok(()));
        c.b.as_mut_slice()[64 * block..].fill(bf16::from_f32(0.0));
        assert!(c.verify().is_err(), "rank 64's block missing passed");
        assert_ne!(v::<bf16>(BenchOp::AllGather, 64, 1), 0);
        assert_eq!(v::<bf16>(BenchOp::ReduceScatter, 64, 1), 0);
    }

    /// 120 ranks in bf16: only the first 64 contribute, so a ring's rank-by-rank sum, each
    /// step rounded to bf16, is the exact sum the check expects.
    #[test]
    fn half_precision_sums_of_large_worlds_stay_exact() {
        let world = 120;
        let mut c = new_case::<bf16>(BenchOp::AllReduce, 2 * 240, 0, world, Forms::default())
            .expect("case");
        assert_ne!(v::<bf16>(BenchOp::AllReduce, 63, 1), 0);
        assert_eq!(v::<bf16>(BenchOp::AllReduce, 64, 1), 0);
        for (i, x) in c.a.as_mut_slice().iter_mut().enumerate() {
            *x = (0..world).fold(bf16::from_f32(0.0), |acc, r| {
                bf16::from_f32(acc.to_f32() + v::<bf16>(BenchOp::AllReduce, r, i) as f32)
            });
        }
        assert_eq!(c.verify(), Ok(()));
        c.a.as_mut_slice()[3] = bf16::from_f32(c.a[3].to_f32() + 2.0);
        assert!(c.verify().is_err(), "a sum off by 2");
        // With every rank contributing, the same ring would have rounded.
        let rounds = (0..240).any(|i| {
            let all: u32 = (0..world).map(|r| v::<f32>(BenchOp::AllReduce, r, i)).sum();
            let ring = (0..world).fold(bf16::from_f32(0.0), |acc, r| {
                bf16::from_f32(acc.to_f32() + v::<f32>(BenchOp::AllReduce, r, i) as f32)
            });
            ring.to_f32() != all as f32
        });
        assert!(rounds);
    }

    #[test]
    fn the_p2p_sender_holds_what_it_streams_and_no_receive_buffer() {
        let sender = new_case::<f32>(BenchOp::P2p, 4096, 0, 2, Forms::default()).expect("case");
        assert!(sender.b.is_empty());
        assert_eq!(sender.user_bytes(), 2 * 4096);
        let receiver = new_case::<f32>(BenchOp::P2p, 4096, 1, 2, Forms::default()).expect("case");
        assert_eq!((receiver.b.len(), receiver.user_bytes()), (1024, 4096));
        let pingpong =
            new_case::<f32>(BenchOp::PingPong, 4096, 0, 2, Forms::default()).expect("case");
        assert_eq!(pingpong.b.len(), 1024);
    }
}
