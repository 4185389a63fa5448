//! The mailbox table: inbound frames demultiplexed by [`MailboxKey`].
//!
//! A frame that arrives before anyone waits for it is kept until taken, within a byte
//! budget shared by the whole endpoint. Past the budget the reader of a frame on a stream
//! of its own stops reading and QUIC flow control pushes back on the sender; a frame
//! somebody is already waiting for never needs budget. Frames on a peer's message stream
//! (64 KiB at most each) are never held back (see the endpoint's readers), nor are
//! relayed ones once half a neighbour's streams wait, so the budget is not a hard bound
//! for those; [`MailboxTable::budget_available`] counts only what it covers. A peer whose
//! streams all hold frames waiting for budget cannot open one for the frame a receiver
//! here waits for: that receive then times out. A taken mailbox is removed, and frames
//! for retired (finished or abandoned) collective tags are discarded on arrival.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};

use crate::{NodeId, TransportError, GAVE_UP_ON_ITS_OWN};

/// Address of one message: communicator, tag, step and the authenticated sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MailboxKey {
    /// Communicator id.
    pub comm: u64,
    /// Tag (collective sequence number or point-to-point tag).
    pub tag: u64,
    /// Step within the tag.
    pub step: u64,
    /// Sender, as authenticated by its certificate.
    pub src: NodeId,
}

/// A received payload: the chunks as QUIC delivered them (no reassembly copy), plus the
/// share of the early-arrival budget it holds until dropped.
#[derive(Debug, Default)]
pub struct Payload {
    chunks: Vec<Bytes>,
    len: usize,
    _permit: Option<BudgetPermit>,
    /// Lane credit the payload holds until dropped (a frame sent on credit).
    _credit: Option<crate::lane::HeldCredit>,
}

impl Payload {
    /// A payload made of one buffer (used for frames a node sends to itself).
    pub fn from_bytes(bytes: Bytes) -> Payload {
        let len = bytes.len();
        Payload {
            chunks: vec![bytes],
            len,
            _permit: None,
            _credit: None,
        }
    }

    /// A payload made of `chunks` in order (to send received chunks on without joining
    /// them).
    pub fn from_parts(chunks: Vec<Bytes>) -> Payload {
        Payload::from_chunks(chunks, None)
    }

    /// The chunks, giving up the payload's share of the early-arrival budget.
    pub fn into_chunks(self) -> Vec<Bytes> {
        self.chunks
    }

    /// The payload as one buffer: its only chunk as is, or the chunks joined (a copy).
    pub fn to_bytes(&self) -> Bytes {
        match self.chunks.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => {
                let mut joined = Vec::with_capacity(self.len);
                for c in many {
                    joined.extend_from_slice(c);
                }
                Bytes::from(joined)
            }
        }
    }

    pub(crate) fn from_chunks(chunks: Vec<Bytes>, permit: Option<BudgetPermit>) -> Payload {
        let len = chunks.iter().map(Bytes::len).sum();
        Payload {
            chunks,
            len,
            _permit: permit,
            _credit: None,
        }
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunks in order.
    pub fn chunks(&self) -> &[Bytes] {
        &self.chunks
    }

    /// Chunk `i`, taken out (an empty one is left in its place); `None` past the last.
    fn take_chunk(&mut self, i: usize) -> Option<Bytes> {
        self.chunks.get_mut(i).map(std::mem::take)
    }

    /// Copies the payload into `dst`, which must be exactly [`Payload::len`] bytes.
    pub fn copy_to(&self, dst: &mut [u8]) -> Result<(), (usize, usize)> {
        if dst.len() != self.len {
            return Err((dst.len(), self.len));
        }
        let mut off = 0;
        for c in &self.chunks {
            dst[off..off + c.len()].copy_from_slice(c);
            off += c.len();
        }
        Ok(())
    }

    /// Calls `f(offset, bytes)` over the payload in order, in pieces whose lengths are
    /// multiples of `align` (an element size), so a reduction can run straight from the
    /// received chunks. Elements split across chunk boundaries are reassembled in a small
    /// buffer. A trailing partial element is an error (returned as `Err(None)`); errors
    /// from `f` are passed through as `Err(Some(e))`.
    pub fn for_each_aligned<E>(
        &self,
        align: usize,
        mut f: impl FnMut(usize, &[u8]) -> Result<(), E>,
    ) -> Result<(), Option<E>> {
        let mut cut = ElementCutter::new(align).ok_or(None)?;
        for chunk in &self.chunks {
            cut.feed(chunk, &mut f).map_err(Some)?;
        }
        if cut.is_whole() {
            Ok(())
        } else {
            Err(None)
        }
    }
}

/// Cuts bytes that arrive in pieces of any length into runs of whole elements, so a
/// reduction can run straight from the received chunks as they come: an element split
/// across two chunks is reassembled in a small buffer.
#[derive(Debug, Clone)]
pub struct ElementCutter {
    align: usize,
    carry: [u8; 16],
    carried: usize,
    /// Bytes passed on so far (the offset of the next run).
    off: usize,
}

impl ElementCutter {
    /// A cutter for elements of `align` bytes (0 counts as 1); `None` above 16 bytes.
    pub fn new(align: usize) -> Option<ElementCutter> {
        let align = align.max(1);
        (align <= 16).then_some(ElementCutter {
            align,
            carry: [0; 16],
            carried: 0,
            off: 0,
        })
    }

    /// Calls `f(offset, bytes)` for the whole elements that `chunk` completes or holds, in
    /// order; the offset counts from the first byte fed. Errors from `f` are passed
    /// through, and the chunk counts as passed on all the same (the elements after the one
    /// `f` failed on included): a later `feed` goes on after it.
    pub fn feed<E>(
        &mut self,
        chunk: &[u8],
        mut f: impl FnMut(usize, &[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let align = self.align;
        let mut c = chunk;
        // The state moves past the whole chunk before `f` runs, so that an error from
        // `f` leaves it as if every byte had been passed on.
        let mut completed = None;
        if self.carried > 0 {
            let take = (align - self.carried).min(c.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&c[..take]);
            self.carried += take;
            c = &c[take..];
            if self.carried < align {
                return Ok(());
            }
            completed = Some((self.carry, self.off));
            self.off += align;
            self.carried = 0;
        }
        let (run, rest) = c.split_at(c.len() / align * align);
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
        let run_off = self.off;
        self.off += run.len();
        if let Some((element, off)) = completed {
            f(off, &element[..align])?;
        }
        if !run.is_empty() {
            f(run_off, run)?;
        }
        Ok(())
    }

    /// True when no partial element is held back: everything fed was whole elements.
    pub fn is_whole(&self) -> bool {
        self.carried == 0
    }
}

enum Slot {
    /// Payload buffered, nobody has asked yet.
    Ready(Payload),
    /// A header arrived; the payload is being read (or waits for budget).
    Incoming {
        wanted: Arc<Notify>,
        waiter: Option<Waiter>,
    },
    /// A receiver waits; nothing has arrived.
    Waiting(Waiter),
    /// The sender gave up on this frame ([`MailboxTable::abandon`]): the next receiver
    /// gets [`TransportError::Abandoned`] and removes the slot. A marker a peer's notice
    /// made holds one of that peer's [`ABANDONED_MARKERS_PER_PEER`].
    Abandoned {
        _place: Option<OwnedSemaphorePermit>,
    },
}

/// A receiver waiting for a frame: for the whole payload ([`MailboxTable::take`]), or
/// for a [`Delivery`] that may hand it the stream itself ([`MailboxTable::take_delivery`]).
enum Waiter {
    Whole(oneshot::Sender<Payload>),
    Delivery(oneshot::Sender<Delivery>),
}

impl Waiter {
    fn is_closed(&self) -> bool {
        match self {
            Waiter::Whole(tx) => tx.is_closed(),
            Waiter::Delivery(tx) => tx.is_closed(),
        }
    }

    /// Hands over a complete payload; gives it back if the receiver is gone.
    fn send(self, payload: Payload) -> Result<(), Payload> {
        match self {
            Waiter::Whole(tx) => tx.send(payload),
            // What comes back is the whole payload just sent.
            Waiter::Delivery(tx) => tx
                .send(Delivery::whole(payload))
                .map_err(|d| d.keep().unwrap_or_default()),
        }
    }
}

/// Payloads at least this large are handed to a [`MailboxTable::take_delivery`] receiver
/// as the stream itself when that receiver waits, or starts to wait while the payload is
/// still arriving (it then gets what was read so far first): it copies (or reduces) the
/// bytes into its buffer as they arrive ([`Delivery::next_chunk`]), so the message is
/// never held whole (smaller ones arrive in a chunk or two, and are read whole).
pub(crate) const STREAM_HANDOVER_BYTES: usize = 256 << 10;

/// A data frame being read: its stream, and what has been read of it so far.
pub(crate) struct PartialFrame {
    pub(crate) key: MailboxKey,
    pub(crate) stream: quinn::RecvStream,
    /// The payload's length.
    pub(crate) len: usize,
    /// The chunks read so far, in order.
    pub(crate) read: Vec<Bytes>,
    /// Early-arrival budget held for the frame, if any.
    pub(crate) permit: Option<BudgetPermit>,
}

/// A frame handed to a [`MailboxTable::take_delivery`] receiver: the whole payload, or
/// (for a large frame still arriving when the receiver came) the QUIC stream it is
/// arriving on, after what was read of it before, to be copied into the receiver's buffer
/// with [`Delivery::copy_into`] or [`Delivery::next_chunk`].
#[derive(Debug)]
pub struct Delivery(Delivered);

#[derive(Debug)]
enum Delivered {
    Whole {
        payload: Payload,
        /// The chunk [`Delivery::next_chunk`] takes next.
        next: usize,
    },
    Stream {
        /// What the reader had read before the receiver came (empty if it waited first),
        /// given out before the rest of the stream.
        read: std::vec::IntoIter<Bytes>,
        stream: quinn::RecvStream,
        len: usize,
        peer: NodeId,
        /// Bytes read from the stream so far, `read` included.
        got: usize,
    },
}

impl Delivery {
    fn whole(payload: Payload) -> Delivery {
        Delivery(Delivered::Whole { payload, next: 0 })
    }

    /// The payload's length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            Delivered::Whole { payload, .. } => payload.len(),
            Delivered::Stream { len, .. } => *len,
        }
    }

    /// True when the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the payload comes as its stream (still arriving).
    pub fn is_streamed(&self) -> bool {
        matches!(self.0, Delivered::Stream { .. })
    }

    /// Copies the payload into `dst`, which must be exactly [`Delivery::len`] bytes (a
    /// [`TransportError::LengthMismatch`] otherwise, and the payload is discarded). A
    /// streamed payload is copied as it arrives; if this future is dropped before it
    /// completes, the rest of the message is refused (its sender's send fails) and the
    /// message is lost. It waits as long as the sender takes: bound it with a deadline.
    pub async fn copy_into(self, dst: &mut [u8]) -> Result<(), TransportError> {
        self.copy_into_with(dst, <[u8]>::copy_from_slice).await
    }

    /// [`Delivery::copy_into`], with each piece copied by `copy(to, piece)` (given two
    /// slices of one length) instead of `copy_from_slice`: for a copy routine whose speed
    /// does not depend on the buffers' addresses, such as `nexar_device::copy_bytes`.
    pub async fn copy_into_with(
        mut self,
        dst: &mut [u8],
        mut copy: impl FnMut(&mut [u8], &[u8]),
    ) -> Result<(), TransportError> {
        let len = self.len();
        if dst.len() != len {
            self.discard();
            return Err(TransportError::LengthMismatch {
                expected: dst.len(),
                actual: len,
            });
        }
        let mut off = 0;
        while let Some(chunk) = self.next_chunk().await? {
            copy(&mut dst[off..off + chunk.len()], &chunk);
            off += chunk.len();
        }
        Ok(())
    }

    /// The next piece of the payload, in order; `None` once all of it has been taken. A
    /// whole payload gives its chunks at once, a streamed one as they arrive (never more
    /// than [`Delivery::len`] bytes in all: a stream that carries more, or ends early, is
    /// refused with [`TransportError::Truncated`]). Cancel-safe between pieces; dropping
    /// the delivery before its last piece refuses the rest of a streamed payload (its
    /// sender's send fails). It waits as long as the sender takes: bound it with a
    /// deadline.
    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>, TransportError> {
        match &mut self.0 {
            Delivered::Whole { payload, next } => {
                let chunk = payload.take_chunk(*next);
                *next += 1;
                Ok(chunk)
            }
            Delivered::Stream {
                read,
                stream,
                len,
                peer,
                got,
            } => match read.next() {
                Some(chunk) => Ok(Some(chunk)),
                None => match crate::endpoint::next_body_chunk(stream, *got, *len).await {
                    Ok(chunk) => {
                        *got += chunk.as_ref().map_or(0, Bytes::len);
                        Ok(chunk)
                    }
                    Err((why, reason)) => {
                        let _ = stream.stop(why.code());
                        Err(TransportError::Truncated {
                            peer: *peer,
                            reason,
                        })
                    }
                },
            },
        }
    }

    /// Drops a payload nobody will use. A streamed one is read to its end in the
    /// background (and dropped), so its sender's send still completes, as it does for a
    /// buffered one.
    pub fn discard(self) {
        if let Delivered::Stream {
            stream, len, got, ..
        } = self.0
        {
            tokio::spawn(discard(stream, len - got));
        }
    }
}

/// How long a frame nobody can use is read (and dropped) before it is refused instead.
const DISCARD_TIMEOUT: Duration = Duration::from_secs(60);

/// Reads the `len` bytes of a frame nobody can use and drops them; a frame that carries
/// more, fails, or takes longer than [`DISCARD_TIMEOUT`] is refused.
async fn discard(mut stream: quinn::RecvStream, len: usize) {
    let read = crate::endpoint::read_body(&mut stream, len, DISCARD_TIMEOUT, |_, _| {});
    match tokio::time::timeout(DISCARD_TIMEOUT, read).await {
        Ok(Ok(())) => {}
        Ok(Err((why, _))) => {
            let _ = stream.stop(why.code());
        }
        Err(_) => {
            let _ = stream.stop(crate::wire::StreamRefusal::Shutdown.code());
        }
    }
}

/// The retired tags of one communicator, as disjoint, non-adjacent runs of tags: the
/// record stays as small as the number of holes (tags still in use below retired ones),
/// however many tags were retired around a call that stays in flight.
#[derive(Default)]
struct Retired {
    /// First tag of each run, mapped to its last (inclusive, so `u64::MAX` fits).
    runs: BTreeMap<u64, u64>,
}

/// What a table has retired: communicators whole (by id alone, so a dropped
/// communicator leaves a few bytes behind, not a record of runs), and tags of the others.
#[derive(Default)]
struct RetiredTags {
    whole: HashSet<u64>,
    tags: HashMap<u64, Retired>,
}

impl RetiredTags {
    fn contains(&self, comm: u64, tag: u64) -> bool {
        self.whole.contains(&comm) || self.tags.get(&comm).is_some_and(|r| r.contains(tag))
    }

    fn insert(&mut self, comm: u64, tag: u64) {
        if !self.whole.contains(&comm) {
            self.tags.entry(comm).or_default().insert(tag);
        }
    }

    fn insert_whole(&mut self, comm: u64) {
        self.tags.remove(&comm);
        self.whole.insert(comm);
    }
}

impl Retired {
    fn contains(&self, tag: u64) -> bool {
        self.runs
            .range(..=tag)
            .next_back()
            .is_some_and(|(_, &last)| tag <= last)
    }

    /// Adds `tag`, joining the runs it touches.
    fn insert(&mut self, tag: u64) {
        if self.contains(tag) {
            return;
        }
        let mut first = tag;
        let mut last = tag;
        if let Some(prev) = tag.checked_sub(1) {
            if let Some((&start, _)) = self
                .runs
                .range(..=prev)
                .next_back()
                .filter(|r| *r.1 == prev)
            {
                first = start;
            }
        }
        if let Some(next) = tag.checked_add(1) {
            if let Some(end) = self.runs.remove(&next) {
                last = end;
            }
        }
        self.runs.insert(first, last);
    }
}

/// The most markers of abandoned frames ([`MailboxTable::abandon`]) that one peer's
/// notices may keep in a table at once, for frames nobody has asked for yet. A marker
/// waits for its receiver, which may never come: a peer can name any frame, and a notice
/// can come after its frame was taken after all (a send that timed out as its receive
/// took the message, or a receive that gave up on it part-way) and so be for a frame no
/// receive will ask for again. So past this a peer's new notice evicts its oldest marker
/// still waiting, over time such stale ones. A receive that then asks for an evicted
/// marker's frame waits to its deadline, as for a frame not yet sent: a point-to-point
/// receive that times out that way does not move on, so its `(src, tag)` stays at that
/// message (as with a notice dropped, which is what happened past this before). A sender
/// only gives up on a frame when a send fails, so a peer with fewer than this many
/// abandoned frames waiting for their receives keeps every marker it sends.
pub const ABANDONED_MARKERS_PER_PEER: usize = 4096;

/// The step of an "abandoned" notice ([`MailboxTable::abandon`]) that names a whole tag
/// rather than one frame: a member whose collective failed because it lost a rank gives
/// up on every frame of the collective's tag, and says so to the others, whose receives
/// of the tag then fail ([`TransportError::TagAbandoned`]) instead of waiting to their
/// deadlines. The low 32 bits carry the communicator rank it lost. Taken only on the
/// channels [`MailboxTable::with_whole_tag_channels`] names (a node's collectives'): their
/// frames' steps carry a 31-bit call fingerprint above a 32-bit step, so never this bit;
/// point-to-point steps count messages.
pub const WHOLE_TAG_STEP: u64 = 1 << 63;

/// The most tags given up on ([`WHOLE_TAG_STEP`]) that one peer's notices keep recorded
/// in a table at once: a record stays until this node retires the tag (its collective
/// failed, or ran and ended) or its communicator, or the peer is declared lost. A node
/// has few collectives in flight; past this, a peer's further notices are dropped (the
/// receives they would have failed end at their deadlines).
pub const ABANDONED_TAGS_PER_PEER: usize = 64;

/// Up to this many frames in a table, [`MailboxTable::retire_taken`] still scans it (about
/// 1.5 us at most).
pub const RETIRE_SCAN_SLOTS: usize = 1024;

/// The overdraft of a table made with [`MailboxTable::new`], per peer
/// ([`MailboxTable::with_overdraft`]): `TransportConfig`'s default `max_streams *
/// stream_window`, 512 MiB.
pub const DEFAULT_OVERDRAFT_BYTES: usize = 512 << 20;

/// Why a peer is given up on that sent frames past its overdraft with no room left for
/// their markers ([`Refused::OverBudget`] untold).
pub(crate) const OVERDRAFT_BEYOND_MARKERS: &str = "sent frames nobody asked for past the early-arrival budget, its overdraft and the markers of those dropped";

/// Drops past one peer's overdraft are logged as a warning at most once in this long (the
/// rest at debug level).
const OVERDRAFT_LOG_GAP: Duration = Duration::from_secs(10);

/// The relay budget of a table made with [`MailboxTable::new`], per hop count.
pub const DEFAULT_RELAY_BUDGET_BYTES: usize = 32 << 20;

/// Relay frames hold relay budget by the number of relays they passed before this node
/// (their hop count), each count a budget of its own, up to this many; longer routes
/// share the last one.
pub const RELAY_HOP_CLASSES: usize = 64;

/// The least a relay frame takes of its relay budget, however small it is: each frame in
/// hand also holds a task and its bookkeeping at the relay, so a neighbour sending tiny
/// frames that cannot be passed on runs out of budget after a bounded number of them
/// (8192 of the default 32 MiB per hop count), not only after 32 MiB of them.
pub const RELAY_FRAME_MIN_CHARGE: usize = 4096;

/// The least a data frame nobody waits for yet takes of the early-arrival budget, however
/// small it is (empty ones too): each such frame also holds a slot in the table, its
/// chunks' bookkeeping and the received datagrams its chunks share memory with, so a peer
/// sending tiny frames nobody asks for runs out of budget after a bounded number of them
/// (65536 of the default 256 MiB), not only after 256 MiB of them. A budget smaller than
/// this is taken whole by every frame.
pub const EARLY_FRAME_MIN_CHARGE: usize = 4096;

/// The relay budgets of a table: [`RELAY_HOP_CLASSES`] of `bytes` each (at least 1).
fn relay_budgets(bytes: usize) -> Vec<Budget> {
    (0..RELAY_HOP_CLASSES)
        .map(|_| Budget::new(bytes.max(1)))
        .collect()
}

/// Bytes that frames may hold in memory while nobody has asked for them yet, shared by
/// every reader of a table.
///
/// Frames that wait for it do not queue in the semaphore: tokio's hands a waiter whatever
/// is free as it comes, so one large frame waiting would hold all the budget free while
/// unread, and every frame that cannot wait (message streams, lanes, relayed frames)
/// would find none. They try again each time a share goes back ([`BudgetPermit`]).
struct Budget {
    inner: Arc<BudgetInner>,
    total: usize,
}

struct BudgetInner {
    sem: Semaphore,
    /// Notified as each share goes back, and when the budget closes.
    released: Notify,
}

/// A share of a [`Budget`] (or of a sender's overdraft) held by a frame; dropped, it goes
/// back and wakes the frames waiting for budget.
pub(crate) struct BudgetPermit {
    budget: Arc<BudgetInner>,
    n: u32,
}

impl std::fmt::Debug for BudgetPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BudgetPermit").field("n", &self.n).finish()
    }
}

impl Drop for BudgetPermit {
    fn drop(&mut self) {
        // Back before the waiters look.
        self.budget.sem.add_permits(self.n as usize);
        self.budget.released.notify_waiters();
    }
}

impl Budget {
    fn new(bytes: usize) -> Budget {
        // tokio refuses, loudly, counts past its limit, and takes at most u32::MAX at once.
        let total = bytes.min(Semaphore::MAX_PERMITS).min(u32::MAX as usize);
        Budget {
            inner: Arc::new(BudgetInner {
                sem: Semaphore::new(total),
                released: Notify::new(),
            }),
            total,
        }
    }

    /// `n` of the budget if free now; never from a budget of 0 bytes (whose shares are
    /// all 0: taking them would let every frame in).
    fn try_acquire(&self, n: u32) -> Option<BudgetPermit> {
        if self.total == 0 {
            return None;
        }
        self.inner.sem.try_acquire_many(n).ok()?.forget();
        Some(BudgetPermit {
            budget: self.inner.clone(),
            n,
        })
    }

    /// `n` of the budget, once free (whatever other frames take meanwhile); `None` once
    /// the budget is closed.
    async fn acquire(&self, n: u32) -> Option<BudgetPermit> {
        loop {
            let released = self.inner.released.notified();
            let mut released = std::pin::pin!(released);
            released.as_mut().enable();
            if self.inner.sem.is_closed() {
                return None;
            }
            if let Some(permit) = self.try_acquire(n) {
                return Some(permit);
            }
            released.await;
        }
    }

    /// What is free now.
    fn available(&self) -> usize {
        self.inner.sem.available_permits()
    }

    /// Closes the budget: waiters end with `None`.
    fn close(&self) {
        self.inner.sem.close();
        self.inner.released.notify_waiters();
    }

    /// What a frame of `len` bytes takes: its length, at least `min`, at most the whole
    /// budget.
    fn charge(&self, len: usize, min: usize) -> u32 {
        // The total fits in a u32 (see `new`).
        u32::try_from(len.max(min).min(self.total)).unwrap_or(u32::MAX)
    }

    /// An early arrival's share ([`EARLY_FRAME_MIN_CHARGE`] at least) for a frame of `len`
    /// bytes; `None` for a frame larger than the whole budget, which can only wait for its
    /// receiver.
    fn early_share(&self, len: usize) -> Option<u32> {
        (len <= self.total).then(|| self.charge(len, EARLY_FRAME_MIN_CHARGE))
    }

    /// An early arrival's share of a frame of `len` bytes if it is free now; `None` when it
    /// is not, and for a frame larger than the whole budget.
    fn try_take(&self, len: usize) -> Option<BudgetPermit> {
        let n = self.early_share(len)?;
        self.try_acquire(n)
    }
}

/// Whether a reader waits for early-arrival budget before it reads a frame nobody waits
/// for yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Park {
    /// A stream of the frame's own: waiting holds up only that frame, and QUIC flow
    /// control pushes back on its sender.
    UntilBudget,
    /// A trusted lane: waiting would hold up the frames behind it.
    Never,
    /// The message stream, a relayed frame: waiting would hold up the frames behind it
    /// (and the peer's heartbeats, or the relay budget), so past the early-arrival budget
    /// the frame takes its sender's overdraft ([`MailboxTable::with_overdraft`]), and
    /// past that is refused ([`Refused::OverBudget`]), its key marked abandoned.
    Overdraft,
}

/// An arriving data frame let in ([`MailboxTable::admit`]).
pub(crate) struct Admitted {
    /// Early-arrival budget held for it; `None` when a receiver waits for it, or when
    /// none was free and the reader could not wait.
    pub(crate) permit: Option<BudgetPermit>,
    /// A receiver waited for it when it was let in.
    pub(crate) waited_for: bool,
    /// Notified when a receiver comes for it or its sender abandons it (its reader then
    /// checks [`MailboxTable::still_incoming`]).
    pub(crate) wanted: Arc<Notify>,
}

/// What a stream reader learns when a header arrives.
#[derive(Debug)]
pub(crate) struct IncomingTicket {
    pub(crate) wanted: Arc<Notify>,
    pub(crate) has_waiter: bool,
}

/// Why an incoming frame was refused by the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    Duplicate,
    Retired,
    /// Its sender gave up on it and said so first.
    Abandoned,
    /// The table closed; or, while the frame waited for budget, its connection ended or
    /// its sender was declared lost ([`MailboxTable::fail_peer`]).
    Closed,
    /// Past the early-arrival budget and its sender's overdraft ([`Park::Overdraft`]):
    /// dropped, its key marked abandoned when `told` (false: the sender holds
    /// [`ABANDONED_MARKERS_PER_PEER`] markers here already, and its receive would wait to
    /// its deadline; the sender is that far ahead, and its reader gives up on it).
    OverBudget {
        told: bool,
    },
}

/// One peer's markers of abandoned frames: the places they hold, and the keys that took
/// them, oldest first (some perhaps taken by their receives since: a queue is cleaned of
/// those once it holds twice the places).
struct Markers {
    places: Arc<Semaphore>,
    order: Mutex<VecDeque<MailboxKey>>,
}

impl Markers {
    fn new() -> Markers {
        Markers {
            places: Arc::new(Semaphore::new(ABANDONED_MARKERS_PER_PEER)),
            order: Mutex::new(VecDeque::new()),
        }
    }

    fn order(&self) -> std::sync::MutexGuard<'_, VecDeque<MailboxKey>> {
        self.order.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Tags given up on whole ([`WHOLE_TAG_STEP`]): by whom, and the rank it lost; and how
/// many each peer's notices hold ([`ABANDONED_TAGS_PER_PEER`]).
#[derive(Default)]
struct GivenUp {
    tags: HashMap<(u64, u64), (NodeId, u32)>,
    per_peer: HashMap<NodeId, usize>,
}

impl GivenUp {
    /// Forgets the record of `tag`, if any.
    fn forget(&mut self, tag: (u64, u64)) {
        if let Some((by, _)) = self.tags.remove(&tag) {
            if let Some(n) = self.per_peer.get_mut(&by) {
                *n -= 1;
                if *n == 0 {
                    self.per_peer.remove(&by);
                }
            }
        }
    }

    /// Forgets the records `gone` picks.
    fn forget_all(&mut self, gone: impl Fn(&(u64, u64), NodeId) -> bool) {
        let picked: Vec<(u64, u64)> = self
            .tags
            .iter()
            .filter(|(tag, (by, _))| gone(tag, *by))
            .map(|(tag, _)| *tag)
            .collect();
        for tag in picked {
            self.forget(tag);
        }
    }
}

/// Inbound frames keyed by [`MailboxKey`]; shared by every connection of an endpoint.
pub struct MailboxTable {
    slots: DashMap<MailboxKey, Slot>,
    /// Early arrivals: data frames here before anyone asks for them.
    budget: Budget,
    /// Relay frames from their arrival until their relay has passed them on (to the next
    /// hop, or into this table), one budget per hop count ([`RELAY_HOP_CLASSES`]).
    relay: Vec<Budget>,
    /// Per peer, the bytes of its frames kept past `budget` that may not wait for it
    /// ([`Park::Overdraft`]): `overdraft_bytes` each, made on first use.
    overdrafts: DashMap<NodeId, Arc<Budget>>,
    overdraft_bytes: usize,
    /// Per peer, when a drop past its overdraft was last logged as a warning, and how many
    /// since.
    overdraft_logged: Mutex<HashMap<NodeId, (std::time::Instant, u64)>>,
    retired: Mutex<RetiredTags>,
    /// Tags a member gave up on whole ([`WHOLE_TAG_STEP`]); `abandoned_tags` counts them,
    /// so that a receive looks here only when there is one.
    given_up: Mutex<GivenUp>,
    abandoned_tags: AtomicUsize,
    /// Which channels (`comm`) take whole-tag notices.
    whole_tag_channels: fn(u64) -> bool,
    /// Per peer, the markers its notices may keep ([`ABANDONED_MARKERS_PER_PEER`]).
    markers: DashMap<NodeId, Arc<Markers>>,
    dead: DashMap<NodeId, String>,
    closed: Mutex<Option<String>>,
    /// Run once by the next receive between its check of the peer and the insertion of
    /// its waiter (tests: a loss at that moment).
    #[cfg(test)]
    on_waiting: Mutex<Option<fn(&MailboxTable)>>,
}

impl std::fmt::Debug for MailboxTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MailboxTable")
            .field("slots", &self.slots.len())
            .field("budget_bytes", &self.budget.total)
            .field("relay_budget_bytes", &self.relay.first().map(|b| b.total))
            .finish_non_exhaustive()
    }
}

impl MailboxTable {
    /// A table that buffers at most `budget_bytes` of early arrivals (each taking at least
    /// [`EARLY_FRAME_MIN_CHARGE`]), with relay budgets of
    /// [`DEFAULT_RELAY_BUDGET_BYTES`] (see [`with_relay_budget`](Self::with_relay_budget))
    /// and overdrafts of [`DEFAULT_OVERDRAFT_BYTES`] (see
    /// [`with_overdraft`](Self::with_overdraft)).
    pub fn new(budget_bytes: usize) -> MailboxTable {
        MailboxTable {
            slots: DashMap::new(),
            budget: Budget::new(budget_bytes),
            relay: relay_budgets(DEFAULT_RELAY_BUDGET_BYTES),
            overdrafts: DashMap::new(),
            overdraft_bytes: DEFAULT_OVERDRAFT_BYTES,
            overdraft_logged: Mutex::default(),
            retired: Mutex::default(),
            given_up: Mutex::new(GivenUp::default()),
            abandoned_tags: AtomicUsize::new(0),
            whole_tag_channels: |_| false,
            markers: DashMap::new(),
            dead: DashMap::new(),
            closed: Mutex::new(None),
            #[cfg(test)]
            on_waiting: Mutex::new(None),
        }
    }

    /// Number of live mailboxes (buffered, in flight or awaited).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no mailbox is live.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The same table with overdrafts of `bytes` per peer: what each peer's frames that
    /// cannot wait for the early-arrival budget (small ones on its message stream, those
    /// relayed from it) may hold past that budget, each taking at least
    /// [`EARLY_FRAME_MIN_CHARGE`]. Past its overdraft such a frame is dropped and its key
    /// marked abandoned, so that its receive fails at once
    /// ([`TransportError::Abandoned`]); the frames after it are taken as they come. A
    /// frame larger than the whole overdraft takes all of it when all of it is free. Such
    /// a marker takes one of the sender's [`ABANDONED_MARKERS_PER_PEER`] places and evicts
    /// none: with none left, the frame is refused unmarked, and the sender given up on (a
    /// node closes its connection; a relayed frame's origin is taken for lost), as its
    /// receive would wait to its deadline, and its pair stay on that message for good. A
    /// node sets it to `max_streams * stream_window`: what a peer may make it hold in
    /// frames left unread on streams of their own.
    pub fn with_overdraft(mut self, bytes: usize) -> MailboxTable {
        self.overdraft_bytes = bytes;
        self.overdrafts.clear();
        self
    }

    /// Overdraft of `key.src` for a frame of `len` bytes if it is free now: its length, at
    /// least [`EARLY_FRAME_MIN_CHARGE`], and all of it for a frame larger than it.
    fn try_overdraft(&self, src: NodeId, len: usize) -> Option<BudgetPermit> {
        let overdraft = self
            .overdrafts
            .entry(src)
            .or_insert_with(|| Arc::new(Budget::new(self.overdraft_bytes)))
            .clone();
        let n = overdraft.charge(len, EARLY_FRAME_MIN_CHARGE);
        overdraft.try_acquire(n)
    }

    /// Logs a frame dropped past its sender's overdraft: the first of a run of them from
    /// its sender as a warning, the rest (while the last one logged is recent) at debug
    /// level, with a count.
    fn overdraft_warning(&self, key: MailboxKey, len: usize, told: bool) {
        let mut last = self
            .overdraft_logged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = std::time::Instant::now();
        let entry = last.entry(key.src).or_insert((now, 0));
        let quiet = entry.1 > 0 && now.duration_since(entry.0) < OVERDRAFT_LOG_GAP;
        entry.1 += 1;
        if quiet {
            tracing::debug!(peer = %key.src, comm = key.comm, tag = key.tag, step = key.step, len, told, "a frame past the early-arrival budget and its sender's overdraft; dropped");
        } else {
            tracing::warn!(peer = %key.src, comm = key.comm, tag = key.tag, step = key.step, len, told, dropped = entry.1, "a frame past the early-arrival budget and its sender's overdraft dropped (its receive told, when `told`); `dropped` counts this peer's since the last warning, and the next 10 s of them are logged at debug level");
            *entry = (now, 1);
        }
    }

    /// The same table with relay budgets of `bytes`: how much the relay frames that have
    /// passed the same number of relays before this node may hold here between their
    /// arrival and their being passed on (to the next hop, or into this table). A reader
    /// waits for it, on the relay frame's own stream, before it reads the frame: a
    /// neighbour that relays faster than this node passes frames on is held back by QUIC
    /// flow control (beyond what QUIC's receive windows hold). A frame larger than a whole
    /// budget takes all of it; 0 counts as 1 (one frame at a time).
    ///
    /// One budget per hop count keeps relays that forward to each other free of deadlock:
    /// a frame held at hop count `h` waits only for budget of count `h + 1` at its next
    /// hop, and a frame at its destination waits for nothing, so no cycle of waits can
    /// form (on routes of up to [`RELAY_HOP_CLASSES`] relays). What the budgets cover is
    /// so, per hop count, `bytes` or one frame larger than it (up to `max_frame_bytes`),
    /// for each of the [`RELAY_HOP_CLASSES`] counts: the count is the one the sending
    /// neighbour's header gives, checked against the signed envelope only once the frame
    /// has been read. Frames read without budget, when half a neighbour's streams wait
    /// (see `TransportConfig::relay_budget_bytes`), come on top.
    pub fn with_relay_budget(mut self, bytes: usize) -> MailboxTable {
        self.relay = relay_budgets(bytes);
        self
    }

    /// The same table taking notices that give up a whole tag ([`WHOLE_TAG_STEP`]) on the
    /// channels (`comm`) `channels` picks (none by default): those of collectives, whose
    /// tags are retired when their calls end.
    pub fn with_whole_tag_channels(mut self, channels: fn(u64) -> bool) -> MailboxTable {
        self.whole_tag_channels = channels;
        self
    }

    /// Bytes of the early-arrival budget currently unused.
    pub fn budget_available(&self) -> usize {
        self.budget.available()
    }

    /// Bytes of the relay budget for frames of hop count `hops` currently unused.
    pub fn relay_budget_available(&self, hops: u64) -> usize {
        self.relay_class(hops).available()
    }

    fn relay_class(&self, hops: u64) -> &Budget {
        let last = self.relay.len().saturating_sub(1);
        let i = usize::try_from(hops).map_or(last, |h| h.min(last));
        &self.relay[i]
    }

    /// Waits up to `timeout` for the frame addressed by `key` and removes its mailbox.
    /// Cancel-safe: dropping the future leaves any arrived frame in the table.
    pub async fn take(
        &self,
        key: MailboxKey,
        timeout: Duration,
    ) -> Result<Payload, TransportError> {
        self.wait_for(key, timeout).await
    }

    /// Like [`take`](Self::take), for a receiver that copies the payload into a buffer of
    /// its own: a frame of at least 256 KiB that arrives while it waits is handed over as
    /// its stream, so the receiver copies the bytes as they come
    /// ([`Delivery::copy_into`]) and the message is never buffered whole. Dropping the
    /// future leaves an arrived whole frame in the table; a frame already handed over
    /// as a stream is refused.
    pub async fn take_delivery(
        &self,
        key: MailboxKey,
        timeout: Duration,
    ) -> Result<Delivery, TransportError> {
        self.wait_for(key, timeout).await
    }

    async fn wait_for<T: Awaited>(
        &self,
        key: MailboxKey,
        timeout: Duration,
    ) -> Result<T, TransportError> {
        // What a lost peer delivered before it was lost stays readable.
        if let Some((_, Slot::Ready(p))) = self
            .slots
            .remove_if(&key, |_, s| matches!(s, Slot::Ready(_)))
        {
            return Ok(T::ready(p));
        }
        self.check_open(key.src)?;
        self.check_tag(&key)?;
        #[cfg(test)]
        if let Some(hook) = self
            .on_waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            hook(self);
        }
        let rx = match self.slots.entry(key) {
            Entry::Occupied(mut e) => match e.get_mut() {
                Slot::Ready(_) => match e.remove() {
                    Slot::Ready(p) => return Ok(T::ready(p)),
                    _ => unreachable!("slot checked to be ready"),
                },
                Slot::Incoming { wanted, waiter } => {
                    if waiter.as_ref().is_some_and(|w| !w.is_closed()) {
                        return Err(TransportError::AlreadyWaiting);
                    }
                    let (tx, rx) = oneshot::channel();
                    *waiter = Some(T::waiter(tx));
                    wanted.notify_one();
                    rx
                }
                Slot::Waiting(tx) => {
                    if !tx.is_closed() {
                        return Err(TransportError::AlreadyWaiting);
                    }
                    let (tx, rx) = oneshot::channel();
                    e.insert(Slot::Waiting(T::waiter(tx)));
                    rx
                }
                Slot::Abandoned { .. } => {
                    e.remove();
                    return Err(TransportError::Abandoned { peer: key.src });
                }
            },
            Entry::Vacant(v) => {
                let (tx, rx) = oneshot::channel();
                v.insert(Slot::Waiting(T::waiter(tx)));
                rx
            }
        };
        let mut guard = TakeGuard {
            table: self,
            key,
            rx: Some(rx),
        };
        // A peer declared lost (or the table closed) between the check above and the
        // waiter's insertion found no waiter to fail: looked at again now that there is
        // one (the guard removes it), so no receive waits out its deadline for a lost peer.
        // A message delivered to the waiter meanwhile is still taken.
        // So is a tag given up on meanwhile.
        if let Err(e) = self.check_open(key.src).and_then(|()| self.check_tag(&key)) {
            if let Some(Ok(p)) = guard.rx.as_mut().map(|rx| rx.try_recv()) {
                guard.rx = None;
                return Ok(p);
            }
            return Err(e);
        }
        let rx = guard
            .rx
            .as_mut()
            .ok_or_else(|| TransportError::Closed("receiver gone".into()))?;
        let res = tokio::time::timeout(timeout, rx).await;
        match res {
            Ok(Ok(p)) => {
                guard.rx = None;
                Ok(p)
            }
            Ok(Err(_)) => {
                guard.rx = None;
                self.check_open(key.src)?;
                self.check_tag(&key)?;
                if self
                    .slots
                    .remove_if(&key, |_, s| matches!(s, Slot::Abandoned { .. }))
                    .is_some()
                {
                    return Err(TransportError::Abandoned { peer: key.src });
                }
                Err(TransportError::Closed("mailbox dropped".into()))
            }
            Err(_) => Err(TransportError::Timeout(timeout)),
        }
    }

    /// Who gave up on the whole tag `(comm, tag)`, and the rank it lost, if a member did
    /// ([`WHOLE_TAG_STEP`]).
    pub fn given_up_on(&self, comm: u64, tag: u64) -> Option<(NodeId, u32)> {
        if self.abandoned_tags.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let given_up = self.given_up.lock().unwrap_or_else(PoisonError::into_inner);
        given_up.tags.get(&(comm, tag)).copied()
    }

    /// `TagAbandoned` when a member gave up on `key`'s whole tag.
    fn check_tag(&self, key: &MailboxKey) -> Result<(), TransportError> {
        match self.given_up_on(key.comm, key.tag) {
            Some((by, lost)) => Err(TransportError::TagAbandoned { by, lost }),
            None => Ok(()),
        }
    }

    fn check_open(&self, src: NodeId) -> Result<(), TransportError> {
        if let Some(reason) = self
            .closed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            return Err(TransportError::Closed(reason.clone()));
        }
        if let Some(reason) = self.dead.get(&src) {
            return Err(TransportError::ConnectionLost {
                peer: src,
                reason: reason.clone(),
            });
        }
        Ok(())
    }

    /// Delivers a locally produced frame (a node sending to itself).
    pub fn deliver_local(&self, key: MailboxKey, payload: Payload) -> Result<(), TransportError> {
        let ticket = self
            .begin_incoming(key)
            .map_err(|r| TransportError::Closed(format!("local delivery refused: {r:?}")))?;
        self.finish_incoming_charging(key, &ticket.wanted, payload, false);
        Ok(())
    }

    pub(crate) fn begin_incoming(&self, key: MailboxKey) -> Result<IncomingTicket, Refused> {
        if self
            .closed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            return Err(Refused::Closed);
        }
        if self.is_retired(key.comm, key.tag) {
            return Err(Refused::Retired);
        }
        match self.slots.entry(key) {
            Entry::Vacant(v) => {
                let wanted = Arc::new(Notify::new());
                v.insert(Slot::Incoming {
                    wanted: wanted.clone(),
                    waiter: None,
                });
                Ok(IncomingTicket {
                    wanted,
                    has_waiter: false,
                })
            }
            Entry::Occupied(mut e) => {
                match e.get() {
                    Slot::Waiting(_) => {}
                    Slot::Abandoned { .. } => return Err(Refused::Abandoned),
                    _ => return Err(Refused::Duplicate),
                }
                let wanted = Arc::new(Notify::new());
                let old = e.insert(Slot::Incoming {
                    wanted: wanted.clone(),
                    waiter: None,
                });
                let has_waiter = match old {
                    Slot::Waiting(tx) if !tx.is_closed() => {
                        if let Slot::Incoming { waiter, .. } = e.get_mut() {
                            *waiter = Some(tx);
                        }
                        true
                    }
                    _ => false,
                };
                Ok(IncomingTicket { wanted, has_waiter })
            }
        }
    }

    /// True when the frame for `key` has arrived whole and waits to be taken.
    pub fn is_ready(&self, key: &MailboxKey) -> bool {
        matches!(self.slots.get(key).as_deref(), Some(Slot::Ready(_)))
    }

    /// True when someone now waits for `key` (checked by a reader parked on the budget).
    #[cfg(test)]
    pub(crate) fn has_waiter(&self, key: &MailboxKey) -> bool {
        matches!(self.slots.get(key).as_deref(), Some(Slot::Incoming { waiter: Some(w), .. }) if !w.is_closed())
    }

    /// True when someone now waits for `key` in the slot of the reader holding `wanted`
    /// (checked by that reader): a reader left behind (its frame abandoned, its key's
    /// slot another frame's since) must not take a receiver waiting for that other frame
    /// for its own.
    pub(crate) fn has_waiter_for(&self, key: &MailboxKey, wanted: &Arc<Notify>) -> bool {
        matches!(
            self.slots.get(key).as_deref(),
            Some(Slot::Incoming { wanted: w, waiter: Some(rx) })
                if Arc::ptr_eq(w, wanted) && !rx.is_closed()
        )
    }

    /// Registers a data frame of `len` bytes from `key.src` as arriving, and takes
    /// early-arrival budget for it unless a receiver already waits for it: with
    /// [`Park::UntilBudget`] it waits for the budget (or for a receiver to ask for this
    /// frame meanwhile), with [`Park::Never`] it takes the budget only if it is free now
    /// and goes on without it otherwise, and with [`Park::Overdraft`] it takes the budget
    /// or else its sender's overdraft if free now, and is refused otherwise
    /// ([`Refused::OverBudget`], its key marked abandoned where there is room). Refused
    /// also: a duplicate, a retired tag, a frame its
    /// sender abandoned, a closed table; and, while it waits, a frame whose tag or
    /// communicator is retired, that its sender abandons, whose sender is declared lost,
    /// or whose connection ends (`gone` resolves: the reader's way out, as nothing else
    /// may ever wake a frame larger than the whole budget that nobody asks for). A frame
    /// refused while it waited leaves no trace in the table (but a marker or a receiver
    /// put there meanwhile).
    pub(crate) async fn admit(
        &self,
        key: MailboxKey,
        len: usize,
        park: Park,
        gone: impl std::future::Future<Output = ()>,
    ) -> Result<Admitted, Refused> {
        let ticket = self.begin_incoming(key)?;
        if ticket.has_waiter {
            return Ok(Admitted {
                permit: None,
                waited_for: true,
                wanted: ticket.wanted,
            });
        }
        if park != Park::UntilBudget {
            let mut permit = self.budget.try_take(len);
            if permit.is_none() && park == Park::Overdraft {
                permit = self.try_overdraft(key.src, len);
                // Dropped, unless a receiver came meanwhile. Its receive is told by a marker,
                // which evicts none of the sender's others: past those places, the receive
                // would wait to its deadline, and its pair stay on that message for good.
                if permit.is_none() && !self.has_waiter_for(&key, &ticket.wanted) {
                    self.forget_incoming(key, &ticket.wanted);
                    let told = self.mark_abandoned(key, false);
                    self.overdraft_warning(key, len, told);
                    return Err(Refused::OverBudget { told });
                }
            }
            return Ok(Admitted {
                permit,
                waited_for: false,
                wanted: ticket.wanted,
            });
        }
        let mut gone = std::pin::pin!(gone);
        loop {
            if self.has_waiter_for(&key, &ticket.wanted) {
                return Ok(Admitted {
                    permit: None,
                    waited_for: true,
                    wanted: ticket.wanted,
                });
            }
            if let Some(why) = self.left_behind(&key, &ticket.wanted) {
                return Err(why);
            }
            // Retired just as its slot went in (the purge may have run before it).
            if self.is_retired(key.comm, key.tag) {
                self.forget_incoming(key, &ticket.wanted);
                return Err(Refused::Retired);
            }
            if self.is_peer_failed(key.src) {
                self.forget_incoming(key, &ticket.wanted);
                return Err(Refused::Closed);
            }
            let acquire = async {
                match self.budget.early_share(len) {
                    Some(n) => self.budget.acquire(n).await,
                    // A frame larger than the whole budget can only wait for its receiver.
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                p = acquire => {
                    let Some(permit) = p else {
                        self.forget_incoming(key, &ticket.wanted);
                        return Err(Refused::Closed);
                    };
                    return Ok(Admitted {
                        permit: Some(permit),
                        waited_for: false,
                        wanted: ticket.wanted,
                    });
                }
                _ = ticket.wanted.notified() => {}
                () = &mut gone => {
                    self.forget_incoming(key, &ticket.wanted);
                    return Err(Refused::Closed);
                }
            }
        }
    }

    /// A frame given up mid-way (its stream failed, or its reader stopped) by the reader
    /// holding `wanted`: ends the `Incoming` slot of `key` if it is still that reader's. A
    /// receiver waiting in it goes back to waiting, an empty slot is removed. All under
    /// the entry's lock, so a marker that [`abandon`](Self::abandon) sets meanwhile is
    /// never overwritten.
    pub(crate) fn forget_incoming(&self, key: MailboxKey, wanted: &Arc<Notify>) {
        let Entry::Occupied(mut e) = self.slots.entry(key) else {
            return;
        };
        let Slot::Incoming {
            wanted: own,
            waiter,
        } = e.get_mut()
        else {
            return;
        };
        if !Arc::ptr_eq(own, wanted) {
            return;
        }
        // Not back to waiting where nothing would wake it: a tag given up on, a sender
        // declared lost (the loss's sweep of the table may have passed this slot while it
        // was still arriving), a tag retired, a table closed. Dropping the waiter wakes its
        // receive, which finds why.
        let hopeless = || {
            self.check_tag(&key).is_err()
                || self.is_peer_failed(key.src)
                || self.is_retired(key.comm, key.tag)
                || self.is_closed()
        };
        match waiter.take().filter(|w| !w.is_closed()) {
            Some(w) if !hopeless() => {
                e.insert(Slot::Waiting(w));
            }
            _ => {
                e.remove();
            }
        }
    }

    /// True once the table is closed ([`close`](Self::close)).
    fn is_closed(&self) -> bool {
        self.closed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Delivers a data frame that came whole through a relay, with early-arrival budget if
    /// nobody waits for it and the budget is free now, and otherwise with its origin's
    /// overdraft ([`with_overdraft`](Self::with_overdraft); past that it is refused, and
    /// its key marked abandoned: [`TransportError::Closed`]). It never waits: a relayed
    /// frame waiting here for its receiver would hold relay budget, and with it every
    /// relay frame behind it, the one that receiver waits for among them. With no room
    /// left for its origin's markers, it is refused unmarked:
    /// [`TransportError::ConnectionLost`], for the caller to take the origin for lost, as
    /// a node does a neighbour that far ahead (its receives would wait to their deadlines
    /// otherwise, and stay on that message for good).
    pub async fn deliver_relayed(
        &self,
        key: MailboxKey,
        chunks: Vec<Bytes>,
    ) -> Result<(), TransportError> {
        let len = chunks.iter().map(Bytes::len).sum();
        let admitted = self
            .admit(key, len, Park::Overdraft, std::future::pending())
            .await
            .map_err(|r| match r {
                Refused::OverBudget { told: false } => TransportError::ConnectionLost {
                    peer: key.src,
                    reason: OVERDRAFT_BEYOND_MARKERS.into(),
                },
                r => TransportError::Closed(format!("relayed delivery refused: {r:?}")),
            })?;
        self.finish_incoming(
            key,
            &admitted.wanted,
            Payload::from_chunks(chunks, admitted.permit),
        );
        Ok(())
    }

    /// A data frame that arrived whole, let in without waiting ([`Park::Never`]) and
    /// delivered: to its receiver, or kept with early-arrival budget when that is free.
    pub(crate) async fn deliver_whole(
        &self,
        key: MailboxKey,
        chunks: Vec<Bytes>,
    ) -> Result<(), Refused> {
        self.deliver_whole_holding(key, chunks, None).await
    }

    /// [`deliver_whole`](Self::deliver_whole) of a frame sent on lane credit: the payload
    /// holds `credit` until it is dropped (a refused frame gives it back at once).
    pub(crate) async fn deliver_whole_holding(
        &self,
        key: MailboxKey,
        chunks: Vec<Bytes>,
        credit: Option<crate::lane::HeldCredit>,
    ) -> Result<(), Refused> {
        let len = chunks.iter().map(Bytes::len).sum();
        let admitted = self
            .admit(key, len, Park::Never, std::future::pending())
            .await?;
        let mut payload = Payload::from_chunks(chunks, admitted.permit);
        payload._credit = credit;
        self.finish_incoming(key, &admitted.wanted, payload);
        Ok(())
    }

    /// Relay budget for a relay frame of `len` bytes that passed `hops` relays before this
    /// node (all of that count's budget for a frame larger than it) if it is free now.
    pub(crate) fn try_relay_budget(&self, hops: u64, len: usize) -> Option<BudgetPermit> {
        let (budget, n) = self.relay_share(hops, len)?;
        budget.try_acquire(n)
    }

    /// Relay budget for a relay frame of `len` bytes that passed `hops` relays before this
    /// node (all of that count's budget for a frame larger than it), waiting until it is
    /// free; `Err` once the table is closed.
    pub(crate) async fn take_relay_budget(
        &self,
        hops: u64,
        len: usize,
    ) -> Result<Option<BudgetPermit>, Refused> {
        let Some((budget, n)) = self.relay_share(hops, len) else {
            return Ok(None);
        };
        match budget.acquire(n).await {
            Some(p) => Ok(Some(p)),
            None => Err(Refused::Closed),
        }
    }

    /// The relay budget of hop count `hops` and the share of it a frame of `len` bytes
    /// takes: its length, at least [`RELAY_FRAME_MIN_CHARGE`], at most the whole budget
    /// (so with a budget under that minimum every frame takes all of it); `None` for an
    /// empty frame, which takes none.
    fn relay_share(&self, hops: u64, len: usize) -> Option<(&Budget, u32)> {
        if len == 0 {
            return None;
        }
        let budget = self.relay_class(hops);
        let n = budget.charge(len, RELAY_FRAME_MIN_CHARGE);
        (n > 0).then_some((budget, n))
    }

    /// Completes the frame of `key` whose reader holds `owner` (its ticket's
    /// [`wanted`](Admitted::wanted)): hands it to the receiver waiting in its slot, or
    /// keeps it there for one to come. A slot that is no longer that reader's (its frame
    /// was abandoned, and the key has since been taken by another frame) is left alone and
    /// the payload dropped.
    pub(crate) fn finish_incoming(&self, key: MailboxKey, owner: &Arc<Notify>, payload: Payload) {
        self.finish_incoming_charging(key, owner, payload, true);
    }

    /// [`finish_incoming`](Self::finish_incoming); a frame kept for a receive to come
    /// without budget takes some ([`charged`](Self::charged)) when `charge` (a frame from
    /// a peer: not a message to this node itself, which none of its peers' budget
    /// covers).
    fn finish_incoming_charging(
        &self,
        key: MailboxKey,
        owner: &Arc<Notify>,
        payload: Payload,
        charge: bool,
    ) {
        if self.is_retired(key.comm, key.tag) {
            self.slots.remove(&key);
            return;
        }
        // One entry lock for the whole hand-over: a receiver arriving meanwhile must find
        // either the in-flight slot or the ready payload, never a gap.
        let Entry::Occupied(mut e) = self.slots.entry(key) else {
            // Purged meanwhile (retired tag or shutdown): drop the frame.
            return;
        };
        let payload = match e.get_mut() {
            Slot::Incoming { wanted, waiter } if Arc::ptr_eq(wanted, owner) => {
                match waiter.take() {
                    Some(w) => match w.send(payload) {
                        Ok(()) => {
                            e.remove();
                            return;
                        }
                        // Its receiver gave up meanwhile.
                        Err(p) => p,
                    },
                    None => payload,
                }
            }
            // Not ours (the slot was replaced, or taken by another frame of the key):
            // keep what is there.
            _ => return,
        };
        let payload = if charge {
            self.charged(key.src, payload)
        } else {
            payload
        };
        e.insert(Slot::Ready(payload));
    }

    /// `payload`, kept for a receive to come, taking early-arrival budget now, or its
    /// sender `src`'s overdraft, where either is free and it holds neither (nor lane
    /// credit): a frame let in without budget because a receiver waited for it, which
    /// gave up before it was whole (or just as it was delivered), or a trusted lane's
    /// frame let in without. It then counts against what the sender may leave here until
    /// it is taken.
    fn charged(&self, src: NodeId, mut payload: Payload) -> Payload {
        if payload._permit.is_none() && payload._credit.is_none() {
            let len = payload.len();
            payload._permit = self
                .budget
                .try_take(len)
                .or_else(|| self.try_overdraft(src, len));
        }
        payload
    }

    /// Hands the stream a frame arrives on to the receiver waiting for it, when that
    /// receiver takes deliveries ([`take_delivery`](Self::take_delivery)); the mailbox is
    /// then consumed. Readers offer frames of [`STREAM_HANDOVER_BYTES`] and more. What
    /// the reader has read of the frame so far goes to the receiver first, and the
    /// early-arrival budget it held for it is given back once the receiver has the frame.
    /// Gives everything back otherwise: the reader then reads the frame whole.
    pub(crate) fn hand_over(
        &self,
        partial: PartialFrame,
        owner: &Arc<Notify>,
    ) -> Result<(), PartialFrame> {
        let Entry::Occupied(mut e) = self.slots.entry(partial.key) else {
            return Err(partial);
        };
        let Slot::Incoming { waiter, wanted } = e.get_mut() else {
            return Err(partial);
        };
        if !Arc::ptr_eq(wanted, owner) {
            return Err(partial);
        }
        let Some(Waiter::Delivery(tx)) = waiter.take_if(|w| matches!(w, Waiter::Delivery(_)))
        else {
            return Err(partial);
        };
        let PartialFrame {
            key,
            stream,
            len,
            read,
            permit,
        } = partial;
        let got = read.iter().map(Bytes::len).sum();
        let delivered = Delivered::Stream {
            read: read.into_iter(),
            stream,
            len,
            peer: key.src,
            got,
        };
        match tx.send(Delivery(delivered)) {
            Ok(()) => {
                e.remove();
                Ok(())
            }
            // The receiver gave up just now: read the frame whole for the next one.
            Err(Delivery(Delivered::Stream { read, stream, .. })) => Err(PartialFrame {
                key,
                stream,
                len,
                read: read.collect(),
                permit,
            }),
            Err(Delivery(Delivered::Whole { .. })) => unreachable!("a stream was sent"),
        }
    }

    /// Records that the sender gave up on the frame for `key` (a send that failed
    /// part-way): its receiver, waiting now or coming later, gets
    /// [`TransportError::Abandoned`] instead of waiting for a frame that will not come,
    /// and a reader still holding the frame's stream drops what it read. A frame already
    /// here whole is kept (nothing of it is lost). A marker for a frame whose receiver
    /// already took part of it as a stream (and failed when it stopped short) stays until
    /// its sender is declared lost or its tag retired, or until newer notices of its
    /// sender evict it ([`ABANDONED_MARKERS_PER_PEER`]). A notice for a frame nobody has
    /// asked for is dropped (and logged) only when its sender holds that many markers
    /// here and another notice took the place an eviction made.
    ///
    /// A notice whose step has [`WHOLE_TAG_STEP`] set gives up on the whole tag instead,
    /// on the channels that take such notices ([`with_whole_tag_channels`]; elsewhere it
    /// is ignored): receives of the tag's frames waiting now, and those that come, fail
    /// with [`TransportError::TagAbandoned`] until this node retires the tag. A frame here
    /// whole is still taken, and so is one arriving for a receive that already waited for
    /// it; a receive that comes while its frame is arriving fails.
    ///
    /// [`with_whole_tag_channels`]: Self::with_whole_tag_channels
    pub fn abandon(&self, key: MailboxKey) {
        self.mark_abandoned(key, true);
    }

    /// [`abandon`](Self::abandon), evicting an older marker of `key.src` for room only
    /// when `evict`; false when the frame was not marked for want of room (a receive that
    /// asks for it then waits to its deadline).
    fn mark_abandoned(&self, key: MailboxKey, evict: bool) -> bool {
        // A late notice of a peer declared lost: its receives fail with the loss, and a
        // marker would stay until its tag retired.
        if self.is_retired(key.comm, key.tag) || self.is_peer_failed(key.src) {
            return true;
        }
        if key.step & WHOLE_TAG_STEP != 0 {
            // No frame has such a step but on channels that do not take these notices.
            if (self.whole_tag_channels)(key.comm) {
                self.abandon_tag(key);
            }
            return true;
        }
        // Only a marker nobody waits for takes a place (and may need an older one evicted):
        // for a slot that is vacant, or a frame arriving with no receiver. Marked already,
        // or here whole: nothing to do.
        let needs_place = match self.slots.get(&key).as_deref() {
            None | Some(Slot::Incoming { waiter: None, .. }) => true,
            Some(Slot::Ready(_) | Slot::Abandoned { .. }) => return true,
            Some(Slot::Incoming { .. } | Slot::Waiting(_)) => false,
        };
        if needs_place {
            // Before the entry is taken: evicting removes other slots, maybe in its shard.
            if evict {
                self.make_marker_room(key.src);
            } else {
                self.tidy_marker_order(key.src);
            }
        }
        match self.slots.entry(key) {
            Entry::Vacant(v) => {
                let Some(place) = self.marker_place(&key) else {
                    return false;
                };
                v.insert(Slot::Abandoned {
                    _place: Some(place),
                });
                // Retired, or its sender declared lost, meanwhile (the sweep may have run
                // before the insert): drop it.
                if self.is_retired(key.comm, key.tag) || self.is_peer_failed(key.src) {
                    self.slots
                        .remove_if(&key, |_, s| matches!(s, Slot::Abandoned { .. }));
                }
            }
            Entry::Occupied(mut e) => {
                if matches!(e.get(), Slot::Ready(_) | Slot::Abandoned { .. }) {
                    return true;
                }
                // A marker nobody waits for yet holds one of the peer's places: its frame's
                // reader stops, and the marker stays until a receiver comes.
                let place = match e.get() {
                    Slot::Incoming { waiter: None, .. } => match self.marker_place(&key) {
                        Some(place) => Some(place),
                        None => return false,
                    },
                    _ => None,
                };
                if let Slot::Incoming { wanted, .. } = e.get() {
                    // A reader parked for budget looks again, and finds it unwanted.
                    wanted.notify_one();
                }
                // A waiter's sender dropped here wakes it to find the marker.
                e.insert(Slot::Abandoned { _place: place });
            }
        }
        true
    }

    /// [`abandon`](Self::abandon) of a whole tag by `key.src`.
    fn abandon_tag(&self, key: MailboxKey) {
        let tag = (key.comm, key.tag);
        // A late notice of a peer declared lost, or departed: its own end says more (its
        // receives fail with the connection's loss).
        if self.is_peer_failed(key.src) {
            return;
        }
        // The rank sits in the low 32 bits.
        let lost = key.step as u32;
        {
            let mut given_up = self.given_up.lock().unwrap_or_else(PoisonError::into_inner);
            // Its waiting receives were failed when the first notice was recorded. A notice
            // that names a lost rank takes the place of one that gave up on its own (a rank
            // whose deadline came before it saw the loss), so that what the tag's receives
            // fail with from then on names the loss.
            let replaces = match given_up.tags.get(&tag) {
                None => None,
                Some(&(by, was)) if was == GAVE_UP_ON_ITS_OWN && lost != GAVE_UP_ON_ITS_OWN => {
                    Some(by)
                }
                Some(_) => return,
            };
            let held = given_up.per_peer.get(&key.src).copied().unwrap_or(0);
            if held >= ABANDONED_TAGS_PER_PEER && replaces != Some(key.src) {
                tracing::warn!(peer = %key.src, comm = key.comm, tag = key.tag, "too many tags given up on by this peer; notice dropped");
                return;
            }
            if replaces.is_some() {
                given_up.forget(tag);
            } else {
                self.abandoned_tags.fetch_add(1, Ordering::SeqCst);
            }
            *given_up.per_peer.entry(key.src).or_insert(0) += 1;
            given_up.tags.insert(tag, (key.src, lost));
        }
        // Retired, or its sender declared lost, meanwhile (the clean-up may have run
        // before the insert): undo.
        if self.is_retired(key.comm, key.tag) || self.is_peer_failed(key.src) {
            self.forget_given_up(|g| g.forget(tag));
            return;
        }
        // Receives waiting for the tag's frames wake (their senders dropped) and find the
        // record. One whose frame is arriving keeps it, unless the frame stops short
        // ([`forget_incoming`](Self::forget_incoming)).
        self.slots
            .retain(|k, s| !((k.comm, k.tag) == tag && matches!(s, Slot::Waiting(_))));
    }

    /// Changes the records of tags given up on (to drop some), if there are any.
    fn forget_given_up(&self, forget: impl FnOnce(&mut GivenUp)) {
        if self.abandoned_tags.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut given_up = self.given_up.lock().unwrap_or_else(PoisonError::into_inner);
        forget(&mut given_up);
        self.abandoned_tags
            .store(given_up.tags.len(), Ordering::SeqCst);
    }

    /// `src`'s markers, made on first use.
    fn markers_of(&self, src: NodeId) -> Arc<Markers> {
        self.markers
            .entry(src)
            .or_insert_with(|| Arc::new(Markers::new()))
            .clone()
    }

    /// When `src`'s markers hold every place, evicts its oldest marker still waiting for a
    /// receiver. Called with no slot locked: it removes slots, and the queue's lock is
    /// never held while it does (a slot's holder may take the queue's lock).
    fn make_marker_room(&self, src: NodeId) {
        let markers = self.markers_of(src);
        while markers.places.available_permits() == 0 {
            let Some(oldest) = markers.order().pop_front() else {
                return;
            };
            let evicted = self.slots.remove_if(&oldest, |_, s| {
                matches!(s, Slot::Abandoned { _place: Some(_) })
            });
            if evicted.is_some() {
                tracing::debug!(peer = %src, comm = oldest.comm, tag = oldest.tag, step = oldest.step, "oldest abandoned-frame marker of this peer evicted");
            }
        }
        self.tidy_marker_order(src);
    }

    /// Drops from `src`'s queue of markers the keys whose markers are gone (taken by
    /// their receives, or retired), once it holds twice as many keys as places: with
    /// evictions or without (a peer past its overdraft gets markers that evict none, and
    /// its queue grew by one key per frame dropped). The clean-up reads the slots from a
    /// copy of the queue, without its lock, and leaves the queue whole meanwhile for
    /// evictions to pop from.
    fn tidy_marker_order(&self, src: NodeId) {
        let markers = self.markers_of(src);
        let snapshot: Vec<MailboxKey> = {
            let order = markers.order();
            if order.len() < 2 * ABANDONED_MARKERS_PER_PEER {
                return;
            }
            order.iter().copied().collect()
        };
        let taken: HashSet<MailboxKey> = snapshot
            .into_iter()
            .filter(|k| {
                !matches!(
                    self.slots.get(k).as_deref(),
                    Some(Slot::Abandoned { _place: Some(_) })
                )
            })
            .collect();
        markers.order().retain(|k| !taken.contains(k));
    }

    /// One of the places for markers of `key.src`'s abandoned frames; `None` (logged)
    /// when it holds [`ABANDONED_MARKERS_PER_PEER`] already (another notice took the
    /// place [`make_marker_room`](Self::make_marker_room) made).
    fn marker_place(&self, key: &MailboxKey) -> Option<OwnedSemaphorePermit> {
        let markers = self.markers_of(key.src);
        let place = markers.places.clone().try_acquire_owned().ok();
        match &place {
            Some(_) => markers.order().push_back(*key),
            None => {
                tracing::warn!(peer = %key.src, comm = key.comm, tag = key.tag, "too many abandoned-frame markers from this peer; notice dropped");
            }
        }
        place
    }

    /// The senders and steps of the frames here (arrived or arriving) under `comm` and
    /// `tag`, at most `max` of them: a scan of the whole table, for a diagnosis after a
    /// failure.
    pub fn frames_under(&self, comm: u64, tag: u64, max: usize) -> Vec<(NodeId, u64)> {
        self.slots
            .iter()
            .filter(|e| {
                let k = e.key();
                k.comm == comm
                    && k.tag == tag
                    && matches!(e.value(), Slot::Ready(_) | Slot::Incoming { .. })
            })
            .take(max)
            .map(|e| (e.key().src, e.key().step))
            .collect()
    }

    /// True when the sender gave up on the frame for `key` and no receiver has been told
    /// yet.
    pub fn is_abandoned(&self, key: &MailboxKey) -> bool {
        matches!(self.slots.get(key).as_deref(), Some(Slot::Abandoned { .. }))
    }

    /// True while the slot of `key` is the incoming one whose reader holds `wanted`: a
    /// reader parked for budget stops when it is not (its frame was abandoned, and the
    /// marker perhaps taken already).
    pub(crate) fn still_incoming(&self, key: &MailboxKey, wanted: &Arc<Notify>) -> bool {
        matches!(
            self.slots.get(key).as_deref(),
            Some(Slot::Incoming { wanted: w, .. }) if Arc::ptr_eq(w, wanted)
        )
    }

    /// Why nothing will take the frame for `key` whose reader holds `wanted` any more,
    /// once its slot was taken away: the table closed, its tag or communicator retired, or
    /// its sender abandoned it. `None` while the slot is still the reader's.
    pub(crate) fn left_behind(&self, key: &MailboxKey, wanted: &Arc<Notify>) -> Option<Refused> {
        if self.still_incoming(key, wanted) {
            None
        } else if self.is_closed() {
            Some(Refused::Closed)
        } else if self.is_retired(key.comm, key.tag) {
            Some(Refused::Retired)
        } else {
            Some(Refused::Abandoned)
        }
    }

    /// Marks a collective tag finished or abandoned: its buffered frames are dropped,
    /// readers waiting for budget for its frames stop (their streams refused), and later
    /// arrivals are discarded.
    pub fn retire(&self, comm: u64, tag: u64) {
        self.mark_retired(comm, tag);
        self.purge(|k| k.comm == comm && k.tag == tag);
    }

    /// [`retire`](Self::retire) for a tag whose every frame for this node was taken (a
    /// collective that completed): later arrivals are discarded, and the table is scanned
    /// for frames to drop only while it holds at most [`RETIRE_SCAN_SLOTS`]. A scan
    /// visits every frame the table holds: about 14 us with 10,000 frames buffered for
    /// other tags, against 26 ns without. (What a scan would still find: frames of a peer
    /// that called another collective under the tag, kept until the communicator goes.)
    pub fn retire_taken(&self, comm: u64, tag: u64) {
        self.mark_retired(comm, tag);
        if self.slots.len() <= RETIRE_SCAN_SLOTS {
            self.purge(|k| k.comm == comm && k.tag == tag);
        }
    }

    /// Retires a tag under which one frame, `key`, was expected (an RPC reply): later
    /// arrivals are discarded, and that frame is dropped if it is here, taken or not (its
    /// receiver gave up, or is dropping its receive), with no scan of the table. (Frames
    /// a peer sent under the tag with other keys stay, as early arrivals for tags never
    /// used do.)
    pub fn retire_key(&self, key: MailboxKey) {
        self.mark_retired(key.comm, key.tag);
        if let Some((_, Slot::Incoming { wanted, .. })) = self.slots.remove(&key) {
            wanted.notify_one();
        }
    }

    fn mark_retired(&self, comm: u64, tag: u64) {
        {
            let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
            retired.insert(comm, tag);
        }
        self.forget_given_up(|g| g.forget((comm, tag)));
    }

    /// Removes the slots whose keys `gone` picks, waking the readers of those still
    /// arriving: one parked for budget finds its slot gone and stops.
    fn purge(&self, gone: impl Fn(&MailboxKey) -> bool) {
        self.slots.retain(|k, s| {
            if !gone(k) {
                return true;
            }
            if let Slot::Incoming { wanted, .. } = s {
                wanted.notify_one();
            }
            false
        });
    }

    /// True when `(comm, tag)` was retired.
    pub fn is_retired(&self, comm: u64, tag: u64) -> bool {
        let retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
        retired.contains(comm, tag)
    }

    /// Retires every tag of `comm` for good (when its communicator is dropped): its
    /// buffered frames are dropped, giving their budget back, readers waiting for budget
    /// for its frames stop, and later arrivals are discarded. What stays of it is its id
    /// (in a set, some 10-20 bytes), so that late frames are not kept as early arrivals
    /// nobody will take.
    pub fn retire_comm(&self, comm: u64) {
        self.retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert_whole(comm);
        self.forget_given_up(|g| g.forget_all(|&(c, _), _| c == comm));
        self.purge(|k| k.comm == comm);
    }

    /// Declares `peer` lost: its pending receivers fail now and later receives from it
    /// fail at once. Frames it already delivered stay readable (and so do those being
    /// read now, once read); readers waiting for budget for its frames stop, their frames
    /// dropped.
    pub fn fail_peer(&self, peer: NodeId, reason: &str) {
        self.dead.entry(peer).or_insert_with(|| reason.to_string());
        // Its markers go below; their queue with them; and the tags it gave up on.
        self.markers.remove(&peer);
        self.forget_given_up(|g| g.forget_all(|_, by| by == peer));
        // One pass, each slot under its shard's lock: a frame's slot that stops arriving
        // between two passes could otherwise put its receiver back to wait after the
        // first and escape the second.
        self.slots.retain(|k, s| {
            if k.src != peer {
                return true;
            }
            match s {
                Slot::Waiting(_) | Slot::Abandoned { .. } => false,
                Slot::Incoming { waiter, wanted } => {
                    *waiter = None;
                    // A reader parked for budget looks again, and finds its peer lost.
                    wanted.notify_one();
                    true
                }
                Slot::Ready(_) => true,
            }
        });
    }

    /// True when `peer` has been declared lost.
    pub fn is_peer_failed(&self, peer: NodeId) -> bool {
        self.dead.contains_key(&peer)
    }

    /// Closes the table: every pending and future receive fails with `reason`.
    pub fn close(&self, reason: &str) {
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = Some(reason.to_string());
        self.purge(|_| true);
        self.budget.close();
        for b in &self.relay {
            b.close();
        }
    }
}

/// What a receiver waits for: a whole [`Payload`] or a [`Delivery`].
trait Awaited: Sized {
    fn waiter(tx: oneshot::Sender<Self>) -> Waiter;
    fn ready(payload: Payload) -> Self;
    /// What arrived for a receiver that gave up, as a payload to keep for the next one
    /// (`None`: a stream handed over, refused when dropped).
    fn keep(self) -> Option<Payload>;
    /// A stream handed over: the message is lost if its receiver gave up.
    fn is_stream(&self) -> bool;
}

impl Awaited for Payload {
    fn waiter(tx: oneshot::Sender<Self>) -> Waiter {
        Waiter::Whole(tx)
    }
    fn ready(payload: Payload) -> Self {
        payload
    }
    fn keep(self) -> Option<Payload> {
        Some(self)
    }
    fn is_stream(&self) -> bool {
        false
    }
}

impl Awaited for Delivery {
    fn waiter(tx: oneshot::Sender<Self>) -> Waiter {
        Waiter::Delivery(tx)
    }
    fn ready(payload: Payload) -> Self {
        Delivery::whole(payload)
    }
    fn keep(self) -> Option<Payload> {
        match self.0 {
            Delivered::Whole { payload, .. } => Some(payload),
            Delivered::Stream { .. } => None,
        }
    }
    fn is_stream(&self) -> bool {
        matches!(self.0, Delivered::Stream { .. })
    }
}

/// Cleans up after a `take` that did not complete (timeout, error or cancellation).
struct TakeGuard<'a, T: Awaited> {
    table: &'a MailboxTable,
    key: MailboxKey,
    rx: Option<oneshot::Receiver<T>>,
}

impl<T: Awaited> Drop for TakeGuard<'_, T> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        // All under the entry's lock: a receiver that comes for the same key meanwhile (it
        // may replace a waiter that is closed) must find either this one's slot, cleaned
        // up, or its own, untouched.
        let entry = self.table.slots.entry(self.key);
        rx.close();
        // Delivered just as we gave up: kept for the next receiver. A stream handed over
        // is refused when dropped here, and its message lost: the next receiver of this
        // key is told so (as if its sender had abandoned it) instead of waiting for it
        // until its own deadline, and every later receiver under its tag after it.
        let got = rx.try_recv().ok();
        // Nothing is kept for a tag retired, or a table closed, meanwhile: no receiver
        // would come for it, and its budget would stay taken.
        let over = self.table.is_retired(self.key.comm, self.key.tag) || self.table.is_closed();
        let lost = got.as_ref().is_some_and(Awaited::is_stream)
            && !over
            && !self.table.is_peer_failed(self.key.src);
        let mut kept = got
            .and_then(Awaited::keep)
            .filter(|_| !over)
            .map(|p| self.table.charged(self.key.src, p));
        match entry {
            Entry::Occupied(mut e) => match e.get_mut() {
                // Ours, closed above.
                Slot::Waiting(w) if w.is_closed() => match kept.take() {
                    Some(p) => {
                        e.insert(Slot::Ready(p));
                    }
                    None if lost => {
                        e.insert(Slot::Abandoned { _place: None });
                    }
                    None => {
                        e.remove();
                    }
                },
                // A later receiver's, and the message lost: it wakes to the marker.
                Slot::Waiting(_) if lost => {
                    e.insert(Slot::Abandoned { _place: None });
                }
                // A later receiver's: it gets what was delivered to us.
                Slot::Waiting(_) => {
                    if let Some(p) = kept.take() {
                        let old = std::mem::replace(e.get_mut(), Slot::Ready(Payload::default()));
                        if let Slot::Waiting(w) = old {
                            match w.send(p) {
                                Ok(()) => {
                                    e.remove();
                                }
                                Err(p) => *e.get_mut() = Slot::Ready(p),
                            }
                        }
                    }
                }
                Slot::Incoming { waiter, .. } => {
                    if waiter.as_ref().is_some_and(Waiter::is_closed) {
                        *waiter = None;
                    }
                }
                Slot::Ready(_) | Slot::Abandoned { .. } => {}
            },
            Entry::Vacant(v) => {
                if let Some(p) = kept {
                    v.insert(Slot::Ready(p));
                } else if lost {
                    v.insert(Slot::Abandoned { _place: None });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn key(step: u64) -> MailboxKey {
        MailboxKey {
            comm: 1,
            tag: 2,
            step,
            src: NodeId(3),
        }
    }

    /// Yields (a bounded number of times) until a receiver of `key` spawned on `t` waits
    /// for it (checked by its slot, not by the table holding anything: another frame may
    /// be there already).
    async fn registered(t: &MailboxTable, key: MailboxKey) {
        for _ in 0..10_000 {
            if matches!(t.slots.get(&key).as_deref(), Some(Slot::Waiting(w)) if !w.is_closed()) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("no receiver of {key:?} registered");
    }

    #[tokio::test]
    async fn early_arrival_is_kept_until_taken_then_removed() {
        let t = MailboxTable::new(1 << 20);
        t.deliver_local(key(0), Payload::from_bytes(Bytes::from_static(b"hello")))
            .unwrap();
        assert_eq!(t.len(), 1);
        let p = t.take(key(0), Duration::from_secs(1)).await.unwrap();
        assert_eq!(p.chunks()[0].as_ref(), b"hello");
        assert!(t.is_empty());
    }

    #[tokio::test]
    async fn waiter_gets_later_frame() {
        let t = Arc::new(MailboxTable::new(1 << 20));
        let t2 = t.clone();
        let h = tokio::spawn(async move { t2.take(key(5), Duration::from_secs(5)).await });
        registered(&t, key(5)).await;
        t.deliver_local(key(5), Payload::from_bytes(Bytes::from_static(b"x")))
            .unwrap();
        assert_eq!(h.await.unwrap().unwrap().len(), 1);
        assert!(t.is_empty());
    }

    /// A relay frame takes at least `RELAY_FRAME_MIN_CHARGE` of its hop count's relay
    /// budget, so tiny frames run it out after a bounded number; an empty one takes none.
    #[test]
    fn relay_frames_take_at_least_the_minimum_charge() {
        const BUDGET: usize = 64 << 10;
        let t = MailboxTable::new(1000).with_relay_budget(BUDGET);
        let tiny = t.try_relay_budget(0, 14).expect("budget");
        assert_eq!(t.relay_budget_available(0), BUDGET - RELAY_FRAME_MIN_CHARGE);
        let big = t.try_relay_budget(1, 40 << 10).expect("budget");
        assert_eq!(t.relay_budget_available(1), BUDGET - (40 << 10));
        assert!(t.try_relay_budget(2, 0).is_none());
        assert_eq!(t.relay_budget_available(2), BUDGET);
        let more: Vec<_> = (1..BUDGET / RELAY_FRAME_MIN_CHARGE)
            .map(|_| t.try_relay_budget(0, 1).expect("budget"))
            .collect();
        assert!(
            t.try_relay_budget(0, 1).is_none(),
            "{} one-byte frames hold the whole budget",
            BUDGET / RELAY_FRAME_MIN_CHARGE
        );
        drop((tiny, big, more));
        assert_eq!(t.relay_budget_available(0), BUDGET);
        assert_eq!(t.relay_budget_available(1), BUDGET);
    }

    /// However small a frame nobody waits for (empty ones too), it takes at least
    /// EARLY_FRAME_MIN_CHARGE of the early-arrival budget, and gives it back when taken; a
    /// budget smaller than that is taken whole by each frame.
    #[tokio::test]
    async fn tiny_and_empty_early_frames_take_the_least_charge() {
        let within = Duration::from_secs(10);
        let t = MailboxTable::new(3 * EARLY_FRAME_MIN_CHARGE);
        let mut held = Vec::new();
        for (i, len) in [0usize, 1, 100].into_iter().enumerate() {
            let admitted = t
                .admit(key(i as u64), len, Park::Never, std::future::pending())
                .await
                .unwrap();
            assert!(admitted.permit.is_some(), "frame {i} of {len} bytes");
            assert_eq!(
                t.budget_available(),
                (2 - i) * EARLY_FRAME_MIN_CHARGE,
                "frame {i} of {len} bytes"
            );
            held.push(admitted);
        }
        // Spent: a fourth one-byte frame on the message stream goes on without budget.
        let fourth = t
            .admit(key(3), 1, Park::Never, std::future::pending())
            .await
            .unwrap();
        assert!(fourth.permit.is_none());
        // Taking the frames gives their charges back.
        for (i, a) in held.into_iter().enumerate() {
            let payload = Payload::from_chunks(vec![Bytes::from(vec![1u8; i])], a.permit);
            t.finish_incoming(key(i as u64), &a.wanted, payload);
        }
        for i in 0..3 {
            drop(t.take(key(i), within).await.unwrap());
        }
        assert_eq!(t.budget_available(), 3 * EARLY_FRAME_MIN_CHARGE);
        // A frame over the least charge takes its length.
        let large = t
            .admit(
                key(10),
                2 * EARLY_FRAME_MIN_CHARGE + 1,
                Park::Never,
                std::future::pending(),
            )
            .await
            .unwrap();
        assert!(large.permit.is_some());
        assert_eq!(t.budget_available(), EARLY_FRAME_MIN_CHARGE - 1);

        let small = MailboxTable::new(100);
        let one = small
            .admit(key(0), 1, Park::Never, std::future::pending())
            .await
            .unwrap();
        assert!(one.permit.is_some());
        assert_eq!(small.budget_available(), 0);
        // A frame larger than the whole budget never takes it.
        assert!(small.budget.try_take(101).is_none());
    }

    /// A relayed frame nobody waits for, past the early-arrival budget, takes its
    /// origin's overdraft (each origin its own); past that it is refused, and its receive
    /// fails at once. A receiver that waits takes one past both. Such frames used to be kept
    /// without budget whatever their number and size: a neighbour could make a node keep
    /// any number of them.
    #[tokio::test]
    async fn relayed_frames_past_the_budget_take_their_origins_overdraft_then_are_refused() {
        let within = Duration::from_secs(10);
        let t = MailboxTable::new(1000).with_overdraft(10_000);
        let frame = |n: u8| vec![Bytes::from(vec![n; 4000])];
        let from = |src: u64, step: u64| MailboxKey {
            src: NodeId(src),
            ..key(step)
        };
        // Larger than the whole early budget: both go to origin 3's overdraft.
        for step in 0..2 {
            t.deliver_relayed(key(step), frame(step as u8))
                .await
                .expect("kept");
        }
        let refused = t.deliver_relayed(key(2), frame(2)).await;
        assert!(
            matches!(refused, Err(TransportError::Closed(_))),
            "{refused:?}"
        );
        // Told (`Abandoned`), where a receive that waited would end in `Timeout`.
        let told = t.take(key(2), within).await;
        assert!(
            matches!(told, Err(TransportError::Abandoned { .. })),
            "{told:?}"
        );
        // Another origin has an overdraft of its own.
        t.deliver_relayed(from(4, 0), frame(9)).await.expect("kept");
        // Taking a frame gives its overdraft back.
        assert!(t.take(key(0), within).await.expect("taken").to_bytes()[..] == [0; 4000]);
        t.deliver_relayed(key(3), frame(3))
            .await
            .expect("kept again");
        // A receiver that waits takes a frame past both.
        let before = t.len();
        let waiting = t.take(key(4), within);
        let deliver = async {
            while t.len() == before {
                tokio::task::yield_now().await;
            }
            t.deliver_relayed(key(4), frame(4)).await
        };
        let (got, delivered) =
            tokio::time::timeout(within, async { tokio::join!(waiting, deliver) })
                .await
                .expect("within the deadline");
        delivered.expect("delivered to its receiver");
        assert_eq!(got.expect("received").len(), 4000);
    }

    /// A relayed frame larger than its origin's whole overdraft is kept when all of it is
    /// free, taking all of it (as a frame larger than the relay budget); the next one
    /// waits for none and is refused.
    #[tokio::test]
    async fn a_relayed_frame_larger_than_the_overdraft_takes_all_of_it() {
        let within = Duration::from_secs(10);
        let t = MailboxTable::new(1000).with_overdraft(10_000);
        let big = || vec![Bytes::from(vec![5u8; 30_000])];
        t.deliver_relayed(key(0), big()).await.expect("kept");
        let refused = t.deliver_relayed(key(1), big()).await;
        assert!(
            matches!(refused, Err(TransportError::Closed(_))),
            "{refused:?}"
        );
        assert_eq!(t.take(key(0), within).await.expect("taken").len(), 30_000);
        t.deliver_relayed(key(2), big()).await.expect("kept again");
    }

    /// A frame dropped past its sender's overdraft evicts none of the sender's markers for
    /// one of its own: with no room left, it is refused unmarked (for the caller to give
    /// the sender up), and the receives of the frames marked before it are still told. An
    /// evicted marker left its receive waiting to its deadline, and its pair on that
    /// message for good.
    #[tokio::test]
    async fn a_frame_past_the_overdraft_evicts_no_marker() {
        let within = Duration::from_secs(10);
        let t = MailboxTable::new(1000).with_overdraft(1000);
        for step in 0..ABANDONED_MARKERS_PER_PEER as u64 {
            t.abandon(key(1000 + step));
        }
        let frame = || vec![Bytes::from(vec![6u8; 4000])];
        t.deliver_relayed(key(0), frame())
            .await
            .expect("on the overdraft");
        let refused = t.deliver_relayed(key(1), frame()).await;
        assert!(
            matches!(&refused, Err(TransportError::ConnectionLost { peer, .. }) if *peer == NodeId(3)),
            "{refused:?}"
        );
        assert!(!t.is_abandoned(&key(1)) && !t.is_ready(&key(1)));
        for step in [0, ABANDONED_MARKERS_PER_PEER as u64 - 1] {
            let told = t.take(key(1000 + step), within).await;
            assert!(
                matches!(told, Err(TransportError::Abandoned { .. })),
                "{told:?}"
            );
        }
        // With room again, the next is marked.
        let refused = t.deliver_relayed(key(2), frame()).await;
        assert!(
            matches!(refused, Err(TransportError::Closed(_))),
            "{refused:?}"
        );
        assert!(t.is_abandoned(&key(2)));
    }

    /// A peer past its overdraft whose dropped frames' receives come, one by one, leaves a
    /// bounded queue of marker keys behind: the queue is tidied without evictions too (it
    /// grew by one key per frame dropped until the peer was failed).
    #[tokio::test]
    async fn markers_past_the_overdraft_leave_a_bounded_queue() {
        let within = Duration::from_secs(10);
        let t = MailboxTable::new(1000).with_overdraft(1000);
        let frame = || vec![Bytes::from(vec![6u8; 4000])];
        t.deliver_relayed(key(0), frame())
            .await
            .expect("on the overdraft");
        for step in 1..=3 * ABANDONED_MARKERS_PER_PEER as u64 {
            let refused = t.deliver_relayed(key(step), frame()).await;
            assert!(refused.is_err(), "step {step}: {refused:?}");
            let told = t.take(key(step), within).await;
            assert!(
                matches!(told, Err(TransportError::Abandoned { .. })),
                "step {step}: {told:?}"
            );
        }
        let queued = t.markers_of(key(0).src).order().len();
        assert!(
            queued <= 2 * ABANDONED_MARKERS_PER_PEER,
            "{queued} keys queued for {ABANDONED_MARKERS_PER_PEER} places"
        );
    }

    /// A frame let in without budget because a receiver waited for it, kept because that
    /// receiver gave up before it was whole, takes budget then: it counts against what its
    /// sender may leave here, and gives it back when taken. It used to stay out of every
    /// budget.
    #[tokio::test]
    async fn a_frame_whose_receiver_gave_up_takes_budget_when_kept() {
        let within = Duration::from_secs(10);
        let t = Arc::new(MailboxTable::new(100_000));
        let receive = {
            let t = t.clone();
            tokio::spawn(async move { t.take(key(0), within).await })
        };
        let deadline = std::time::Instant::now() + within;
        while t.is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the receive never waited"
            );
            tokio::task::yield_now().await;
        }
        let admitted = t
            .admit(key(0), 8000, Park::UntilBudget, std::future::pending())
            .await
            .expect("admitted");
        assert!(admitted.waited_for && admitted.permit.is_none());
        // The receive gives up (dropped, as at its deadline).
        receive.abort();
        assert!(receive.await.is_err_and(|e| e.is_cancelled()));
        let payload = Payload::from_bytes(Bytes::from(vec![1u8; 8000]));
        t.finish_incoming(key(0), &admitted.wanted, payload);
        assert!(t.is_ready(&key(0)));
        assert_eq!(t.budget_available(), 100_000 - 8000);
        drop(t.take(key(0), within).await.expect("taken"));
        assert_eq!(t.budget_available(), 100_000);
    }

    /// A frame that waits for more early-arrival budget than is free holds none of it
    /// while it waits: frames that cannot wait still find what is free, and it takes its
    /// share once enough goes back. (tokio's semaphore handed the waiting frame all that
    /// was free, so one large frame held the whole budget unread.)
    #[tokio::test]
    async fn a_frame_waiting_for_budget_holds_none_of_it() {
        let within = Duration::from_secs(10);
        let t = Arc::new(MailboxTable::new(1 << 20));
        t.deliver_whole(key(0), vec![Bytes::from_static(b"x")])
            .await
            .expect("kept");
        assert_eq!(t.budget_available(), (1 << 20) - EARLY_FRAME_MIN_CHARGE);
        let large = {
            let t = t.clone();
            tokio::spawn(async move {
                t.admit(key(1), 1 << 20, Park::UntilBudget, std::future::pending())
                    .await
            })
        };
        let deadline = std::time::Instant::now() + within;
        while t.len() < 2 {
            assert!(std::time::Instant::now() < deadline, "never let in");
            tokio::task::yield_now().await;
        }
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!large.is_finished(), "the budget is short of the frame");
        assert_eq!(
            t.budget_available(),
            (1 << 20) - EARLY_FRAME_MIN_CHARGE,
            "the waiting frame holds budget"
        );
        let small = t
            .admit(key(2), 100, Park::Never, std::future::pending())
            .await
            .expect("admitted");
        assert!(
            small.permit.is_some(),
            "no budget for a frame that cannot wait"
        );
        drop(small);
        // Both earlier frames' budget goes back: the large frame takes its share.
        drop(t.take(key(0), within).await.expect("taken"));
        let admitted = tokio::time::timeout(within, large)
            .await
            .expect("the large frame gets its budget")
            .expect("task")
            .expect("admitted");
        assert!(admitted.permit.is_some());
        assert_eq!(t.budget_available(), 0);
    }

    /// A frame that came through a relay takes early-arrival budget when nobody waits for
    /// it and the budget is free, and is delivered without it otherwise (on its origin's
    /// overdraft), never waiting.
    #[tokio::test]
    async fn a_relayed_frame_takes_budget_when_free_and_never_waits() {
        let within = Duration::from_secs(10);
        let t = Arc::new(MailboxTable::new(10_000));
        let frame = |n: u8| Bytes::from(vec![n; 8000]);
        let deliver = |k: MailboxKey, n: u8| {
            let t = t.clone();
            // In two chunks, as a relay passes them on.
            let f = frame(n);
            let chunks = vec![f.slice(..3000), f.slice(3000..)];
            async move {
                tokio::time::timeout(within, t.deliver_relayed(k, chunks))
                    .await
                    .unwrap()
                    .unwrap()
            }
        };
        deliver(key(0), 0).await;
        assert!(t.is_ready(&key(0)));
        assert_eq!(t.budget_available(), 2000);
        // No budget left: delivered all the same (on the overdraft).
        deliver(key(1), 1).await;
        assert!(t.is_ready(&key(1)));
        assert_eq!(t.budget_available(), 2000);
        // A receiver waits: delivered to it, without budget.
        let t2 = t.clone();
        let h = tokio::spawn(async move { t2.take(key(2), within).await });
        let deadline = std::time::Instant::now() + within;
        while t.len() < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "receiver never registered"
            );
            tokio::task::yield_now().await;
        }
        deliver(key(2), 2).await;
        assert!(h.await.unwrap().unwrap().to_bytes() == frame(2));
        assert_eq!(t.budget_available(), 2000);
        // Taking a frame gives its budget back.
        assert!(t.take(key(1), within).await.unwrap().to_bytes() == frame(1));
        drop(t.take(key(0), within).await.unwrap());
        assert_eq!(t.budget_available(), 10_000);
        assert!(t.is_empty());
    }

    /// A peer declared lost after a receive checked it but before its waiter was in the
    /// table (so the loss found no waiter to fail) still fails that receive at once; it
    /// used to wait out its deadline and end in `Timeout`. So does a table closed then.
    #[tokio::test]
    async fn a_loss_while_a_receive_registers_fails_it_at_once() {
        /// A receive on a fresh table with `hook` run as it registers; it must end well
        /// before its 60 s deadline, and leave no waiter behind.
        async fn taken_with(hook: fn(&MailboxTable)) -> Result<Payload, TransportError> {
            let t = MailboxTable::new(1 << 20);
            *t.on_waiting.lock().unwrap() = Some(hook);
            let take = t.take(key(0), Duration::from_secs(60));
            let got = tokio::time::timeout(Duration::from_secs(5), take)
                .await
                .expect("failed at once, not at its deadline");
            assert_eq!(t.len(), 0, "the waiter is gone with it");
            got
        }
        let got = taken_with(|t| t.fail_peer(NodeId(3), "lost just now")).await;
        assert!(
            matches!(
                got,
                Err(TransportError::ConnectionLost {
                    peer: NodeId(3),
                    ..
                })
            ),
            "{got:?}"
        );
        let got = taken_with(|t| t.close("closing")).await;
        assert!(matches!(got, Err(TransportError::Closed(_))), "{got:?}");
    }

    /// One peer's notices keep at most `ABANDONED_MARKERS_PER_PEER` markers of frames
    /// nobody asked for (a notice again for a marked frame takes no second place); past
    /// that a new notice evicts the peer's oldest marker still waiting (stale ones, for
    /// frames taken after all, would otherwise use the places up for good and leave the
    /// next genuine notice dropped); a marker taken by its receive frees its place, other
    /// peers' notices are kept meanwhile, and the queue of keys stays bounded. (A peer
    /// could name any number of frames, each a marker kept for good.)
    #[tokio::test]
    async fn a_peers_abandoned_markers_are_bounded() {
        let t = MailboxTable::new(1 << 20);
        let cap = ABANDONED_MARKERS_PER_PEER as u64;
        for step in 0..cap {
            t.abandon(key(step));
            t.abandon(key(0));
        }
        assert!((0..cap).all(|step| t.is_abandoned(&key(step))));
        assert_eq!(t.len(), ABANDONED_MARKERS_PER_PEER);
        for step in cap..cap + 10 {
            t.abandon(key(step));
        }
        assert!(
            (0..10).all(|step| !t.is_abandoned(&key(step))),
            "the oldest evicted"
        );
        assert!((10..cap + 10).all(|step| t.is_abandoned(&key(step))));
        assert_eq!(t.len(), ABANDONED_MARKERS_PER_PEER);
        let other = MailboxKey {
            src: NodeId(4),
            ..key(cap)
        };
        t.abandon(other);
        assert!(t.is_abandoned(&other), "another peer's notice");
        let got = t.take(key(15), Duration::from_secs(5)).await;
        assert!(
            matches!(got, Err(TransportError::Abandoned { .. })),
            "{got:?}"
        );
        t.abandon(key(cap + 10));
        assert!(t.is_abandoned(&key(cap + 10)), "a place freed by a receive");
        assert!(t.is_abandoned(&key(10)), "so nothing was evicted for it");
        // A frame whose header arrived (nobody waiting) and whose reader then stops: its
        // marker takes a place too, the oldest marker making room.
        let reading = t.begin_incoming(key(cap + 11)).expect("a header");
        t.abandon(key(cap + 11));
        t.forget_incoming(key(cap + 11), &reading.wanted);
        assert!(t.is_abandoned(&key(cap + 11)) && !t.is_abandoned(&key(10)));
        assert_eq!(t.len(), ABANDONED_MARKERS_PER_PEER + 1);
        // A notice for a frame a receive waits for takes no place, so evicts nothing.
        let (got, ()) = tokio::join!(t.take(key(cap + 12), Duration::from_secs(5)), async {
            tokio::task::yield_now().await;
            t.abandon(key(cap + 12));
        });
        assert!(
            matches!(got, Err(TransportError::Abandoned { .. })),
            "{got:?}"
        );
        assert!(
            t.is_abandoned(&key(11)),
            "a marker evicted for a waiting receive"
        );
        // Markers taken by their receives leave their keys queued until a clean-up.
        for step in 2 * cap..5 * cap {
            t.abandon(key(step));
            let got = t.take(key(step), Duration::from_secs(5)).await;
            assert!(matches!(got, Err(TransportError::Abandoned { .. })));
        }
        let queued = t.markers_of(NodeId(3)).order().len();
        assert!(
            queued <= 2 * ABANDONED_MARKERS_PER_PEER,
            "{queued} keys queued"
        );
        // The first of them evicted one marker more; the others found a place free.
        assert_eq!(t.len(), ABANDONED_MARKERS_PER_PEER);
        // A lost peer's markers go, and their queue with them.
        t.fail_peer(NodeId(3), "gone");
        assert!(t.markers.get(&NodeId(3)).is_none());
        assert_eq!(t.len(), 1, "another peer's marker stays");
        // Its late notices make no marker (none would ever be taken).
        t.abandon(key(7 * cap));
        assert!(!t.is_abandoned(&key(7 * cap)) && t.markers.get(&NodeId(3)).is_none());
    }

    /// A notice that names a lost rank takes the place of one that gave up on its own
    /// (a rank whose deadline came first), from any member; nothing else replaces a
    /// record, and the count of tags given up on stays one.
    #[test]
    fn a_notice_naming_a_loss_takes_the_place_of_one_given_up_on_its_own() {
        let t = MailboxTable::new(1 << 20).with_whole_tag_channels(|comm| comm == 1);
        let whole = |src: u64, lost: u32| MailboxKey {
            tag: 2,
            step: WHOLE_TAG_STEP | u64::from(lost),
            src: NodeId(src),
            ..key(0)
        };
        t.abandon(whole(4, GAVE_UP_ON_ITS_OWN));
        assert_eq!(t.given_up_on(1, 2), Some((NodeId(4), GAVE_UP_ON_ITS_OWN)));
        t.abandon(whole(5, GAVE_UP_ON_ITS_OWN));
        assert_eq!(t.given_up_on(1, 2), Some((NodeId(4), GAVE_UP_ON_ITS_OWN)));
        t.abandon(whole(6, 3));
        assert_eq!(
            t.given_up_on(1, 2),
            Some((NodeId(6), 3)),
            "the loss replaces it"
        );
        t.abandon(whole(7, 1));
        t.abandon(whole(8, GAVE_UP_ON_ITS_OWN));
        assert_eq!(t.given_up_on(1, 2), Some((NodeId(6), 3)), "and stays");
        assert_eq!(t.abandoned_tags.load(Ordering::SeqCst), 1);
        t.retire(1, 2);
        assert_eq!(t.abandoned_tags.load(Ordering::SeqCst), 0);
        assert_eq!(t.given_up_on(1, 2), None);
    }

    /// A notice for a whole tag, on a channel that takes them, fails the tag's receives,
    /// waiting and later, naming who gave up and the rank it lost; other tags go on; the
    /// record goes when the tag retires (a notice after that is ignored) or its sender is
    /// lost; each peer keeps at most `ABANDONED_TAGS_PER_PEER`; other channels ignore them.
    #[tokio::test]
    async fn a_tag_given_up_on_fails_its_receives_until_it_retires() {
        let t = MailboxTable::new(1 << 20).with_whole_tag_channels(|comm| comm == 1);
        let whole = |tag: u64, lost: u64| MailboxKey {
            tag,
            step: WHOLE_TAG_STEP | lost,
            ..key(0)
        };
        let count = |t: &MailboxTable| t.abandoned_tags.load(Ordering::SeqCst);
        let (got, ()) = tokio::join!(t.take(key(1), Duration::from_secs(5)), async {
            tokio::task::yield_now().await;
            t.abandon(whole(2, 7));
        });
        let given_up = |got: &Result<Payload, TransportError>| {
            matches!(
                got,
                Err(TransportError::TagAbandoned {
                    by: NodeId(3),
                    lost: 7
                })
            )
        };
        assert!(given_up(&got), "a waiting receive: {got:?}");
        assert_eq!(t.given_up_on(1, 2), Some((NodeId(3), 7)));
        assert_eq!(t.given_up_on(1, 3), None);
        let later = t.take(key(2), Duration::from_secs(5)).await;
        assert!(given_up(&later), "a later receive: {later:?}");
        let other = MailboxKey { tag: 9, ..key(0) };
        t.deliver_local(other, Payload::from_bytes(Bytes::from_static(b"x")))
            .unwrap();
        assert!(t.take(other, Duration::from_secs(5)).await.is_ok());
        t.retire(1, 2);
        assert_eq!(count(&t), 0);
        assert_eq!(t.given_up_on(1, 2), None);
        t.abandon(whole(2, 7));
        assert_eq!(count(&t), 0, "a retired tag's notice");
        let p2p = MailboxKey {
            comm: 5,
            ..whole(3, 1)
        };
        t.abandon(p2p);
        assert_eq!(count(&t), 0, "a channel that takes none");
        assert!(!t.is_abandoned(&p2p), "nor a marker of one frame");
        for tag in 100..100 + ABANDONED_TAGS_PER_PEER as u64 + 5 {
            t.abandon(whole(tag, 1));
        }
        assert_eq!(count(&t), ABANDONED_TAGS_PER_PEER);
        let past = MailboxKey {
            tag: 100 + ABANDONED_TAGS_PER_PEER as u64,
            ..key(0)
        };
        let past = t.take(past, Duration::ZERO).await;
        assert!(
            matches!(past, Err(TransportError::Timeout(_))),
            "past the cap: {past:?}"
        );
        let from_other = MailboxKey {
            src: NodeId(4),
            ..whole(50, 1)
        };
        t.abandon(from_other);
        assert_eq!(
            count(&t),
            ABANDONED_TAGS_PER_PEER + 1,
            "another peer's notice"
        );
        t.fail_peer(NodeId(3), "gone");
        assert_eq!(count(&t), 1, "a lost peer's records go");
        t.abandon(whole(60, 1));
        assert_eq!(count(&t), 1, "a lost peer's late notice");
        t.retire_comm(1);
        assert_eq!(count(&t), 0);
    }

    /// A receive waiting in the slot of a frame that is arriving is not put back to wait
    /// when the frame stops short after its sender was declared lost (here: the loss
    /// recorded, as if the loss's sweep of the table had passed the slot before the
    /// receive moved into it): it fails with the loss, not at its deadline.
    #[tokio::test]
    async fn a_receive_whose_frame_stops_short_after_its_sender_was_lost_fails() {
        let t = MailboxTable::new(1 << 20);
        let reading = t.begin_incoming(key(1)).expect("a header");
        let (got, ()) = tokio::join!(t.take(key(1), Duration::from_secs(5)), async {
            tokio::task::yield_now().await;
            t.dead.insert(NodeId(3), "gone".into());
            t.forget_incoming(key(1), &reading.wanted);
        });
        assert!(
            matches!(got, Err(TransportError::ConnectionLost { .. })),
            "{got:?}"
        );
    }

    /// A receive waiting in the slot of a frame that is arriving is not put back to wait
    /// when the frame stops short after its tag was given up on: it fails.
    #[tokio::test]
    async fn a_receive_whose_frame_stops_short_after_its_tag_was_given_up_on_fails() {
        let t = MailboxTable::new(1 << 20).with_whole_tag_channels(|comm| comm == 1);
        let reading = t.begin_incoming(key(1)).expect("a header");
        let (got, ()) = tokio::join!(t.take(key(1), Duration::from_secs(5)), async {
            tokio::task::yield_now().await;
            t.abandon(MailboxKey {
                step: WHOLE_TAG_STEP | 4,
                ..key(0)
            });
            t.forget_incoming(key(1), &reading.wanted);
        });
        assert!(
            matches!(got, Err(TransportError::TagAbandoned { lost: 4, .. })),
            "{got:?}"
        );
    }

    /// A reader whose frame was abandoned (the marker taken by its receive) and whose key
    /// has since been taken by another frame (a sender that reuses a key; honest ones do
    /// not) finishes or gives up without touching the other frame's slot: the next
    /// receive of the key gets the other frame's bytes, whole, and nothing of the first.
    #[tokio::test]
    async fn a_reader_left_behind_leaves_a_later_frame_of_its_key_alone() {
        let within = Duration::from_secs(5);
        let t = MailboxTable::new(1 << 20);
        let first = t.begin_incoming(key(1)).expect("the first header");
        t.abandon(key(1));
        let told = t.take(key(1), within).await;
        assert!(
            matches!(told, Err(TransportError::Abandoned { .. })),
            "{told:?}"
        );
        let second = t.begin_incoming(key(1)).expect("the second header");
        let stale = Payload::from_bytes(Bytes::from_static(b"first"));
        t.finish_incoming(key(1), &first.wanted, stale);
        t.forget_incoming(key(1), &first.wanted);
        assert!(t.still_incoming(&key(1), &second.wanted));
        let fresh = Payload::from_bytes(Bytes::from_static(b"second"));
        t.finish_incoming(key(1), &second.wanted, fresh);
        let got = t.take(key(1), within).await.expect("the second frame");
        assert_eq!(got.to_bytes().as_ref(), b"second");
        assert!(t.is_empty());
    }

    /// A budget of 0 bytes holds no frame: shares of 0 let every frame in (empty frames
    /// under fresh keys without bound, and any frame on a zero overdraft).
    #[tokio::test]
    async fn a_zero_budget_holds_no_frame() {
        let t = MailboxTable::new(0).with_overdraft(0);
        for (k, len) in [(0, 0), (1, 10)] {
            let let_in = t
                .admit(key(k), len, Park::Never, std::future::pending())
                .await
                .expect("read without budget");
            assert!(
                let_in.permit.is_none(),
                "a frame of {len} bytes took budget"
            );
        }
        for (k, len) in [(2, 0), (3, 10)] {
            let refused = t
                .admit(key(k), len, Park::Overdraft, std::future::pending())
                .await;
            assert!(
                matches!(refused, Err(Refused::OverBudget { .. })),
                "{len} bytes: {:?}",
                refused.map(|a| a.waited_for)
            );
        }
    }

    /// A reader parked for budget whose frame was abandoned meanwhile, and whose key's slot
    /// is a later frame's by the time it looks, with a receiver waiting for that frame,
    /// is refused: it does not take that receiver as waiting for its own frame (it was
    /// then handed that receiver, which read the abandoned frame's stream, and the later
    /// frame's slot went with it).
    #[tokio::test]
    async fn a_reader_left_behind_never_takes_a_later_frames_receiver() {
        let within = Duration::from_secs(5);
        let t = Arc::new(MailboxTable::new(100));
        let parked = {
            let t = t.clone();
            tokio::spawn(async move {
                t.admit(key(1), 1000, Park::UntilBudget, std::future::pending())
                    .await
            })
        };
        let deadline = std::time::Instant::now() + within;
        while t.is_empty() {
            assert!(std::time::Instant::now() < deadline, "never let in");
            tokio::task::yield_now().await;
        }
        // All before the parked reader runs again (one thread).
        t.abandon(key(1));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let told = std::future::Future::poll(std::pin::pin!(t.take(key(1), within)), &mut cx);
        assert!(
            matches!(
                told,
                std::task::Poll::Ready(Err(TransportError::Abandoned { .. }))
            ),
            "{told:?}"
        );
        let second = t.begin_incoming(key(1)).expect("the second header");
        let mut receive = Box::pin(t.take_delivery(key(1), within));
        assert!(std::future::Future::poll(receive.as_mut(), &mut cx).is_pending());
        assert!(t.has_waiter_for(&key(1), &second.wanted));
        let res = tokio::time::timeout(within, parked)
            .await
            .expect("the parked reader ends")
            .expect("task");
        assert!(
            matches!(res, Err(Refused::Abandoned)),
            "{:?}",
            res.map(|a| a.waited_for)
        );
        assert!(
            t.has_waiter_for(&key(1), &second.wanted),
            "the receiver still waits"
        );
        let fresh = Payload::from_bytes(Bytes::from_static(b"second"));
        t.finish_incoming(key(1), &second.wanted, fresh);
        let got = tokio::time::timeout(within, receive)
            .await
            .expect("delivered")
            .expect("the second frame");
        let mut out = [0u8; 6];
        got.copy_into(&mut out).await.expect("copied");
        assert_eq!(&out, b"second");
    }

    /// A communicator retired whole retires every tag, `u64::MAX` included, and retiring
    /// that tag again afterwards neither overflows nor brings the others back. What stays
    /// of it is its id, not a record of its tags (one with tags retired before included).
    #[test]
    fn a_retired_communicator_covers_the_last_tag() {
        let t = MailboxTable::new(1 << 20);
        t.retire(1, 5);
        t.retire(1, 9);
        t.retire_comm(1);
        {
            let retired = t.retired.lock().expect("retired");
            assert!(retired.tags.is_empty() && retired.whole.len() == 1);
        }
        assert!(t.is_retired(1, u64::MAX));
        t.retire(1, u64::MAX);
        assert!(t.is_retired(1, 0) && t.is_retired(1, u64::MAX - 1) && t.is_retired(1, u64::MAX));
        assert!(!t.is_retired(2, 0));
        t.retire(2, u64::MAX);
        assert!(t.is_retired(2, u64::MAX) && !t.is_retired(2, 0));
        let retired = t.retired.lock().expect("retired");
        assert_eq!((retired.tags.len(), retired.whole.len()), (1, 1));
    }

    /// An abandonment marker fails the receive of its frame, whether the receiver waits
    /// already, comes later, or comes while the frame's stream is still being read (whose
    /// rest is then dropped, and a frame arriving after the marker is refused); a frame
    /// already here whole is kept.
    #[tokio::test]
    async fn an_abandoned_frame_fails_its_receive_once_and_a_whole_one_is_kept() {
        let abandoned = |r: Result<Payload, TransportError>| {
            matches!(r, Err(TransportError::Abandoned { peer: NodeId(3) }))
        };
        let t = Arc::new(MailboxTable::new(1 << 20));
        // Marker first, receiver later: it fails once, and the slot is gone.
        t.abandon(key(0));
        assert!(t.is_abandoned(&key(0)));
        assert!(abandoned(t.take(key(0), Duration::from_secs(5)).await));
        assert!(t.is_empty());
        // A receiver waiting when the marker comes is woken with it.
        let t2 = t.clone();
        let h = tokio::spawn(async move { t2.take(key(1), Duration::from_secs(5)).await });
        registered(&t, key(1)).await;
        t.abandon(key(1));
        assert!(abandoned(h.await.unwrap()));
        assert!(t.is_empty());
        // A frame being read when the marker comes: its end is dropped, its receiver fails,
        // and a reader parked for budget sees that the slot is no longer its own.
        let ticket = t.begin_incoming(key(2)).unwrap();
        assert!(t.still_incoming(&key(2), &ticket.wanted));
        t.abandon(key(2));
        assert!(!t.still_incoming(&key(2), &ticket.wanted));
        let late = Payload::from_bytes(Bytes::from_static(b"late"));
        t.finish_incoming(key(2), &ticket.wanted, late);
        assert!(abandoned(t.take(key(2), Duration::from_secs(5)).await));
        drop(ticket);
        // A reader whose stream fails after the marker came leaves the marker in place.
        let reading = t.begin_incoming(key(5)).unwrap();
        t.abandon(key(5));
        t.forget_incoming(key(5), &reading.wanted);
        assert!(abandoned(t.take(key(5), Duration::from_secs(5)).await));
        // A frame that arrives after its marker is refused.
        t.abandon(key(3));
        assert_eq!(t.begin_incoming(key(3)).unwrap_err(), Refused::Abandoned);
        // A frame here whole stays.
        t.deliver_local(key(4), Payload::from_bytes(Bytes::from_static(b"kept")))
            .unwrap();
        t.abandon(key(4));
        let p = t.take(key(4), Duration::from_secs(5)).await.unwrap();
        assert_eq!(p.to_bytes(), Bytes::from_static(b"kept"));
    }

    /// A receive given up (its guard dropping) while a new receiver for the same key has
    /// already replaced its closed waiter leaves the new receiver waiting: it gets the
    /// frame when it comes.
    #[tokio::test]
    async fn a_receive_given_up_leaves_a_later_receiver_for_its_key_alone() {
        let t = Arc::new(MailboxTable::new(1 << 20));
        // The first receiver, as `wait_for` leaves it, with its channel already closed.
        let (tx, mut rx) = oneshot::channel::<Payload>();
        t.slots.insert(key(4), Slot::Waiting(Waiter::Whole(tx)));
        rx.close();
        let first = TakeGuard {
            table: &t,
            key: key(4),
            rx: Some(rx),
        };
        // The second receiver comes before the first one's guard cleans up.
        let t2 = t.clone();
        let second = tokio::spawn(async move { t2.take(key(4), Duration::from_secs(10)).await });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !matches!(t.slots.get(&key(4)).as_deref(), Some(Slot::Waiting(w)) if !w.is_closed()) {
            assert!(
                std::time::Instant::now() < deadline,
                "second receiver never waited"
            );
            tokio::task::yield_now().await;
        }
        drop(first);
        t.deliver_local(key(4), Payload::from_bytes(Bytes::from_static(b"late")))
            .unwrap();
        let got = second.await.unwrap().unwrap();
        assert_eq!(got.chunks()[0].as_ref(), b"late");
        assert!(t.is_empty());
    }

    /// A frame delivered to a receive just as that receive gave up (its guard dropping)
    /// is kept for the next receiver holding budget, as one kept when its receiver gave
    /// up before it was whole.
    #[tokio::test]
    async fn a_frame_delivered_as_its_receive_gives_up_takes_budget_when_kept() {
        let t = MailboxTable::new(100_000);
        let (tx, rx) = oneshot::channel::<Payload>();
        t.slots.insert(key(5), Slot::Waiting(Waiter::Whole(tx)));
        let guard = TakeGuard {
            table: &t,
            key: key(5),
            rx: Some(rx),
        };
        t.deliver_local(key(5), Payload::from_bytes(Bytes::from(vec![2u8; 8000])))
            .unwrap();
        assert_eq!(t.budget_available(), 100_000, "delivered to its receiver");
        drop(guard);
        assert!(t.is_ready(&key(5)));
        assert_eq!(t.budget_available(), 100_000 - 8000);
        drop(t.take(key(5), Duration::from_secs(5)).await.unwrap());
        assert_eq!(t.budget_available(), 100_000);
    }

    #[tokio::test]
    async fn timeout_removes_waiting_slot() {
        let t = MailboxTable::new(1 << 20);
        let err = t.take(key(1), Duration::from_millis(10)).await.unwrap_err();
        assert!(matches!(err, TransportError::Timeout(_)));
        assert!(t.is_empty());
    }

    #[tokio::test]
    async fn retired_tags_are_discarded() {
        let t = MailboxTable::new(1 << 20);
        t.deliver_local(key(0), Payload::from_bytes(Bytes::from_static(b"a")))
            .unwrap();
        t.retire(1, 2);
        assert!(t.is_empty());
        assert!(t.deliver_local(key(1), Payload::default()).is_err());
        assert!(t.is_retired(1, 2));
        assert!(!t.is_retired(1, 3));
        t.retire(1, 0);
        t.retire(1, 1);
        // 0, 1, 2 retired: the record collapses into one run.
        let map = t.retired.lock().unwrap();
        assert_eq!(map.tags[&1].runs, BTreeMap::from([(0, 2)]));
    }

    /// A tag retired as taken is retired like any (later arrivals refused); its frames
    /// are dropped while the table is small, and the scan that finds them is skipped in a
    /// large one.
    #[tokio::test]
    async fn a_tag_retired_as_taken_is_scanned_for_only_in_a_small_table() {
        let t = MailboxTable::new(1 << 30);
        let one = |key| {
            t.deliver_local(key, Payload::from_bytes(Bytes::from_static(b"a")))
                .unwrap()
        };
        one(key(0));
        t.retire_taken(1, 2);
        assert!(t.is_retired(1, 2) && !t.is_retired(1, 3));
        assert!(t.deliver_local(key(1), Payload::default()).is_err());
        assert!(t.is_empty(), "a small table is scanned");
        for tag in 0..RETIRE_SCAN_SLOTS as u64 {
            one(MailboxKey {
                comm: 9,
                tag,
                ..key(0)
            });
        }
        let stray = MailboxKey { tag: 4, ..key(0) };
        one(stray);
        t.retire_taken(1, 4);
        assert!(t.is_ready(&stray), "a large table is not scanned");
        t.retire(1, 4);
        assert!(!t.is_ready(&stray), "retire scans it");
        assert_eq!(t.len(), RETIRE_SCAN_SLOTS);
        // An RPC reply's key: dropped without a scan, whether it was taken or not.
        let reply = MailboxKey { tag: 5, ..key(0) };
        let stray = MailboxKey { step: 1, ..reply };
        one(reply);
        one(stray);
        t.retire_key(reply);
        assert!(!t.is_ready(&reply) && t.is_ready(&stray));
        assert!(t.is_retired(1, 5));
        assert!(t.deliver_local(reply, Payload::default()).is_err());
        assert_eq!(t.len(), RETIRE_SCAN_SLOTS + 1);
    }

    /// Tags retired around one that stays in use (a long RPC call, a collective still in
    /// flight) are kept as runs: the record holds two runs however many tags retire after
    /// the hole, not one entry per tag; retiring the hole joins them.
    #[test]
    fn tags_retired_around_one_in_use_are_kept_as_runs() {
        let t = MailboxTable::new(1 << 20);
        t.retire(1, 0);
        for tag in (1..5_000)
            .rev()
            .map(|i| 2 * i)
            .chain((3..10_000).step_by(2))
        {
            t.retire(1, tag);
        }
        assert!(!t.is_retired(1, 1) && !t.is_retired(1, 10_000));
        assert!((2..10_000).all(|tag| t.is_retired(1, tag)) && t.is_retired(1, 0));
        assert_eq!(
            t.retired.lock().unwrap().tags[&1].runs,
            BTreeMap::from([(0, 0), (2, 9_999)])
        );
        t.retire(1, 1);
        t.retire(1, u64::MAX);
        t.retire(1, u64::MAX - 1);
        assert_eq!(
            t.retired.lock().unwrap().tags[&1].runs,
            BTreeMap::from([(0, 9_999), (u64::MAX - 1, u64::MAX)])
        );
        assert!(t.is_retired(1, u64::MAX) && !t.is_retired(1, u64::MAX - 2));
    }

    /// A reader parked for budget with a frame larger than the whole budget, which only
    /// its receiver could let in, stops (its slot gone, the stream's place freed) when the
    /// frame's tag or communicator is retired, its sender is declared lost, the table
    /// closes, or its connection ends (`gone`); it used to wait for good.
    #[tokio::test]
    async fn a_reader_parked_for_budget_stops_when_its_frame_can_never_be_taken() {
        let within = Duration::from_secs(10);
        /// Parks a reader for `k` (5000 bytes, budget 1000); `gone` ends its connection.
        async fn parked(
            t: &Arc<MailboxTable>,
            k: MailboxKey,
        ) -> (
            tokio::task::JoinHandle<Result<Admitted, Refused>>,
            oneshot::Sender<()>,
        ) {
            let (end, gone) = oneshot::channel::<()>();
            let t2 = t.clone();
            let h = tokio::spawn(async move {
                let gone = async {
                    let _ = gone.await;
                };
                t2.admit(k, 5000, Park::UntilBudget, gone).await
            });
            for _ in 0..1000 {
                if t.slots.contains_key(&k) {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert!(t.slots.contains_key(&k), "the reader never registered");
            (h, end)
        }
        type Joined = Result<Result<Admitted, Refused>, tokio::task::JoinError>;
        let refused = |r: Result<Joined, tokio::time::error::Elapsed>| match r {
            Ok(Ok(Err(why))) => why,
            Ok(Ok(Ok(_))) => panic!("let in"),
            Ok(Err(e)) => panic!("reader task: {e}"),
            Err(_) => panic!("the reader is still parked"),
        };
        let t = Arc::new(MailboxTable::new(1000));
        let (h, _end) = parked(&t, key(0)).await;
        t.retire(1, 2);
        assert_eq!(
            refused(tokio::time::timeout(within, h).await),
            Refused::Retired
        );
        assert!(t.is_empty());

        let k = MailboxKey { comm: 7, ..key(0) };
        let (h, _end) = parked(&t, k).await;
        t.retire_comm(7);
        assert_eq!(
            refused(tokio::time::timeout(within, h).await),
            Refused::Retired
        );
        assert!(t.is_empty());

        let k = MailboxKey { comm: 8, ..key(0) };
        let (h, end) = parked(&t, k).await;
        drop(end);
        assert_eq!(
            refused(tokio::time::timeout(within, h).await),
            Refused::Closed
        );
        assert!(t.is_empty(), "the frame left no slot behind");

        let k = MailboxKey { comm: 9, ..key(0) };
        let (h, _end) = parked(&t, k).await;
        t.fail_peer(NodeId(3), "gone");
        assert_eq!(
            refused(tokio::time::timeout(within, h).await),
            Refused::Closed
        );
        assert!(t.is_empty(), "the frame left no slot behind");

        let t = Arc::new(MailboxTable::new(1000));
        let (h, _end) = parked(&t, key(0)).await;
        t.close("shutting down");
        assert_eq!(
            refused(tokio::time::timeout(within, h).await),
            Refused::Closed
        );
        assert!(t.is_empty());
    }

    #[tokio::test]
    async fn failed_peer_fails_waiters_and_later_takes() {
        let t = Arc::new(MailboxTable::new(1 << 20));
        // Delivered before the loss: still readable after it.
        t.deliver_local(key(7), Payload::from_bytes(Bytes::from_static(b"kept")))
            .unwrap();
        let t2 = t.clone();
        let h = tokio::spawn(async move { t2.take(key(0), Duration::from_secs(5)).await });
        registered(&t, key(0)).await;
        t.fail_peer(NodeId(3), "gone");
        assert!(matches!(
            h.await.unwrap(),
            Err(TransportError::ConnectionLost { .. })
        ));
        assert!(matches!(
            t.take(key(1), Duration::from_secs(1)).await,
            Err(TransportError::ConnectionLost { .. })
        ));
        let kept = t.take(key(7), Duration::from_secs(1)).await.unwrap();
        assert_eq!(kept.to_bytes().as_ref(), b"kept");
        assert!(t.is_empty());
    }

    #[test]
    fn a_cutter_passes_on_whole_elements_of_pieces_fed_one_by_one() {
        let bytes: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        for align in [1usize, 2, 4, 8, 16] {
            let whole = bytes.len() / align * align;
            for piece in [1usize, 3, 7, 64, 999] {
                let mut cut = ElementCutter::new(align).unwrap();
                let mut out = Vec::new();
                for p in bytes[..whole].chunks(piece) {
                    cut.feed(p, |off, run| {
                        assert_eq!(off, out.len(), "offsets follow each other");
                        assert_eq!(run.len() % align, 0, "whole elements only");
                        out.extend_from_slice(run);
                        Ok::<(), ()>(())
                    })
                    .unwrap();
                }
                assert!(cut.is_whole());
                assert_eq!(out, &bytes[..whole], "align {align}, pieces of {piece}");
                if align > 1 {
                    cut.feed(&bytes[..1], |_, _| Ok::<(), ()>(())).unwrap();
                    assert!(!cut.is_whole(), "a partial element is held back");
                }
            }
        }
        assert!(ElementCutter::new(17).is_none());
    }

    /// An element that `f` failed on counts as passed on: a later `feed` does not pass it
    /// again (a reduction would add it twice), with the element split across chunks or not.
    #[test]
    fn a_cutter_never_passes_an_element_twice_after_an_error() {
        let ok = |_: usize, _: &[u8]| Ok::<(), ()>(());
        let fail = |_: usize, _: &[u8]| Err::<(), ()>(());
        for split in [true, false] {
            let mut cut = ElementCutter::new(4).unwrap();
            if split {
                cut.feed(&[1, 2], ok).unwrap();
                assert!(cut.feed(&[3, 4], fail).is_err());
            } else {
                assert!(cut.feed(&[1, 2, 3, 4], fail).is_err());
            }
            let mut seen = Vec::new();
            for piece in [&[][..], &[9, 9, 9, 9]] {
                cut.feed(piece, |off, run| {
                    seen.push((off, run.to_vec()));
                    Ok::<(), ()>(())
                })
                .unwrap();
            }
            assert_eq!(seen, [(4, vec![9, 9, 9, 9])], "split {split}");
            assert!(cut.is_whole());
        }
        // Bytes after the element `f` failed on are kept too: a whole element, then the
        // start of the next, which the next chunk completes.
        let mut cut = ElementCutter::new(4).unwrap();
        cut.feed(&[1, 2], ok).unwrap();
        assert!(cut.feed(&[3, 4, 5, 6, 7, 8, 9], fail).is_err());
        let mut seen = Vec::new();
        cut.feed(&[10, 11, 12], |off, run| {
            seen.push((off, run.to_vec()));
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(seen, [(8, vec![9, 10, 11, 12])]);
    }

    #[test]
    fn aligned_iteration_reassembles_split_elements() {
        let chunks = vec![
            Bytes::from_static(&[1, 2, 3]),
            Bytes::from_static(&[4, 5]),
            Bytes::from_static(&[6, 7, 8, 9, 10, 11, 12]),
        ];
        let p = Payload::from_chunks(chunks, None);
        let mut seen = Vec::new();
        p.for_each_aligned::<()>(4, |off, b| {
            assert_eq!(off % 4, 0);
            assert_eq!(b.len() % 4, 0);
            assert_eq!(off, seen.len());
            seen.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, (1..=12).collect::<Vec<u8>>());
        let odd = Payload::from_chunks(vec![Bytes::from_static(&[1, 2, 3])], None);
        assert!(odd.for_each_aligned::<()>(2, |_, _| Ok(())).is_err());
    }

    #[test]
    fn payload_parts_pass_on_without_copies() {
        let parts =
            Payload::from_parts(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cde")]);
        assert_eq!(parts.len(), 5);
        assert_eq!(&parts.to_bytes()[..], b"abcde");
        let chunks = parts.into_chunks();
        assert_eq!(chunks.len(), 2, "the chunks come back as they were");
        let one = Payload::from_bytes(Bytes::from_static(b"xyz"));
        assert_eq!(
            one.to_bytes().as_ptr(),
            one.chunks()[0].as_ptr(),
            "a payload of one chunk is that chunk, not a copy"
        );
        assert!(Payload::default().to_bytes().is_empty());
    }
}
