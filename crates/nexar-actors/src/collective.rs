//! CollectiveActor: one per in-flight collective. It owns the schedule and the working
//! buffers, turns each action into a send or receive task (tasks move bytes and report
//! back with a cast), runs copies and reductions itself, and replies when the schedule is
//! done. Every buffer access happens inside the actor, so no task ever holds a reference
//! into memory the caller gets back, even if the caller's future is dropped.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use nexar_collectives::{Action, BufId, BufRange, OpId, Schedule};
use nexar_device::{DataType, ReduceOp};
use nexar_transport::Payload;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, debug_span, Instrument};

use crate::comm::{send_frame, CommCore};
use crate::{NexarError, Result};

/// The buffers a collective works on (see [`BufId`]).
#[derive(Default)]
pub(crate) struct Buffers {
    pub(crate) data: Vec<u8>,
    pub(crate) input: Vec<u8>,
    pub(crate) scratch: Vec<u8>,
    /// When set, [`BufId::Data`] lives here (device memory) and `data` is unused: sends
    /// stage ranges out of it, receives are written or reduced into it where it lives.
    pub(crate) device: Option<Box<dyn nexar_device::DeviceMemory>>,
}

impl std::fmt::Debug for Buffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffers")
            .field("data", &self.data.len())
            .field("input", &self.input.len())
            .field("scratch", &self.scratch.len())
            .field("device", &self.device.as_ref().map(|d| d.byte_len()))
            .finish()
    }
}

impl Buffers {
    /// Hands the host buffers back to the node's pool.
    pub(crate) fn recycle(self, pool: &crate::pool::BufferPool) {
        pool.put(self.data);
        pool.put(self.input);
        pool.put(self.scratch);
    }

    fn on_device(&self, r: &BufRange) -> bool {
        r.buf == BufId::Data && self.device.is_some()
    }

    /// The bytes of `r` as an owned buffer (staged from the device when Data lives there).
    fn read_bytes(&self, r: &BufRange) -> Result<Bytes> {
        match (&self.device, r.buf) {
            (Some(dev), BufId::Data) => {
                let mut out = vec![0u8; r.range.len()];
                dev.read(r.range.start, &mut out)?;
                Ok(Bytes::from(out))
            }
            _ => Ok(Bytes::copy_from_slice(self.get(r)?)),
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
            None => d.copy_from_slice(src),
        }
        Ok(())
    }

    fn get(&self, r: &BufRange) -> Result<&[u8]> {
        let b = match r.buf {
            BufId::Data => &self.data,
            BufId::Input => &self.input,
            BufId::Scratch => &self.scratch,
        };
        b.get(r.range.clone()).ok_or_else(|| range_err(r, b.len()))
    }

    fn get_mut(&mut self, r: &BufRange) -> Result<&mut [u8]> {
        let b = self.buf_mut(r.buf);
        let len = b.len();
        b.get_mut(r.range.clone()).ok_or_else(|| range_err(r, len))
    }

    fn buf_mut(&mut self, id: BufId) -> &mut Vec<u8> {
        match id {
            BufId::Data => &mut self.data,
            BufId::Input => &mut self.input,
            BufId::Scratch => &mut self.scratch,
        }
    }

    /// A read-only source and a writable destination, which the schedule guarantees do not
    /// overlap.
    fn pair(&mut self, src: &BufRange, dst: &BufRange) -> Result<(&[u8], &mut [u8])> {
        if src.buf != dst.buf {
            // Two distinct Vecs: borrow one shared and one mutable through a match on ids.
            let (a, b) = match (src.buf, dst.buf) {
                (BufId::Data, BufId::Input) => (&self.data, &mut self.input),
                (BufId::Data, BufId::Scratch) => (&self.data, &mut self.scratch),
                (BufId::Input, BufId::Data) => (&self.input, &mut self.data),
                (BufId::Input, BufId::Scratch) => (&self.input, &mut self.scratch),
                (BufId::Scratch, BufId::Data) => (&self.scratch, &mut self.data),
                (BufId::Scratch, BufId::Input) => (&self.scratch, &mut self.input),
                _ => return Err(NexarError::InvalidArgument("buffer ids must differ".into())),
            };
            let alen = a.len();
            let blen = b.len();
            let s = a
                .get(src.range.clone())
                .ok_or_else(|| range_err(src, alen))?;
            let d = b
                .get_mut(dst.range.clone())
                .ok_or_else(|| range_err(dst, blen))?;
            return Ok((s, d));
        }
        let buf = self.buf_mut(src.buf);
        let len = buf.len();
        let (sr, dr) = (src.range.clone(), dst.range.clone());
        if sr.end > len || dr.end > len || sr.start > sr.end || dr.start > dr.end {
            return Err(range_err(if sr.end > len { src } else { dst }, len));
        }
        if sr.start < dr.end && dr.start < sr.end {
            return Err(NexarError::InvalidArgument(format!(
                "schedule produced overlapping ranges {sr:?} and {dr:?}"
            )));
        }
        if sr.end <= dr.start {
            let (lo, hi) = buf.split_at_mut(dr.start);
            Ok((&lo[sr], &mut hi[..dr.end - dr.start]))
        } else {
            let (lo, hi) = buf.split_at_mut(sr.start);
            Ok((&hi[..sr.end - sr.start], &mut lo[dr]))
        }
    }
}

fn range_err(r: &BufRange, len: usize) -> NexarError {
    NexarError::InvalidArgument(format!(
        "schedule range {:?} {:?} outside a buffer of {len} bytes",
        r.buf, r.range
    ))
}

/// What a collective needs to run.
pub(crate) struct Job {
    pub(crate) core: Arc<CommCore>,
    pub(crate) tag: u64,
    /// Fingerprint of the call (collective, count, dtype, op, root) carried in the upper
    /// half of every step, so ranks that call mismatched collectives never match frames:
    /// they time out with an error instead of combining unrelated data.
    pub(crate) sig: u32,
    pub(crate) schedule: Box<dyn Schedule>,
    pub(crate) bufs: Buffers,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) deadline: Instant,
    pub(crate) reply: oneshot::Sender<Result<Buffers>>,
}

/// Messages a [`CollectiveActor`] handles.
#[derive(Debug)]
pub(crate) enum CollMsg {
    /// Issue the first actions.
    Start,
    /// A send task handed its bytes to the transport.
    Sent(OpId),
    /// A receive task got its frame.
    Received(OpId, Payload),
    /// A task failed.
    Failed(NexarError),
}

pub(crate) struct CollectiveActor;

pub(crate) struct CollState {
    job: Option<Job>,
    pending_recvs: Vec<(OpId, Recv)>,
    tasks: Vec<JoinHandle<()>>,
    actions: Vec<Action>,
}

#[derive(Debug)]
struct Recv {
    dst: BufRange,
    reduce: bool,
}

impl Actor for CollectiveActor {
    type Msg = CollMsg;
    type State = CollState;
    type Arguments = Job;

    async fn pre_start(
        &self,
        myself: ActorRef<CollMsg>,
        job: Job,
    ) -> Result<CollState, ActorProcessingErr> {
        myself.send_message(CollMsg::Start)?;
        Ok(CollState {
            job: Some(job),
            pending_recvs: Vec::new(),
            tasks: Vec::new(),
            actions: Vec::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<CollMsg>,
        msg: CollMsg,
        st: &mut CollState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(job) = st.job.as_ref() else {
            return Ok(());
        };
        if job.reply.is_closed() {
            // The caller went away: stop early; post_stop retires the tag.
            debug!(tag = job.tag, "collective abandoned by its caller");
            myself.stop(None);
            return Ok(());
        }
        let res = match msg {
            CollMsg::Start => Ok(()),
            CollMsg::Sent(id) => complete(st, id),
            CollMsg::Received(id, payload) => on_received(st, id, payload),
            CollMsg::Failed(e) => Err(e),
        };
        let res = res.and_then(|()| advance(&myself, st));
        match res {
            Err(e) => finish(&myself, st, Err(e)),
            Ok(true) => {
                let bufs = st
                    .job
                    .as_mut()
                    .map(|j| std::mem::take(&mut j.bufs))
                    .unwrap_or_default();
                finish(&myself, st, Ok(bufs));
            }
            Ok(false) => {}
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<CollMsg>,
        st: &mut CollState,
    ) -> Result<(), ActorProcessingErr> {
        for t in st.tasks.drain(..) {
            t.abort();
        }
        if let Some(job) = st.job.take() {
            job.core.shared.table.retire(job.core.coll_comm(), job.tag);
            let _ = job.reply.send(Err(NexarError::Actor(
                "collective stopped before finishing".into(),
            )));
        }
        Ok(())
    }
}

fn finish(myself: &ActorRef<CollMsg>, st: &mut CollState, res: Result<Buffers>) {
    if let Some(job) = st.job.take() {
        job.core.shared.table.retire(job.core.coll_comm(), job.tag);
        let _ = job.reply.send(res);
    }
    for t in st.tasks.drain(..) {
        t.abort();
    }
    myself.stop(None);
}

fn complete(st: &mut CollState, id: OpId) -> Result<()> {
    let job = st.job.as_mut().ok_or(NexarError::Shutdown)?;
    job.schedule.complete(id)?;
    Ok(())
}

fn on_received(st: &mut CollState, id: OpId, payload: Payload) -> Result<()> {
    let pos = st
        .pending_recvs
        .iter()
        .position(|(i, _)| *i == id)
        .ok_or_else(|| {
            NexarError::InvalidArgument(format!("unexpected receive completion {id:?}"))
        })?;
    let (_, recv) = st.pending_recvs.swap_remove(pos);
    let job = st.job.as_mut().ok_or(NexarError::Shutdown)?;
    let (dtype, op) = (job.dtype, job.op);
    if job.bufs.on_device(&recv.dst) {
        let mut host = vec![0u8; payload.len()];
        payload
            .copy_to(&mut host)
            .map_err(|(e, a)| NexarError::LengthMismatch {
                what: "collective message (bytes)",
                expected: e,
                actual: a,
            })?;
        job.bufs
            .store(&recv.dst, &host, recv.reduce.then_some((dtype, op)))?;
        return complete(st, id);
    }
    let dst = job.bufs.get_mut(&recv.dst)?;
    if payload.len() != dst.len() {
        return Err(NexarError::LengthMismatch {
            what: "collective message (bytes); did every rank pass the same arguments?",
            expected: dst.len(),
            actual: payload.len(),
        });
    }
    if recv.reduce {
        let mut err = None;
        let r = payload.for_each_aligned(dtype.size(), |off, bytes| {
            nexar_device::reduce_bytes(dtype, op, &mut dst[off..off + bytes.len()], bytes)
        });
        if let Err(e) = r {
            err = Some(match e {
                Some(e) => NexarError::Device(e),
                None => {
                    NexarError::InvalidArgument("payload is not a whole number of elements".into())
                }
            });
        }
        if let Some(e) = err {
            return Err(e);
        }
    } else {
        payload
            .copy_to(dst)
            .map_err(|(e, a)| NexarError::LengthMismatch {
                what: "collective message (bytes)",
                expected: e,
                actual: a,
            })?;
    }
    complete(st, id)
}

/// Polls the schedule and issues everything ready; local actions run at once. Returns
/// true when the schedule is done.
fn advance(myself: &ActorRef<CollMsg>, st: &mut CollState) -> Result<bool> {
    loop {
        let job = st.job.as_mut().ok_or(NexarError::Shutdown)?;
        st.actions.clear();
        job.schedule.poll(&mut st.actions);
        if st.actions.is_empty() {
            return Ok(job.schedule.is_done());
        }
        let mut local_done = Vec::new();
        for action in st.actions.drain(..) {
            let is_reduce = matches!(action, Action::Reduce { .. });
            match action {
                Action::Send {
                    id,
                    peer,
                    step,
                    src,
                } => {
                    let bytes = job.bufs.read_bytes(&src)?;
                    let core = job.core.clone();
                    let (tag, deadline, me) = (job.tag, job.deadline, myself.clone());
                    let wire_step = wire_step(job.sig, step);
                    let span = debug_span!("send", peer, step);
                    st.tasks.push(tokio::spawn(
                        async move {
                            let comm = core.coll_comm();
                            let res =
                                send_frame(&core, peer, comm, tag, wire_step, bytes, deadline)
                                    .await;
                            let _ = me.send_message(match res {
                                Ok(()) => CollMsg::Sent(id),
                                Err(e) => CollMsg::Failed(e),
                            });
                        }
                        .instrument(span),
                    ));
                }
                Action::Recv {
                    id,
                    peer,
                    step,
                    dst,
                    reduce,
                } => {
                    let core = job.core.clone();
                    let (tag, deadline, me) = (job.tag, job.deadline, myself.clone());
                    let wire_step = wire_step(job.sig, step);
                    st.pending_recvs.push((id, Recv { dst, reduce }));
                    st.tasks.push(tokio::spawn(async move {
                        // A collective involves every member: if any of them is lost, the
                        // collective cannot finish, so stop waiting at once.
                        let res = tokio::select! {
                            res = core.take(peer, core.coll_comm(), tag, wire_step, deadline) => res,
                            lost = member_lost(&core) => Err(lost),
                        };
                        let _ = me.send_message(match res {
                            Ok(p) => CollMsg::Received(id, p),
                            Err(e) => CollMsg::Failed(e),
                        });
                    }));
                }
                Action::Copy { id, src, dst } | Action::Reduce { id, src, dst }
                    if job.bufs.on_device(&src) || job.bufs.on_device(&dst) =>
                {
                    // Device memory is involved: go through a host copy of the source.
                    let bytes = job.bufs.read_bytes(&src)?;
                    let reduce = is_reduce.then_some((job.dtype, job.op));
                    job.bufs.store(&dst, &bytes, reduce)?;
                    local_done.push(id);
                }
                Action::Copy { id, src, dst } => {
                    let (s, d) = job.bufs.pair(&src, &dst)?;
                    d.copy_from_slice(s);
                    local_done.push(id);
                }
                Action::Reduce { id, src, dst } => {
                    let (s, d) = job.bufs.pair(&src, &dst)?;
                    nexar_device::reduce_bytes(job.dtype, job.op, d, s)?;
                    local_done.push(id);
                }
                Action::FillIdentity { id, dst } => {
                    let (dtype, op) = (job.dtype, job.op);
                    let mut id_bytes = vec![0u8; dst.range.len()];
                    nexar_device::fill_identity(dtype, op, &mut id_bytes)?;
                    job.bufs.store(&dst, &id_bytes, None)?;
                    local_done.push(id);
                }
            }
        }
        // Keep finished tasks from piling up in long collectives.
        st.tasks.retain(|t| !t.is_finished());
        if local_done.is_empty() {
            return Ok(job.schedule.is_done());
        }
        for id in local_done {
            job.schedule.complete(id)?;
        }
    }
}

/// Resolves with `PeerLost` as soon as any member of the communicator is known lost.
async fn member_lost(core: &CommCore) -> NexarError {
    let mut watch = core.shared.failures.subscribe();
    loop {
        let hit = {
            let lost = watch.borrow_and_update();
            core.members.iter().position(|m| lost.contains(m))
        };
        if let Some(rank) = hit {
            let reason = core
                .shared
                .lost
                .get(&core.members[rank])
                .map(|r| r.clone())
                .unwrap_or_else(|| "lost".into());
            return NexarError::PeerLost { rank, reason };
        }
        if watch.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

fn wire_step(sig: u32, step: u32) -> u64 {
    u64::from(sig) << 32 | u64::from(step)
}

/// Runs one collective to completion (or error) in a fresh CollectiveActor.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    core: Arc<CommCore>,
    tag: u64,
    sig: u32,
    schedule: Box<dyn Schedule>,
    mut bufs: Buffers,
    dtype: DataType,
    op: ReduceOp,
) -> Result<Buffers> {
    let name = schedule.name();
    bufs.scratch = core.shared.pool.zeroed(schedule.scratch_len());
    if schedule.is_done() {
        core.shared.table.retire(core.coll_comm(), tag);
        return Ok(bufs);
    }
    let timeout = core.shared.config.op_timeout;
    let deadline = Instant::now() + timeout;
    let (tx, rx) = oneshot::channel();
    let job = Job {
        core: core.clone(),
        tag,
        sig,
        schedule,
        bufs,
        dtype,
        op,
        deadline,
        reply: tx,
    };
    let span = debug_span!("collective", algorithm = name, tag, rank = core.rank);
    async move {
        let (actor, handle) = Actor::spawn(None, CollectiveActor, job)
            .await
            .map_err(|e| NexarError::Actor(e.to_string()))?;
        let res = match tokio::time::timeout(timeout + std::time::Duration::from_secs(1), rx).await
        {
            Ok(Ok(res)) => res,
            Ok(Err(_)) => Err(NexarError::Actor(
                "collective actor stopped without replying".into(),
            )),
            Err(_) => {
                actor.stop(None);
                Err(NexarError::Timeout {
                    what: format!("collective {name} (tag {tag})"),
                    after: timeout,
                })
            }
        };
        drop(handle);
        res
    }
    .instrument(span)
    .await
}
