//! quinn's UDP socket with its segmentation offload (GSO) batches kept under the kernel's
//! limit, whatever the datagram size.
//!
//! quinn batches up to 10 datagrams into one GSO send. The kernel refuses a batch above
//! 64 KiB (`EMSGSIZE`), and quinn drops such a batch without a word, so with quinn's own
//! socket the UDP payload had to stay under ~6500 bytes. This socket splits a larger batch
//! into sends that each fit, so datagrams of any size up to the path's MTU (found by MTU
//! discovery: 64 KiB on loopback, 9000 or 1500 on most fabrics) keep GSO, and quinn's
//! per-packet work, which dominates its CPU cost, is spread over more bytes. The receive
//! side is sized the same way: one coalesced (GRO) read holds at most 64 KiB, so a read
//! slot needs room for no more than that (quinn's default sizes every slot for 64
//! datagrams of the largest size), and one system call fills at most [`RECV_SLOTS`] of
//! quinn's 32 slots.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// The most UDP payload bytes one segmentation-offload batch (or one coalesced receive)
/// may carry: the 64 KiB IP datagram limit less the IPv6 and UDP headers, with room to
/// spare.
const OFFLOAD_BYTES: usize = 65_000;

/// The most receive slots (coalesced reads of at most [`OFFLOAD_BYTES`]) one system call
/// fills.
///
/// quinn hands the socket 32 slots, and with a busy peer the kernel fills all of them in
/// one call: up to 2 MiB of datagrams, spread over 4 MiB of quinn's buffer, before quinn
/// copies the first one out of it. By then that datagram has left the 1-2 MiB L2 cache, so
/// quinn's copy reads it from memory, and the kernel's copy wrote it there through cold
/// lines. Four slots (256 KiB) keep both copies in the cache and a slot's lines warm for
/// the next call, at the price of more calls (one per 256 KiB, not per 2 MiB). Measured
/// here (A-B-B-A, `bench/abba.sh`): 8 ranks in one process, collectives of 1-4 MiB 7-23%
/// less CPU per byte with 1, 2 or 4 slots than with 32; 4 processes, 4-16 MiB 4-11% less;
/// 2 ranks and the one-way stream within the noise (bench/HISTORY.md, session 21).
pub(crate) const RECV_SLOTS: usize = 4;

/// Datagrams of `payload` bytes that fit in one offload batch (at least 1).
pub(crate) fn offload_segments(payload: usize) -> usize {
    (OFFLOAD_BYTES / payload.max(1)).max(1)
}

/// An [`AsyncUdpSocket`] that forwards everything to quinn's own socket, splitting
/// offload batches larger than [`OFFLOAD_BYTES`] and sizing receive slots for one
/// coalesced read of at most that much.
pub(crate) struct CappedOffload {
    inner: Arc<dyn AsyncUdpSocket>,
    segments: usize,
}

impl CappedOffload {
    /// Wraps `inner` for datagrams of at most `max_payload` bytes (which sizes the receive
    /// slots).
    pub(crate) fn new(inner: Arc<dyn AsyncUdpSocket>, max_payload: u16) -> CappedOffload {
        CappedOffload {
            inner,
            segments: offload_segments(usize::from(max_payload)),
        }
    }
}

impl fmt::Debug for CappedOffload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CappedOffload")
            .field("inner", &self.inner)
            .field("segments", &self.segments)
            .finish()
    }
}

impl AsyncUdpSocket for CappedOffload {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        let Some(size) = transmit
            .segment_size
            .filter(|_| transmit.contents.len() > OFFLOAD_BYTES)
        else {
            return self.inner.try_send(transmit);
        };
        // Whole datagrams per send, as many as fit (at least one). If a later piece fails
        // (the socket buffer is full), the error goes back to quinn, which sends the whole
        // batch again later: the receiver drops the datagrams it already has as duplicate
        // packets, where reporting success would have lost the rest.
        let per_send = offload_segments(size) * size.max(1);
        for piece in transmit.contents.chunks(per_send) {
            self.inner.try_send(&Transmit {
                destination: transmit.destination,
                ecn: transmit.ecn,
                contents: piece,
                segment_size: (piece.len() > size).then_some(size),
                src_ip: transmit.src_ip,
            })?;
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let slots = bufs.len().min(meta.len()).min(RECV_SLOTS);
        self.inner
            .poll_recv(cx, &mut bufs[..slots], &mut meta[..slots])
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        // Batches of any size: `try_send` splits what the kernel would refuse.
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        // One extra segment of room: a coalesced read never exceeds 64 KiB, and this
        // many payload-sized slots always cover it.
        self.inner.max_receive_segments().min(self.segments + 1)
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Mutex;

    /// Records every send; fails the sends whose index is in `fail`.
    #[derive(Debug, Default)]
    struct Recorder {
        sent: Mutex<Vec<(Vec<u8>, Option<usize>)>>,
        fail: Vec<usize>,
        /// How many slots each receive was given.
        recv_slots: Mutex<Vec<usize>>,
    }

    #[derive(Debug)]
    struct Ready;

    impl UdpPoller for Ready {
        fn poll_writable(self: Pin<&mut Self>, _: &mut Context) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncUdpSocket for Recorder {
        fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
            Box::pin(Ready)
        }

        fn try_send(&self, t: &Transmit) -> io::Result<()> {
            let mut sent = self.sent.lock().unwrap();
            if self.fail.contains(&sent.len()) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            assert!(t.contents.len() <= OFFLOAD_BYTES || t.segment_size.is_none());
            sent.push((t.contents.to_vec(), t.segment_size));
            Ok(())
        }

        fn poll_recv(
            &self,
            _: &mut Context,
            bufs: &mut [IoSliceMut<'_>],
            meta: &mut [RecvMeta],
        ) -> Poll<io::Result<usize>> {
            assert_eq!(bufs.len(), meta.len());
            self.recv_slots.lock().unwrap().push(bufs.len());
            Poll::Pending
        }

        fn local_addr(&self) -> io::Result<SocketAddr> {
            Ok(SocketAddr::from(([127, 0, 0, 1], 9)))
        }

        fn max_transmit_segments(&self) -> usize {
            10
        }

        fn max_receive_segments(&self) -> usize {
            64
        }
    }

    fn transmit(contents: &[u8], segment_size: Option<usize>) -> Transmit<'_> {
        Transmit {
            destination: SocketAddr::from(([127, 0, 0, 1], 7)),
            ecn: None,
            contents,
            segment_size,
            src_ip: None,
        }
    }

    fn send(
        rec: Arc<Recorder>,
        contents: &[u8],
        seg: Option<usize>,
    ) -> io::Result<Vec<(Vec<u8>, Option<usize>)>> {
        let socket = CappedOffload::new(rec.clone(), 65_000);
        socket.try_send(&transmit(contents, seg))?;
        Ok(std::mem::take(&mut *rec.sent.lock().unwrap()))
    }

    #[test]
    fn oversized_batches_are_split_into_whole_datagrams() {
        let data: Vec<u8> = (0..90_000u32).map(|i| i as u8).collect();
        // 10 datagrams of 9000: 7 fit in one send, 3 in the next.
        let sent = send(Arc::default(), &data, Some(9000)).unwrap();
        assert_eq!(sent.len(), 2);
        assert_eq!((sent[0].0.len(), sent[0].1), (63_000, Some(9000)));
        assert_eq!((sent[1].0.len(), sent[1].1), (27_000, Some(9000)));
        assert_eq!([&sent[0].0[..], &sent[1].0[..]].concat(), data);
        // Datagrams too big to batch go one per send, as single datagrams.
        let big: Vec<u8> = (0..3 * 60_000u32).map(|i| (i * 7) as u8).collect();
        let sent = send(Arc::default(), &big, Some(60_000)).unwrap();
        assert_eq!(sent.len(), 3);
        assert!(sent
            .iter()
            .all(|(c, seg)| c.len() == 60_000 && seg.is_none()));
        assert_eq!(
            sent.into_iter().flat_map(|(c, _)| c).collect::<Vec<u8>>(),
            big
        );
        // A last datagram shorter than the segment size stays whole.
        let sent = send(Arc::default(), &big[..150_000], Some(60_000)).unwrap();
        assert_eq!(
            sent.iter().map(|(c, _)| c.len()).collect::<Vec<_>>(),
            vec![60_000, 60_000, 30_000]
        );
    }

    #[test]
    fn batches_that_fit_pass_through_unchanged() {
        let data = vec![5u8; 65_000];
        let sent = send(Arc::default(), &data, Some(6500)).unwrap();
        assert_eq!(sent, vec![(data, Some(6500))]);
        let one = vec![1u8; 64_000];
        let sent = send(Arc::default(), &one, None).unwrap();
        assert_eq!(sent, vec![(one, None)]);
    }

    #[test]
    fn a_failed_piece_fails_the_whole_send() {
        let rec = Arc::new(Recorder {
            fail: vec![1],
            ..Recorder::default()
        });
        let data = vec![0u8; 3 * 40_000];
        let err = send(rec.clone(), &data, Some(40_000)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(
            rec.sent.lock().unwrap().len(),
            1,
            "stops at the failed piece"
        );
    }

    #[test]
    fn receive_slots_hold_one_coalesced_read() {
        let rec: Arc<Recorder> = Arc::default();
        for payload in [1200u16, 6500, 9000, 65_000] {
            let n = CappedOffload::new(rec.clone(), payload).max_receive_segments();
            assert!(n * usize::from(payload) >= 65_535, "{payload}: {n}");
            assert!(n <= 64);
        }
    }

    #[test]
    fn one_receive_fills_at_most_recv_slots() {
        let rec: Arc<Recorder> = Arc::default();
        let socket = CappedOffload::new(rec.clone(), 65_000);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for given in [32, RECV_SLOTS + 1, RECV_SLOTS, 1] {
            let mut storage = vec![[0u8; 16]; given];
            let mut bufs: Vec<IoSliceMut<'_>> =
                storage.iter_mut().map(|b| IoSliceMut::new(b)).collect();
            let mut meta = vec![RecvMeta::default(); given];
            assert!(socket.poll_recv(&mut cx, &mut bufs, &mut meta).is_pending());
        }
        assert_eq!(
            *rec.recv_slots.lock().unwrap(),
            vec![RECV_SLOTS, RECV_SLOTS, RECV_SLOTS, 1]
        );
    }

    #[test]
    fn batches_stay_under_the_offload_limit() {
        for payload in [1200u16, 1472, 6500, 9000, 16_000, 32_000, 65_000, 65_527] {
            let n = offload_segments(usize::from(payload));
            assert!(n >= 1);
            assert!(
                n == 1 || n * usize::from(payload) <= OFFLOAD_BYTES,
                "{n} x {payload}"
            );
            assert!(
                (n + 1) * usize::from(payload) > OFFLOAD_BYTES,
                "{payload}: room for one more"
            );
        }
        assert_eq!(offload_segments(6500), 10, "quinn's own batch size at 6500");
    }
}
