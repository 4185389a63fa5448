//! [`DagSchedule`]: a static list of actions with dependencies, issued as they become
//! ready; and the builder every algorithm uses to make one.
//!
//! The builder derives the data dependencies itself: it tracks, per buffer and per byte,
//! the last action that wrote it and the actions that read it since, so an action that
//! reads a range waits for the last writer of every byte in it, and an action that writes
//! a range waits for the last writer and for every reader since. Algorithms therefore only
//! list actions in program order; pipelining falls out of chunk-sized ranges.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;

use crate::layout::Chunking;
use crate::{Action, BufId, BufRange, OpId, Schedule, ScheduleError, SendPart};

/// Lifecycle of one action inside a [`DagSchedule`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpState {
    Waiting,
    Ready,
    Issued,
    Done,
}

/// A [`Schedule`] made of a fixed list of actions and the dependencies between them.
///
/// Action `i` has id `OpId(i)` and may start once all of its dependencies completed.
/// [`poll`](Schedule::poll) emits ready actions in increasing id order. At most `window`
/// sends and local actions are in flight at once (0 means unlimited); receives are never
/// held back by the window, since a receive finishes only when a peer sends and counting
/// it could deadlock two ranks waiting on each other.
pub struct DagSchedule {
    name: &'static str,
    actions: Vec<Action>,
    /// Number of dependencies of each action that have not completed yet.
    pending_deps: Vec<u32>,
    /// CSR adjacency: the dependents of action `i` are
    /// `dependents[dependents_start[i]..dependents_start[i + 1]]`.
    dependents_start: Vec<u32>,
    dependents: Vec<u32>,
    state: Vec<OpState>,
    ready_recv: BinaryHeap<Reverse<u32>>,
    ready_other: BinaryHeap<Reverse<u32>>,
    windowed_in_flight: usize,
    window: usize,
    completed: usize,
    scratch_len: usize,
    /// Per action: for a send, the receive whose payload it passes on unchanged.
    forwards: Vec<Option<OpId>>,
    /// Per action: for a send, its pieces when some pass received payloads on.
    parts: Vec<Option<Box<[SendPart]>>>,
    /// Per action: for a receive, how many sends pass its payload on.
    forward_count: Vec<u32>,
    /// Per action: for a receive, how many of those pass it on as a piece.
    piece_count: Vec<u32>,
    /// Per action: a reducing receive whose result only its forwarding sends read.
    only_forwarded: Vec<bool>,
    /// Per action: a copy into `Data` that nothing later reads or writes.
    write_once: Vec<bool>,
    /// Per action: a receive copied into `Data` that only sends passing it on whole read.
    write_once_past_forwards: Vec<bool>,
}

impl DagSchedule {
    /// All actions of the schedule, in id order, whether issued or not.
    pub fn actions(&self) -> &[Action] {
        &self.actions
    }

    /// The window: the most sends and local actions in flight at once (0 = unlimited).
    pub fn window(&self) -> usize {
        self.window
    }

    /// Number of actions issued and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.state.iter().filter(|s| **s == OpState::Issued).count()
    }

    fn make_ready(&mut self, i: u32) {
        self.state[i as usize] = OpState::Ready;
        if self.actions[i as usize].is_recv() {
            self.ready_recv.push(Reverse(i));
        } else {
            self.ready_other.push(Reverse(i));
        }
    }
}

impl Schedule for DagSchedule {
    fn poll(&mut self, out: &mut Vec<Action>) {
        let first = out.len();
        while let Some(Reverse(i)) = self.ready_recv.pop() {
            self.state[i as usize] = OpState::Issued;
            out.push(self.actions[i as usize].clone());
        }
        while self.window == 0 || self.windowed_in_flight < self.window {
            let Some(Reverse(i)) = self.ready_other.pop() else {
                break;
            };
            self.state[i as usize] = OpState::Issued;
            self.windowed_in_flight += 1;
            out.push(self.actions[i as usize].clone());
        }
        out[first..].sort_by_key(Action::id);
    }

    fn complete(&mut self, id: OpId) -> Result<(), ScheduleError> {
        let i = id.0 as usize;
        match self.state.get(i) {
            None => return Err(ScheduleError::UnknownOp(id)),
            Some(OpState::Waiting | OpState::Ready) => return Err(ScheduleError::NotIssued(id)),
            Some(OpState::Done) => return Err(ScheduleError::DuplicateCompletion(id)),
            Some(OpState::Issued) => {}
        }
        self.state[i] = OpState::Done;
        self.completed += 1;
        if !self.actions[i].is_recv() {
            self.windowed_in_flight -= 1;
        }
        let (lo, hi) = (
            self.dependents_start[i] as usize,
            self.dependents_start[i + 1] as usize,
        );
        for k in lo..hi {
            let d = self.dependents[k];
            let p = &mut self.pending_deps[d as usize];
            *p -= 1;
            if *p == 0 {
                self.make_ready(d);
            }
        }
        Ok(())
    }

    fn is_done(&self) -> bool {
        self.completed == self.actions.len()
    }

    fn scratch_len(&self) -> usize {
        self.scratch_len
    }

    fn name(&self) -> &'static str {
        self.name
    }

    fn forwards(&self, send: OpId) -> Option<OpId> {
        self.forwards.get(send.0 as usize).copied().flatten()
    }

    fn parts(&self, send: OpId) -> Option<&[SendPart]> {
        self.parts.get(send.0 as usize)?.as_deref()
    }

    fn forward_count(&self, recv: OpId) -> usize {
        self.forward_count
            .get(recv.0 as usize)
            .map_or(0, |&n| n as usize)
    }

    fn piece_count(&self, recv: OpId) -> usize {
        self.piece_count
            .get(recv.0 as usize)
            .map_or(0, |&n| n as usize)
    }

    fn only_forwarded(&self, recv: OpId) -> bool {
        self.only_forwarded
            .get(recv.0 as usize)
            .copied()
            .unwrap_or(false)
    }

    fn write_once(&self, op: OpId) -> bool {
        self.write_once.get(op.0 as usize).copied().unwrap_or(false)
    }

    fn write_once_past_forwards(&self, op: OpId) -> bool {
        self.write_once_past_forwards
            .get(op.0 as usize)
            .copied()
            .unwrap_or(false)
    }
}

impl fmt::Debug for DagSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DagSchedule")
            .field("name", &self.name)
            .field("actions", &self.actions.len())
            .field("completed", &self.completed)
            .field("window", &self.window)
            .field("scratch_len", &self.scratch_len)
            .finish()
    }
}

/// Who touched a run of bytes last: the writer, and the readers since that write.
#[derive(Clone, Debug, Default)]
struct Segment {
    end: usize,
    writer: Option<u32>,
    readers: Vec<u32>,
}

/// Access history of one buffer, as non-overlapping segments keyed by start offset.
#[derive(Debug, Default)]
struct Tracker {
    segs: BTreeMap<usize, Segment>,
}

impl Tracker {
    /// Where the segments that overlap a range starting at `start` begin: the segment
    /// holding `start` may begin before it.
    fn first_overlapping(&self, start: usize) -> usize {
        self.segs
            .range(..=start)
            .next_back()
            .filter(|(_, seg)| seg.end > start)
            .map_or(start, |(&s, _)| s)
    }

    /// The actions that last wrote some byte of `range`.
    fn writers_in(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        if range.is_empty() {
            return Vec::new();
        }
        let from = self.first_overlapping(range.start);
        let mut who: Vec<u32> = self
            .segs
            .range(from..range.end)
            .filter_map(|(_, seg)| seg.writer)
            .collect();
        who.sort_unstable();
        who.dedup();
        who
    }

    /// `range` as runs of bytes with one last writer each (`None`: never written), in
    /// order; neighbouring runs have different writers.
    fn runs(&self, range: std::ops::Range<usize>) -> Vec<(std::ops::Range<usize>, Option<u32>)> {
        let mut runs: Vec<(std::ops::Range<usize>, Option<u32>)> = Vec::new();
        let mut push = |r: std::ops::Range<usize>, w: Option<u32>| match runs.last_mut() {
            Some((last, lw)) if *lw == w && last.end == r.start => last.end = r.end,
            _ => runs.push((r, w)),
        };
        let mut pos = range.start;
        if range.is_empty() {
            return runs;
        }
        let from = self.first_overlapping(range.start);
        for (&s, seg) in self.segs.range(from..range.end) {
            if s > pos {
                push(pos..s, None);
            }
            let end = seg.end.min(range.end);
            push(s.max(pos)..end, seg.writer);
            pos = end;
        }
        if pos < range.end {
            push(pos..range.end, None);
        }
        runs
    }

    /// True when every byte of `range` has been written (an empty range is).
    fn fully_written(&self, range: std::ops::Range<usize>) -> bool {
        self.runs(range).iter().all(|(_, writer)| writer.is_some())
    }

    /// Splits the segment containing `at` (if any) so that a segment starts at `at`.
    fn split_at(&mut self, at: usize) {
        let Some((_, seg)) = self.segs.range_mut(..at).next_back() else {
            return;
        };
        if seg.end <= at {
            return;
        }
        // The tail keeps the original end and the same history.
        let tail = seg.clone();
        seg.end = at;
        self.segs.insert(at, tail);
    }

    /// Records that action `me` accesses `range` (`write`: writes it, perhaps also
    /// reading it) and appends the actions it must wait for to `deps`.
    fn access(&mut self, range: std::ops::Range<usize>, write: bool, me: u32, deps: &mut Vec<u32>) {
        if range.is_empty() {
            return;
        }
        self.split_at(range.start);
        self.split_at(range.end);
        // Fill the gaps inside `range` with fresh segments so every byte is covered.
        let mut gaps = Vec::new();
        let mut pos = range.start;
        for (&s, seg) in self.segs.range(range.start..range.end) {
            if s > pos {
                gaps.push((pos, s));
            }
            pos = seg.end;
        }
        if pos < range.end {
            gaps.push((pos, range.end));
        }
        for (s, e) in gaps {
            self.segs.insert(
                s,
                Segment {
                    end: e,
                    ..Segment::default()
                },
            );
        }
        for (_, seg) in self.segs.range_mut(range.start..range.end) {
            deps.extend(seg.writer);
            if write {
                deps.append(&mut seg.readers);
                seg.writer = Some(me);
            } else {
                seg.readers.push(me);
            }
        }
    }
}

/// What became of the result a reducing receive wrote (see
/// [`Schedule::only_forwarded`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Fate {
    /// Nothing but its forwarding sends has read it, and it has not been overwritten.
    #[default]
    Unread,
    /// Something else reads some of it (or overwrites only part of it, which the
    /// builder does not follow further).
    Read,
    /// Overwritten whole, with nothing but its forwarding sends reading it before.
    Overwritten,
}

/// Builds a [`DagSchedule`], deriving data dependencies from the ranges actions touch.
#[derive(Debug, Default)]
pub(crate) struct DagBuilder {
    in_place: Option<InPlace>,
    actions: Vec<Action>,
    deps: Vec<Vec<u32>>,
    trackers: [Tracker; 3],
    scratch_len: usize,
    forwards: Vec<Option<OpId>>,
    parts: Vec<Option<Box<[SendPart]>>>,
    forward_count: Vec<u32>,
    piece_count: Vec<u32>,
    fates: Vec<Fate>,
}

/// The most pieces a send is cut into to pass received payloads on ([`Schedule::parts`]);
/// a send of more is copied whole.
const MAX_SEND_PARTS: usize = 64;

/// Where a collective's `Input` and `Data` lie when it runs in place on one buffer, which
/// the schedule then addresses as `Data`: each at its byte offset in that buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct InPlace {
    pub(crate) input_at: usize,
    pub(crate) data_at: usize,
}

impl InPlace {
    /// `r` moved into the one buffer (scratch stays where it is).
    fn place(&self, r: BufRange) -> BufRange {
        let at = match r.buf {
            BufId::Input => self.input_at,
            BufId::Data => self.data_at,
            BufId::Scratch => return r,
        };
        BufRange::data(r.range.start + at..r.range.end + at)
    }
}

impl DagBuilder {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A builder that places every `Input` and `Data` range it is given by `in_place`
    /// (when set). The dependencies it derives then cover the aliasing, copies of a range
    /// onto itself are left out, and a reduction onto a base that landed on its own
    /// destination becomes a reduction into it.
    pub(crate) fn placed(in_place: Option<InPlace>) -> Self {
        Self {
            in_place,
            ..Self::default()
        }
    }

    fn place(&self, r: BufRange) -> BufRange {
        match &self.in_place {
            Some(p) => p.place(r),
            None => r,
        }
    }

    /// Declares (at least) `len` bytes of scratch.
    pub(crate) fn scratch(&mut self, len: usize) {
        self.scratch_len = self.scratch_len.max(len);
    }

    fn tracker(&mut self, buf: BufId) -> &mut Tracker {
        &mut self.trackers[match buf {
            BufId::Data => 0,
            BufId::Input => 1,
            BufId::Scratch => 2,
        }]
    }

    fn push(&mut self, make: impl FnOnce(OpId) -> Action, extra: &[OpId]) -> OpId {
        let me = u32::try_from(self.actions.len()).unwrap_or(u32::MAX);
        let id = OpId(me);
        let action = make(id);
        let (forwards, parts) = match &action {
            Action::Send { src, .. } => self.passed_on(src),
            _ => (None, None),
        };
        if let Some(r) = forwards {
            self.forward_count[r.0 as usize] += 1;
        }
        for r in parts.iter().flatten().filter_map(|p| p.forwards) {
            self.forward_count[r.0 as usize] += 1;
            self.piece_count[r.0 as usize] += 1;
        }
        self.forwards.push(forwards);
        self.parts.push(parts.map(Vec::into_boxed_slice));
        self.forward_count.push(0);
        self.piece_count.push(0);
        self.fates.push(Fate::Unread);
        self.follow_results(&action, forwards);
        // Scratch starts with unspecified contents (see `BufId::Scratch`).
        debug_assert!(
            self.reads_written_scratch(&action),
            "{action:?} reads scratch that nothing wrote"
        );
        let mut deps: Vec<u32> = extra.iter().map(|o| o.0).collect();
        if let Some(r) = action.reads() {
            let r = r.clone();
            if r.buf == BufId::Scratch {
                self.scratch(r.range.end);
            }
            self.tracker(r.buf).access(r.range, false, me, &mut deps);
        }
        if let Some(w) = action.writes() {
            let w = w.clone();
            debug_assert!(
                w.buf != BufId::Input,
                "schedules never write the input buffer"
            );
            if w.buf == BufId::Scratch {
                self.scratch(w.range.end);
            }
            self.tracker(w.buf).access(w.range, true, me, &mut deps);
        }
        deps.sort_unstable();
        deps.dedup();
        deps.retain(|&d| d != me);
        self.actions.push(action);
        self.deps.push(deps);
        id
    }

    /// What a send of `src` passes on: the receive whose result `src` holds unchanged, if
    /// any (the last writer of every byte of `src` is one receive into exactly `src`), or
    /// else its pieces when some of them do ([`Schedule::parts`]): each run of bytes that
    /// a receive which copies wrote whole (and nothing since) passes its payload on; the
    /// rest is copied.
    fn passed_on(&mut self, src: &BufRange) -> (Option<OpId>, Option<Vec<SendPart>>) {
        let runs = self.tracker(src.buf).runs(src.range.clone());
        let received_into = |w: u32, range: &std::ops::Range<usize>, copies: bool| {
            matches!(self.actions.get(w as usize), Some(Action::Recv { dst, reduce, .. })
                if dst.buf == src.buf && dst.range == *range && !(copies && *reduce))
        };
        if let [(range, Some(w))] = runs.as_slice() {
            if received_into(*w, range, false) {
                return (Some(OpId(*w)), None);
            }
        }
        let mut parts: Vec<SendPart> = Vec::new();
        for (range, writer) in runs {
            let forwards = writer.filter(|&w| received_into(w, &range, true));
            match parts.last_mut() {
                Some(last) if forwards.is_none() && last.forwards.is_none() => {
                    last.range.range.end = range.end;
                }
                _ => parts.push(SendPart {
                    range: BufRange::new(src.buf, range),
                    forwards: forwards.map(OpId),
                }),
            }
        }
        let passes = parts.iter().any(|p| p.forwards.is_some());
        (
            None,
            (passes && parts.len() <= MAX_SEND_PARTS).then_some(parts),
        )
    }

    /// True unless `action` reads scratch bytes that no earlier action wrote.
    fn reads_written_scratch(&mut self, action: &Action) -> bool {
        let read = action.reads().into_iter();
        let reread = action.writes().filter(|_| !action.overwrites());
        read.chain(reread)
            .filter(|r| r.buf == BufId::Scratch)
            .all(|r| self.tracker(BufId::Scratch).fully_written(r.range.clone()))
    }

    /// Updates the [`Fate`] of the reducing receives whose results `action` (not yet
    /// recorded) reads or overwrites; `forwards` is the receive it forwards, if any.
    fn follow_results(&mut self, action: &Action, forwards: Option<OpId>) {
        let mut read = Vec::new();
        let mut overwritten = Vec::new();
        if let Some(r) = action.reads() {
            for w in self.tracker(r.buf).writers_in(r.range.clone()) {
                if forwards != Some(OpId(w)) {
                    read.push(w);
                }
            }
        }
        if let Some(d) = action.writes() {
            for w in self.tracker(d.buf).writers_in(d.range.clone()) {
                let whole = match &self.actions[w as usize] {
                    Action::Recv { dst, .. } => {
                        dst.range.start >= d.range.start && dst.range.end <= d.range.end
                    }
                    _ => false,
                };
                if action.overwrites() && whole {
                    overwritten.push(w);
                } else {
                    read.push(w);
                }
            }
        }
        for w in read {
            self.fates[w as usize] = Fate::Read;
        }
        for w in overwritten {
            let fate = &mut self.fates[w as usize];
            if *fate == Fate::Unread {
                *fate = Fate::Overwritten;
            }
        }
    }

    /// Sends `src` to `peer` as message `step`, after `after` and the data hazards.
    pub(crate) fn send_after(
        &mut self,
        peer: usize,
        step: u32,
        src: BufRange,
        after: &[OpId],
    ) -> OpId {
        let src = self.place(src);
        self.push(
            |id| Action::Send {
                id,
                peer,
                step,
                src,
            },
            after,
        )
    }

    /// Sends `src` to `peer` as message `step`.
    pub(crate) fn send(&mut self, peer: usize, step: u32, src: BufRange) -> OpId {
        self.send_after(peer, step, src, &[])
    }

    /// Receives message `step` from `peer` into `dst`, reducing if `reduce`.
    pub(crate) fn recv(&mut self, peer: usize, step: u32, dst: BufRange, reduce: bool) -> OpId {
        self.push_recv(peer, step, dst, reduce, None)
    }

    /// Receives message `step` from `peer` and writes `op(base, received)` into `dst`.
    pub(crate) fn recv_reduce_onto(
        &mut self,
        peer: usize,
        step: u32,
        base: BufRange,
        dst: BufRange,
    ) -> OpId {
        debug_assert_eq!(base.len(), dst.len());
        self.push_recv(peer, step, dst, true, Some(base))
    }

    /// The messages that `r`, message `phase` of an algorithm, travels as under `ch`: one
    /// per chunk, numbered `ch.step(phase, chunk)`; an empty range is one empty message
    /// (`ch.step(phase, 0)`). Chunks are cut from the range's own start, so a sender's
    /// range and its receiver's, of the same length, are cut alike.
    fn cut(ch: &Chunking, phase: usize, r: BufRange) -> Vec<(u32, BufRange)> {
        if r.range.is_empty() {
            return vec![(ch.step(phase, 0), r)];
        }
        ch.chunks(r.range.clone())
            .map(|(c, range)| (ch.step(phase, c), BufRange::new(r.buf, range)))
            .collect()
    }

    /// Sends `src` to `peer` as message `phase` cut by `ch` ([`Self::cut`]), every piece
    /// after `after` and its data hazards.
    pub(crate) fn send_cut_after(
        &mut self,
        ch: &Chunking,
        peer: usize,
        phase: usize,
        src: BufRange,
        after: &[OpId],
    ) -> Vec<OpId> {
        Self::cut(ch, phase, src)
            .into_iter()
            .map(|(step, piece)| self.send_after(peer, step, piece, after))
            .collect()
    }

    /// Sends `src` to `peer` as message `phase` cut by `ch` ([`Self::cut`]).
    pub(crate) fn send_cut(
        &mut self,
        ch: &Chunking,
        peer: usize,
        phase: usize,
        src: BufRange,
    ) -> Vec<OpId> {
        self.send_cut_after(ch, peer, phase, src, &[])
    }

    /// Receives message `phase` from `peer`, cut by `ch` ([`Self::cut`]), into `dst`,
    /// reducing if `reduce`.
    pub(crate) fn recv_cut(
        &mut self,
        ch: &Chunking,
        peer: usize,
        phase: usize,
        dst: BufRange,
        reduce: bool,
    ) -> Vec<OpId> {
        Self::cut(ch, phase, dst)
            .into_iter()
            .map(|(step, piece)| self.recv(peer, step, piece, reduce))
            .collect()
    }

    /// Receives message `phase` from `peer`, cut by `ch` ([`Self::cut`]), and writes
    /// `op(base, received)` into `dst`, piece by piece.
    pub(crate) fn recv_reduce_onto_cut(
        &mut self,
        ch: &Chunking,
        peer: usize,
        phase: usize,
        base: BufRange,
        dst: BufRange,
    ) -> Vec<OpId> {
        debug_assert_eq!(base.len(), dst.len());
        let shift = |r: &BufRange| {
            BufRange::new(
                base.buf,
                r.range.start - dst.range.start + base.range.start
                    ..r.range.end - dst.range.start + base.range.start,
            )
        };
        Self::cut(ch, phase, dst.clone())
            .into_iter()
            .map(|(step, piece)| self.recv_reduce_onto(peer, step, shift(&piece), piece))
            .collect()
    }

    fn push_recv(
        &mut self,
        peer: usize,
        step: u32,
        dst: BufRange,
        reduce: bool,
        base: Option<BufRange>,
    ) -> OpId {
        let dst = self.place(dst);
        // A base placed on its destination is the destination's own bytes; any other
        // base must lie apart from it.
        let base = base.map(|b| self.place(b)).filter(|b| *b != dst);
        debug_assert!(base.as_ref().is_none_or(|b| !b.overlaps(&dst)));
        self.push(
            |id| Action::Recv {
                id,
                peer,
                step,
                dst,
                reduce,
                base,
            },
            &[],
        )
    }

    /// Copies `src` to `dst` locally; nothing (`None`) when they are placed on the same
    /// bytes.
    pub(crate) fn copy(&mut self, src: BufRange, dst: BufRange) -> Option<OpId> {
        debug_assert_eq!(src.len(), dst.len());
        let (src, dst) = (self.place(src), self.place(dst));
        if src == dst {
            return None;
        }
        Some(self.push(|id| Action::Copy { id, src, dst }, &[]))
    }

    /// Reduces `src` into `dst` locally.
    pub(crate) fn reduce(&mut self, src: BufRange, dst: BufRange) -> OpId {
        debug_assert_eq!(src.len(), dst.len());
        let (src, dst) = (self.place(src), self.place(dst));
        self.push(|id| Action::Reduce { id, src, dst }, &[])
    }

    /// Fills `dst` with the op's identity.
    pub(crate) fn fill_identity(&mut self, dst: BufRange) -> OpId {
        let dst = self.place(dst);
        self.push(|id| Action::FillIdentity { id, dst }, &[])
    }

    /// Finishes the schedule. `window` bounds sends and local actions in flight (0 =
    /// unlimited).
    pub(crate) fn build(self, name: &'static str, window: usize) -> DagSchedule {
        let n = self.actions.len();
        let mut count = vec![0u32; n + 1];
        for deps in &self.deps {
            for &d in deps {
                count[d as usize + 1] += 1;
            }
        }
        for i in 0..n {
            count[i + 1] += count[i];
        }
        let dependents_start = count.clone();
        let mut fill = count;
        let mut dependents = vec![0u32; dependents_start[n] as usize];
        for (i, deps) in self.deps.iter().enumerate() {
            for &d in deps {
                dependents[fill[d as usize] as usize] = i as u32;
                fill[d as usize] += 1;
            }
        }
        let pending_deps: Vec<u32> = self.deps.iter().map(|d| d.len() as u32).collect();
        let only_forwarded = self
            .actions
            .iter()
            .zip(&self.fates)
            .zip(&self.forward_count)
            .map(|((a, fate), &uses)| match a {
                Action::Recv {
                    reduce: true, dst, ..
                } if uses > 0 => {
                    *fate == Fate::Overwritten
                        || (*fate == Fate::Unread && dst.buf == BufId::Scratch)
                }
                _ => false,
            })
            .collect();
        // A result is `Unread` when no later action read any of it or wrote over it
        // (`follow_results` marks both; a copy is never counted as overwritten whole).
        // A receive passed on by sends is `Unread` too (forwarding sends are not counted
        // as reads), but those sends may read its bytes back: not written once.
        let write_once = self
            .actions
            .iter()
            .zip(&self.fates)
            .zip(&self.forward_count)
            .map(|((a, fate), &forwarded)| {
                let only_writes_data = match a {
                    Action::Copy { dst, .. } => dst.buf == BufId::Data,
                    // Copying, or reducing onto a base: neither reads `dst`.
                    Action::Recv {
                        dst, reduce, base, ..
                    } if !reduce || base.is_some() => dst.buf == BufId::Data && forwarded == 0,
                    _ => false,
                };
                only_writes_data && *fate == Fate::Unread
            })
            .collect();
        // The same for a receive that sends pass on whole only: they may be handed its
        // payload instead of reading the range.
        let write_once_past_forwards = self
            .actions
            .iter()
            .zip(&self.fates)
            .zip(self.forward_count.iter().zip(&self.piece_count))
            .map(|((a, fate), (&forwarded, &pieces))| {
                let copies_into_data = matches!(
                    a,
                    Action::Recv { dst, reduce: false, .. } if dst.buf == BufId::Data
                );
                copies_into_data && forwarded > 0 && pieces == 0 && *fate == Fate::Unread
            })
            .collect();
        let mut dag = DagSchedule {
            name,
            actions: self.actions,
            pending_deps,
            dependents_start,
            dependents,
            state: vec![OpState::Waiting; n],
            ready_recv: BinaryHeap::new(),
            ready_other: BinaryHeap::new(),
            windowed_in_flight: 0,
            window,
            completed: 0,
            scratch_len: self.scratch_len,
            forwards: self.forwards,
            parts: self.parts,
            forward_count: self.forward_count,
            piece_count: self.piece_count,
            only_forwarded,
            write_once,
            write_once_past_forwards,
        };
        for i in 0..n {
            if dag.pending_deps[i] == 0 {
                dag.make_ready(i as u32);
            }
        }
        dag
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn deps_of(b: &DagBuilder, id: OpId) -> Vec<u32> {
        b.deps[id.0 as usize].clone()
    }

    #[test]
    fn hazards_become_dependencies() {
        let mut b = DagBuilder::new();
        let w = b.recv(1, 0, BufRange::data(0..16), true);
        // Read after write, on a sub-range.
        let r1 = b.send(1, 1, BufRange::data(4..8));
        // Disjoint read: independent.
        let r2 = b.send(1, 2, BufRange::data(16..20));
        // Write after read: waits for the reader (and the earlier writer).
        let w2 = b.recv(1, 3, BufRange::data(6..12), false);
        // Another buffer entirely.
        let other = b
            .copy(BufRange::input(0..4), BufRange::scratch(0..4))
            .expect("distinct ranges");
        assert_eq!(deps_of(&b, r1), vec![w.0]);
        assert!(deps_of(&b, r2).is_empty());
        assert_eq!(deps_of(&b, w2), vec![w.0, r1.0]);
        assert!(deps_of(&b, other).is_empty());
        // Read of a range written by two different actions waits for both.
        let r3 = b.send(1, 4, BufRange::data(0..16));
        assert_eq!(deps_of(&b, r3), vec![w.0, w2.0]);
        assert_eq!(b.scratch_len, 4);
    }

    #[test]
    fn sends_of_a_received_range_forward_its_payload() {
        let mut b = DagBuilder::new();
        let r = b.recv(1, 0, BufRange::data(0..16), false);
        // A read of part of the range splits its history; the whole is still r's.
        let part = b.send(2, 0, BufRange::data(4..8));
        let whole = b.send(2, 1, BufRange::data(0..16));
        let again = b.send(3, 0, BufRange::data(0..16));
        let reduced = b.recv(1, 1, BufRange::data(16..32), true);
        let of_reduced = b.send(2, 2, BufRange::data(16..32));
        let part_of_reduced = b.send(2, 6, BufRange::data(16..24));
        let r2 = b.recv(1, 2, BufRange::data(32..40), false);
        let r3 = b.recv(1, 3, BufRange::data(40..48), false);
        let two_writers = b.send(2, 3, BufRange::data(32..48));
        let half_written = b.send(2, 4, BufRange::data(40..56));
        b.copy(BufRange::input(0..16), BufRange::data(0..16));
        let overwritten = b.send(2, 5, BufRange::data(0..16));
        let d = b.build("t", 0);
        assert_eq!(d.forwards(whole), Some(r));
        assert_eq!(d.forwards(again), Some(r));
        assert_eq!(d.forward_count(r), 2);
        assert_eq!(d.forwards(of_reduced), Some(reduced));
        for s in [
            part,
            part_of_reduced,
            two_writers,
            half_written,
            overwritten,
        ] {
            assert_eq!(d.forwards(s), None, "{s:?}");
        }
        assert_eq!(d.forward_count(reduced), 1);
        // Sends of several receives' payloads, or of one and bytes of no receive, pass
        // them on in pieces; a piece of a reduced result or of a copy is copied.
        let piece = |range, forwards| SendPart {
            range: BufRange::data(range),
            forwards,
        };
        assert_eq!(
            d.parts(two_writers),
            Some(&[piece(32..40, Some(r2)), piece(40..48, Some(r3))][..])
        );
        assert_eq!(
            d.parts(half_written),
            Some(&[piece(40..48, Some(r3)), piece(48..56, None)][..])
        );
        for s in [whole, part, of_reduced, part_of_reduced, overwritten] {
            assert_eq!(d.parts(s), None, "{s:?}");
        }
        assert_eq!(d.forward_count(r2), 1);
        assert_eq!(d.forward_count(r3), 2);
        assert_eq!((d.piece_count(r2), d.piece_count(r3)), (1, 2));
        assert_eq!(d.piece_count(r), 0, "passed on whole only");
        assert_eq!(d.forwards(r), None, "a receive forwards nothing");
        assert_eq!(d.parts(r), None, "a receive has no pieces");
    }

    /// A piece passes a payload on only where the send holds the receive's whole range
    /// (not one cut at either end of the send), and a send of more than
    /// `MAX_SEND_PARTS` pieces is copied whole.
    #[test]
    fn a_send_passes_on_only_whole_receives_in_at_most_max_pieces() {
        let piece = |range, forwards| SendPart {
            range: BufRange::data(range),
            forwards,
        };
        let mut b = DagBuilder::new();
        let r = b.recv(1, 0, BufRange::data(0..16), false);
        let q = b.recv(1, 1, BufRange::data(16..32), false);
        let clipped_both = b.send(2, 0, BufRange::data(8..24));
        let clipped_end = b.send(2, 1, BufRange::data(0..24));
        let clipped_start = b.send(2, 2, BufRange::data(8..32));
        // Receives of 4 bytes with 4 unwritten between them: 2n - 1 pieces for n of them.
        let mut alternating = |at: usize, n: usize, step: u32| {
            for i in 0..n {
                let from = at + 8 * i;
                b.recv(1, step + i as u32, BufRange::data(from..from + 4), false);
            }
            b.send(3, step, BufRange::data(at..at + 8 * n - 4))
        };
        let most = alternating(64, MAX_SEND_PARTS.div_ceil(2), 10);
        let over = alternating(1024, MAX_SEND_PARTS.div_ceil(2) + 1, 200);
        let d = b.build("t", 0);
        assert_eq!(d.parts(clipped_both), None);
        assert_eq!(
            d.parts(clipped_end),
            Some(&[piece(0..16, Some(r)), piece(16..24, None)][..])
        );
        assert_eq!(
            d.parts(clipped_start),
            Some(&[piece(8..16, None), piece(16..32, Some(q))][..])
        );
        assert_eq!(
            d.parts(most).map(<[SendPart]>::len),
            Some(MAX_SEND_PARTS - 1)
        );
        assert_eq!(d.parts(over), None);
    }

    #[test]
    fn a_reduced_result_only_its_forwarding_sends_read_may_go_unwritten() {
        let mut b = DagBuilder::new();
        let input = |r: std::ops::Range<usize>| BufRange::input(r);
        // In scratch, read by its forwarding sends only.
        let scratch = b.recv_reduce_onto(1, 0, input(0..8), BufRange::scratch(0..8));
        b.send(2, 0, BufRange::scratch(0..8));
        b.send(3, 0, BufRange::scratch(0..8));
        // In Data, overwritten whole afterwards (by a wider copy).
        let overwritten = b.recv(1, 1, BufRange::data(0..8), true);
        b.send(2, 1, BufRange::data(0..8));
        b.copy(input(0..16), BufRange::data(0..16));
        // In Data and never overwritten: the caller reads it.
        let kept = b.recv(1, 2, BufRange::data(16..24), true);
        b.send(2, 2, BufRange::data(16..24));
        // (Scratch is written before it is read or reduced into.)
        b.copy(input(0..24), BufRange::scratch(8..32));
        // Also read by something other than a forwarding send.
        let also_read = b.recv(1, 3, BufRange::scratch(8..16), true);
        b.send(2, 3, BufRange::scratch(8..16));
        b.reduce(BufRange::scratch(8..16), BufRange::scratch(16..24));
        // Overwritten only in part, then wholly: not followed, so not left unwritten.
        let partly = b.recv(1, 4, BufRange::data(24..32), true);
        b.send(2, 4, BufRange::data(24..32));
        b.copy(input(0..4), BufRange::data(24..28));
        b.copy(input(0..8), BufRange::data(24..32));
        // Reduced into again (read) before being overwritten.
        let reread = b.recv(1, 5, BufRange::data(32..40), true);
        b.send(2, 5, BufRange::data(32..40));
        b.recv(1, 6, BufRange::data(32..40), true);
        b.copy(input(0..8), BufRange::data(32..40));
        // Forwarded by no send: nothing to hand over.
        let unsent = b.recv(1, 7, BufRange::scratch(24..32), true);
        // A copying receive is never "only forwarded" (its payload is the result).
        let copied = b.recv(1, 8, BufRange::scratch(32..40), false);
        b.send(2, 8, BufRange::scratch(32..40));
        let d = b.build("t", 0);
        assert_eq!(d.forward_count(scratch), 2);
        assert!(d.only_forwarded(scratch));
        assert!(d.only_forwarded(overwritten));
        for r in [kept, also_read, partly, reread, unsent, copied] {
            assert!(!d.only_forwarded(r), "{r:?}");
        }
        assert_eq!(
            d.actions()[scratch.0 as usize].reads(),
            Some(&input(0..8)),
            "the base is read"
        );
        assert!(d.actions()[scratch.0 as usize].overwrites());
        assert!(!d.actions()[overwritten.0 as usize].overwrites());
    }

    /// A copy, a copying receive, or a receive reducing onto a base, into `Data` is
    /// written once when nothing after it reads or writes its bytes (and, for a receive,
    /// no send passes it on); one that a send or a reduction reads, a later copy
    /// writes over, one reducing into its own bytes, one passed on, or one into scratch is
    /// not.
    #[test]
    fn copies_and_receives_that_nothing_later_touches_are_written_once() {
        let input = BufRange::input;
        let data = BufRange::data;
        let mut b = DagBuilder::new();
        let copied = b.copy(input(0..8), data(0..8)).expect("copy");
        b.send(1, 0, input(0..8));
        let received = b.recv(1, 0, data(8..16), false);
        let sent = b.copy(input(0..8), data(16..24)).expect("copy");
        b.send(1, 1, data(16..24));
        let reduced_into = b.copy(input(0..8), data(24..32)).expect("copy");
        b.recv(1, 2, data(24..32), true);
        let rewritten = b.copy(input(0..8), data(32..40)).expect("copy");
        b.copy(input(8..12), data(36..40));
        let to_scratch = b.copy(input(0..8), BufRange::scratch(0..8)).expect("copy");
        let reducing = b.recv(1, 3, data(40..48), true);
        let forwarded = b.recv(1, 4, data(48..56), false);
        b.send(2, 4, data(48..56));
        let read = b.recv(1, 5, data(56..64), false);
        b.reduce(data(56..64), data(64..72));
        let into_scratch = b.recv(1, 6, BufRange::scratch(8..16), false);
        b.send(2, 6, BufRange::scratch(8..16));
        let onto = b.recv_reduce_onto(1, 7, input(0..8), data(72..80));
        let onto_sent = b.recv_reduce_onto(1, 8, input(0..8), data(80..88));
        b.send(2, 8, data(80..88));
        let onto_scratch = b.recv_reduce_onto(1, 9, input(0..8), BufRange::scratch(16..24));
        b.send(2, 9, BufRange::scratch(16..24));
        let onto_read = b.recv_reduce_onto(1, 10, input(0..8), data(88..96));
        b.reduce(data(88..96), data(96..104));
        let d = b.build("t", 0);
        assert!(d.write_once(copied) && d.write_once(received) && d.write_once(onto));
        let not = [
            sent,
            reduced_into,
            rewritten,
            to_scratch,
            reducing,
            forwarded,
            read,
            into_scratch,
            onto_sent,
            onto_scratch,
            onto_read,
        ];
        for op in not {
            assert!(!d.write_once(op), "{op:?}");
        }
        // The receive that a send passes on whole is written once but for that send.
        assert!(d.write_once_past_forwards(forwarded));
        let not_past_forwards = [
            copied,
            received,
            onto,
            sent,
            reduced_into,
            reducing,
            read,
            into_scratch,
            onto_sent,
        ];
        for op in not_past_forwards {
            assert!(!d.write_once_past_forwards(op), "{op:?}");
        }
    }

    /// A chain broadcast's ranks pass every chunk on whole: written once but for those
    /// sends, except at the last rank, which passes nothing on (written once outright).
    /// Recursive doubling passes its receives on as parts of larger messages, which count
    /// as reads of them (a driver may lend those ranges from the buffer): not written once
    /// past them. Nor is a receive passed on whole that a later action reads or
    /// overwrites.
    #[test]
    fn receives_passed_on_whole_only_are_written_once_past_their_forwards() {
        let g = |rank| crate::algos::Geom {
            rank,
            world: 4,
            esz: 4,
            count: 4096,
            in_place: None,
        };
        let recvs = |d: &DagSchedule| -> Vec<OpId> {
            let acts = d.actions().iter();
            acts.filter(|a| a.is_recv()).map(Action::id).collect()
        };
        let chunks = crate::layout::Chunking::new(4096, 4, 4 * 4096, 4);
        let middle = crate::algos::broadcast::chain(g(1), 0, chunks, 0);
        assert!(recvs(&middle).len() > 1);
        for r in recvs(&middle) {
            assert!(middle.forward_count(r) > 0);
            assert!(
                middle.write_once_past_forwards(r) && !middle.write_once(r),
                "{r:?}"
            );
        }
        let last = crate::algos::broadcast::chain(g(3), 0, chunks, 0);
        for r in recvs(&last) {
            assert!(
                !last.write_once_past_forwards(r) && last.write_once(r),
                "{r:?}"
            );
        }
        let whole = crate::layout::Chunking::new(usize::MAX, 4, 4 * 4096, 4);
        let rd = crate::algos::all_gather::rd(g(1), whole, 0);
        let passed_on: Vec<OpId> = recvs(&rd)
            .into_iter()
            .filter(|r| rd.forward_count(*r) > 0)
            .collect();
        assert!(!passed_on.is_empty());
        assert!(passed_on.iter().all(|r| !rd.write_once_past_forwards(*r)));
        // Passed on whole, then read or written over by a local action.
        let data = |r: std::ops::Range<usize>| BufRange::data(r);
        let mut b = DagBuilder::new();
        let read = b.recv(1, 0, data(0..8), false);
        b.send(2, 0, data(0..8));
        b.reduce(data(0..8), data(8..16));
        let overwritten = b.recv(1, 1, data(16..24), false);
        b.send(2, 1, data(16..24));
        b.copy(BufRange::input(0..8), data(16..24));
        let clean = b.recv(1, 2, data(24..32), false);
        b.send(2, 2, data(24..32));
        let d = b.build("t", 0);
        assert!(d.forward_count(read) > 0 && d.forward_count(overwritten) > 0);
        assert!(!d.write_once_past_forwards(read));
        assert!(!d.write_once_past_forwards(overwritten));
        assert!(d.write_once_past_forwards(clean));
    }

    /// Where the own block goes in each all-gather: the ring sends it from `Input`, so
    /// its copy into place is written once; recursive doubling sends it from `Data`.
    #[test]
    fn the_rings_own_block_copy_is_written_once() {
        let g = |rank| crate::algos::Geom {
            rank,
            world: 4,
            esz: 4,
            count: 1024,
            in_place: None,
        };
        let copies = |d: &DagSchedule| -> Vec<OpId> {
            d.actions()
                .iter()
                .filter(|a| matches!(a, Action::Copy { .. }))
                .map(Action::id)
                .collect()
        };
        let whole = crate::layout::Chunking::new(usize::MAX, 4, 4 * 1024, 4);
        let ring = crate::algos::all_gather::ring(g(1), whole, "ring", 0);
        let ring_copies = copies(&ring);
        assert_eq!(ring_copies.len(), 1);
        assert!(ring.write_once(ring_copies[0]));
        let rd = crate::algos::all_gather::rd(g(1), whole, 0);
        assert!(copies(&rd).iter().all(|c| !rd.write_once(*c)));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "reads scratch that nothing wrote")]
    fn a_schedule_that_reads_unwritten_scratch_is_caught() {
        let mut b = DagBuilder::new();
        b.copy(BufRange::input(0..4), BufRange::scratch(0..4));
        // Bytes 4..8 were never written.
        b.send(1, 0, BufRange::scratch(0..8));
    }

    #[test]
    fn explicit_dependencies_and_empty_ranges() {
        let mut b = DagBuilder::new();
        let a = b.recv(1, 0, BufRange::data(0..0), false);
        let s = b.send_after(1, 1, BufRange::data(0..0), &[a]);
        assert_eq!(deps_of(&b, s), vec![a.0]);
        let mut d = b.build("t", 0);
        let mut out = Vec::new();
        d.poll(&mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].id(), a);
        d.complete(a).unwrap();
        assert!(!d.is_done());
        out.clear();
        d.poll(&mut out);
        assert_eq!(out.iter().map(Action::id).collect::<Vec<_>>(), vec![s]);
        d.complete(s).unwrap();
        assert!(d.is_done());
        assert_eq!(d.in_flight(), 0);
    }

    #[test]
    fn receives_bypass_the_window() {
        let mut b = DagBuilder::new();
        for i in 0..4 {
            b.send(1, i, BufRange::data(0..4));
            b.recv(
                1,
                i,
                BufRange::scratch(4 * i as usize..4 * i as usize + 4),
                false,
            );
        }
        let mut d = b.build("t", 1);
        let mut out = Vec::new();
        d.poll(&mut out);
        assert_eq!(out.iter().filter(|a| a.is_recv()).count(), 4);
        assert_eq!(out.iter().filter(|a| !a.is_recv()).count(), 1);
        assert!(out.windows(2).all(|w| w[0].id() < w[1].id()));
    }
}
