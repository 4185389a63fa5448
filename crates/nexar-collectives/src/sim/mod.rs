//! [`SimNet`]: a deterministic in-memory network that runs one schedule per rank.
//!
//! Every tick the simulator picks, with a seeded generator, one piece of ready work among
//! all ranks: a local action or send to perform, a message in the network to deliver, or a
//! receive whose message has arrived. Schedules therefore see arbitrary (but reproducible)
//! interleavings and message orders. The simulator also checks what a real driver cannot
//! afford to: that actions stay inside their buffers and on element boundaries, never
//! write the input buffer, never race with another in-flight action of the same rank, and
//! that every message is received exactly once with the expected length. A lost message
//! ends in [`SimError::Stalled`], a duplicated one in [`SimError::DuplicateMessage`] or
//! [`SimError::Undelivered`]: never a hang.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use nexar_device::{fill_identity, reduce_bytes, DataType, DeviceError, ReduceOp};

use crate::{Action, BufId, BufRange, OpId, Schedule};

/// What the simulator fills scratch with at the start, and writes where a schedule lets a
/// driver leave a reduced result unwritten ([`Schedule::only_forwarded`]): NaN in every
/// float type, -1 or the maximum in the integer ones, so results that read it come out
/// wrong.
const POISON: u8 = 0xff;

mod error;

pub use error::SimError;

/// One rank's buffers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankBuffers {
    /// [`BufId::Data`].
    pub data: Vec<u8>,
    /// [`BufId::Input`].
    pub input: Vec<u8>,
    /// [`BufId::Scratch`]; [`SimNet::run`] replaces it with `scratch_len` bytes of poison
    /// (its contents are unspecified, so a schedule must write it before reading it).
    pub scratch: Vec<u8>,
}

impl RankBuffers {
    /// Buffers with the given data and input and no scratch.
    pub fn new(data: Vec<u8>, input: Vec<u8>) -> Self {
        Self {
            data,
            input,
            scratch: Vec::new(),
        }
    }

    fn get(&self, buf: BufId) -> &[u8] {
        match buf {
            BufId::Data => &self.data,
            BufId::Input => &self.input,
            BufId::Scratch => &self.scratch,
        }
    }

    fn get_mut(&mut self, buf: BufId) -> &mut [u8] {
        match buf {
            BufId::Data => &mut self.data,
            BufId::Input => &mut self.input,
            BufId::Scratch => &mut self.scratch,
        }
    }
}

/// Counters from one simulated run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimStats {
    /// Units of work performed.
    pub ticks: usize,
    /// Messages sent (before fault injection).
    pub messages: usize,
    /// Payload bytes sent.
    pub bytes: usize,
    /// The longest message's payload, in bytes.
    pub largest_message: usize,
    /// Messages that passed a received payload or reduced result on
    /// ([`Schedule::forwards`]).
    pub forwarded: usize,
    /// Pieces of messages that passed a received payload on ([`Schedule::parts`]).
    pub forwarded_parts: usize,
    /// Bytes of the messages sent that a driver whose transport must own what it sends
    /// copies out of the buffers: all but what [`Schedule::forwards`] and
    /// [`Schedule::parts`] pass on.
    pub copied: usize,
    /// Reduced results left unwritten ([`Schedule::only_forwarded`]): poisoned in the
    /// buffer, and sent from the simulator's own copy.
    pub unwritten: usize,
    /// Per rank, the most actions in flight at once.
    pub max_in_flight: Vec<usize>,
    /// Per rank, the most sends and local actions (the ones a window bounds) in flight at
    /// once.
    pub max_windowed_in_flight: Vec<usize>,
}

/// The result of a successful run.
#[derive(Clone, Debug)]
pub struct SimOutput {
    /// Final buffers, by rank.
    pub ranks: Vec<RankBuffers>,
    /// Counters.
    pub stats: SimStats,
}

/// A deterministic simulated network with optional fault injection.
#[derive(Clone, Debug)]
pub struct SimNet {
    seed: u64,
    drop_nth: Option<usize>,
    duplicate_nth: Option<usize>,
}

/// SplitMix64: small, fast, good enough to shuffle work, and dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

type Key = (usize, u32);

#[derive(Debug)]
struct Message {
    src: usize,
    dst: usize,
    step: u32,
    bytes: Vec<u8>,
}

#[derive(Debug)]
enum Work {
    /// A send or local action of `rank`.
    Exec(usize, Action),
    /// A message in the network.
    Deliver(Message),
    /// A posted receive of `rank` whose message is in its mailbox.
    Recv(usize, Key),
}

struct RankState {
    sched: Box<dyn Schedule>,
    bufs: RankBuffers,
    in_flight: Vec<Action>,
    posted: HashMap<Key, Action>,
    mailbox: HashMap<Key, Vec<u8>>,
    received: HashSet<Key>,
    sent: HashSet<(usize, u32)>,
    /// Payloads of receives that sends pass on ([`Schedule::forwards`]), with the number
    /// of such sends still to come.
    kept: HashMap<OpId, (Vec<u8>, usize)>,
    /// Destinations of the actions issued so far that the schedule said are written once
    /// ([`Schedule::write_once`]): no later action may read or write them.
    written_once: Vec<BufRange>,
    /// The same for [`Schedule::write_once_past_forwards`]: only the sends that pass the
    /// receive (its id here) on whole may read them.
    written_once_past_forwards: Vec<(BufRange, OpId)>,
}

struct Run<'a> {
    net: &'a SimNet,
    dtype: DataType,
    op: ReduceOp,
    ranks: Vec<RankState>,
    pool: Vec<Work>,
    stats: SimStats,
    scratch_out: Vec<Action>,
}

/// Takes one use of the payload kept for receive `r` (dropped after its last), which the
/// bytes the buffer holds there must equal unless the buffer was `poisoned`: the kept
/// bytes, or what is wrong.
fn pass_on(
    kept: &mut HashMap<OpId, (Vec<u8>, usize)>,
    r: OpId,
    held: Option<&[u8]>,
    poisoned: bool,
) -> Result<Vec<u8>, String> {
    let Some((bytes, uses)) = kept.get_mut(&r) else {
        return Err(format!("{r:?}, which kept nothing"));
    };
    if !poisoned && held != Some(&bytes[..]) {
        return Err(format!(
            "the payload of {r:?}, which the buffer no longer holds"
        ));
    }
    *uses -= 1;
    let out = bytes.clone();
    if *uses == 0 {
        kept.remove(&r);
    }
    Ok(out)
}

impl SimNet {
    /// A network whose delivery order is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            drop_nth: None,
            duplicate_nth: None,
        }
    }

    /// Loses the `k`-th message sent (counting from 0, over all ranks, in send order).
    pub fn drop_nth_message(mut self, k: usize) -> Self {
        self.drop_nth = Some(k);
        self
    }

    /// Delivers the `k`-th message sent (counting from 0) twice.
    pub fn duplicate_nth_message(mut self, k: usize) -> Self {
        self.duplicate_nth = Some(k);
        self
    }

    /// Runs one schedule per rank (rank `i` is `schedules[i]`) over `buffers`, with `op`
    /// as the reduce op of `Recv { reduce: true }`, `Reduce` and `FillIdentity` on
    /// `dtype` elements ([`ReduceOp::Avg`] reduces as a sum, like the kernels do).
    /// Scratch is allocated filled with poison. Returns every rank's final buffers.
    pub fn run(
        &self,
        dtype: DataType,
        op: ReduceOp,
        schedules: Vec<Box<dyn Schedule>>,
        buffers: Vec<RankBuffers>,
    ) -> Result<SimOutput, SimError> {
        if schedules.len() != buffers.len() {
            return Err(SimError::WorldMismatch {
                schedules: schedules.len(),
                buffers: buffers.len(),
            });
        }
        let world = schedules.len();
        let ranks = schedules
            .into_iter()
            .zip(buffers)
            .map(|(sched, mut bufs)| {
                bufs.scratch = vec![POISON; sched.scratch_len()];
                RankState {
                    sched,
                    bufs,
                    in_flight: Vec::new(),
                    posted: HashMap::new(),
                    mailbox: HashMap::new(),
                    received: HashSet::new(),
                    sent: HashSet::new(),
                    kept: HashMap::new(),
                    written_once: Vec::new(),
                    written_once_past_forwards: Vec::new(),
                }
            })
            .collect();
        let mut run = Run {
            net: self,
            dtype,
            op,
            ranks,
            pool: Vec::new(),
            stats: SimStats {
                max_in_flight: vec![0; world],
                max_windowed_in_flight: vec![0; world],
                ..SimStats::default()
            },
            scratch_out: Vec::new(),
        };
        let mut rng = Rng(self.seed ^ 0x6E65_7861_7273_696D);
        for r in 0..world {
            run.poll(r)?;
        }
        while !run.pool.is_empty() {
            let w = run.pool.swap_remove(rng.below(run.pool.len()));
            run.stats.ticks += 1;
            run.step(w)?;
        }
        run.finish()
    }
}

impl Run<'_> {
    fn world(&self) -> usize {
        self.ranks.len()
    }

    fn poll(&mut self, rank: usize) -> Result<(), SimError> {
        let mut out = std::mem::take(&mut self.scratch_out);
        self.ranks[rank].sched.poll(&mut out);
        for a in out.drain(..) {
            self.issue(rank, a)?;
        }
        self.scratch_out = out;
        Ok(())
    }

    fn bad(rank: usize, action: &Action, reason: impl Into<String>) -> SimError {
        SimError::BadAction {
            rank,
            action: Box::new(action.clone()),
            reason: reason.into(),
        }
    }

    fn check_range(&self, rank: usize, action: &Action, r: &BufRange) -> Result<(), SimError> {
        let len = self.ranks[rank].bufs.get(r.buf).len();
        if r.range.start > r.range.end || r.range.end > len {
            return Err(Self::bad(
                rank,
                action,
                format!("{r} outside a buffer of {len} bytes"),
            ));
        }
        let esz = self.dtype.size();
        if r.range.start % esz != 0 || r.range.end % esz != 0 {
            return Err(Self::bad(rank, action, format!("{r} splits an element")));
        }
        Ok(())
    }

    fn validate(&self, rank: usize, a: &Action) -> Result<(), SimError> {
        if let Some(r) = a.reads() {
            self.check_range(rank, a, r)?;
        }
        if let Some(w) = a.writes() {
            self.check_range(rank, a, w)?;
            if w.buf == BufId::Input {
                return Err(Self::bad(rank, a, "writes the input buffer"));
            }
        }
        match a {
            Action::Send { peer, .. } | Action::Recv { peer, .. } => {
                if *peer >= self.world() || *peer == rank {
                    return Err(Self::bad(rank, a, "bad peer"));
                }
            }
            Action::Copy { src, dst, .. } | Action::Reduce { src, dst, .. } => {
                if src.len() != dst.len() {
                    return Err(Self::bad(rank, a, "source and destination lengths differ"));
                }
                if src.overlaps(dst) {
                    return Err(Self::bad(rank, a, "source and destination overlap"));
                }
            }
            Action::FillIdentity { .. } => {}
        }
        Ok(())
    }

    fn conflicts(a: &Action, b: &Action) -> bool {
        let (aw, bw) = (a.writes(), b.writes());
        let (ar, br) = (a.reads(), b.reads());
        let hit = |x: Option<&BufRange>, y: Option<&BufRange>| match (x, y) {
            (Some(x), Some(y)) => x.overlaps(y),
            _ => false,
        };
        hit(aw, bw) || hit(aw, br) || hit(ar, bw)
    }

    fn issue(&mut self, rank: usize, a: Action) -> Result<(), SimError> {
        self.validate(rank, &a)?;
        let st = &mut self.ranks[rank];
        let touched = [a.reads(), a.writes()].into_iter().flatten();
        if let Some(r) = touched
            .filter_map(|x| st.written_once.iter().find(|w| w.overlaps(x)))
            .next()
        {
            return Err(Self::bad(rank, &a, format!("touches {r:?}, written once")));
        }
        let forwards = match &a {
            Action::Send { .. } => st.sched.forwards(a.id()),
            _ => None,
        };
        let touched = [a.reads(), a.writes()].into_iter().flatten();
        if let Some((r, _)) = touched
            .filter_map(|x| {
                let mut once = st.written_once_past_forwards.iter();
                once.find(|(w, recv)| w.overlaps(x) && forwards != Some(*recv))
            })
            .next()
        {
            return Err(Self::bad(
                rank,
                &a,
                format!("touches {r:?}, written once but for the sends that pass it on"),
            ));
        }
        if st.sched.write_once_past_forwards(a.id()) {
            let sched = &st.sched;
            let copies_forwarded = matches!(a, Action::Recv { reduce: false, .. })
                && sched.forward_count(a.id()) > 0
                && sched.piece_count(a.id()) == 0;
            match a.writes() {
                Some(w) if copies_forwarded && w.buf == BufId::Data => {
                    st.written_once_past_forwards.push((w.clone(), a.id()));
                }
                _ => {
                    return Err(Self::bad(
                        rank,
                        &a,
                        "written once but for its forwards, but not a receive copied into \
                         Data that sends pass on whole",
                    ))
                }
            }
        }
        if st.sched.write_once(a.id()) {
            // A copy, or a receive that copies or reduces onto a base (neither reads its
            // destination) and that no send passes on.
            let writes_only = match &a {
                Action::Copy { .. } => true,
                Action::Recv { reduce, base, .. } => {
                    (!reduce || base.is_some()) && st.sched.forward_count(a.id()) == 0
                }
                _ => false,
            };
            match a.writes() {
                Some(w) if writes_only && w.buf == BufId::Data => st.written_once.push(w.clone()),
                _ => {
                    return Err(Self::bad(
                        rank,
                        &a,
                        "written once but not a copy or a reduction onto a base into Data",
                    ))
                }
            }
        }
        if let Some(other) = st.in_flight.iter().find(|b| Self::conflicts(&a, b)) {
            return Err(SimError::Race {
                rank,
                first: Box::new(other.clone()),
                second: Box::new(a),
            });
        }
        st.in_flight.push(a.clone());
        let windowed = st.in_flight.iter().filter(|x| !x.is_recv()).count();
        let total = st.in_flight.len();
        self.stats.max_in_flight[rank] = self.stats.max_in_flight[rank].max(total);
        self.stats.max_windowed_in_flight[rank] =
            self.stats.max_windowed_in_flight[rank].max(windowed);
        match a {
            Action::Recv { peer, step, .. } => {
                let key = (peer, step);
                if st.posted.contains_key(&key) {
                    return Err(SimError::DuplicateRecv {
                        src: peer,
                        dst: rank,
                        step,
                    });
                }
                if st.mailbox.contains_key(&key) {
                    self.pool.push(Work::Recv(rank, key));
                }
                st.posted.insert(key, a);
            }
            other => self.pool.push(Work::Exec(rank, other)),
        }
        Ok(())
    }

    fn complete(&mut self, rank: usize, id: OpId) -> Result<(), SimError> {
        let st = &mut self.ranks[rank];
        st.in_flight.retain(|a| a.id() != id);
        st.sched
            .complete(id)
            .map_err(|source| SimError::Schedule { rank, source })?;
        self.poll(rank)
    }

    fn device(rank: usize) -> impl Fn(DeviceError) -> SimError {
        move |source| SimError::Device { rank, source }
    }

    fn step(&mut self, w: Work) -> Result<(), SimError> {
        match w {
            Work::Exec(rank, a) => self.exec(rank, a),
            Work::Deliver(m) => {
                let st = &mut self.ranks[m.dst];
                let key = (m.src, m.step);
                if !st.received.insert(key) {
                    return Err(SimError::DuplicateMessage {
                        src: m.src,
                        dst: m.dst,
                        step: m.step,
                    });
                }
                if st.posted.contains_key(&key) {
                    self.pool.push(Work::Recv(m.dst, key));
                }
                st.mailbox.insert(key, m.bytes);
                Ok(())
            }
            Work::Recv(rank, key) => {
                let st = &mut self.ranks[rank];
                let (Some(a), Some(bytes)) = (st.posted.remove(&key), st.mailbox.remove(&key))
                else {
                    return Err(SimError::Stalled {
                        detail: format!("rank {rank}: internal receive bookkeeping for {key:?}"),
                    });
                };
                let Action::Recv {
                    id,
                    dst,
                    reduce,
                    base,
                    ..
                } = a
                else {
                    return Err(Self::bad(rank, &a, "posted action is not a receive"));
                };
                if bytes.len() != dst.len() {
                    return Err(SimError::LengthMismatch {
                        rank,
                        peer: key.0,
                        step: key.1,
                        expected: dst.len(),
                        got: bytes.len(),
                    });
                }
                let result = if reduce {
                    let from = base.as_ref().unwrap_or(&dst);
                    let mut out = st.bufs.get(from.buf)[from.range.clone()].to_vec();
                    reduce_bytes(self.dtype, self.op, &mut out, &bytes)
                        .map_err(Self::device(rank))?;
                    out
                } else {
                    bytes
                };
                let out = &mut st.bufs.get_mut(dst.buf)[dst.range];
                if reduce && st.sched.only_forwarded(id) {
                    // A driver may leave the destination unwritten and hand the result
                    // to the forwarding sends alone: poison it, so that a schedule that
                    // reads it anyway computes garbage.
                    out.fill(POISON);
                    self.stats.unwritten += 1;
                } else {
                    out.copy_from_slice(&result);
                }
                // Sends that pass this result on (a driver sends these very bytes)
                // check that the buffer still holds them, unless it was poisoned.
                let uses = st.sched.forward_count(id);
                if uses > 0 {
                    st.kept.insert(id, (result, uses));
                }
                self.complete(rank, id)
            }
        }
    }

    fn exec(&mut self, rank: usize, a: Action) -> Result<(), SimError> {
        let (dtype, op) = (self.dtype, self.op);
        let st = &mut self.ranks[rank];
        match &a {
            Action::Send {
                peer, step, src, ..
            } => {
                if !st.sent.insert((*peer, *step)) {
                    return Err(SimError::DuplicateSend {
                        src: rank,
                        dst: *peer,
                        step: *step,
                    });
                }
                let mut bytes = st.bufs.get(src.buf)[src.range.clone()].to_vec();
                if let Some(r) = st.sched.forwards(a.id()) {
                    let poisoned = st.sched.only_forwarded(r);
                    // The kept bytes equal the buffer's (checked) unless the buffer was
                    // poisoned: send them.
                    bytes = pass_on(&mut st.kept, r, Some(&bytes), poisoned)
                        .map_err(|e| Self::bad(rank, &a, format!("forwards {e}")))?;
                    self.stats.forwarded += 1;
                } else if let Some(parts) = st.sched.parts(a.id()) {
                    let mut pos = src.range.start;
                    for part in parts {
                        if part.range.buf != src.buf || part.range.range.start != pos {
                            return Err(Self::bad(
                                rank,
                                &a,
                                format!("piece {part:?} out of place"),
                            ));
                        }
                        pos = part.range.range.end;
                        let Some(r) = part.forwards else {
                            self.stats.copied += part.range.len();
                            continue;
                        };
                        let at = part.range.range.start - src.range.start;
                        let held = bytes.get(at..at + part.range.len());
                        pass_on(&mut st.kept, r, held, false)
                            .map_err(|e| Self::bad(rank, &a, format!("a piece forwards {e}")))?;
                        self.stats.forwarded_parts += 1;
                    }
                    if pos != src.range.end {
                        return Err(Self::bad(rank, &a, "pieces that do not cover the send"));
                    }
                } else {
                    self.stats.copied += bytes.len();
                }
                let k = self.stats.messages;
                self.stats.messages += 1;
                self.stats.bytes += bytes.len();
                self.stats.largest_message = self.stats.largest_message.max(bytes.len());
                let msg = || Message {
                    src: rank,
                    dst: *peer,
                    step: *step,
                    bytes: bytes.clone(),
                };
                if self.net.drop_nth != Some(k) {
                    self.pool.push(Work::Deliver(msg()));
                }
                if self.net.duplicate_nth == Some(k) {
                    self.pool.push(Work::Deliver(msg()));
                }
            }
            Action::Copy { src, dst, .. } => {
                let tmp = st.bufs.get(src.buf)[src.range.clone()].to_vec();
                st.bufs.get_mut(dst.buf)[dst.range.clone()].copy_from_slice(&tmp);
            }
            Action::Reduce { src, dst, .. } => {
                let tmp = st.bufs.get(src.buf)[src.range.clone()].to_vec();
                let out = &mut st.bufs.get_mut(dst.buf)[dst.range.clone()];
                reduce_bytes(dtype, op, out, &tmp).map_err(Self::device(rank))?;
            }
            Action::FillIdentity { dst, .. } => {
                let out = &mut st.bufs.get_mut(dst.buf)[dst.range.clone()];
                fill_identity(dtype, op, out).map_err(Self::device(rank))?;
            }
            Action::Recv { .. } => {
                return Err(Self::bad(rank, &a, "receive scheduled as local work"))
            }
        }
        self.complete(rank, a.id())
    }

    fn finish(self) -> Result<SimOutput, SimError> {
        let mut detail = String::new();
        for (r, st) in self.ranks.iter().enumerate() {
            if !st.sched.is_done() {
                let _ = write!(detail, "rank {r} ({}) waits on", st.sched.name());
                for a in &st.in_flight {
                    if let Action::Recv { peer, step, .. } = a {
                        let _ = write!(detail, " recv(from {peer}, step {step})");
                    }
                }
                detail.push_str("; ");
            }
        }
        if !detail.is_empty() {
            return Err(SimError::Stalled { detail });
        }
        let mut count = 0;
        for (r, st) in self.ranks.iter().enumerate() {
            for (src, step) in st.mailbox.keys() {
                count += 1;
                let _ = write!(detail, "{src}->{r} step {step}; ");
            }
        }
        if count > 0 {
            return Err(SimError::Undelivered { count, detail });
        }
        for (rank, st) in self.ranks.iter().enumerate() {
            if let Some((&recv, (_, uses))) = st.kept.iter().min_by_key(|(r, _)| **r) {
                return Err(SimError::Unspent {
                    rank,
                    recv,
                    uses: *uses,
                });
            }
        }
        Ok(SimOutput {
            ranks: self.ranks.into_iter().map(|s| s.bufs).collect(),
            stats: self.stats,
        })
    }
}
