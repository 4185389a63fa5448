//! The collective driver: runs one schedule from nexar-collectives over the transport,
//! inside the caller's future, on the caller's buffers.
//!
//! Every buffer access (copying a send range out, writing it to a trusted-fabric socket,
//! reducing a received payload in, local copies and reductions) happens while the caller's
//! future is being polled, and the only things that outlive a poll are owned: the `Bytes`
//! handed to the transport, the payloads it delivers and the [`DirectFrame`]s of sends
//! written straight from the caller's buffer (they hold a socket, never a borrow). So when
//! the caller drops the future, nothing can touch its memory afterwards: the in-flight
//! sends and receives are dropped with the future (a direct frame dropped half written is
//! padded and marked aborted by the transport, so its receiver discards it), and the
//! [`Ticket`] retires the collective's tag so late frames for it are discarded on arrival.
//! A send range is read until its send completes; the schedule's contract keeps it
//! unwritten until then. A send that passes a received block on unchanged
//! ([`Schedule::forwards`]: ring all-gather, chain broadcast) hands QUIC the received
//! chunks themselves instead of a copy out of the buffer, and so does a send whose range
//! holds received blocks among bytes of its own ([`Schedule::parts`]: recursive-doubling
//! all-gather), for those blocks, copying out only the rest. Receives are taken piece by
//! piece ([`Incoming`]): a block that arrives while its receive waits comes as its QUIC
//! stream (`nexar_transport::Delivery`), and each chunk is copied or reduced into place as
//! it arrives, while it is in cache, instead of after the whole block has been buffered.
//! Running on the caller's slice
//! (rather than on a copy, as the earlier actor-per-collective driver did) saves a
//! buffer-sized copy in and out per call and keeps the peak memory near the caller's own
//! buffers; running in the caller's task (rather than in an actor and a task per send
//! and receive) saves the spawns and cross-task wake-ups that dominated small
//! collectives.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::Instant;

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use nexar_collectives::{Action, BufId, BufRange, OpId, Schedule, SendPart};
use nexar_device::{DataType, DeviceMemory, ReduceOp};
use nexar_transport::{
    Delivery, DirectFrame, ElementCutter, FrameKind, Payload, TcpLane, TransportError,
    GAVE_UP_ON_ITS_OWN,
};
use tracing::{debug_span, trace, Instrument};

use crate::comm::{bulk_to, lane_to, send_error, send_frame, CommCore};
use crate::pool::{CopiedOut, FlightShare, InFlight, SendPool, SEND_PIECE_BYTES};
use crate::zero_copy::{self, Lender, Region};
use crate::{NexarError, Result};

/// Sends of a [`ZeroCopyBuffer`] shorter than this are copied, not lent. A lent range
/// cannot be written until the peer acknowledges it, and a peer that got a single
/// datagram acknowledges it only after `TransportConfig::max_ack_delay` (1 ms), unless
/// it has something to send back first: the latency-bound schedules for small buffers
/// (recursive doubling) rewrite what they just sent in the very next round, so a 4 KiB
/// all-reduce on 4 ranks took 3 ms lent against 0.2 ms copied (bench/HISTORY.md,
/// session 10). Copying under 64 KiB costs a few microseconds.
///
/// [`ZeroCopyBuffer`]: crate::ZeroCopyBuffer
const LEND_MIN_BYTES: usize = 64 << 10;

/// Reduced results that only sends read may wait for those sends in buffers of their own
/// up to this many times the send budget (`NodeConfig::collective_send_budget_bytes`)
/// when the result would otherwise go to scratch, instead of the budget itself: scratch
/// is never lent, so a result stored there is copied out again for its send. A ring
/// reduce-scatter of 64 MiB on 4 ranks in one process stored about two thirds of its
/// results in scratch with one budget and a twentieth with four, and used 6-8% less CPU
/// per byte (at 16 MiB within the noise), for 12 MiB more memory per rank (bench/HISTORY.md,
/// session 27). The collectives that reduce into scratch and only pass the result on:
/// ring reduce-scatter on 3 ranks or more, and reduce (`rsg` off the root, and
/// `binomial` on ranks with children, on 4 ranks or more). Results bound
/// for Data keep one budget: stored in place, they cost a zero-copy buffer no copy (and
/// keeping more of them measured dearer there), and a 4-rank all-reduce's peak memory
/// is a target.
const SCRATCH_RESULT_BUDGETS: usize = 4;

/// The buffers one collective works on (see [`BufId`]), borrowed from the caller for the
/// duration of the call.
pub(crate) struct Buffers<'a> {
    /// [`BufId::Data`] when it lives in host memory (empty when `device` is set).
    pub(crate) data: Region<'a>,
    /// [`BufId::Input`]: read only.
    pub(crate) input: &'a [u8],
    /// Lends ranges of `input` to sends instead of copying them (a [`ZeroCopyBuffer`]'s).
    ///
    /// [`ZeroCopyBuffer`]: crate::ZeroCopyBuffer
    input_lender: Option<&'a dyn Lender>,
    /// [`BufId::Scratch`]: a pooled buffer the driver fills in.
    scratch: Vec<u8>,
    /// When set, [`BufId::Data`] lives here (device memory): sends stage ranges out of it,
    /// receives are written or reduced into it where it lives.
    pub(crate) device: Option<&'a mut dyn DeviceMemory>,
}

impl std::fmt::Debug for Buffers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffers")
            .field("data", &self.data.len())
            .field("lends", &self.data.lender().is_some())
            .field("input", &self.input.len())
            .field("scratch", &self.scratch.len())
            .field("device", &self.device.as_ref().map(|d| d.byte_len()))
            .finish()
    }
}

impl<'a> Buffers<'a> {
    /// Host buffers: `data` in place (or the receive buffer), `input` read only.
    pub(crate) fn host(data: &'a mut [u8], input: &'a [u8]) -> Buffers<'a> {
        Buffers::lending(Region::new(data), input, None)
    }

    /// Host buffers whose ranges may be lent to sends instead of copied: `data` when it
    /// lends, `input` when `input_lender` is set.
    pub(crate) fn lending(
        data: Region<'a>,
        input: &'a [u8],
        input_lender: Option<&'a dyn Lender>,
    ) -> Buffers<'a> {
        Buffers {
            data,
            input,
            input_lender,
            scratch: Vec::new(),
            device: None,
        }
    }

    /// `Data` in device memory, `input` staged on the host.
    pub(crate) fn device(mem: &'a mut dyn DeviceMemory, input: &'a [u8]) -> Buffers<'a> {
        Buffers {
            data: Region::new(&mut []),
            input,
            input_lender: None,
            scratch: Vec::new(),
            device: Some(mem),
        }
    }

    /// These buffers with `input` read in place of the caller's send buffer (which is
    /// then not lent either).
    pub(crate) fn reading<'b>(self, input: &'b [u8]) -> Buffers<'b>
    where
        'a: 'b,
    {
        Buffers {
            data: self.data,
            input,
            input_lender: None,
            scratch: self.scratch,
            device: self.device,
        }
    }

    fn on_device(&self, r: &BufRange) -> bool {
        r.buf == BufId::Data && self.device.is_some()
    }

    /// Bytes of the caller's host buffers the call works on: `Input` and `Data` (which
    /// holds the whole input too in the in-place forms; none in device memory).
    pub(crate) fn footprint(&self) -> usize {
        self.input.len() + self.data.len()
    }

    /// Whether a send of `r` copies host bytes ([`Buffers::send_bytes`] neither lends the
    /// range nor stages it from a device).
    fn copies_host(&self, r: &BufRange) -> bool {
        !self.lends(r) && !self.on_device(r)
    }

    /// Whether a send of `r` lends the range instead of copying it: one of
    /// [`LEND_MIN_BYTES`] or more of a buffer that lends.
    fn lends(&self, r: &BufRange) -> bool {
        r.range.len() >= LEND_MIN_BYTES
            && match r.buf {
                BufId::Data => self.data.lender().is_some(),
                BufId::Input => self.input_lender.is_some(),
                BufId::Scratch => false,
            }
    }

    /// The bytes of `r` as an owned buffer (staged from the device when Data lives there),
    /// for a send: a loan of the range when its buffer lends (a [`ZeroCopyBuffer`]),
    /// otherwise a pooled copy; either counts against `flight` until the transport is
    /// done with it.
    ///
    /// [`ZeroCopyBuffer`]: crate::ZeroCopyBuffer
    fn send_bytes(
        &self,
        r: &BufRange,
        pool: &Arc<SendPool>,
        flight: &Arc<InFlight>,
    ) -> Result<Bytes> {
        let lent = match (r.buf, self.input_lender) {
            _ if !self.lends(r) => None,
            (BufId::Data, _) => self.data.lend(&r.range, flight),
            (BufId::Input, Some(l)) => zero_copy::lend(l, self.input.len(), &r.range, flight),
            _ => None,
        };
        if let Some(bytes) = lent {
            return Ok(bytes);
        }
        match (&self.device, r.buf) {
            (Some(dev), BufId::Data) => {
                Ok(pool.filled(r.range.len(), flight, |out| dev.read(r.range.start, out))?)
            }
            _ => Ok(pool.copy_of(self.get(r)?, flight)),
        }
    }

    /// Whether writing `r` must wait until the transport returns a loan of it.
    fn writes_lent(&self, r: &BufRange) -> bool {
        r.buf == BufId::Data && self.data.is_lent(&r.range)
    }

    /// The bytes of `r` as a host copy (staged from the device when Data lives there).
    fn read_vec(&self, r: &BufRange) -> Result<Vec<u8>> {
        match (&self.device, r.buf) {
            (Some(dev), BufId::Data) => {
                let mut out = vec![0u8; r.range.len()];
                dev.read(r.range.start, &mut out)?;
                Ok(out)
            }
            _ => Ok(self.get(r)?.to_vec()),
        }
    }

    /// `dst = src` or `dst = op(dst, src)` for host bytes `src`, wherever `dst` lives.
    fn store(
        &mut self,
        dst: &BufRange,
        src: &[u8],
        reduce: Option<(DataType, ReduceOp)>,
    ) -> Result<()> {
        if let (Some(dev), BufId::Data) = (self.device.as_mut(), dst.buf) {
            if src.len() != dst.range.len() {
                return Err(NexarError::LengthMismatch {
                    what: "collective message (bytes)",
                    expected: dst.range.len(),
                    actual: src.len(),
                });
            }
            match reduce {
                Some((_, op)) => dev.reduce(dst.range.start, src, op)?,
                None => dev.write(dst.range.start, src)?,
            }
            return Ok(());
        }
        let d = self.get_mut(dst)?;
        match reduce {
            Some((dtype, op)) => nexar_device::reduce_bytes(dtype, op, d, src)?,
            None => nexar_device::copy_bytes(d, src),
        }
        Ok(())
    }

    fn get(&self, r: &BufRange) -> Result<&[u8]> {
        match r.buf {
            BufId::Data => region_part(&self.data, r),
            BufId::Input => part(self.input, r),
            BufId::Scratch => part(&self.scratch, r),
        }
    }

    fn get_mut(&mut self, r: &BufRange) -> Result<&mut [u8]> {
        match r.buf {
            BufId::Data => region_part_mut(&mut self.data, r),
            BufId::Scratch => part_mut(&mut self.scratch, r),
            BufId::Input => Err(input_written()),
        }
    }

    /// A read-only source and a writable destination, which the schedule guarantees do not
    /// overlap.
    fn pair(&mut self, src: &BufRange, dst: &BufRange) -> Result<(&[u8], &mut [u8])> {
        match (src.buf, dst.buf) {
            (_, BufId::Input) => Err(input_written()),
            (BufId::Data, BufId::Data) => split_pair(self.data.reborrow(), src, dst),
            (BufId::Scratch, BufId::Scratch) => {
                split_pair(Region::new(&mut self.scratch), src, dst)
            }
            (BufId::Input, BufId::Data) => Ok((
                part(self.input, src)?,
                region_part_mut(&mut self.data, dst)?,
            )),
            (BufId::Scratch, BufId::Data) => Ok((
                part(&self.scratch, src)?,
                region_part_mut(&mut self.data, dst)?,
            )),
            (BufId::Input, BufId::Scratch) => {
                Ok((part(self.input, src)?, part_mut(&mut self.scratch, dst)?))
            }
            (BufId::Data, BufId::Scratch) => Ok((
                region_part(&self.data, src)?,
                part_mut(&mut self.scratch, dst)?,
            )),
        }
    }

    /// True when a receive's destination and base (if any) are host memory.
    fn on_host(&self, into: &RecvInto) -> bool {
        !self.on_device(&into.dst) && into.base.as_ref().is_none_or(|b| !self.on_device(b))
    }

    /// Writes or reduces a received payload whose destination (or base) is in device
    /// memory: through a host copy.
    fn apply_staged(
        &mut self,
        into: &RecvInto,
        payload: &Payload,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let RecvInto {
            dst, reduce, base, ..
        } = into;
        let mut host = match base {
            Some(b) => self.read_vec(b)?,
            None => vec![0u8; payload.len()],
        };
        if base.is_some() {
            reduce_chunks(payload, dtype, |off, bytes| {
                reduce_at(dtype, op, &mut host, off, bytes)
            })?;
        } else {
            payload
                .copy_to(&mut host)
                .map_err(|(e, a)| mismatch(e, a))?;
        }
        let reduce = (*reduce && base.is_none()).then_some((dtype, op));
        self.store(dst, &host, reduce)
    }

    /// Writes or reduces the received bytes `bytes`, which belong at offset `off` of the
    /// payload, into the destination (host memory, [`Buffers::on_host`]). With a base,
    /// the destination piece gets `op(base piece, bytes)` in one pass
    /// ([`nexar_device::reduce_onto_bytes`], or its streaming form when `into.streamed`).
    fn put(
        &mut self,
        into: &RecvInto,
        off: usize,
        bytes: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let piece = off..off + bytes.len();
        if let Some(base) = &into.base {
            let (b, d) = self.pair(base, &into.dst)?;
            let b = b.get(piece.clone()).ok_or_else(|| past(base, &piece))?;
            let d = d
                .get_mut(piece.clone())
                .ok_or_else(|| past(&into.dst, &piece))?;
            let reduce = if into.streamed {
                nexar_device::reduce_onto_bytes_streaming
            } else {
                nexar_device::reduce_onto_bytes
            };
            return Ok(reduce(dtype, op, d, b, bytes)?);
        }
        let d = self.get_mut(&into.dst)?;
        let d = d
            .get_mut(piece.clone())
            .ok_or_else(|| past(&into.dst, &piece))?;
        if into.reduce {
            nexar_device::reduce_bytes(dtype, op, d, bytes)?;
        } else {
            copy(d, bytes, into.streamed);
        }
        Ok(())
    }

    /// Writes into `out` (as long as the payload) the result of reducing the received
    /// bytes `bytes` (at offset `off` of the payload) onto the receive's base (or its
    /// destination when it has none), in one pass, leaving the destination as it is.
    fn put_result(
        &self,
        into: &RecvInto,
        out: &mut [u8],
        off: usize,
        bytes: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let from = into.base.as_ref().unwrap_or(&into.dst);
        let b = self.get(from)?;
        let piece = off..off + bytes.len();
        let b = b.get(piece.clone()).ok_or_else(|| past(from, &piece))?;
        let out_len = out.len();
        let o = out.get_mut(piece.clone()).ok_or_else(|| {
            NexarError::InvalidArgument(format!(
                "payload piece {piece:?} past its result buffer of {out_len} bytes"
            ))
        })?;
        Ok(nexar_device::reduce_onto_bytes(dtype, op, o, b, bytes)?)
    }
}

/// Where a receive's payload goes: copied or reduced into `dst`, reduced with `base` when
/// that is set (see [`Action::Recv`]); a copy, or a reduction onto `base`, with streaming
/// stores when `streamed` (see [`streamed`]).
#[derive(Debug)]
struct RecvInto {
    dst: BufRange,
    reduce: bool,
    base: Option<BufRange>,
    streamed: bool,
}

/// A payload of `len` bytes must fill the destination exactly (and a base, when there is
/// one, too).
fn check_len(into: &RecvInto, len: usize) -> Result<()> {
    let dst = &into.dst;
    if len != dst.len() {
        return Err(NexarError::LengthMismatch {
            what: "collective message (bytes); did every rank pass the same arguments?",
            expected: dst.len(),
            actual: len,
        });
    }
    if into.base.as_ref().is_some_and(|b| b.len() != dst.len()) {
        return Err(NexarError::InvalidArgument(format!(
            "schedule reduces onto a base of another length than {dst}"
        )));
    }
    Ok(())
}

fn mismatch(expected: usize, actual: usize) -> NexarError {
    NexarError::LengthMismatch {
        what: "collective message (bytes)",
        expected,
        actual,
    }
}

/// Calls `f(offset, bytes)` over the payload in pieces of whole elements.
fn reduce_chunks(
    payload: &Payload,
    dtype: DataType,
    f: impl FnMut(usize, &[u8]) -> std::result::Result<(), nexar_device::DeviceError>,
) -> Result<()> {
    payload
        .for_each_aligned(dtype.size(), f)
        .map_err(|e| match e {
            Some(e) => NexarError::Device(e),
            None => NexarError::InvalidArgument("payload is not a whole number of elements".into()),
        })
}

/// `dst[off..] = op(dst[off..], bytes)` over the length of `bytes`.
fn reduce_at(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    off: usize,
    bytes: &[u8],
) -> std::result::Result<(), nexar_device::DeviceError> {
    nexar_device::reduce_bytes(dtype, op, &mut dst[off..off + bytes.len()], bytes)
}

/// The bytes of `r` in `b`.
fn part<'b>(b: &'b [u8], r: &BufRange) -> Result<&'b [u8]> {
    b.get(r.range.clone()).ok_or_else(|| range_err(r, b.len()))
}

/// The bytes of `r` in `b`, writable.
fn part_mut<'b>(b: &'b mut [u8], r: &BufRange) -> Result<&'b mut [u8]> {
    let len = b.len();
    b.get_mut(r.range.clone()).ok_or_else(|| range_err(r, len))
}

/// The bytes of `r` in Data.
fn region_part<'b>(d: &'b Region<'_>, r: &BufRange) -> Result<&'b [u8]> {
    d.get(r.range.clone()).ok_or_else(|| range_err(r, d.len()))
}

/// The bytes of `r` in Data, writable (an error while part of them is lent).
fn region_part_mut<'b>(d: &'b mut Region<'_>, r: &BufRange) -> Result<&'b mut [u8]> {
    let len = d.len();
    d.get_mut(r.range.clone())?.ok_or_else(|| range_err(r, len))
}

/// Two non-overlapping ranges of one buffer, the first read only.
fn split_pair<'b>(
    buf: Region<'b>,
    src: &BufRange,
    dst: &BufRange,
) -> Result<(&'b [u8], &'b mut [u8])> {
    let len = buf.len();
    let bad = if src.range.end > len { src } else { dst };
    buf.split(src.range.clone(), dst.range.clone())?
        .ok_or_else(|| range_err(bad, len))
}

fn input_written() -> NexarError {
    NexarError::InvalidArgument("schedule writes the read-only input buffer".into())
}

/// Received bytes at `piece` of a payload fall outside the range `r` they belong to.
fn past(r: &BufRange, piece: &std::ops::Range<usize>) -> NexarError {
    NexarError::InvalidArgument(format!(
        "received bytes {piece:?} past the {} bytes of {r}",
        r.len()
    ))
}

fn range_err(r: &BufRange, len: usize) -> NexarError {
    NexarError::InvalidArgument(format!(
        "schedule range {:?} {:?} outside a buffer of {len} bytes",
        r.buf, r.range
    ))
}

/// One collective's claim on its tag (the communicator's next collective sequence
/// number, taken when an `async fn` collective is first polled or an `_nb` one is
/// called, so every rank that starts its calls in the same order numbers them alike) and call
/// fingerprint. Dropping it, whether the collective finished, failed, was never run or
/// had its future dropped, retires the tag: frames for it that arrive later are discarded.
/// When it failed here of its own accord (not for a lost rank or a peer's error), or
/// was never run or dropped, the other members are told that this rank gave up on the
/// tag ([`Ticket::tell_left`]); one let go unused by [`Ticket::release_after`] tells them
/// as the error that ended its caller's calls says.
pub(crate) struct Ticket {
    core: Arc<CommCore>,
    tag: u64,
    /// Fingerprint of the call (collective, count, dtype, op, root) carried in the upper
    /// half of every step, so ranks that call mismatched collectives never match frames:
    /// they time out with an error instead of combining unrelated data.
    sig: u32,
    /// The collective completed here: every frame of its tag for this node was taken, so
    /// retiring it needs no scan of a large mailbox table.
    completed: bool,
    /// Dropped without completing, it tells the others it gave up ([`Ticket::tell_left`]):
    /// true until the collective ends with another failure than one of this rank's own
    /// ([`own_failure`]), such as a lost rank, which the others are told of
    /// ([`Ticket::give_up`]) or see themselves, or a failure on a peer's side, which is
    /// that peer's to tell.
    tell_on_drop: bool,
}

/// True for a failure of a collective that only this rank sees and no other rank will
/// tell of: its deadline, a send over its own limit, a frame this node refused, its
/// device's error, a frame of the call that does not fit its buffers (a mismatched call),
/// a schedule, codec or actor failure here. Not for failures a lost rank causes (its
/// connection's errors, `PeerLost`, `PeerLostElsewhere`), nor for a tag another member
/// gave up on, a shutdown or an abort: a notice of this rank's then could reach a member
/// before the loss's and hide it.
fn own_failure(e: &NexarError) -> bool {
    matches!(
        e,
        NexarError::Timeout { .. }
            | NexarError::Device(_)
            | NexarError::Schedule(_)
            | NexarError::Codec(_)
            | NexarError::LengthMismatch { .. }
            | NexarError::CallMismatch { .. }
            | NexarError::InvalidArgument(_)
            | NexarError::Actor(_)
            | NexarError::Transport(
                TransportError::Timeout(_)
                    | TransportError::FrameTooLarge { .. }
                    | TransportError::Abandoned { .. }
                    | TransportError::LengthMismatch { .. }
            )
    )
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let table = &self.core.shared.table;
        if self.completed {
            table.retire_taken(self.core.coll_comm(), self.tag);
        } else {
            if self.tell_on_drop {
                self.tell_left();
            }
            table.retire(self.core.coll_comm(), self.tag);
        }
    }
}

impl Ticket {
    /// Lets this claim go unused after `ended` stopped the caller's run of calls before
    /// it came to this one (a resize point's later collectives, say): as the call would
    /// have ended had it run into `ended`. For a rank lost, the others are told of the
    /// loss ([`give_up`](Self::give_up)), not that this rank gave up on its own, which
    /// could reach a member before the loss and hide it; after an error every member
    /// meets alike at that point (`same_everywhere`) nothing is sent (each member lets its
    /// own claim go); after another collective error, the others are told it gave up
    /// only where a call ending so would tell them ([`own_failure`]: not after a loss
    /// seen elsewhere, a peer's broken connection or a peer's own notice); after an error
    /// of the caller's own between the calls (a [`NexarError::Bootstrap`] one, say), they
    /// are told, as a plain drop tells them.
    pub(crate) fn release_after(mut self, ended: &NexarError, same_everywhere: bool) {
        match ended {
            _ if same_everywhere => self.tell_on_drop = false,
            NexarError::PeerLost { rank, .. } => {
                self.give_up(*rank);
                self.tell_on_drop = false;
            }
            NexarError::Bootstrap(_) => {}
            e => self.tell_on_drop = own_failure(e),
        }
    }

    pub(crate) fn new(core: Arc<CommCore>, tag: u64, sig: u32) -> Ticket {
        Ticket {
            core,
            tag,
            sig,
            completed: false,
            tell_on_drop: true,
        }
    }

    /// The collective's number on its communicator (its tag), equal on every rank.
    pub(crate) fn tag(&self) -> u64 {
        self.tag
    }

    /// The same claim with the call's fingerprint `sig`.
    pub(crate) fn signed(mut self, sig: u32) -> Ticket {
        self.sig = sig;
        self
    }

    /// Runs `schedule` to completion (or error) on `bufs`, in the caller's task. Ends by
    /// the node's op timeout at the latest, or as soon as a member is known lost.
    pub(crate) async fn run(
        self,
        schedule: Box<dyn Schedule>,
        bufs: &mut Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let deadline = crate::deadline_in(self.core.shared.config.op_timeout);
        self.run_by(schedule, bufs, dtype, op, deadline).await
    }

    /// [`run`](Self::run) by `deadline`: the call's, when it waited for something else
    /// first (its buffer's loans).
    pub(crate) async fn run_by(
        mut self,
        mut schedule: Box<dyn Schedule>,
        bufs: &mut Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
        deadline: Instant,
    ) -> Result<()> {
        if let Some(e) = self.core.refusing() {
            // A node shut down, or aborted, runs no more calls, not even one with no
            // messages to send (a single rank's, no bytes): its communicators fail with
            // `Shutdown`, or the abort's error, as documented (the others are told of
            // either otherwise).
            self.tell_on_drop = false;
            return Err(e);
        }
        if schedule.is_done() {
            self.completed = true;
            return Ok(());
        }
        let core = &*self.core;
        let pool = &core.shared.pool;
        bufs.scratch = pool.scratch(schedule.scratch_len());
        let span = debug_span!(
            "collective",
            algorithm = schedule.name(),
            tag = self.tag,
            rank = core.rank
        );
        let res = self
            .drive(&mut *schedule, bufs, dtype, op, deadline)
            .instrument(span)
            .await;
        pool.put(std::mem::take(&mut bufs.scratch));
        self.completed = res.is_ok();
        // A frame cut short (its sender dropped its send when it gave up) reads as the
        // transport's error: when a member has said by now that it gave up on the tag,
        // that is the failure.
        let res = match res {
            Err(NexarError::Transport(e)) => {
                match core.shared.table.given_up_on(core.coll_comm(), self.tag) {
                    Some((by, lost)) => Err(core.given_up_error(by, lost)),
                    None => Err(NexarError::Transport(e)),
                }
            }
            // At the deadline, frames of another call under this one's tag say why.
            Err(e @ NexarError::Timeout { .. }) => Err(self.mismatch().unwrap_or(e)),
            res => res,
        };
        self.tell_on_drop = matches!(&res, Err(e) if own_failure(e));
        match &res {
            Err(NexarError::PeerLost { rank, .. }) => self.give_up(*rank),
            Err(NexarError::PeerLostElsewhere { rank, .. }) => {
                let rank = *rank;
                return self.seen_here(res, rank, deadline).await;
            }
            _ => {}
        }
        res
    }

    /// [`NexarError::CallMismatch`] when a frame from a member under this call's tag
    /// carries another call's fingerprint (the upper half of its step: see [`wire_step`]).
    fn mismatch(&self) -> Option<NexarError> {
        let core = &*self.core;
        let frames = core
            .shared
            .table
            .frames_under(core.coll_comm(), self.tag, 64);
        frames
            .into_iter()
            .find(|(node, step)| step >> 32 != u64::from(self.sig) && core.members.contains(node))
            .map(|(node, _)| NexarError::CallMismatch {
                rank: core.rank_of(node),
                call: self.tag,
            })
    }

    /// `PeerLostElsewhere` (`res`, naming `rank`): another member saw a loss first. This
    /// node may see a loss too a moment later (heartbeats stop at every rank a crashed
    /// one was connected to, not all at one instant), or have seen `rank` depart, and then
    /// the failure is the `PeerLost` those ranks get. Waited for up to one heartbeat
    /// timeout, within the call's deadline, after the tag is retired (frames for it are
    /// not kept meanwhile); ended by an abort or shutdown, which the call then reports.
    async fn seen_here(&self, res: Result<()>, rank: usize, deadline: Instant) -> Result<()> {
        /// How often the wait looks for an abort or shutdown, which no watch announces.
        const LOOK: std::time::Duration = std::time::Duration::from_millis(20);
        let core = &*self.core;
        core.shared.table.retire(core.coll_comm(), self.tag);
        let patience = core
            .shared
            .config
            .heartbeat_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let until = Instant::now() + patience;
        let named = ranks_lost(core, Some(rank));
        let any = ranks_lost(core, None);
        tokio::pin!(named, any);
        loop {
            if let Some(e) = core.aborted() {
                return Err(e);
            }
            if core.shared.is_shutting_down() {
                return Err(NexarError::Shutdown);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return res;
            }
            tokio::select! {
                lost = &mut named => return Err(lost),
                lost = &mut any => return Err(lost),
                () = tokio::time::sleep(left.min(LOOK)) => {}
            }
        }
    }

    /// After this collective failed because this node lost member `lost`: tells every
    /// other member it can still reach, in the background, that it gave up on the tag, so
    /// that their parts fail soon (`PeerLostElsewhere`, or `PeerLost` where they see a
    /// loss too) instead of waiting to their deadlines for what this rank will not send.
    /// A loss is known only where it is seen (one broken link, or a sparse topology's
    /// neighbours alone notice a rank); this
    /// carries it to the others for this one collective. Not for a loss this node learnt
    /// of that way itself (a rank it still reaches): that would send every failure on
    /// to everyone again. At most [`GIVE_UP_NOTICES_PER_LOSS`] collectives of a
    /// communicator do so per lost rank.
    ///
    /// [`GIVE_UP_NOTICES_PER_LOSS`]: crate::comm::GIVE_UP_NOTICES_PER_LOSS
    fn give_up(&self, lost: usize) {
        let core = &self.core;
        let Some(&node) = core.members.get(lost) else {
            return;
        };
        if !core.shared.lost.contains_key(&node)
            && !core.shared.has_departed(node)
            && core.shared.closed_as_lost(node).is_none()
        {
            return;
        }
        let Ok(lost_bits) = u32::try_from(lost) else {
            return;
        };
        {
            let mut sent = core.give_ups.entry(lost).or_insert(0);
            if *sent >= crate::comm::GIVE_UP_NOTICES_PER_LOSS {
                return;
            }
            *sent += 1;
        }
        self.tell_given_up(lost_bits, Some(lost));
    }

    /// Tells every other member but `except` that this rank gave up on the tag, having
    /// lost rank `lost` (or [`GAVE_UP_ON_ITS_OWN`]).
    fn tell_given_up(&self, lost: u32, except: Option<usize>) {
        let core = &self.core;
        #[cfg(test)]
        core.gave_up_told
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let step = nexar_transport::WHOLE_TAG_STEP | u64::from(lost);
        for dst in (0..core.members.len()).filter(|&r| r != core.rank && Some(r) != except) {
            crate::comm::tell_abandoned_on(core, core.coll_comm(), dst, self.tag, step);
        }
    }

    /// This rank takes no further part in the collective, and its tag is retired (frames
    /// for it are discarded): it reached its deadline, a send of its own was over its
    /// limit (`max_frame_bytes`, left by the cut at `max_message_bytes` only to blocks of
    /// more than `2^30 / phases` pieces), its arguments were refused here, or its future
    /// was dropped. Tells every other member, in the background, that it gave up on the
    /// tag ([`GAVE_UP_ON_ITS_OWN`]), so that their parts, which wait for what this rank
    /// will not send (directly, or through the ranks that pass it on), fail at once
    /// instead of at their deadlines, and a member that comes to the tag later fails it
    /// at once too (the notice waits for it): the communicator's next call starts
    /// together. Without it, the others ran a full op timeout behind a rank that refused
    /// a call, or ahead of one late by more than the op timeout, from then on: each later
    /// call ended on the leading ranks before the others started it, and failed
    /// everywhere, for any schedule with a round that waits for an earlier one. Not told:
    /// when a member gave up on the tag first (its notice reached the others too), on
    /// one rank, on shutdown, after an abort (the others are told of that), or outside a
    /// runtime (nothing could send it).
    fn tell_left(&self) {
        let core = &*self.core;
        if core.members.len() < 2
            || core.shared.is_shutting_down()
            || core.aborted().is_some()
            || core
                .shared
                .table
                .given_up_on(core.coll_comm(), self.tag)
                .is_some()
            || tokio::runtime::Handle::try_current().is_err()
        {
            return;
        }
        self.tell_given_up(GAVE_UP_ON_ITS_OWN, None);
    }

    async fn drive(
        &self,
        schedule: &mut dyn Schedule,
        bufs: &mut Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
        deadline: Instant,
    ) -> Result<()> {
        let core = &*self.core;
        let pool = core.shared.pool.sends();
        let flight = Arc::new(InFlight::default());
        let budget = core.shared.config.collective_send_budget_bytes;
        let mut sends = FuturesUnordered::new();
        let mut recvs = FuturesUnordered::new();
        // Receives whose payload is arriving: its pieces are taken as they come.
        let mut incoming = FuturesUnordered::new();
        // Sends written straight from the caller's buffer over a trusted-fabric lane: each
        // resolves when its frame can make progress, and is written (a borrow of the
        // buffer for the duration of one non-blocking write) here in the loop.
        let mut direct: FuturesUnordered<DirectWait<'_>> = FuturesUnordered::new();
        // Sends the schedule issued that wait for in-flight bytes to drop under the budget.
        let mut deferred: VecDeque<(OpId, usize, u32, BufRange)> = VecDeque::new();
        // Large sends of copied host bytes over QUIC, in the order they started: each is
        // copied out piece by piece as the budget lets it, while its writer (in `sends`)
        // sends the frame ([`Feed`]).
        let mut feeding: VecDeque<Feed> = VecDeque::new();
        // Received payloads that sends will pass on as they are, whole or as a piece
        // (`Schedule::forwards`, `Schedule::parts`), with how many such sends are still
        // to be issued.
        let mut kept = Kept::default();
        let lost = ranks_lost(core, None);
        let expiry = tokio::time::sleep_until(deadline.into());
        tokio::pin!(lost, expiry);
        let mut actions = Vec::new();
        // Poll for progress (see `NodeConfig::spin_wait`) until this long after the last.
        let spin = core.shared.config.spin_wait.unwrap_or_else(|| {
            let single =
                tokio::runtime::Handle::try_current().is_ok_and(|h| h.metrics().num_workers() == 1);
            if single {
                crate::config::AUTO_SPIN_WAIT
            } else {
                std::time::Duration::ZERO
            }
        });
        let mut progress = Instant::now();
        let crowded = !spin.is_zero() && core.crowded();
        // Over trusted-fabric lanes sends are written straight from the buffer, with no
        // copy to save: a reduced result is then stored in place and sent from there, not
        // built in a buffer of its own (which would cost a copy of its base).
        let keep_results = !core.shared.config.trusted_fabric;
        // Actions that write a range of Data the transport still holds on loan (a
        // zero-copy buffer's sends): issued once the loan comes back.
        let mut held: Vec<Action> = Vec::new();
        let loans = bufs.data.lender();
        let mut returns = 0;
        loop {
            // Issue everything ready; local actions run at once and may make more ready.
            // Held actions are looked at again first, once per turn.
            // Returns are counted before any range is checked, so one that comes in
            // after a check wakes the wait below.
            let mut retry = std::mem::take(&mut held);
            if let Some(l) = &loans {
                returns = l.loans().returns();
            }
            loop {
                actions.clear();
                actions.append(&mut retry);
                schedule.poll(&mut actions);
                if actions.is_empty() {
                    break;
                }
                for action in actions.drain(..) {
                    if action.writes().is_some_and(|dst| bufs.writes_lent(dst)) {
                        held.push(action);
                        continue;
                    }
                    let streamed = streamed(&*schedule, &action, op, bufs.footprint());
                    match action {
                        Action::Send {
                            id,
                            peer,
                            step,
                            src,
                        } => deferred.push_back((id, peer, step, src)),
                        Action::Recv {
                            id,
                            peer,
                            step,
                            dst,
                            reduce,
                            base,
                        } => {
                            let into = RecvInto {
                                dst,
                                reduce,
                                base,
                                streamed,
                            };
                            recvs.push(self.recv(id, peer, step, into, deadline));
                        }
                        local => {
                            let id = local.id();
                            run_local(bufs, local, dtype, op, streamed)?;
                            schedule.complete(id)?;
                        }
                    }
                }
            }
            // Copy out more of the large send begun, then begin more sends, while the
            // transport holds less than the budget (and always at least one send while it
            // holds nothing: a whole one, or a large one's first piece), in the order the
            // schedule issued them. Sends over a trusted lane copy nothing and hold no
            // memory: they start at once; so do sends that add nothing to what the
            // transport holds (a payload an earlier send holds, an empty message).
            while let Some(feed) = feeding.front_mut() {
                if !feed.next_pieces(bufs, pool, &flight, budget)? {
                    break;
                }
                feeding.pop_front();
            }
            while let Some(&(id, peer, step, ref src)) = deferred.front() {
                // A reduced result that was kept instead of stored exists only as kept.
                let unwritten = schedule
                    .forwards(id)
                    .is_some_and(|r| schedule.only_forwarded(r) && kept.holds(r));
                // Pieces of received payloads, and of bytes to copy: sent as they are when
                // the range would be copied and every payload is kept. Otherwise the send
                // takes no piece, and lets go of the kept ones.
                let parts = schedule.parts(id).unwrap_or_default();
                let pieced_payloads = !parts.is_empty()
                    && bufs.copies_host(src)
                    && parts
                        .iter()
                        .all(|p| p.forwards.is_none_or(|r| kept.holds(r)));
                if !bufs.on_device(src) && !unwritten {
                    if let Some(lane) = lane_to(core, peer)? {
                        let src = src.clone();
                        deferred.pop_front();
                        // Written from the buffer itself: a kept payload is not needed.
                        kept.take(schedule.forwards(id), None);
                        kept.let_go(parts);
                        let start = DirectState::Start { lane, step };
                        direct.push(self.direct_wait(id, peer, src, start, deadline));
                        continue;
                    }
                }
                let held = flight.bytes();
                // A send in pieces copies its copied pieces at once (its payloads are
                // already held, within the room kept for them): where those copies alone
                // would pass the budget, it goes as a large copy instead (below).
                let copies: usize = parts
                    .iter()
                    .filter(|p| p.forwards.is_none())
                    .map(|p| p.range.len())
                    .sum();
                let in_pieces = pieced_payloads && copies <= budget;
                let by_pieces =
                    in_pieces.then(|| kept.adds(parts.iter().map(|p| (p.forwards, p.range.len()))));
                // A large copy to a peer over QUIC goes out in pieces: it starts with one.
                let pieced = !in_pieces
                    && src.len() > SEND_PIECE_BYTES
                    && !schedule.forwards(id).is_some_and(|r| kept.holds(r))
                    && bufs.copies_host(src);
                let bulk = if pieced { bulk_to(core, peer)? } else { None };
                // One large send copies out its pieces at a time: the next waits for it.
                if bulk.is_some() && !feeding.is_empty() {
                    break;
                }
                // A payload an earlier send still holds adds nothing; `sharing` keeps its
                // share alive until this send has taken it too.
                let (adds, sharing) = match by_pieces {
                    Some(by_pieces) => by_pieces,
                    None => {
                        let first = if bulk.is_some() {
                            SEND_PIECE_BYTES
                        } else {
                            src.len()
                        };
                        kept.adds(std::iter::once((schedule.forwards(id), first)))
                    }
                };
                if held > 0 && adds > 0 && held + adds > budget {
                    break;
                }
                let Some((id, peer, step, src)) = deferred.pop_front() else {
                    break;
                };
                if !in_pieces {
                    kept.let_go(parts);
                }
                if let Some(bulk) = bulk {
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    let len = src.len();
                    sends.push(
                        self.send_pieced(id, peer, step, len, bulk, rx, deadline)
                            .right_future(),
                    );
                    let mut feed = Feed { src, fed: 0, tx };
                    if !feed.next_pieces(bufs, pool, &flight, budget)? {
                        feeding.push_back(feed);
                    }
                    continue;
                }
                // A received payload passed on as it is (no copy); it counts against the
                // budget like a copy until the transport lets go of it (once, however many
                // sends hold it).
                let payload = if in_pieces {
                    Payload::from_parts(kept.pieces(parts, bufs, pool, &flight)?)
                } else {
                    match kept.take(schedule.forwards(id), Some(&flight)) {
                        Some(parts) => Payload::from_parts(parts),
                        None => Payload::from_bytes(bufs.send_bytes(&src, pool, &flight)?),
                    }
                };
                drop(sharing);
                sends.push(self.send(id, peer, step, payload, deadline).left_future());
            }
            if schedule.is_done() {
                return Ok(());
            }
            if sends.is_empty()
                && recvs.is_empty()
                && incoming.is_empty()
                && deferred.is_empty()
                && direct.is_empty()
                && held.is_empty()
            {
                return Err(NexarError::Actor(format!(
                    "collective {} stalled with nothing in flight",
                    schedule.name()
                )));
            }
            // A collective involves every member: if any of them is lost, it cannot
            // finish, so stop waiting at once. Every send and receive has the deadline;
            // bytes held by the transport are released as the peer acknowledges them.
            tokio::select! {
                biased;
                Some((id, peer, step, mut into, res)) = recvs.next(), if !recvs.is_empty() => {
                    progress = Instant::now();
                    let delivery = res?;
                    let len = delivery.len();
                    trace!(peer, len, streamed = delivery.is_streamed(), "receiving");
                    if let Err(e) = check_len(&into, len) {
                        delivery.discard();
                        return Err(e);
                    }
                    // Kept for the sends that pass it on, within the send budget (past it,
                    // those sends copy the range out when the budget lets them; a result
                    // bound for scratch has more room, see `SCRATCH_RESULT_BUDGETS`).
                    let uses = schedule.forward_count(id);
                    // Sends that pass it on as a piece use it only where they copy their
                    // range (which holds this one): not where it is lent or written
                    // from the buffer over a trusted lane.
                    let whole = uses - schedule.piece_count(id).min(uses);
                    let wanted = whole > 0 || (keep_results && bufs.copies_host(&into.dst));
                    let on_host = bufs.on_host(&into);
                    let result = keep_results && into.reduce && schedule.only_forwarded(id);
                    let room = keep_room(result, into.dst.buf, budget);
                    let keep = uses > 0 && wanted && on_host && kept.bytes + len <= room;
                    let sink = if !on_host {
                        Sink::Staged(Vec::new())
                    } else if keep && result {
                        // Only those sends read the result: it goes to them alone, in a
                        // buffer of its own, instead of into the destination and then
                        // out again in a copy per send.
                        Sink::Result(pool.take_len(len))
                    } else {
                        Sink::Buffer {
                            parts: (keep && !into.reduce).then(Vec::new),
                        }
                    };
                    if sink.keeps() {
                        kept.bytes += len;
                    }
                    // Kept for its forwards over QUIC (within the room for kept payloads),
                    // the payload is what they send: the range is the caller's alone. Not
                    // kept, or over trusted lanes, those sends read the range.
                    let forwards_kept = keep && keep_results && !into.reduce;
                    into.streamed |= streamed_past_forwards(&*schedule, id, len, op, forwards_kept);
                    let align = if into.reduce { dtype.size() } else { 1 };
                    let cut = ElementCutter::new(align).ok_or_else(|| {
                        NexarError::InvalidArgument(format!("elements of {align} bytes"))
                    })?;
                    let rx = Incoming { id, peer, step, into, delivery, cut, sink, uses, done: false };
                    let rx = self.take_ready(rx, bufs, dtype, op)?;
                    if rx.done {
                        rx.finish(bufs, &mut kept, pool, dtype, op)?;
                        schedule.complete(id)?;
                    } else {
                        incoming.push(self.read_next(rx, deadline));
                    }
                }
                Some((mut rx, res)) = incoming.next(), if !incoming.is_empty() => {
                    progress = Instant::now();
                    match res? {
                        Some(chunk) => {
                            rx.take(chunk, bufs, dtype, op)?;
                            rx = self.take_ready(rx, bufs, dtype, op)?;
                        }
                        None => rx.done = true,
                    }
                    if rx.done {
                        let id = rx.id;
                        rx.finish(bufs, &mut kept, pool, dtype, op)?;
                        schedule.complete(id)?;
                    } else {
                        incoming.push(self.read_next(rx, deadline));
                    }
                }
                Some((id, res)) = sends.next(), if !sends.is_empty() => {
                    progress = Instant::now();
                    res?;
                    schedule.complete(id)?;
                }
                Some((id, peer, src, res)) = direct.next(), if !direct.is_empty() => {
                    let mut frame = res?;
                    let written = match frame.advance(bufs.get(&src)?) {
                        Ok(written) => written,
                        // A write that fails as the lane ends (a crashed peer's) waits
                        // for the verdict, as a wait for room on the lane does. The
                        // call's other work goes first (its frames padded in the
                        // background): each direct frame holds its lane's write lock,
                        // which would stall those lanes' other traffic for the wait.
                        Err(e) => {
                            drop((direct, sends, recvs, incoming));
                            return Err(failed_send(core, peer, e, deadline).await);
                        }
                    };
                    progress = Instant::now();
                    if written {
                        schedule.complete(id)?;
                    } else {
                        let resume = DirectState::Resume(frame);
                        direct.push(self.direct_wait(id, peer, src, resume, deadline));
                    }
                }
                () = returned(loans, returns), if !held.is_empty() => {}
                () = flight.wait(), if !deferred.is_empty() || !feeding.is_empty() => {}
                () = &mut expiry, if !deferred.is_empty() || !held.is_empty() || !feeding.is_empty() => {
                    return Err(NexarError::Timeout {
                        what: format!("collective {} (tag {}): sends not acknowledged", schedule.name(), self.tag),
                        after: core.shared.config.op_timeout,
                    });
                }
                e = &mut lost => return Err(e),
                // Nothing ready: yield the task (the runtime then polls the sockets without
                // sleeping) and the thread (other processes on this core run), and look
                // again.
                () = tokio::task::yield_now(), if polls(spin, progress.elapsed(), crowded, !incoming.is_empty()) => {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// A send's future: owns its bytes, borrows only the communicator.
    fn send(
        &self,
        id: OpId,
        peer: usize,
        step: u32,
        bytes: Payload,
        deadline: Instant,
    ) -> impl Future<Output = (OpId, Result<()>)> + Send + '_ {
        let core = &*self.core;
        let step = wire_step(self.sig, step);
        async move {
            let res = send_frame(
                core,
                peer,
                core.coll_comm(),
                self.tag,
                step,
                bytes,
                deadline,
            );
            (id, res.await)
        }
    }

    /// A large send's writer over QUIC ([`Feed`]): sends the frame of `len` bytes as its
    /// pieces come from `pieces`.
    #[allow(clippy::too_many_arguments)]
    fn send_pieced(
        &self,
        id: OpId,
        peer: usize,
        step: u32,
        len: usize,
        bulk: nexar_transport::Connection,
        pieces: tokio::sync::mpsc::UnboundedReceiver<Bytes>,
        deadline: Instant,
    ) -> impl Future<Output = (OpId, Result<()>)> + Send + '_ {
        let core = &*self.core;
        let step = wire_step(self.sig, step);
        async move {
            let comm = core.coll_comm();
            let send = bulk.send_streamed(FrameKind::Data, comm, self.tag, step, len, pieces);
            (id, within(core, peer, deadline, send).await)
        }
    }

    /// A direct send's wait: for the lane's write lock (`Start`), then for room in the
    /// socket (`Resume`); resolves with the frame to write more of.
    fn direct_wait(
        &self,
        id: OpId,
        peer: usize,
        src: BufRange,
        state: DirectState,
        deadline: Instant,
    ) -> DirectWait<'_> {
        let core = &*self.core;
        Box::pin(async move {
            let res = match state {
                DirectState::Start { lane, step } => {
                    let step = wire_step(self.sig, step);
                    let len = src.range.len();
                    let begin = lane.begin_frame(core.coll_comm(), self.tag, step, len);
                    within(core, peer, deadline, begin).await
                }
                DirectState::Resume(frame) => {
                    let room = tokio::time::timeout_at(deadline.into(), frame.writable()).await;
                    match room {
                        Ok(Ok(())) => Ok(frame),
                        // The frame (and its lane's write lock) goes before the wait for
                        // the verdict: held, it kept the lane's shutdown, and so the
                        // peer's sight of the lane's end, which the verdict comes from,
                        // waiting.
                        Ok(Err(e)) => {
                            drop(frame);
                            Err(failed_send(core, peer, e, deadline).await)
                        }
                        Err(_) => Err(send_timeout(core, peer)),
                    }
                }
            };
            (id, peer, src, res)
        })
    }

    /// A receive's future: resolves with the payload's delivery (whole, or the stream it
    /// is arriving on) and where it goes.
    fn recv(
        &self,
        id: OpId,
        peer: usize,
        step: u32,
        into: RecvInto,
        deadline: Instant,
    ) -> impl Future<Output = (OpId, usize, u64, RecvInto, Result<Delivery>)> + Send + '_ {
        let core = &*self.core;
        let step = wire_step(self.sig, step);
        async move {
            let res = core.take_delivery(peer, core.coll_comm(), self.tag, step, deadline);
            (id, peer, step, into, res.await)
        }
    }

    /// Takes the pieces of `rx`'s payload that are here already (all of a whole one);
    /// `rx.done` once there are no more.
    fn take_ready(
        &self,
        mut rx: Incoming,
        bufs: &mut Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Incoming> {
        while let Some(next) = rx.delivery.next_chunk().now_or_never() {
            match next.map_err(|e| self.core.recv_error(e, rx.peer, self.tag, rx.step))? {
                Some(chunk) => rx.take(chunk, bufs, dtype, op)?,
                None => {
                    rx.done = true;
                    break;
                }
            }
        }
        Ok(rx)
    }

    /// Waits, until the deadline, for the next piece of `rx`'s payload.
    fn read_next(
        &self,
        mut rx: Incoming,
        deadline: Instant,
    ) -> impl Future<Output = (Incoming, Result<Option<Bytes>>)> + Send + '_ {
        let core = &*self.core;
        async move {
            let next = tokio::time::timeout_at(deadline.into(), rx.delivery.next_chunk()).await;
            let res = next
                .unwrap_or_else(|_| Err(TransportError::Timeout(core.shared.config.op_timeout)))
                .map_err(|e| core.recv_error(e, rx.peer, self.tag, rx.step));
            (rx, res)
        }
    }
}

/// A receive whose payload is taken piece by piece, as QUIC delivers it: each piece is
/// written or reduced into place while it is in cache, so a large payload that arrives
/// while its receive waits is never held whole (unless sends pass it on).
struct Incoming {
    id: OpId,
    peer: usize,
    /// The frame's step on the wire.
    step: u64,
    into: RecvInto,
    delivery: Delivery,
    /// Cuts the pieces into whole elements for a reduction.
    cut: ElementCutter,
    sink: Sink,
    /// Sends that pass the payload on ([`Schedule::forward_count`]).
    uses: usize,
    /// All of it has been taken.
    done: bool,
}

/// Where the pieces of an [`Incoming`] payload go.
enum Sink {
    /// Into the destination; the pieces themselves are also kept (`parts`) when sends
    /// pass the payload on as it is.
    Buffer { parts: Option<Vec<Bytes>> },
    /// The reduced result, into a pooled buffer of its own, for the sends that pass it
    /// on ([`Schedule::only_forwarded`]); the destination is left as it is.
    Result(Vec<u8>),
    /// Gathered whole, then staged into device memory.
    Staged(Vec<Bytes>),
}

impl Sink {
    /// True when the payload, or the result built from it, is kept for sends that pass
    /// it on (and counts against the send budget from the start).
    fn keeps(&self) -> bool {
        matches!(self, Sink::Result(_) | Sink::Buffer { parts: Some(_) })
    }
}

impl Incoming {
    /// Takes the next piece of the payload.
    fn take(
        &mut self,
        chunk: Bytes,
        bufs: &mut Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let Incoming {
            into, cut, sink, ..
        } = self;
        match sink {
            Sink::Buffer { parts } => {
                cut.feed(&chunk, |off, b| bufs.put(into, off, b, dtype, op))?;
                if let Some(parts) = parts {
                    parts.push(chunk);
                }
            }
            Sink::Result(out) => {
                cut.feed(&chunk, |off, b| {
                    bufs.put_result(into, out, off, b, dtype, op)
                })?;
            }
            Sink::Staged(parts) => parts.push(chunk),
        }
        Ok(())
    }

    /// Completes the receive once all of its payload has been taken: keeps what sends
    /// pass on, or stages the payload into device memory.
    fn finish(
        self,
        bufs: &mut Buffers<'_>,
        kept: &mut Kept,
        pool: &Arc<SendPool>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        if !self.cut.is_whole() {
            return Err(NexarError::InvalidArgument(
                "payload is not a whole number of elements".into(),
            ));
        }
        let len = self.delivery.len();
        match self.sink {
            Sink::Buffer { parts: None } => {}
            Sink::Buffer { parts: Some(parts) } => kept.keep(self.id, parts, len, self.uses),
            Sink::Result(out) => kept.keep(self.id, vec![pool.passed_on(out)], len, self.uses),
            Sink::Staged(parts) => {
                bufs.apply_staged(&self.into, &Payload::from_parts(parts), dtype, op)?;
            }
        }
        Ok(())
    }
}

/// Whether a collective with nothing ready polls again instead of sleeping: within `spin`
/// of its last progress, except while a large block streams in (`streaming`) on a host
/// with a CPU per rank (not `crowded`). The block's chunks wake the collective as they
/// arrive, and a core of its own wakes it at once, so polling between them only costs
/// CPU (10-20% of a large collective's, 2 processes on 2 cores); where ranks outnumber
/// cores, a sleeping rank waits for a time slice, and polling pays (bench/HISTORY.md,
/// session 9).
fn polls(
    spin: std::time::Duration,
    idle: std::time::Duration,
    crowded: bool,
    streaming: bool,
) -> bool {
    idle < spin && (crowded || !streaming)
}

/// Resolves once a loan of `lender`'s has come back since it counted `seen` returns.
async fn returned(lender: Option<&dyn Lender>, seen: u64) {
    match lender {
        Some(l) => l.loans().returned_since(seen).await,
        None => std::future::pending().await,
    }
}

/// Copies (and receives, copying or reducing onto a base) into a result that nothing
/// reads again during the call ([`Schedule::write_once`]) of at least this many bytes
/// bypass the cache ([`nexar_device::copy_bytes_streaming`]): the L2 cache of a core
/// here. Smaller ones stay in the cache, where they cost less than the memory round trip
/// (a 2-process all-gather of 1 MiB, whose own block of 512 KiB was copied streaming as
/// an experiment, cost more CPU, not less; bench/HISTORY.md, session 17). Reductions
/// also need [`STREAM_REDUCE_FOOTPRINT_BYTES`].
const STREAM_COPY_BYTES: usize = 1 << 20;

/// Whether `action` writes with streaming stores: a result nothing reads again during the
/// call (the schedule's [`Schedule::write_once`], except under [`ReduceOp::Avg`], whose
/// final division reads the result right after the schedule) of [`STREAM_COPY_BYTES`] or
/// more; for a reduction onto a base, only in a call whose buffers (`footprint` bytes,
/// [`Buffers::footprint`]) are [`STREAM_REDUCE_FOOTPRINT_BYTES`] or more.
///
/// A receive writes its payload a piece at a time, as the transport hands it over: one
/// datagram's stream data, up to 64 KiB on loopback and jumbo-frame paths but about 1.4
/// KiB on a path with a 1500-byte MTU. The kernels stream only pieces of 2 KiB (copies)
/// and 8 KiB (reductions) or more, so on such a path a streamed receive is written
/// through the cache all the same.
fn streamed(schedule: &dyn Schedule, action: &Action, op: ReduceOp, footprint: usize) -> bool {
    let reduces = matches!(action, Action::Recv { base: Some(_), .. });
    action.writes().is_some_and(|w| result_streams(op, w.len()))
        && (!reduces || footprint >= STREAM_REDUCE_FOOTPRINT_BYTES)
        && schedule.write_once(action.id())
}

/// The rule every streamed result shares: [`STREAM_COPY_BYTES`] or more, and not under
/// [`ReduceOp::Avg`], whose final division reads the result right after the schedule.
fn result_streams(op: ReduceOp, len: usize) -> bool {
    op != ReduceOp::Avg && len >= STREAM_COPY_BYTES
}

/// Whether receive `id` of `len` bytes, which only the sends that pass it on whole read
/// after it ([`Schedule::write_once_past_forwards`]), copies its payload with streaming
/// stores, as [`streamed`] would a result written once: when those sends are handed the
/// payload itself (`forwards_kept`), not the range. A chain broadcast's ranks pass each
/// chunk on so; through the cache, the copy into the caller's buffer first read every
/// line of it in (broadcast of 64 MiB, CPU per byte through the cache against streamed:
/// 4 processes +17%, 8 processes +9%; BENCHMARKS.md, session 35).
fn streamed_past_forwards(
    schedule: &dyn Schedule,
    id: OpId,
    len: usize,
    op: ReduceOp,
    forwards_kept: bool,
) -> bool {
    forwards_kept && result_streams(op, len) && schedule.write_once_past_forwards(id)
}

/// Reductions onto a base ([`nexar_device::reduce_onto_bytes_streaming`]) stream their
/// stores only in a call whose buffers are at least this large together, too large for
/// the cache to keep the result's lines from one call to the next. In smaller ones the
/// stores through the cache cost less: the lines are still there. A 2-process
/// reduce-scatter of 4 MiB (6 MiB of buffers) took 24% more CPU streamed, one of 64 MiB
/// (96 MiB) 6-9% less (BENCHMARKS.md, session 34).
const STREAM_REDUCE_FOOTPRINT_BYTES: usize = 32 << 20;

/// Copies `src` into `dst`, with streaming stores when `streamed` (see [`streamed`]; and
/// `Communicator::recv`, for messages of `RECV_STREAM_BYTES` and more).
pub(crate) fn copy(dst: &mut [u8], src: &[u8], streamed: bool) {
    if streamed {
        nexar_device::copy_bytes_streaming(dst, src);
    } else {
        nexar_device::copy_bytes(dst, src);
    }
}

/// Runs a local action (copy, reduce, fill) on the buffers; a copy with streaming stores
/// when `streamed` ([`streamed`]).
fn run_local(
    bufs: &mut Buffers<'_>,
    action: Action,
    dtype: DataType,
    op: ReduceOp,
    streamed: bool,
) -> Result<()> {
    let is_reduce = matches!(action, Action::Reduce { .. });
    match action {
        Action::Copy { src, dst, .. } | Action::Reduce { src, dst, .. }
            if bufs.on_device(&src) || bufs.on_device(&dst) =>
        {
            // Device memory is involved: go through a host copy of the source.
            let bytes = bufs.read_vec(&src)?;
            bufs.store(&dst, &bytes, is_reduce.then_some((dtype, op)))
        }
        Action::Copy { src, dst, .. } => {
            let (s, d) = bufs.pair(&src, &dst)?;
            copy(d, s, streamed);
            Ok(())
        }
        Action::Reduce { src, dst, .. } => {
            let (s, d) = bufs.pair(&src, &dst)?;
            Ok(nexar_device::reduce_bytes(dtype, op, d, s)?)
        }
        Action::FillIdentity { dst, .. } => {
            let mut id_bytes = vec![0u8; dst.range.len()];
            nexar_device::fill_identity(dtype, op, &mut id_bytes)?;
            bufs.store(&dst, &id_bytes, None)
        }
        Action::Send { .. } | Action::Recv { .. } => Err(NexarError::InvalidArgument(
            "a send or receive is not a local action".into(),
        )),
    }
}

/// Resolves with `PeerLost` as soon as rank `only` (with `None`: any member) of the
/// communicator is known lost, or departed and gone (it left the cluster or finished, and
/// its connections closed: it will never take part again). With `None`, a member that
/// finished its job (said farewell) and went does not count: it finished every
/// collective it took part in, and one that still needs it fails anyway, at the receive
/// of what it never sent (its mailboxes fail when its connections close) or the send to
/// it. (A collective on other ranks used to fail when such a member closed while it still
/// waited for a third one.)
pub(crate) async fn ranks_lost(core: &CommCore, only: Option<usize>) -> NexarError {
    let mut failures = core.shared.failures.subscribe();
    let mut gone = core.shared.watch_gone();
    loop {
        let hit = {
            let lost = failures.borrow_and_update();
            let gone = gone.borrow_and_update();
            core.members.iter().enumerate().position(|(r, m)| {
                only.is_none_or(|o| o == r)
                    && (lost.contains(m)
                        || (gone.contains(m)
                            && (only.is_some() || !core.shared.finished_normally(*m))))
            })
        };
        if let Some(rank) = hit {
            let member = core.members[rank];
            let reason = match core.shared.lost.get(&member) {
                Some(r) => r.clone(),
                None if core.shared.has_departed(member) => {
                    "it departed (left the cluster or finished, or was turned away at a resize \
                     point) and its connections are closed"
                        .into()
                }
                None => "disconnected".into(),
            };
            return NexarError::PeerLost { rank, reason };
        }
        tokio::select! {
            res = failures.changed() => {
                if res.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            res = gone.changed() => {
                if res.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }
}

/// How many bytes of received payloads a collective may keep for the sends that pass
/// them on, when the one at hand is a reduced `result` that only sends read (else a
/// payload passed on as it arrived), bound for `dst`: the send `budget`, or
/// [`SCRATCH_RESULT_BUDGETS`] of them for a result bound for scratch.
fn keep_room(result: bool, dst: BufId, budget: usize) -> usize {
    if result && dst == BufId::Scratch {
        budget.saturating_mul(SCRATCH_RESULT_BUDGETS)
    } else {
        budget
    }
}

/// Received payloads kept for the sends that pass them on, whole or as one of their pieces
/// ([`Schedule::forwards`], [`Schedule::parts`]): each with the number of such sends not
/// yet issued, and dropped after the last. The driver
/// keeps at most the send budget's worth (`bytes`), or [`SCRATCH_RESULT_BUDGETS`] of them
/// for results bound for scratch ([`keep_room`]), so a collective holds at most about
/// twice the budget beyond the caller's buffers (kept payloads, and sends the transport
/// has not released), or five times where it reduces into scratch, as against once when
/// every send was a copy.
#[derive(Default)]
struct Kept {
    entries: Vec<KeptPayload>,
    bytes: usize,
}

struct KeptPayload {
    recv: OpId,
    chunks: Vec<Bytes>,
    len: usize,
    /// Sends still to pass it on.
    uses: usize,
    /// Its in-flight share while a send the transport holds passes it on (not held here:
    /// the share goes when the last such send lets go, even if more are to come).
    share: Weak<FlightShare>,
}

impl Kept {
    /// Keeps the `len` bytes of `recv`'s payload, already counted in `bytes`.
    fn keep(&mut self, recv: OpId, chunks: Vec<Bytes>, len: usize, uses: usize) {
        self.entries.push(KeptPayload {
            recv,
            chunks,
            len,
            uses,
            share: Weak::new(),
        });
    }

    /// True when a payload of `recv` is kept.
    fn holds(&self, recv: OpId) -> bool {
        self.entries.iter().any(|e| e.recv == recv)
    }

    /// The in-flight share of `recv`'s payload while a send the transport holds passes
    /// it on (a further send of it then adds nothing to the count).
    fn held(&self, recv: Option<OpId>) -> Option<Arc<FlightShare>> {
        let recv = recv?;
        self.entries
            .iter()
            .find(|e| e.recv == recv)
            .and_then(|e| e.share.upgrade())
    }

    /// What a send of `pieces` (each a payload kept for it, or bytes to copy, with its
    /// length) adds to the bytes the transport holds: a payload an earlier send still
    /// holds adds nothing, and its share is returned, to be kept alive until this send has
    /// taken the payload too.
    fn adds(
        &self,
        pieces: impl Iterator<Item = (Option<OpId>, usize)>,
    ) -> (usize, Vec<Arc<FlightShare>>) {
        let mut adds = 0;
        let mut sharing = Vec::new();
        for (recv, len) in pieces {
            match self.held(recv) {
                Some(share) => sharing.push(share),
                None => adds += len,
            }
        }
        (adds, sharing)
    }

    /// Lets go of the payloads that the pieces `parts` of a send pass on, for a send that
    /// takes none of them (it copies its range whole, or writes it from the buffer).
    fn let_go(&mut self, parts: &[SendPart]) {
        for p in parts {
            self.take(p.forwards, None);
        }
    }

    /// The message of a send in pieces `parts`, all of whose payloads are kept: those
    /// payloads as they came, and the rest copied out in pooled pieces of at most
    /// [`SEND_PIECE_BYTES`], each counted against `flight`.
    fn pieces(
        &mut self,
        parts: &[SendPart],
        bufs: &Buffers<'_>,
        pool: &Arc<SendPool>,
        flight: &Arc<InFlight>,
    ) -> Result<Vec<Bytes>> {
        let mut chunks = Vec::new();
        for p in parts {
            if p.forwards.is_some() {
                let kept = self.take(p.forwards, Some(flight)).ok_or_else(|| {
                    NexarError::Actor(format!("no payload kept for {:?}", p.forwards))
                })?;
                chunks.extend(kept);
                continue;
            }
            let r = &p.range;
            for at in (r.range.start..r.range.end).step_by(SEND_PIECE_BYTES) {
                let end = (at + SEND_PIECE_BYTES).min(r.range.end);
                chunks.push(bufs.send_bytes(&BufRange::new(r.buf, at..end), pool, flight)?);
            }
        }
        Ok(chunks)
    }

    /// The chunks of `recv`'s payload for one more send (`None` when none are kept, as
    /// when the payload went into device memory), counted against `flight` when given:
    /// in one share for all the sends that hold it at once.
    fn take(&mut self, recv: Option<OpId>, flight: Option<&Arc<InFlight>>) -> Option<Vec<Bytes>> {
        let recv = recv?;
        let i = self.entries.iter().position(|e| e.recv == recv)?;
        let entry = &mut self.entries[i];
        let share = flight.map(|flight| {
            entry.share.upgrade().unwrap_or_else(|| {
                let share = Arc::new(FlightShare::new(flight, entry.len));
                entry.share = Arc::downgrade(&share);
                share
            })
        });
        entry.uses -= 1;
        let chunks = if entry.uses > 0 {
            entry.chunks.clone()
        } else {
            let entry = self.entries.swap_remove(i);
            self.bytes -= entry.len;
            entry.chunks
        };
        Some(match share {
            Some(share) => crate::pool::counted(chunks, share),
            None => chunks,
        })
    }
}

/// A large send of copied host bytes over QUIC: its range is copied out in pieces of
/// [`SEND_PIECE_BYTES`] (pooled buffers, counted in flight until the transport drops
/// them) as the send budget lets them, while its writer sends the frame. A whole copy
/// would hold a second copy of the range, and one over the send pool's size a fresh one
/// every call (page faults on every page of it), and would not start to send before it
/// was made.
struct Feed {
    src: BufRange,
    /// Bytes copied out so far.
    fed: usize,
    /// To the writer; dropped once every piece is out.
    tx: tokio::sync::mpsc::UnboundedSender<Bytes>,
}

impl Feed {
    /// Copies out pieces while the transport holds less than `budget` (at least one while
    /// it holds nothing); true once every piece is out, or the writer is gone (it failed,
    /// and says so itself).
    fn next_pieces(
        &mut self,
        bufs: &Buffers<'_>,
        pool: &Arc<SendPool>,
        flight: &Arc<InFlight>,
        budget: usize,
    ) -> Result<bool> {
        let src = bufs.get(&self.src)?;
        let out = pool.copy_out(src, &mut self.fed, &self.tx, flight, budget);
        Ok(out != CopiedOut::Budget)
    }
}

/// Where a direct send stands.
enum DirectState {
    /// Not begun: the lane to write it on and its step.
    Start { lane: TcpLane, step: u32 },
    /// Begun: the frame, waiting for room in the socket.
    Resume(DirectFrame),
}

/// A direct send waiting to make progress: resolves with the frame to write more of.
type DirectWait<'a> =
    Pin<Box<dyn Future<Output = (OpId, usize, BufRange, Result<DirectFrame>)> + Send + 'a>>;

/// Runs a transport wait for a send to rank `peer` under the collective's deadline.
pub(crate) async fn within<T>(
    core: &CommCore,
    peer: usize,
    deadline: Instant,
    fut: impl Future<Output = std::result::Result<T, nexar_transport::TransportError>>,
) -> Result<T> {
    match tokio::time::timeout_at(deadline.into(), fut).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(failed_send(core, peer, e, deadline).await),
        Err(_) => Err(send_timeout(core, peer)),
    }
}

/// A send to rank `peer` that reached the collective's deadline.
pub(crate) fn send_timeout(core: &CommCore, peer: usize) -> NexarError {
    NexarError::Timeout {
        what: format!("send to rank {peer}"),
        after: core.shared.config.op_timeout,
    }
}

/// The error of a send to rank `peer` that failed with `e`: the peer's loss where the
/// failure was its lane ending as it crashed ([`lane_verdict`]), else `e` as a send error.
pub(crate) async fn failed_send(
    core: &CommCore,
    peer: usize,
    e: nexar_transport::TransportError,
    deadline: Instant,
) -> NexarError {
    match lane_verdict(core, peer, &e, deadline).await {
        Some(lost) => lost,
        None => send_error(core, peer, e),
    }
}

/// For a send that failed as rank `peer`'s trusted lane ended while its QUIC connections
/// stay open, as a crashed peer's do (its kernel closes the TCP connection; nothing sends
/// a QUIC close): the peer's actor gives a QUIC close a moment to say whether the peer
/// finished or was lost (`peer.rs`). This waits for that verdict, up to one heartbeat
/// timeout within the deadline, so that a crash ends the send with `PeerLost`, as it does
/// over QUIC, and not with the lane's error. `None` where that does not apply, or no
/// verdict came.
async fn lane_verdict(
    core: &CommCore,
    peer: usize,
    e: &nexar_transport::TransportError,
    deadline: Instant,
) -> Option<NexarError> {
    if !matches!(e, nexar_transport::TransportError::Send { .. }) {
        return None;
    }
    let node = core.node_of(peer).ok()?;
    let ended = core
        .shared
        .links
        .get(&node)
        .and_then(|l| l.lane.as_ref().map(TcpLane::is_closed))?;
    if !ended || core.shared.lost.contains_key(&node) || core.shared.is_shutting_down() {
        return None;
    }
    let patience = core
        .shared
        .config
        .heartbeat_timeout
        .min(deadline.saturating_duration_since(Instant::now()));
    tokio::time::timeout(patience, ranks_lost(core, Some(peer)))
        .await
        .ok()
}

fn wire_step(sig: u32, step: u32) -> u64 {
    // The top bit stays clear: a notice with it set gives up a whole tag
    // (`nexar_transport::WHOLE_TAG_STEP`).
    debug_assert!(sig < 1 << 31, "a call fingerprint of 31 bits");
    u64::from(sig) << 32 | u64::from(step)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;
    use nexar_collectives::{BufId, BufRange, OpId};

    use super::{
        keep_room, polls, streamed, streamed_past_forwards, Buffers, InFlight, Kept, SendPool,
    };
    use crate::ZeroCopyBuffer;

    /// Receives that only the sends passing them on whole read stream their stores when
    /// those sends are handed the payload, from 1 MiB, not under `Avg`. (That the driver
    /// hands the rule whether it kept the payload is not observable from here.)
    #[test]
    fn chunks_passed_on_stream_when_their_forwards_are_handed_the_payload() {
        use nexar_collectives::{Action, CollectiveConfig, OpId, Schedule};
        use nexar_device::{DataType, ReduceOp};
        let cfg = CollectiveConfig::default();
        let mib = 1 << 20;
        // Each receive of a schedule and its length, found by running it to its end.
        let recvs_of = |s: &mut dyn Schedule| -> Vec<(OpId, usize)> {
            let (mut recvs, mut ready) = (Vec::new(), Vec::new());
            while !s.is_done() {
                s.poll(&mut ready);
                assert!(!ready.is_empty(), "the schedule stalled");
                for a in ready.drain(..) {
                    s.complete(a.id()).expect("complete");
                    if let Action::Recv { id, dst, .. } = a {
                        recvs.push((id, dst.len()));
                    }
                }
            }
            recvs
        };
        // A 4-rank chain broadcast of 64 MiB from rank 0: rank 1 passes each chunk on.
        let broadcast = |rank| {
            nexar_collectives::broadcast(rank, 4, 16 * mib, DataType::F32, 0, &cfg)
                .expect("schedule")
        };
        let mut chain = broadcast(1);
        assert_eq!(chain.name(), "chain");
        let recvs = recvs_of(&mut *chain);
        assert!(!recvs.is_empty());
        for (id, len) in recvs {
            assert!(len >= super::STREAM_COPY_BYTES, "{len}");
            let streams = |len, op, kept| streamed_past_forwards(&*chain, id, len, op, kept);
            assert!(streams(len, ReduceOp::Sum, true));
            // Not when the sends read the range instead, nor under Avg, nor short.
            assert!(!streams(len, ReduceOp::Sum, false));
            assert!(!streams(len, ReduceOp::Avg, true));
            assert!(!streams(super::STREAM_COPY_BYTES - 1, ReduceOp::Sum, true));
        }
        // The last rank passes nothing on: its receives are written once outright.
        let mut last = broadcast(3);
        for (id, len) in recvs_of(&mut *last) {
            assert!(!streamed_past_forwards(
                &*last,
                id,
                len,
                ReduceOp::Sum,
                true
            ));
            assert!(last.write_once(id));
        }
    }

    /// Results written once stream their stores: copies of 1 MiB or more; reductions onto
    /// a base of 1 MiB or more only in a call on 32 MiB of buffers or more (out of the
    /// cache; in it, streaming stores cost more); nothing under `Avg`, whose division
    /// reads the result back. The buffers are the input and the result, or the one buffer
    /// of an in-place call.
    #[test]
    fn results_stream_from_their_size_and_reductions_from_the_calls() {
        use nexar_collectives::{Action, CollectiveConfig, Schedule};
        use nexar_device::{DataType, ReduceOp};
        let cfg = CollectiveConfig::default();
        let mib = 1 << 20;
        // The last action `f` picks, found by running the schedule to its end.
        let last = |s: &mut dyn Schedule, f: &dyn Fn(&Action) -> bool| -> Action {
            let (mut found, mut ready) = (None, Vec::new());
            while !s.is_done() {
                s.poll(&mut ready);
                assert!(!ready.is_empty(), "the schedule stalled");
                for a in ready.drain(..) {
                    s.complete(a.id()).expect("complete");
                    if f(&a) {
                        found = Some(a);
                    }
                }
            }
            found.expect("such an action")
        };
        // A 2-rank reduce-scatter of 16 MiB: its receive reduces 8 MiB onto the input
        // into the result; input and result are 24 MiB.
        let mut rs =
            nexar_collectives::reduce_scatter(0, 2, 2 * mib, DataType::F32, ReduceOp::Sum, &cfg)
                .expect("schedule");
        let onto = last(
            &mut *rs,
            &|a| matches!(a, Action::Recv { base: Some(_), dst, .. } if dst.buf == BufId::Data),
        );
        let (input, mut result) = (vec![0u8; 16 * mib], vec![0u8; 8 * mib]);
        let out_of_place = Buffers::host(&mut result, &input).footprint();
        assert_eq!(out_of_place, 24 * mib);
        assert!(!streamed(&*rs, &onto, ReduceOp::Sum, out_of_place));
        assert!(streamed(&*rs, &onto, ReduceOp::Sum, 32 * mib));
        assert!(!streamed(&*rs, &onto, ReduceOp::Avg, 32 * mib));
        // In place the one buffer holds all 16 MiB of the input.
        let mut whole = vec![0u8; 16 * mib];
        assert_eq!(Buffers::host(&mut whole, &[]).footprint(), 16 * mib);
        // A 2-rank all-gather's copy of its own 1 MiB block streams in any call.
        let mut ag =
            nexar_collectives::all_gather(0, 2, mib / 4, DataType::F32, &cfg).expect("schedule");
        let own = last(&mut *ag, &|a| matches!(a, Action::Copy { .. }));
        assert!(streamed(&*ag, &own, ReduceOp::Sum, 3 * mib));
        let mut small = nexar_collectives::all_gather(0, 2, mib / 4 - 1, DataType::F32, &cfg)
            .expect("schedule");
        let own = last(&mut *small, &|a| matches!(a, Action::Copy { .. }));
        assert!(!streamed(&*small, &own, ReduceOp::Sum, 64 * mib));
    }

    /// A 2-rank reduce sends the leaf's whole buffer (5 MiB and 12 bytes here) to the root:
    /// over QUIC it is copied out in pieces of at most 1 MiB of the send pool, which the
    /// pool holds once the transport is done with them, and never as one whole copy (a
    /// pooled buffer of the whole size). The root's result is right.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_send_is_copied_out_in_pieces_of_the_pool() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        let n = (5 << 20) / 4 + 3;
        let calls = comms.iter().cloned().map(|c| {
            tokio::spawn(async move {
                let mut v: Vec<f32> = (0..n).map(|i| (i % 7) as f32 + c.rank() as f32).collect();
                c.reduce(&mut v, nexar_device::ReduceOp::Sum, 0)
                    .await
                    .map(|()| v)
            })
        });
        let done = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(calls))
            .await
            .expect("the reduce in time");
        let root = done[0].as_ref().expect("task").as_ref().expect("reduce");
        assert!(root
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (2 * (i % 7) + 1) as f32));
        // The leaf's copies come back to its pool as the root acknowledges them: a whole
        // copy at once (it would be all there is), pieces one by one.
        let pool = comms[1].core.shared.pool.sends().clone();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while pool.free_capacities().iter().sum::<usize>() < crate::pool::SEND_PIECE_BYTES {
            assert!(
                std::time::Instant::now() < deadline,
                "the pieces never came back: {:?}",
                pool.free_capacities()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let largest = pool.free_capacities()[0];
        assert!(
            largest <= crate::pool::SEND_PIECE_BYTES,
            "a buffer of {largest} bytes"
        );
        cluster.shutdown().await;
    }

    /// A reduced result bound for scratch (copied out again for its send if stored) may
    /// wait in a buffer of its own past the send budget; results bound for Data, and
    /// payloads passed on as they arrived, only within it.
    #[test]
    fn results_bound_for_scratch_may_be_kept_past_the_send_budget() {
        let budget = 4 << 20;
        assert_eq!(keep_room(true, BufId::Scratch, budget), 4 * budget);
        assert_eq!(keep_room(true, BufId::Data, budget), budget);
        assert_eq!(keep_room(false, BufId::Scratch, budget), budget);
        assert_eq!(keep_room(false, BufId::Data, budget), budget);
        assert_eq!(keep_room(true, BufId::Scratch, usize::MAX), usize::MAX);
    }

    /// Sends from a zero-copy buffer's Data or Input lend the buffer's own bytes; short
    /// ones, sends from scratch, and sends from borrowed slices copy.
    #[test]
    fn sends_lend_zero_copy_buffers_and_copy_the_rest() {
        const K: usize = 1 << 10;
        let pool = Arc::new(SendPool::new(4 << 20));
        let flight = Arc::new(InFlight::default());
        let mut data = ZeroCopyBuffer::from(vec![1u32; 64 * K]);
        let input = ZeroCopyBuffer::from(vec![2u32; 64 * K]);
        let (data_at, input_at) = (data.as_ptr() as usize, input.as_ptr() as usize);
        let (bytes, lender) = input.lent_input();
        let mut bufs = Buffers::lending(data.region(), bytes, Some(lender));
        bufs.scratch = vec![3u8; 128 * K];
        let range = |buf, r: std::ops::Range<usize>| BufRange { buf, range: r };
        let send = |bufs: &Buffers<'_>, r: &BufRange| {
            bufs.send_bytes(r, &pool, &flight)
                .map_err(|e| e.to_string())
        };
        let d = send(&bufs, &range(BufId::Data, 8..8 + 64 * K)).expect("data");
        let i = send(&bufs, &range(BufId::Input, 0..128 * K)).expect("input");
        let s = send(&bufs, &range(BufId::Scratch, 0..128 * K)).expect("scratch");
        let short = send(&bufs, &range(BufId::Data, 0..64 * K - 1)).expect("short");
        assert_eq!(d.as_ptr() as usize, data_at + 8, "Data lent");
        assert_eq!(i.as_ptr() as usize, input_at, "Input lent");
        assert!(s.iter().all(|b| *b == 3), "scratch copied");
        assert_ne!(short.as_ptr() as usize, data_at, "a short send is copied");
        assert_eq!(flight.bytes(), 64 * K + 128 * K + 128 * K + 64 * K - 1);
        assert!(bufs.writes_lent(&range(BufId::Data, 64 * K..64 * K + 16)));
        assert!(!bufs.writes_lent(&range(BufId::Data, 64 * K + 8..64 * K + 16)));
        assert!(
            !bufs.writes_lent(&range(BufId::Data, 0..8)),
            "the copy lends nothing"
        );
        assert!(
            send(&bufs, &range(BufId::Data, 0..512 * K)).is_err(),
            "out of bounds"
        );
        drop((d, i, s, short, bufs));
        assert_eq!(flight.bytes(), 0);

        let mut plain = vec![5u8; 128 * K];
        let bufs = Buffers::host(&mut plain, &[]);
        let c = send(&bufs, &range(BufId::Data, 0..128 * K)).expect("slice");
        assert_ne!(c.as_ptr(), plain_ptr(&bufs), "a borrowed slice is copied");
        assert!(!bufs.writes_lent(&range(BufId::Data, 0..64)));
    }

    /// A received payload that several sends pass on counts once against the send budget
    /// while any of them holds it, and not at all while none does.
    #[test]
    fn a_payload_passed_on_by_several_sends_counts_once_in_flight() {
        let flight = Arc::new(InFlight::default());
        let mut kept = Kept::default();
        let (recv, other) = (OpId(7), OpId(8));
        let chunks = vec![Bytes::from(vec![1u8; 1000]), Bytes::from(vec![2u8; 24])];
        kept.keep(recv, chunks, 1024, 3);
        kept.bytes += 1024;
        assert!(kept.held(Some(recv)).is_none());
        let first = kept.take(Some(recv), Some(&flight)).expect("kept");
        assert_eq!(flight.bytes(), 1024);
        assert_eq!(first.iter().map(Bytes::len).sum::<usize>(), 1024);
        // A second send while the first is held adds nothing.
        let sharing = kept.held(Some(recv));
        assert!(sharing.is_some());
        assert!(
            kept.held(Some(other)).is_none(),
            "another payload is not held"
        );
        let second = kept.take(Some(recv), Some(&flight)).expect("kept");
        drop(sharing);
        assert_eq!(flight.bytes(), 1024, "counted once");
        drop(first);
        assert_eq!(flight.bytes(), 1024, "the second send still holds it");
        drop(second);
        assert_eq!(flight.bytes(), 0);
        // The last send, after the others let go, counts it again; then it is gone.
        assert!(kept.held(Some(recv)).is_none());
        let last = kept.take(Some(recv), Some(&flight)).expect("kept");
        assert_eq!(flight.bytes(), 1024);
        assert!(!kept.holds(recv));
        assert_eq!(kept.bytes, 0);
        drop(last);
        assert_eq!(flight.bytes(), 0);
        // Taken without a flight (a trusted lane writes from the buffer), nothing counts.
        kept.keep(other, vec![Bytes::from(vec![3u8; 64])], 64, 1);
        kept.bytes += 64;
        let lane = kept.take(Some(other), None).expect("kept");
        assert_eq!(flight.bytes(), 0);
        drop(lane);
        assert!(kept.take(Some(other), None).is_none());
    }

    /// A send in pieces passes each kept payload on as it is (the same bytes, not a copy)
    /// and copies the rest out of the buffer in pooled pieces of at most 1 MiB, all
    /// counted in flight; a send that takes none of the pieces lets go of the payloads.
    #[test]
    fn a_send_in_pieces_passes_kept_payloads_on_and_copies_only_the_rest() {
        let piece = crate::pool::SEND_PIECE_BYTES;
        let pool = Arc::new(SendPool::new(8 << 20));
        let flight = Arc::new(InFlight::default());
        let mut data: Vec<u8> = (0..3 * piece + 300).map(|i| (i % 251) as u8).collect();
        let expect = data.clone();
        let bufs = Buffers::host(&mut data, &[]);
        let (recv, other) = (OpId(3), OpId(4));
        // The receive wrote bytes 100..300 (its payload came in two chunks); the pieces
        // around it are the buffer's own.
        let payload = [
            Bytes::copy_from_slice(&expect[100..150]),
            Bytes::copy_from_slice(&expect[150..300]),
        ];
        let at = payload[0].as_ptr();
        let mut kept = Kept::default();
        kept.keep(recv, payload.to_vec(), 200, 2);
        kept.keep(other, vec![Bytes::from(vec![9u8; 16])], 16, 1);
        kept.bytes += 216;
        let part = |r: std::ops::Range<usize>, forwards| nexar_collectives::SendPart {
            range: BufRange::data(r),
            forwards,
        };
        let parts = [
            part(0..100, None),
            part(100..300, Some(recv)),
            part(300..3 * piece + 300, None),
        ];
        let chunks = kept.pieces(&parts, &bufs, &pool, &flight).expect("pieces");
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        assert_eq!(joined, expect);
        assert_eq!(chunks[1].as_ptr(), at, "the payload as it came");
        assert!(chunks.iter().all(|c| c.len() <= piece));
        assert_eq!(chunks.len(), 1 + 2 + 3, "the copies cut at 1 MiB");
        assert_eq!(flight.bytes(), 3 * piece + 300);
        assert!(kept.holds(recv), "one more send passes it on");
        // A send that copies its range whole instead lets go of the payloads it would
        // have passed on: the last use of `recv`, the only one of `other`.
        kept.let_go(&[part(100..300, Some(recv)), part(300..316, Some(other))]);
        assert!(!kept.holds(recv) && !kept.holds(other));
        assert_eq!(kept.bytes, 0);
        drop(chunks);
        assert_eq!(flight.bytes(), 0);
        // A piece whose payload is not kept is an error, not a gap in the message.
        assert!(kept.pieces(&parts, &bufs, &pool, &flight).is_err());
    }

    fn plain_ptr(bufs: &Buffers<'_>) -> *const u8 {
        bufs.get(&BufRange {
            buf: BufId::Data,
            range: 0..1,
        })
        .map_or(std::ptr::null(), <[u8]>::as_ptr)
    }

    #[test]
    fn waits_poll_within_the_spin_but_not_through_a_stream_on_an_uncrowded_host() {
        let (spin, soon, late) = (
            Duration::from_millis(1),
            Duration::from_micros(10),
            Duration::from_millis(2),
        );
        // Waiting for a block to start, or for small messages: poll, crowded or not.
        assert!(polls(spin, soon, false, false));
        assert!(polls(spin, soon, true, false));
        // A block streaming in: its chunks wake the collective; poll only where ranks
        // outnumber cores.
        assert!(!polls(spin, soon, false, true));
        assert!(polls(spin, soon, true, true));
        // Past the spin, or with none: sleep.
        assert!(!polls(spin, late, true, false));
        assert!(!polls(Duration::ZERO, Duration::ZERO, true, false));
    }
}
