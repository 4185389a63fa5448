//! The vocabulary shared by every algorithm and every driver: buffers, byte ranges,
//! actions and the [`Schedule`] trait.

use std::fmt;
use std::ops::Range;

use crate::ScheduleError;

/// Which buffer a range refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufId {
    /// The in-place buffer (all_reduce, broadcast, reduce, scan) or the receive buffer
    /// (all_gather, reduce_scatter, gather, scatter, all_to_all).
    Data,
    /// The caller's separate, read-only send buffer (all_gather, reduce_scatter, gather,
    /// scatter, all_to_all); never written.
    Input,
    /// Scratch space of [`Schedule::scratch_len`] bytes that the driver allocates, with
    /// contents unspecified: schedules write every scratch byte before they read it.
    Scratch,
}

/// A byte range of one buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BufRange {
    /// The buffer.
    pub buf: BufId,
    /// Byte offsets within the buffer; always a whole number of elements.
    pub range: Range<usize>,
}

impl BufRange {
    /// A range of `buf`.
    pub const fn new(buf: BufId, range: Range<usize>) -> Self {
        Self { buf, range }
    }

    /// A range of [`BufId::Data`].
    pub const fn data(range: Range<usize>) -> Self {
        Self::new(BufId::Data, range)
    }

    /// A range of [`BufId::Input`].
    pub const fn input(range: Range<usize>) -> Self {
        Self::new(BufId::Input, range)
    }

    /// A range of [`BufId::Scratch`].
    pub const fn scratch(range: Range<usize>) -> Self {
        Self::new(BufId::Scratch, range)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// True when the range holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// True when both ranges are non-empty, lie in the same buffer and share a byte.
    pub fn overlaps(&self, other: &BufRange) -> bool {
        self.buf == other.buf
            && !self.is_empty()
            && !other.is_empty()
            && self.range.start < other.range.end
            && other.range.start < self.range.end
    }
}

impl fmt::Display for BufRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}[{}..{}]",
            self.buf, self.range.start, self.range.end
        )
    }
}

/// One piece of a send's message ([`Schedule::parts`]): a range of the send's `src`, and
/// the receive whose payload that range holds unchanged, if one does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendPart {
    /// The bytes of this piece.
    pub range: BufRange,
    /// `Some(r)`: receive `r` (one that copies its payload) wrote exactly `range`, and
    /// nothing has written any of it since. `None`: bytes a driver that must own what it
    /// sends copies out.
    pub forwards: Option<OpId>,
}

/// Identifies one action within a schedule; completion events name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

/// One step a driver performs on behalf of a [`Schedule`].
///
/// All peers are communicator-local ranks. Messages between one (sender, receiver) pair
/// within one collective carry distinct `step` values (always below 2^31), so a
/// transport can key frames by (collective, step, sender) and buffer early arrivals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send the bytes of `src` to `peer` as message `step`. The driver may complete it as
    /// soon as the bytes are handed to the transport (copied), so the range may be
    /// overwritten after completion.
    Send {
        /// The action's id.
        id: OpId,
        /// Receiving rank.
        peer: usize,
        /// Message number within this collective for this (sender, receiver) pair.
        step: u32,
        /// The bytes to send.
        src: BufRange,
    },
    /// Receive message `step` from `peer` (its length must equal `dst.range.len()`, else it
    /// is an error) and either copy it into `dst` (`reduce == false`) or reduce it into
    /// `dst`: `dst = op(dst, received)` (`reduce == true`), or, with a `base`,
    /// `dst = op(base, received)`.
    Recv {
        /// The action's id.
        id: OpId,
        /// Sending rank.
        peer: usize,
        /// Message number, as given by the sender's [`Action::Send`].
        step: u32,
        /// Where the bytes go.
        dst: BufRange,
        /// Reduce into `dst` instead of overwriting it.
        reduce: bool,
        /// With `reduce`: the other operand, read in place of `dst`'s old bytes (which
        /// are then only written); same length as `dst`, never overlapping it. Saves the
        /// copy of `base` into `dst` that would come first otherwise (ring
        /// reduce-scatter). Always `None` without `reduce`.
        base: Option<BufRange>,
    },
    /// Local copy of `src` into `dst` (same length; never overlapping).
    Copy {
        /// The action's id.
        id: OpId,
        /// Source bytes.
        src: BufRange,
        /// Destination bytes.
        dst: BufRange,
    },
    /// Local reduction: `dst = op(dst, src)` (same length; never overlapping).
    Reduce {
        /// The action's id.
        id: OpId,
        /// Source bytes.
        src: BufRange,
        /// Destination bytes, read and written.
        dst: BufRange,
    },
    /// Fill `dst` with the identity element of the collective's reduce op
    /// ([`nexar_device::fill_identity`]); used by exclusive scan on rank 0.
    FillIdentity {
        /// The action's id.
        id: OpId,
        /// Destination bytes.
        dst: BufRange,
    },
}

impl Action {
    /// The action's id.
    pub fn id(&self) -> OpId {
        match self {
            Action::Send { id, .. }
            | Action::Recv { id, .. }
            | Action::Copy { id, .. }
            | Action::Reduce { id, .. }
            | Action::FillIdentity { id, .. } => *id,
        }
    }

    /// The range the action reads without writing, if any.
    pub fn reads(&self) -> Option<&BufRange> {
        match self {
            Action::Send { src, .. } | Action::Copy { src, .. } | Action::Reduce { src, .. } => {
                Some(src)
            }
            Action::Recv { base, .. } => base.as_ref(),
            Action::FillIdentity { .. } => None,
        }
    }

    /// True when the action replaces every byte of its [`writes`](Action::writes) range
    /// without reading the old ones (a copy, a receive that is not reduced into `dst`, a
    /// fill).
    pub fn overwrites(&self) -> bool {
        match self {
            Action::Copy { .. } | Action::FillIdentity { .. } => true,
            Action::Recv { reduce, base, .. } => !reduce || base.is_some(),
            Action::Send { .. } | Action::Reduce { .. } => false,
        }
    }

    /// The range the action writes (and, for reductions, also reads), if any.
    pub fn writes(&self) -> Option<&BufRange> {
        match self {
            Action::Recv { dst, .. }
            | Action::Copy { dst, .. }
            | Action::Reduce { dst, .. }
            | Action::FillIdentity { dst, .. } => Some(dst),
            Action::Send { .. } => None,
        }
    }

    /// True for actions that wait on a peer ([`Action::Recv`]). These are never held back
    /// by a schedule's window, since a receive can only finish when a peer sends.
    pub fn is_recv(&self) -> bool {
        matches!(self, Action::Recv { .. })
    }
}

/// A collective algorithm as a state machine, driven by a transport.
///
/// The driver allocates [`scratch_len`](Schedule::scratch_len) bytes of scratch (contents
/// unspecified), calls
/// [`poll`](Schedule::poll) once, performs the actions it gets, reports each finished one
/// through [`complete`](Schedule::complete) and polls again, until
/// [`is_done`](Schedule::is_done). A schedule with nothing to exchange (one rank; zero
/// bytes for the ring forms and for the Bruck all-to-all) may still have local actions (a
/// copy of the own block, an identity fill): poll it like any other, it may or may not be
/// done before the first poll; the other forms still exchange their empty messages with
/// zero bytes, so every rank of a call takes part.
pub trait Schedule: Send + fmt::Debug {
    /// Append every action that is now ready and not yet issued (respecting the window).
    /// Called once at the start and after every `complete`.
    fn poll(&mut self, out: &mut Vec<Action>);

    /// Report that an issued action finished. Unknown, not yet issued or duplicate ids
    /// are errors.
    fn complete(&mut self, id: OpId) -> Result<(), ScheduleError>;

    /// True when every action has completed.
    fn is_done(&self) -> bool;

    /// Bytes of scratch the driver must allocate before the first poll. Their contents are
    /// unspecified: a schedule writes every scratch byte before it reads it.
    fn scratch_len(&self) -> usize;

    /// Short algorithm name for logs and benches (`"ring"`, `"rhd"`, `"binomial"`, ...).
    fn name(&self) -> &'static str;

    /// The receive whose result the send `send` may pass on as it is: `Some(r)` when
    /// every byte the send reads was last written by receive `r`, whose destination is
    /// exactly that range. For a receive that copies, the bytes are its payload's; for
    /// one that reduces, they are the reduced result. A driver whose transport must own
    /// the bytes it sends can then hand it the received (or reduced) buffers instead of
    /// copying the range out again (ring all-gather, chain broadcast, ring
    /// reduce-scatter). `None` (the default) promises nothing.
    fn forwards(&self, send: OpId) -> Option<OpId> {
        let _ = send;
        None
    }

    /// The pieces of send `send`'s message, in order, when some of its range holds
    /// received payloads unchanged but not all of it one receive's (which
    /// [`forwards`](Schedule::forwards) covers): the pieces cover `src` exactly, at
    /// least one [`forwards`](SendPart::forwards) a receive, and no two pieces that copy
    /// are adjacent. A driver whose transport must own the bytes it sends can then send
    /// those payloads as they came and copy out only the rest (recursive-doubling
    /// all-gather: each round's message is the own block and earlier rounds' receives).
    /// `None` (the default) promises nothing.
    fn parts(&self, send: OpId) -> Option<&[SendPart]> {
        let _ = send;
        None
    }

    /// How many sends pass the result of receive `recv` on, whole
    /// ([`forwards`](Schedule::forwards)) or as one of their [`parts`](Schedule::parts):
    /// a driver keeping results for them can let go after that many. 0 by default.
    fn forward_count(&self, recv: OpId) -> usize {
        let _ = recv;
        0
    }

    /// How many of the [`forward_count`](Schedule::forward_count) sends of receive
    /// `recv`'s payload pass it on as one of their [`parts`](Schedule::parts): a driver
    /// that sends those ranges without copying them (lent, or written from the buffer)
    /// need not keep the payload for them. 0 by default.
    fn piece_count(&self, recv: OpId) -> usize {
        let _ = recv;
        0
    }

    /// True when nothing but the sends that [`forward`](Schedule::forwards) it ever reads
    /// what reducing receive `recv` writes: the bytes are overwritten whole afterwards,
    /// or lie in scratch. A driver that hands those sends the reduced result in a buffer
    /// of its own may then leave `dst` unwritten, which saves a store of the result and
    /// a copy of it for each send. `false` (the default) promises nothing.
    fn only_forwarded(&self, recv: OpId) -> bool {
        let _ = recv;
        false
    }

    /// True when action `op` is a copy, or a receive that copies its payload or reduces it
    /// with a `base` (which writes `dst` without reading it) and that no send passes on,
    /// into [`BufId::Data`] that nothing later in the schedule reads or writes again: its
    /// bytes are the call's result and are next read by the caller, after the call. A
    /// driver may then write them with streaming stores that bypass the cache (a large
    /// copy through the cache would evict the data the transfers in flight are about to
    /// touch). `false` (the default) promises nothing.
    fn write_once(&self, op: OpId) -> bool {
        let _ = op;
        false
    }

    /// True when receive `op` copies its payload into [`BufId::Data`] that nothing later
    /// in the schedule reads or writes but the sends that pass it on whole
    /// ([`forwards`](Schedule::forwards); none passes it on as one of its
    /// [`parts`](Schedule::parts)). A driver that hands those sends the received payload
    /// itself, not the range, may write the range with streaming stores, as for
    /// [`write_once`](Schedule::write_once) (chain broadcast: each rank passes every
    /// chunk it receives on to the next; not under an `Avg` whose final division reads
    /// the result). `false` (the default) promises nothing.
    fn write_once_past_forwards(&self, op: OpId) -> bool {
        let _ = op;
        false
    }
}
