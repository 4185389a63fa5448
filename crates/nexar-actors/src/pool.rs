//! Reused buffers, so collectives in steady state allocate nothing fresh (touching fresh
//! pages costs ~2.2 µs per 4 KiB on this kind of machine: a 64 MiB buffer per call was 16K+
//! page faults): working buffers (scratch, copies), and the send copies handed to the
//! transport, which come back here when the transport drops them (once the peer has
//! acknowledged every byte).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Notify;

/// A small pool of byte buffers, bounded in count and total bytes.
#[derive(Debug)]
pub(crate) struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    max_buffers: usize,
    max_bytes: usize,
    sends: Arc<SendPool>,
}

impl BufferPool {
    pub(crate) fn new(max_buffers: usize, max_bytes: usize) -> BufferPool {
        BufferPool {
            free: Mutex::new(Vec::new()),
            max_buffers,
            max_bytes,
            sends: Arc::new(SendPool::new(SEND_POOL_BYTES)),
        }
    }

    /// The pool of send copies.
    pub(crate) fn sends(&self) -> &Arc<SendPool> {
        &self.sends
    }

    /// A buffer with capacity for at least `len` bytes (the smallest that fits), holding
    /// what it held when it was put back.
    fn take(&self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        let mut free = self
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => free.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    /// `len` bytes of scratch in a pooled buffer, holding whatever they held before (the
    /// schedules write scratch before they read it): a reused buffer is not cleared, so a
    /// collective in steady state writes no byte of it that it does not use. Bytes past
    /// the reused buffer's old length are zeroed.
    pub(crate) fn scratch(&self, len: usize) -> Vec<u8> {
        sized(self.take(len), len)
    }

    /// Returns a buffer for reuse (dropped if the pool is full).
    pub(crate) fn put(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > self.max_bytes {
            return;
        }
        let mut free = self
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        free.push(buf);
        // Keep the largest buffers that fit within the bounds, largest first; drop the
        // rest (a buffer too large for what is left does not push out smaller ones).
        free.sort_unstable_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut total = 0usize;
        let mut kept = 0usize;
        free.retain(|b| {
            let keep = kept < self.max_buffers && total + b.capacity() <= self.max_bytes;
            if keep {
                total += b.capacity();
                kept += 1;
            }
            keep
        });
    }
}

/// `b` at exactly `len` bytes, keeping what it held up to there: shortened, or grown with
/// zeroes past its old length (a buffer taken for reuse is written before it is read, so
/// only bytes it never held need a value).
fn sized(mut b: Vec<u8>, len: usize) -> Vec<u8> {
    if b.len() >= len {
        b.truncate(len);
    } else {
        b.resize(len, 0);
    }
    b
}

/// Free send buffers kept per node (beyond this they are freed).
const SEND_POOL_BYTES: usize = 32 << 20;

/// Send copies below this size come from the allocator directly (it serves small blocks
/// from memory it already has, and a pool would only add a lock).
const POOLED_SEND_MIN: usize = 64 << 10;

/// Free send buffers, bounded in total bytes.
#[derive(Debug)]
pub(crate) struct SendPool {
    free: Mutex<Vec<Vec<u8>>>,
    max_bytes: usize,
}

impl SendPool {
    pub(crate) fn new(max_bytes: usize) -> SendPool {
        SendPool {
            free: Mutex::new(Vec::new()),
            max_bytes,
        }
    }

    /// An empty buffer with room for `len` bytes, reused when one of a similar size (at
    /// most twice `len`, so a big buffer is not pinned by a small message) is free.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut b = self.reuse(len).unwrap_or_else(|| Vec::with_capacity(len));
        b.clear();
        b
    }

    /// A buffer of exactly `len` bytes, for a caller that writes every one of them before
    /// they are read or sent: a reused buffer keeps what it held (only bytes past its old
    /// length are zeroed), so no pass over it is spent clearing it.
    pub(crate) fn take_len(&self, len: usize) -> Vec<u8> {
        sized(self.reuse(len).unwrap_or_default(), len)
    }

    /// A free buffer with room for `len` bytes (see [`SendPool::take`]), as it was put
    /// back.
    fn reuse(&self, len: usize) -> Option<Vec<u8>> {
        if len < POOLED_SEND_MIN {
            return None;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let found = free
            .iter()
            .position(|b| b.capacity() >= len && b.capacity() / 2 <= len)?;
        Some(free.swap_remove(found))
    }

    /// The free buffers' capacities, largest first (tests).
    #[cfg(test)]
    pub(crate) fn free_capacities(&self) -> Vec<usize> {
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let mut caps: Vec<usize> = free.iter().map(Vec::capacity).collect();
        caps.sort_unstable_by(|a, b| b.cmp(a));
        caps
    }

    fn put(&self, buf: Vec<u8>) {
        if buf.capacity() < POOLED_SEND_MIN || buf.capacity() > self.max_bytes {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + buf.capacity() <= self.max_bytes {
            free.push(buf);
        }
    }
}

/// Send bytes of one collective that the transport still holds (queued or not yet
/// acknowledged by the peer): the driver stops copying out new sends past a budget and
/// waits for [`InFlight::wait`], which returns when some are released.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    bytes: AtomicUsize,
    released: Notify,
}

impl InFlight {
    /// Bytes held by the transport now.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Resolves after some bytes were released since the last call (or at once if some
    /// were released while nobody waited).
    pub(crate) async fn wait(&self) {
        self.released.notified().await;
    }
}

/// `len` bytes of a collective's in-flight count, from creation until dropped (which
/// wakes a driver waiting for the count to fall).
pub(crate) struct FlightShare {
    len: usize,
    flight: Arc<InFlight>,
}

impl FlightShare {
    pub(crate) fn new(flight: &Arc<InFlight>, len: usize) -> FlightShare {
        flight.bytes.fetch_add(len, Ordering::AcqRel);
        FlightShare {
            len,
            flight: flight.clone(),
        }
    }
}

impl Drop for FlightShare {
    fn drop(&mut self) {
        self.flight.bytes.fetch_sub(self.len, Ordering::AcqRel);
        self.flight.released.notify_one();
    }
}

/// A send copy on its way through the transport: returns its buffer to the pool, then its
/// bytes to the collective's in-flight count, when the transport drops the last reference.
struct SendBuf {
    buf: Vec<u8>,
    pool: Arc<SendPool>,
    _share: Option<FlightShare>,
}

impl AsRef<[u8]> for SendBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for SendBuf {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.buf));
    }
}

/// The last of the received chunks a send passes on, holding the in-flight share of all
/// of them: the transport releases chunks in order, as the peer acknowledges them. Sends
/// that pass the same payload on hold the same share, so it counts once.
struct Counted {
    last: Bytes,
    _share: Arc<FlightShare>,
}

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.last
    }
}

/// A copy of `src` in a fresh allocation, as `Bytes::copy_from_slice` but made with
/// [`nexar_device::copy_bytes`]'s routine, whose speed does not depend on where the two
/// buffers lie.
pub(crate) fn copied(src: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(src.len());
    nexar_device::extend_bytes(&mut v, src);
    Bytes::from(v)
}

/// `chunks` counted in `share` (all of their bytes) until the last of them, and of any
/// other chunks given the same share, is dropped.
pub(crate) fn counted(mut chunks: Vec<Bytes>, share: Arc<FlightShare>) -> Vec<Bytes> {
    let Some(last) = chunks.pop() else {
        return chunks;
    };
    chunks.push(Bytes::from_owner(Counted {
        last,
        _share: share,
    }));
    chunks
}

/// Pieces a large send's bytes are copied out in (a p2p `send`'s, a collective's).
pub(crate) const SEND_PIECE_BYTES: usize = 1 << 20;

/// Where copying out a large send's pieces stopped ([`SendPool::copy_out`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum CopiedOut {
    /// Every piece is out.
    All,
    /// The transport holds the budget: wait for [`InFlight::wait`] and call again.
    Budget,
    /// The writer is gone (it failed, and says so itself).
    WriterGone,
}

impl SendPool {
    /// Copies `src[*fed..]` out to `tx` in pooled pieces of [`SEND_PIECE_BYTES`], counted
    /// against `flight`, while the transport holds less than `budget` (at least one piece
    /// while it holds nothing), advancing `fed`.
    pub(crate) fn copy_out(
        self: &Arc<Self>,
        src: &[u8],
        fed: &mut usize,
        tx: &tokio::sync::mpsc::UnboundedSender<Bytes>,
        flight: &Arc<InFlight>,
        budget: usize,
    ) -> CopiedOut {
        while *fed < src.len() {
            let held = flight.bytes();
            if held > 0 && held + SEND_PIECE_BYTES > budget {
                return CopiedOut::Budget;
            }
            let piece = &src[*fed..src.len().min(*fed + SEND_PIECE_BYTES)];
            if tx.send(self.copy_of(piece, flight)).is_err() {
                return CopiedOut::WriterGone;
            }
            *fed += piece.len();
        }
        CopiedOut::All
    }

    /// A copy of `src` in a (reused) buffer, as `Bytes` that count against `flight` until
    /// the transport drops them.
    pub(crate) fn copy_of(self: &Arc<Self>, src: &[u8], flight: &Arc<InFlight>) -> Bytes {
        let mut buf = self.take(src.len());
        nexar_device::extend_bytes(&mut buf, src);
        self.wrap(buf, flight)
    }

    /// `len` bytes written by `fill` (which must write all of them), like
    /// [`SendPool::copy_of`].
    pub(crate) fn filled<E>(
        self: &Arc<Self>,
        len: usize,
        flight: &Arc<InFlight>,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<Bytes, E> {
        let mut buf = self.take_len(len);
        fill(&mut buf)?;
        Ok(self.wrap(buf, flight))
    }

    /// `buf` (from [`SendPool::take`]) as `Bytes` that return it to the pool when
    /// dropped. Not counted in flight: a send that passes them on counts them
    /// ([`counted`]).
    pub(crate) fn passed_on(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        self.owned(buf, None)
    }

    fn wrap(self: &Arc<Self>, buf: Vec<u8>, flight: &Arc<InFlight>) -> Bytes {
        let share = FlightShare::new(flight, buf.len());
        self.owned(buf, Some(share))
    }

    fn owned(self: &Arc<Self>, buf: Vec<u8>, _share: Option<FlightShare>) -> Bytes {
        Bytes::from_owner(SendBuf {
            buf,
            pool: self.clone(),
            _share,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copied_holds_the_same_bytes() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();
        for len in [0, 1, 2047, 2048, 4096 + 17, 70_000] {
            // From an odd offset too: the copy must not depend on alignment.
            for off in [0, 3] {
                let piece = &src[off..off + len.min(src.len() - off)];
                assert_eq!(&copied(piece)[..], piece, "len {len} offset {off}");
            }
        }
    }

    #[test]
    fn buffers_are_reused_and_bounded() {
        let pool = BufferPool::new(2, 1 << 20);
        let a = pool.scratch(1000);
        assert_eq!(a.len(), 1000);
        let ptr = a.as_ptr();
        pool.put(a);
        let mut b = pool.scratch(500);
        assert_eq!(b.as_ptr(), ptr, "the pooled allocation is reused");
        b.fill(7);
        pool.put(b);
        // Scratch is reused as it is: no byte of it is written again.
        let c = pool.scratch(300);
        assert_eq!(c.as_ptr(), ptr);
        assert_eq!(c, vec![7u8; 300]);
        pool.put(c);
        let d = pool.scratch(600);
        assert_eq!(d.as_ptr(), ptr);
        assert_eq!(d[..300], [7u8; 300]);
        assert_eq!(d[300..], [0u8; 300], "grown past the old length: zeroed");
        pool.put(d);
        pool.put(vec![0u8; 10]);
        pool.put(vec![0u8; 20]);
        assert!(pool.free.lock().map(|f| f.len()).unwrap_or(0) <= 2);
        pool.put(vec![0u8; 2 << 20]);
        assert!(pool
            .free
            .lock()
            .map(|f| f.iter().all(|b| b.capacity() <= 1 << 20))
            .unwrap_or(false));
    }

    #[test]
    fn a_buffer_too_large_for_the_room_left_does_not_push_out_smaller_ones() {
        let pool = BufferPool::new(8, 100);
        pool.put(Vec::with_capacity(30));
        pool.put(Vec::with_capacity(60));
        pool.put(Vec::with_capacity(50));
        let kept: Vec<usize> = pool
            .free
            .lock()
            .map(|f| f.iter().map(Vec::capacity).collect())
            .unwrap_or_default();
        assert_eq!(kept, [60, 30], "the 50 has no room; the 30 still fits");
    }

    #[test]
    fn passed_on_chunks_count_in_flight_until_the_last_is_dropped() {
        let flight = Arc::new(InFlight::default());
        let chunks = vec![
            Bytes::from_static(&[1; 100]),
            Bytes::from_static(&[2; 50]),
            Bytes::from_static(&[3; 7]),
        ];
        let mut out = counted(chunks, Arc::new(FlightShare::new(&flight, 157)));
        assert_eq!(flight.bytes(), 157);
        assert_eq!(
            out.iter().map(Bytes::len).collect::<Vec<_>>(),
            vec![100, 50, 7]
        );
        assert_eq!(&out[2][..], &[3; 7], "the last chunk keeps its bytes");
        let last = out.pop();
        drop(out);
        assert_eq!(flight.bytes(), 157, "held while the last chunk lives");
        drop(last);
        assert_eq!(flight.bytes(), 0);
        assert!(counted(Vec::new(), Arc::new(FlightShare::new(&flight, 0))).is_empty());
        assert_eq!(flight.bytes(), 0);
    }

    #[test]
    fn send_copies_count_in_flight_until_dropped_and_are_reused() {
        let pool = Arc::new(SendPool::new(4 << 20));
        let flight = Arc::new(InFlight::default());
        let src = vec![3u8; 1 << 20];
        let a = pool.copy_of(&src, &flight);
        let ptr = a.as_ptr();
        let part = a.slice(10..20);
        assert_eq!(flight.bytes(), 1 << 20);
        drop(a);
        assert_eq!(flight.bytes(), 1 << 20, "a slice still holds the buffer");
        drop(part);
        assert_eq!(flight.bytes(), 0);
        let b = pool
            .filled(1 << 20, &flight, |out| {
                out.fill(5);
                Ok::<(), ()>(())
            })
            .unwrap_or_default();
        assert_eq!(b.as_ptr(), ptr, "the returned buffer is reused");
        assert!(b.iter().all(|x| *x == 5));
        // Small copies are not pooled, and a buffer over twice the size is not reused.
        drop(b);
        let small = pool.copy_of(&[1u8; 100], &flight);
        assert_ne!(small.as_ptr(), ptr);
        let tiny = pool.copy_of(&[1u8; 100 << 10], &flight);
        assert_ne!(tiny.as_ptr(), ptr);
        drop((small, tiny));
        assert_eq!(flight.bytes(), 0);
    }

    #[test]
    fn take_len_reuses_a_buffer_without_clearing_it_and_zeroes_only_new_bytes() {
        let pool = SendPool::new(4 << 20);
        let fresh = pool.take_len(100 << 10);
        assert_eq!(fresh.len(), 100 << 10);
        assert!(fresh.iter().all(|x| *x == 0), "new memory is zeroed");
        pool.put(vec![9u8; 1 << 20]);
        let shorter = pool.take_len(600 << 10);
        assert_eq!(shorter.len(), 600 << 10);
        assert!(shorter.iter().all(|x| *x == 9), "reused as it was");
        pool.put(shorter);
        let longer = pool.take_len(1 << 20);
        assert_eq!(longer.len(), 1 << 20);
        assert!(longer[..600 << 10].iter().all(|x| *x == 9));
        assert!(
            longer[600 << 10..].iter().all(|x| *x == 0),
            "past the old length"
        );
        pool.put(longer);
        assert!(
            pool.take(1 << 20).is_empty(),
            "take still hands out an empty buffer"
        );
    }
}
