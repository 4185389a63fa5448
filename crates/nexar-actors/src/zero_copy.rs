//! [`ZeroCopyBuffer`]: host memory that collectives send from without copying.
//!
//! A collective over a borrowed `&mut [T]` must copy every range it sends: QUIC holds sent
//! bytes until the peer acknowledges them, which can be after the call's future is
//! dropped and the borrow has ended. A `ZeroCopyBuffer` owns its memory behind an `Arc`,
//! so a send can hand QUIC a *loan* of a range instead (`Bytes` that keep the memory
//! alive and register the range as lent until the transport drops them). The driver never
//! writes a lent range: an action that would waits until the loan comes back (the peer
//! acknowledged those bytes, or the connection dropped them), and [`Region`] refuses such
//! a write outright, so a missed wait is an error, never a race.

use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use nexar_device::Element;
use tokio::sync::Notify;

use crate::pool::{FlightShare, InFlight};
use crate::{NexarError, Result};

/// Host memory for collectives that send straight from it, without the copy a `&[T]`
/// argument costs (`Communicator::all_reduce_zero_copy` and the other `*_zero_copy`
/// forms).
///
/// It owns a `Vec<T>`. While a collective runs on it, the transport may hold loans of
/// ranges that were sent (until the peer acknowledges them); they keep the memory alive
/// even if the buffer is dropped or the collective's future is cancelled. Reading is
/// always possible ([`std::ops::Deref`]). Writing needs every loan back:
/// [`ZeroCopyBuffer::writable`] waits for them, [`ZeroCopyBuffer::as_mut_slice`] moves
/// the contents to fresh memory if any is still out (a copy, which `writable` avoids).
/// Collectives on the buffer wait for loans of ranges they write by themselves.
///
/// ```
/// use nexar_actors::ZeroCopyBuffer;
///
/// let mut grads = ZeroCopyBuffer::from(vec![1.0f32; 1024]);
/// grads.as_mut_slice()[0] = 2.0; // nothing lent: written in place
/// assert_eq!(grads[0], 2.0);
/// assert_eq!(grads.into_vec().len(), 1024);
/// ```
pub struct ZeroCopyBuffer<T: Element> {
    store: Arc<Store<T>>,
}

impl<T: Element> From<Vec<T>> for ZeroCopyBuffer<T> {
    fn from(v: Vec<T>) -> Self {
        ZeroCopyBuffer {
            store: Arc::new(Store::new(v)),
        }
    }
}

impl<T: Element> std::ops::Deref for ZeroCopyBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // Loans only read; nothing writes while `self` is shared.
        unsafe { std::slice::from_raw_parts(self.store.ptr.as_ptr(), self.store.len) }
    }
}

impl<T: Element> std::fmt::Debug for ZeroCopyBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroCopyBuffer")
            .field("len", &self.store.len)
            .field("lent", &self.is_lent())
            .finish()
    }
}

impl<T: Element> ZeroCopyBuffer<T> {
    /// Whether the transport still holds a loan of some range of this buffer.
    pub fn is_lent(&self) -> bool {
        Arc::strong_count(&self.store) > 1
    }

    /// The elements, writable. If a loan is still out, the contents first move to fresh
    /// memory (a copy of the whole buffer; the loans keep the old memory until they
    /// return): use [`ZeroCopyBuffer::writable`] to wait for them instead.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        if Arc::get_mut(&mut self.store).is_none() {
            tracing::debug!(
                len = self.store.len,
                "zero-copy buffer still lent: writing to a copy"
            );
            self.store = Arc::new(Store::new(self.to_vec()));
        }
        let store = &self.store;
        // Unique: no loan, and `&mut self` excludes every other access.
        unsafe { std::slice::from_raw_parts_mut(store.ptr.as_ptr(), store.len) }
    }

    /// The elements, writable, once every loan has come back. A loan returns when the
    /// peer acknowledges its bytes, or when its connection closes (at the latest after
    /// the transport's idle timeout), so this wait is bounded.
    pub async fn writable(&mut self) -> &mut [T] {
        loop {
            let seen = self.store.loans.returns();
            if !self.is_lent() {
                return self.as_mut_slice();
            }
            self.store.loans.returned_since(seen).await;
        }
    }

    /// The `Vec` back (a copy if a loan is still out).
    pub fn into_vec(self) -> Vec<T> {
        match Arc::try_unwrap(self.store) {
            Ok(store) => store.into_vec(),
            Err(store) => {
                // SAFETY: as in `Deref`: loans only read.
                unsafe { std::slice::from_raw_parts(store.ptr.as_ptr(), store.len) }.to_vec()
            }
        }
    }

    /// The buffer as the driver's `Data`: written by range, and lending the ranges it
    /// sends. The `&mut` borrow keeps everyone else out for the region's lifetime.
    pub(crate) fn region(&mut self) -> Region<'_> {
        let len = std::mem::size_of_val::<[T]>(self);
        let store: &Arc<Store<T>> = &self.store;
        Region {
            ptr: store.ptr.as_ptr().cast::<u8>(),
            len,
            lender: Some(store),
            _life: PhantomData,
        }
    }

    /// The buffer's bytes, read only, and the lender of its ranges (the driver's `Input`).
    pub(crate) fn lent_input(&self) -> (&[u8], &dyn Lender) {
        (bytemuck::cast_slice(self), &self.store)
    }
}

/// A `Vec<T>` taken apart, so that loans can read ranges of it while the driver writes
/// others through raw pointers.
struct Store<T: Element> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
    /// Shared with every loan, which needs it after letting go of the store.
    loans: Arc<Loans>,
}

// SAFETY: `Store` owns plain data (`Element` is `Pod + Send + Sync`); who may write which
// range is governed by `Loans` and `&mut ZeroCopyBuffer`.
unsafe impl<T: Element> Send for Store<T> {}
unsafe impl<T: Element> Sync for Store<T> {}

impl<T: Element> Store<T> {
    fn new(v: Vec<T>) -> Store<T> {
        let mut v = std::mem::ManuallyDrop::new(v);
        Store {
            // A Vec's pointer is never null (dangling but aligned when empty).
            ptr: NonNull::new(v.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len: v.len(),
            cap: v.capacity(),
            loans: Arc::default(),
        }
    }

    fn into_vec(self) -> Vec<T> {
        let mut this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so its `loans` is dropped here once (it is an
        // allocation of its own, leaked before), and the parts of the Vec taken apart in
        // `new` are given back once.
        unsafe {
            std::ptr::drop_in_place(&mut this.loans);
            Vec::from_raw_parts(this.ptr.as_ptr(), this.len, this.cap)
        }
    }
}

impl<T: Element> Drop for Store<T> {
    fn drop(&mut self) {
        // SAFETY: as in `into_vec`.
        drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, self.cap) });
    }
}

/// What the driver needs of a buffer it sends from without copying.
pub(crate) trait Lender: Send + Sync {
    /// `range` (bytes) as `Bytes` that register it as lent, and count against `flight`,
    /// until the transport drops them.
    fn lend(&self, range: Range<usize>, flight: &Arc<InFlight>) -> Bytes;
    /// The ranges on loan now.
    fn loans(&self) -> &Loans;
}

impl<T: Element> Lender for Arc<Store<T>> {
    fn lend(&self, range: Range<usize>, flight: &Arc<InFlight>) -> Bytes {
        if range.is_empty() {
            return Bytes::new();
        }
        self.loans.open(range.clone());
        let share = FlightShare::new(flight, range.len());
        Bytes::from_owner(Loan {
            store: Some(self.clone()),
            loans: self.loans.clone(),
            range,
            _share: share,
        })
    }

    fn loans(&self) -> &Loans {
        &self.loans
    }
}

/// `r` of a buffer of `len` bytes lent by `lender`; `None` when out of bounds.
pub(crate) fn lend(
    lender: &dyn Lender,
    len: usize,
    r: &Range<usize>,
    flight: &Arc<InFlight>,
) -> Option<Bytes> {
    (r.start <= r.end && r.end <= len).then(|| lender.lend(r.clone(), flight))
}

/// One lent range, as the owner of the `Bytes` the transport holds.
struct Loan<T: Element> {
    /// `Some` until dropped.
    store: Option<Arc<Store<T>>>,
    loans: Arc<Loans>,
    range: Range<usize>,
    _share: FlightShare,
}

impl<T: Element> AsRef<[u8]> for Loan<T> {
    fn as_ref(&self) -> &[u8] {
        let Some(store) = &self.store else {
            return &[];
        };
        // SAFETY: `range` was checked against the buffer when lent (`Region::lend`), and
        // nothing writes it while it is registered in `loans`.
        unsafe {
            std::slice::from_raw_parts(
                store.ptr.as_ptr().cast::<u8>().add(self.range.start),
                self.range.len(),
            )
        }
    }
}

impl<T: Element> Drop for Loan<T> {
    fn drop(&mut self) {
        // Let go of the store before announcing the return, so whoever the return wakes
        // finds the buffer no longer shared (`ZeroCopyBuffer::writable`).
        drop(self.store.take());
        self.loans.close(&self.range);
    }
}

/// The byte ranges of one buffer on loan to the transport.
#[derive(Debug, Default)]
pub(crate) struct Loans {
    ranges: Mutex<Vec<Range<usize>>>,
    /// How many loans have come back, ever: a waiter reads it before checking the
    /// ranges, so a return between its check and its wait is not missed.
    returns: AtomicU64,
    returned: Notify,
}

impl Loans {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Range<usize>>> {
        self.ranges.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn open(&self, r: Range<usize>) {
        self.lock().push(r);
    }

    fn close(&self, r: &Range<usize>) {
        {
            let mut ranges = self.lock();
            if let Some(i) = ranges.iter().position(|x| x == r) {
                ranges.swap_remove(i);
            }
        }
        self.returns.fetch_add(1, Ordering::AcqRel);
        self.returned.notify_waiters();
    }

    /// Whether some loan overlaps `r` (an empty `r` overlaps nothing, wherever it lies).
    pub(crate) fn overlaps(&self, r: &Range<usize>) -> bool {
        !r.is_empty()
            && self
                .lock()
                .iter()
                .any(|x| x.start < r.end && r.start < x.end)
    }

    /// Loans returned so far (see [`Loans::returned_since`]).
    pub(crate) fn returns(&self) -> u64 {
        self.returns.load(Ordering::Acquire)
    }

    /// Resolves once a loan has come back since [`Loans::returns`] read `seen`.
    pub(crate) async fn returned_since(&self, seen: u64) {
        loop {
            let notified = self.returned.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.returns() != seen {
                return;
            }
            notified.await;
        }
    }
}

/// The driver's `Data` in host memory: read and written by range. Over a
/// [`ZeroCopyBuffer`] it lends the ranges sends read, and refuses to write a range on loan.
pub(crate) struct Region<'a> {
    ptr: *mut u8,
    len: usize,
    lender: Option<&'a dyn Lender>,
    _life: PhantomData<&'a mut [u8]>,
}

// SAFETY: a `Region` is a `&mut [u8]` with checked access by range.
unsafe impl Send for Region<'_> {}
unsafe impl Sync for Region<'_> {}

impl<'a> Region<'a> {
    /// A borrowed buffer: nothing is ever lent from it.
    pub(crate) fn new(buf: &'a mut [u8]) -> Region<'a> {
        Region {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            lender: None,
            _life: PhantomData,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The lender, when ranges are lent instead of copied.
    pub(crate) fn lender(&self) -> Option<&'a dyn Lender> {
        self.lender
    }

    /// The same region, borrowed for less long (to [`Region::split`] it).
    pub(crate) fn reborrow(&mut self) -> Region<'_> {
        Region {
            ptr: self.ptr,
            len: self.len,
            lender: self.lender,
            _life: PhantomData,
        }
    }

    /// Whether writing `r` must wait for a loan to come back.
    pub(crate) fn is_lent(&self, r: &Range<usize>) -> bool {
        self.lender.is_some_and(|l| l.loans().overlaps(r))
    }

    pub(crate) fn get(&self, r: Range<usize>) -> Option<&[u8]> {
        (r.start <= r.end && r.end <= self.len)
            // SAFETY: in bounds; shared with loans (which only read) and with nothing
            // that writes, since writing needs `&mut self`.
            .then(|| unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) })
    }

    /// `r` writable: `None` out of bounds, an error if part of it is on loan.
    pub(crate) fn get_mut(&mut self, r: Range<usize>) -> Result<Option<&mut [u8]>> {
        if r.start > r.end || r.end > self.len {
            return Ok(None);
        }
        self.check_unlent(&r)?;
        // SAFETY: in bounds, not lent, and `&mut self` excludes our own other borrows.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len())
        }))
    }

    /// `src` to read and `dst` to write, which must not overlap; `None` if either is out
    /// of bounds.
    pub(crate) fn split(
        self,
        src: Range<usize>,
        dst: Range<usize>,
    ) -> Result<Option<(&'a [u8], &'a mut [u8])>> {
        let inside = |r: &Range<usize>| r.start <= r.end && r.end <= self.len;
        if !inside(&src) || !inside(&dst) {
            return Ok(None);
        }
        // An empty range overlaps nothing, wherever it lies.
        let overlap = !src.is_empty() && !dst.is_empty();
        if overlap && src.start < dst.end && dst.start < src.end {
            return Err(NexarError::InvalidArgument(format!(
                "schedule produced overlapping ranges {src:?} and {dst:?}"
            )));
        }
        self.check_unlent(&dst)?;
        // SAFETY: both in bounds and disjoint; `dst` is not lent.
        Ok(Some(unsafe {
            (
                std::slice::from_raw_parts(self.ptr.add(src.start), src.len()),
                std::slice::from_raw_parts_mut(self.ptr.add(dst.start), dst.len()),
            )
        }))
    }

    /// Waits (at most `within`) for every loan of a byte of `r` to come back, then returns
    /// `r` writable; `None` when `r` is out of bounds. Loans of other ranges may stay out.
    pub(crate) async fn writable(
        &mut self,
        r: Range<usize>,
        within: std::time::Duration,
    ) -> Result<Option<&mut [u8]>> {
        if let Some(lender) = self.lender {
            let loans = lender.loans();
            let wait = async {
                loop {
                    let seen = loans.returns();
                    if !loans.overlaps(&r) {
                        return;
                    }
                    loans.returned_since(seen).await;
                }
            };
            tokio::time::timeout(within, wait)
                .await
                .map_err(|_| NexarError::Timeout {
                    what: "sent bytes of a zero-copy buffer to be acknowledged".into(),
                    after: within,
                })?;
        }
        self.get_mut(r)
    }

    /// `r` lent to the transport as `Bytes` (no copy) when this region lends its ranges;
    /// `None` when it does not, or when `r` is out of bounds (the caller's copy reports
    /// that).
    pub(crate) fn lend(&self, r: &Range<usize>, flight: &Arc<InFlight>) -> Option<Bytes> {
        lend(self.lender?, self.len, r, flight)
    }

    fn check_unlent(&self, r: &Range<usize>) -> Result<()> {
        if self.is_lent(r) {
            return Err(NexarError::Actor(format!(
                "collective driver wrote bytes {r:?} while the transport still holds them"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn lend_bytes<T: Element>(
        buf: &mut ZeroCopyBuffer<T>,
        r: Range<usize>,
        flight: &Arc<InFlight>,
    ) -> Bytes {
        buf.region().lend(&r, flight).unwrap_or_default()
    }

    #[test]
    fn split_refuses_overlaps_but_not_an_empty_range_inside_another() {
        let mut buf = ZeroCopyBuffer::from(vec![0u8; 16]);
        let mut fits = |src: Range<usize>, dst: Range<usize>| match buf.region().split(src, dst) {
            Ok(Some(_)) => "ok",
            Ok(None) => "out of bounds",
            Err(_) => "overlap",
        };
        assert_eq!(fits(5..5, 0..10), "ok");
        assert_eq!(fits(0..10, 5..5), "ok");
        assert_eq!(fits(0..8, 8..16), "ok");
        assert_eq!(fits(0..9, 8..16), "overlap");
        assert_eq!(fits(0..8, 8..17), "out of bounds");
    }

    #[test]
    fn into_vec_frees_the_loan_table() {
        let mut buf = ZeroCopyBuffer::from((0u32..16).collect::<Vec<_>>());
        let flight = Arc::new(InFlight::default());
        drop(lend_bytes(&mut buf, 0..8, &flight));
        let table = Arc::downgrade(&buf.store.loans);
        assert_eq!(buf.into_vec(), (0u32..16).collect::<Vec<_>>());
        assert!(table.upgrade().is_none(), "the loan table was leaked");
    }

    #[test]
    fn a_loan_reads_the_buffer_itself_and_keeps_writes_off_its_range() {
        let mut buf = ZeroCopyBuffer::from((0u32..16).collect::<Vec<_>>());
        let base = buf.as_ptr().cast::<u8>();
        let flight = Arc::new(InFlight::default());
        let loan = lend_bytes(&mut buf, 8..24, &flight);
        assert_eq!(
            loan.as_ptr(),
            base.wrapping_add(8),
            "no copy: the buffer's own bytes"
        );
        assert_eq!(&loan[..4], &2u32.to_ne_bytes());
        assert_eq!(flight.bytes(), 16, "a loan counts as in flight");
        assert!(buf.is_lent());
        let mut region = buf.region();
        assert!(region.is_lent(&(20..28)) && !region.is_lent(&(24..32)));
        assert!(
            matches!(region.get_mut(0..8), Ok(Some(_))),
            "outside the loan"
        );
        assert!(
            region.get_mut(20..28).is_err(),
            "a write into the loan is refused"
        );
        assert!(
            region.reborrow().split(0..4, 16..20).is_err(),
            "as a destination too"
        );
        assert!(
            matches!(region.reborrow().split(16..20, 0..4), Ok(Some(_))),
            "reading it is fine"
        );
        assert!(matches!(region.get_mut(60..68), Ok(None)), "out of bounds");
        assert!(region.lend(&(60..68), &flight).is_none());
        drop(loan);
        assert!(
            matches!(region.get_mut(20..28), Ok(Some(_))),
            "returned: writable"
        );
        assert_eq!(flight.bytes(), 0);
        assert!(!buf.is_lent());
        assert!(
            lend_bytes(&mut buf, 4..4, &flight).is_empty(),
            "empty: nothing lent"
        );
        assert!(!buf.is_lent());
    }

    #[tokio::test]
    async fn writable_waits_for_loans_and_as_mut_slice_moves_off_them() {
        let mut buf = ZeroCopyBuffer::from(vec![7u32; 1024]);
        let base = buf.as_ptr();
        let flight = Arc::new(InFlight::default());
        let loan = lend_bytes(&mut buf, 0..64, &flight);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let holder = tokio::spawn(async move {
            let _ = rx.await;
            drop(loan);
        });
        {
            let mut wait = std::pin::pin!(buf.writable());
            assert!((&mut wait).now_or_never().is_none(), "waits while lent");
            let _ = tx.send(());
            let out = tokio::time::timeout(std::time::Duration::from_secs(10), wait)
                .await
                .expect("writable once the loan returns");
            assert_eq!(out.as_ptr(), base, "written in place: no copy");
            out[0] = 1;
        }
        holder.await.expect("holder");
        assert_eq!(buf[0], 1);

        // With a loan out, a synchronous write moves the contents to fresh memory; the
        // loan keeps reading the old bytes.
        let loan = lend_bytes(&mut buf, 0..8, &flight);
        buf.as_mut_slice()[0] = 2;
        assert_ne!(buf.as_ptr(), base);
        assert_eq!(&loan[..4], &1u32.to_ne_bytes());
        assert_eq!((buf[0], buf[1], buf.len()), (2, 7, 1024));
        assert!(!buf.is_lent(), "the new memory is the buffer's alone");
        drop(loan);
        let v = buf.into_vec();
        assert_eq!((v[0], v[1023], v.len()), (2, 7, 1024));
    }

    /// An empty range inside a loan is not lent: writing it needs no wait (it counted as
    /// lent, so a zero-byte write would have waited for the loan).
    #[test]
    fn an_empty_range_inside_a_loan_is_not_lent() {
        let mut buf = ZeroCopyBuffer::from(vec![0u32; 1024]);
        let flight = Arc::new(InFlight::default());
        let _loan = lend_bytes(&mut buf, 0..2048, &flight);
        let mut region = buf.region();
        assert!(region.is_lent(&(100..101)));
        assert!(!region.is_lent(&(1024..1024)));
        assert!(matches!(region.get_mut(1024..1024), Ok(Some(b)) if b.is_empty()));
    }

    /// An in-place reduce-scatter's Avg divides this rank's block as soon as that block's
    /// loans are back: a loan of another block (sent, never written again) does not hold
    /// the call (it used to wait for every loan of the buffer, up to the call's deadline).
    #[tokio::test]
    async fn an_avg_reduce_scatter_finishes_while_another_block_is_lent() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        let n = 100_000;
        let flight = Arc::new(InFlight::default());
        let mut loans = Vec::new();
        let calls: Vec<_> = (0..2usize)
            .map(|r| {
                let mut buf = ZeroCopyBuffer::from(vec![(r + 1) as f32; n]);
                // The other rank's block, as if the transport still held it.
                let other = (1 - r) * n / 2 * 4..(2 - r) * n / 2 * 4;
                loans.push(lend_bytes(&mut buf, other, &flight));
                let c = comms[r].clone();
                tokio::spawn(async move {
                    c.reduce_scatter_in_place_zero_copy(&mut buf, nexar_device::ReduceOp::Avg)
                        .await
                        .map(|()| buf)
                })
            })
            .collect();
        for (r, call) in calls.into_iter().enumerate() {
            let buf = tokio::time::timeout(std::time::Duration::from_secs(20), call)
                .await
                .expect("finishes with the other block still lent")
                .expect("task")
                .expect("reduce-scatter");
            let mine = &buf[r * n / 2..(r + 1) * n / 2];
            assert!(
                mine.iter().all(|x| *x == 1.5),
                "rank {r}: the mean of 1 and 2"
            );
        }
        drop(loans);
    }

    /// A collective waits for a loan of a range it writes, instead of writing under it:
    /// rank 0's whole buffer is on loan (as if the transport still held an earlier call's
    /// sends) when the all-reduce starts.
    #[tokio::test]
    async fn a_collective_writes_a_lent_range_only_once_it_returns() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        let n = 100_000;
        let mut bufs: Vec<ZeroCopyBuffer<u32>> = (0..2u32)
            .map(|r| ZeroCopyBuffer::from(vec![r + 1; n]))
            .collect();
        let flight = Arc::new(InFlight::default());
        let loan = lend_bytes(&mut bufs[0], 0..n * 4, &flight);
        let (b1, b0) = (bufs.pop(), bufs.pop());
        let (Some(mut b0), Some(mut b1)) = (b0, b1) else {
            panic!("two buffers");
        };
        let (c0, c1) = (comms[0].clone(), comms[1].clone());
        let other = tokio::spawn(async move {
            c1.all_reduce_zero_copy(&mut b1, nexar_device::ReduceOp::Sum)
                .await
                .map(|()| b1)
        });
        let deadline = std::time::Duration::from_secs(60);
        {
            let call = c0.all_reduce_zero_copy(&mut b0, nexar_device::ReduceOp::Sum);
            let mut call = std::pin::pin!(call);
            let early =
                tokio::time::timeout(std::time::Duration::from_millis(300), &mut call).await;
            assert!(early.is_err(), "finished under the loan: {early:?}");
            assert_eq!(
                &loan[..4],
                &1u32.to_ne_bytes(),
                "the lent bytes are untouched"
            );
            drop(loan);
            tokio::time::timeout(deadline, call)
                .await
                .expect("finishes once the loan returns")
                .expect("all-reduce");
        }
        let b1 = tokio::time::timeout(deadline, other)
            .await
            .expect("rank 1 finishes")
            .expect("task")
            .expect("all-reduce");
        assert!(b0.iter().chain(b1.iter()).all(|x| *x == 3));
    }
}
