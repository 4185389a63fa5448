//! The Communicator: a group of ranks with point-to-point messages and collectives.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use dashmap::DashMap;
use nexar_collectives as coll;
use nexar_device::{DataType, DeviceMemory, Element, ReduceOp};
use nexar_transport::{
    Clearance, Credit, Delivery, FrameKind, MailboxKey, NodeId, Payload, TcpLane, TransportError,
    MESSAGE_FRAME_BYTES,
};
use tracing::{debug, debug_span, Instrument};

use crate::collective::{within, Buffers, Ticket};
use crate::node::NodeShared;
use crate::pool::{CopiedOut, InFlight, SEND_PIECE_BYTES};
use crate::tags::{RecvCounts, TagCounts};
use crate::zero_copy::{Region, ZeroCopyBuffer};
use crate::{NexarError, Result};

/// Collective frames use the communicator id with this bit set, so collective sequence
/// numbers and user point-to-point tags never share a mailbox key.
pub(crate) const COLLECTIVE_CHANNEL: u64 = 1 << 63;

/// True for a communicator's collective channel (not the node's RPC replies or lane
/// handshakes, whose channels also have the top bit): the channels whose tags another
/// member may give up on whole ([`nexar_transport::WHOLE_TAG_STEP`]).
pub(crate) fn is_collective_channel(comm: u64) -> bool {
    comm & COLLECTIVE_CHANNEL != 0
        && comm != crate::rpc::RPC_REPLY_CHANNEL
        && comm != crate::node::LANE_CHANNEL
}

/// What every clone of a communicator shares.
#[derive(Debug)]
pub(crate) struct CommCore {
    pub(crate) shared: Arc<NodeShared>,
    /// Communicator id (top bit clear).
    pub(crate) id: u64,
    pub(crate) rank: usize,
    /// Communicator rank -> node.
    pub(crate) members: Arc<[NodeId]>,
    coll_seq: AtomicU64,
    compress_seq: AtomicU64,
    pub(crate) shrink_seq: AtomicU64,
    /// The last shrink that succeeded (see [`Communicator::shrink`]); its lock is held
    /// while an agreement runs.
    pub(crate) shrunk: tokio::sync::Mutex<Option<crate::shrink::LastShrink>>,
    /// How many shrinks of this communicator have succeeded.
    pub(crate) shrinks_done: AtomicU64,
    /// Messages sent per `(rank, tag)`.
    send_seq: std::sync::Mutex<TagCounts>,
    /// Messages received per `(rank, tag)`, and the turns of receives waiting.
    recv_seq: RecvCounts,
    /// Whether this host runs more of the members than it has CPUs ([`CommCore::crowded`]).
    crowded: std::sync::OnceLock<bool>,
    /// How many failed collectives have told the others this node gave up on them, per
    /// lost rank ([`GIVE_UP_NOTICES_PER_LOSS`]).
    pub(crate) give_ups: DashMap<usize, u32>,
    /// Collectives this node told the others it gave up on, of its own or over a loss
    /// (tests).
    #[cfg(test)]
    pub(crate) gave_up_told: std::sync::atomic::AtomicUsize,
}

/// The size from which [`Communicator::recv`] writes a message with streaming stores: twice
/// a core's L2 cache here (2 MiB), where a message written through the cache no longer
/// stays in it for its reader.
pub const RECV_STREAM_BYTES: usize = 4 << 20;

/// How many failed collectives of one communicator tell the other members this node gave
/// up on them, per rank it lost: enough for the calls in flight when the loss struck and a
/// few retries, and not one notice per member for every call of a loop that goes on
/// retrying on a communicator with a lost member.
pub(crate) const GIVE_UP_NOTICES_PER_LOSS: u32 = 16;

/// The last clone of a communicator is gone (and with it every call on it): nothing will
/// take its frames any more, so those buffered are dropped and later ones discarded,
/// collective and point-to-point alike.
impl Drop for CommCore {
    fn drop(&mut self) {
        let table = &self.shared.table;
        table.retire_comm(self.coll_comm());
        table.retire_comm(self.id);
        table.retire_comm(crate::shrink::channel(self.id));
        self.shared.unregister_rpcs(Some(self.id));
    }
}

impl CommCore {
    pub(crate) fn new(
        shared: Arc<NodeShared>,
        id: u64,
        rank: usize,
        members: Arc<[NodeId]>,
    ) -> CommCore {
        CommCore {
            shared,
            id: id & !COLLECTIVE_CHANNEL,
            rank,
            members,
            coll_seq: AtomicU64::new(0),
            compress_seq: AtomicU64::new(0),
            shrink_seq: AtomicU64::new(0),
            shrunk: tokio::sync::Mutex::new(None),
            shrinks_done: AtomicU64::new(0),
            send_seq: std::sync::Mutex::default(),
            recv_seq: RecvCounts::default(),
            crowded: std::sync::OnceLock::new(),
            give_ups: DashMap::new(),
            #[cfg(test)]
            gave_up_told: Default::default(),
        }
    }

    /// True when this host runs more of the communicator's ranks than it has CPUs: this
    /// rank and those reached over loopback, against the available parallelism (ranks on
    /// the same host reached through another address are not counted). Decided at the
    /// first call that asks, when the mesh is up, and kept.
    pub(crate) fn crowded(&self) -> bool {
        *self.crowded.get_or_init(|| {
            let on_host =
                self.members
                    .iter()
                    .filter(|m| {
                        **m == self.shared.id
                            || self.shared.links.get(*m).is_some_and(|l| {
                                l.bulk.remote_addr().ip().to_canonical().is_loopback()
                            })
                    })
                    .count();
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            debug!(rank = self.rank, on_host, cpus, "ranks on this host");
            on_host > cpus
        })
    }

    pub(crate) fn coll_comm(&self) -> u64 {
        self.id | COLLECTIVE_CHANNEL
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    pub(crate) fn node_of(&self, rank: usize) -> Result<NodeId> {
        self.members
            .get(rank)
            .copied()
            .ok_or(NexarError::InvalidRank {
                rank,
                world: self.world(),
            })
    }

    pub(crate) fn rank_of(&self, node: NodeId) -> usize {
        self.members
            .iter()
            .position(|n| *n == node)
            .unwrap_or(usize::MAX)
    }

    /// Why this communicator runs no more calls, if it does not: its node shut down
    /// (`Shutdown`), or aborted after a loss ([`aborted`](Self::aborted)). Every call
    /// checks it, those that send nothing (one rank's, no bytes) too.
    pub(crate) fn refusing(&self) -> Option<NexarError> {
        if self.shared.is_shutting_down() {
            return Some(NexarError::Shutdown);
        }
        self.aborted()
    }

    /// Under the Abort policy once a node is lost, the error every call fails with: the
    /// lowest lost member's rank, or the lowest lost node where no member is lost.
    pub(crate) fn aborted(&self) -> Option<NexarError> {
        let (node, reason) = self.shared.aborted()?;
        let lost = &self.shared.lost;
        let member = self
            .members
            .iter()
            .enumerate()
            .find_map(|(rank, n)| lost.get(n).map(|r| (rank, r.clone())));
        Some(match member {
            Some((rank, reason)) => NexarError::PeerLost { rank, reason },
            None => NexarError::Aborted {
                node: node.0,
                reason,
            },
        })
    }

    fn map_err(&self, e: TransportError, what: &str) -> NexarError {
        if let Some(e) = self.aborted() {
            return e;
        }
        match e {
            // A node of no rank here (a relay's, say) is not named as a rank.
            TransportError::ConnectionLost { peer, reason } => {
                match self.members.iter().position(|n| *n == peer) {
                    Some(rank) => NexarError::PeerLost { rank, reason },
                    None => NexarError::Transport(TransportError::ConnectionLost { peer, reason }),
                }
            }
            TransportError::Timeout(after) => NexarError::Timeout {
                what: what.to_string(),
                after,
            },
            // Another member's collective failed for a loss it saw: so does this one,
            // naming that rank (which this node may still reach: a broken link). A
            // notice that names no other member of this communicator is passed on as
            // it came.
            TransportError::TagAbandoned { by, lost } => self.given_up_error(by, lost),
            TransportError::Closed(_) if self.shared.is_shutting_down() => NexarError::Shutdown,
            other => NexarError::Transport(other),
        }
    }

    /// The failure of a collective that member `node` gave up on after losing rank
    /// `lost`: `PeerLostElsewhere`; a notice that names no other member of this
    /// communicator (or this rank) as the transport's error, as it came.
    pub(crate) fn given_up_error(&self, node: NodeId, lost: u32) -> NexarError {
        let by = self.rank_of(node);
        match usize::try_from(lost) {
            Ok(rank)
                if by < self.world() && rank < self.world() && rank != by && rank != self.rank =>
            {
                NexarError::PeerLostElsewhere { rank, by }
            }
            _ => NexarError::Transport(TransportError::TagAbandoned { by: node, lost }),
        }
    }

    /// Waits for the frame `(comm, tag, step)` from communicator rank `peer`: the whole
    /// payload, or (for a large frame that arrives while this waits) the stream it is
    /// arriving on.
    pub(crate) async fn take_delivery(
        &self,
        peer: usize,
        comm: u64,
        tag: u64,
        step: u64,
        deadline: Instant,
    ) -> Result<Delivery> {
        let key = self.mailbox(peer, comm, tag, step)?;
        let left = deadline.saturating_duration_since(Instant::now());
        let res = self.shared.table.take_delivery(key, left).await;
        res.map_err(|e| self.recv_error(e, peer, tag, step))
    }

    fn mailbox(&self, peer: usize, comm: u64, tag: u64, step: u64) -> Result<MailboxKey> {
        Ok(MailboxKey {
            comm,
            tag,
            step,
            src: self.node_of(peer)?,
        })
    }

    pub(crate) fn recv_error(
        &self,
        e: TransportError,
        peer: usize,
        tag: u64,
        step: u64,
    ) -> NexarError {
        self.peer_error(
            peer,
            e,
            &format!("receive from rank {peer} (tag {tag}, step {step})"),
        )
    }

    /// `e` from an exchange with rank `peer`, as [`map_err`](Self::map_err) says it, or
    /// `PeerLost` when the peer is known lost by now, or its connections closed as a loss
    /// that its peer actor has yet to record (`NodeShared::closed_as_lost`): a stream that
    /// broke because its sender died is that loss, not a fault of the transport. An abort
    /// still says so first, as for every other call.
    fn peer_error(&self, peer: usize, e: TransportError, what: &str) -> NexarError {
        if let Some(e) = self.aborted() {
            return e;
        }
        if let Ok(node) = self.node_of(peer) {
            if let Some(reason) = self.shared.lost.get(&node).map(|r| r.clone()) {
                return NexarError::PeerLost { rank: peer, reason };
            }
            let broke = matches!(
                e,
                TransportError::Send { .. }
                    | TransportError::Truncated { .. }
                    | TransportError::ConnectionLost { .. }
            );
            if let Some(reason) = broke.then(|| self.shared.closed_as_lost(node)).flatten() {
                return NexarError::PeerLost { rank: peer, reason };
            }
        }
        self.map_err(e, what)
    }
}

/// The node of rank `peer`, if frames may be sent to it now: not while the node shuts
/// down, after an abort, or to a peer known lost.
fn sendable(core: &CommCore, peer: usize) -> Result<NodeId> {
    let node = core.node_of(peer)?;
    let shared = &core.shared;
    if let Some(e) = core.refusing() {
        return Err(e);
    }
    if node != shared.id {
        if let Some(reason) = shared.lost.get(&node) {
            return Err(NexarError::PeerLost {
                rank: peer,
                reason: reason.clone(),
            });
        }
    }
    Ok(node)
}

/// A failed send to rank `peer` as the caller sees it: `PeerLost` when the peer has been
/// declared lost meanwhile (the transport error is then only a symptom).
pub(crate) fn send_error(core: &CommCore, peer: usize, e: TransportError) -> NexarError {
    core.peer_error(peer, e, "send")
}

/// The trusted-fabric lane to rank `peer`, when frames to it go over one (a remote peer of
/// a node with `trusted_fabric`); the same checks as [`send_frame`].
pub(crate) fn lane_to(core: &CommCore, peer: usize) -> Result<Option<TcpLane>> {
    let node = sendable(core, peer)?;
    if node == core.shared.id {
        return Ok(None);
    }
    Ok(core.shared.links.get(&node).and_then(|l| l.lane.clone()))
}

/// The QUIC connection that carries large frames to communicator rank `peer`: `None` for
/// this node itself, a peer reached through relays, and one with a trusted lane (data
/// frames go there).
pub(crate) fn bulk_to(core: &CommCore, peer: usize) -> Result<Option<nexar_transport::Connection>> {
    let node = sendable(core, peer)?;
    if node == core.shared.id {
        return Ok(None);
    }
    Ok(core
        .shared
        .links
        .get(&node)
        .and_then(|l| l.lane.is_none().then(|| l.bulk.clone())))
}

/// Sends one frame to communicator rank `peer`, choosing the lane by size. Bytes to self
/// are delivered straight into the local mailbox table.
pub(crate) async fn send_frame(
    core: &CommCore,
    peer: usize,
    comm: u64,
    tag: u64,
    step: u64,
    payload: Payload,
    deadline: Instant,
) -> Result<()> {
    let node = sendable(core, peer)?;
    let shared = &core.shared;
    if node == shared.id {
        let key = MailboxKey {
            comm,
            tag,
            step,
            src: node,
        };
        return shared
            .table
            .deliver_local(key, payload)
            .map_err(|e| core.map_err(e, "local delivery"));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let send = crate::relay::send_to(shared, node, FrameKind::Data, comm, tag, step, payload);
    match tokio::time::timeout(left, send).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(send_error(core, peer, e)),
        Err(_) => Err(NexarError::Timeout {
            what: format!("send to rank {peer}"),
            after: left,
        }),
    }
}

/// Leave to send a point-to-point message over a trusted lane (see [`lane_leave`]).
enum Leave {
    /// Sent unasked, on the lane's credit.
    Credit(Credit),
    /// Announced: sent once the receiver answers (perhaps answered already).
    Announced(Clearance),
}

/// Leave to send point-to-point message `step` of `len` bytes under `tag` over `lane`,
/// into `slot`: on the lane's credit when it has enough ([`TcpLane::take_credit`]), else
/// announced, once the receiver answers ([`TcpLane::announce`]). So a sender running
/// ahead of its receiver is held back there too: it sends at most
/// [`LANE_CREDIT_BYTES`](nexar_transport::LANE_CREDIT_BYTES) unasked, then what the
/// receiver's early-arrival budget holds. Nothing for a message of at most
/// [`MESSAGE_FRAME_BYTES`], which goes at once, as over QUIC, where it shares the message
/// stream and is kept past the budget: held back there, a program whose ranks each send
/// many small messages before receiving would wait on each other until they time out.
async fn lane_leave(
    core: &CommCore,
    lane: &TcpLane,
    peer: usize,
    (tag, step, len): (u64, u64, usize),
    deadline: Instant,
    slot: &mut Option<Leave>,
) -> Result<()> {
    if len <= MESSAGE_FRAME_BYTES {
        return Ok(());
    }
    if let Some(credit) = lane.take_credit(len) {
        *slot = Some(Leave::Credit(credit));
        return Ok(());
    }
    let announce = lane.announce(core.id, tag, step, len);
    let clearance = within(core, peer, deadline, announce).await?;
    let Leave::Announced(clearance) = slot.insert(Leave::Announced(clearance)) else {
        unreachable!("just inserted")
    };
    within(core, peer, deadline, clearance.cleared()).await
}

/// Queues message `step` under `tag` on channel `comm` over `lane` with the leave
/// [`lane_leave`] gave: on its credit, or once its announcement is answered (at once if it
/// was); a message that needs none goes at once.
async fn send_with_leave(
    lane: &TcpLane,
    comm: u64,
    (tag, step): (u64, u64),
    bytes: Bytes,
    leave: Option<Leave>,
) -> std::result::Result<(), TransportError> {
    match leave {
        Some(Leave::Credit(credit)) => lane.send_credited(comm, tag, step, bytes, credit).await,
        Some(Leave::Announced(clearance)) => lane.send_announced(clearance, bytes).await,
        None => lane.send(comm, tag, step, bytes).await,
    }
}

/// Sends point-to-point message `step` to rank `peer` under `tag` (the communicator's
/// point-to-point channel): as [`send_frame`], but over a trusted lane with leave
/// ([`lane_leave`]).
async fn send_message(
    core: &CommCore,
    peer: usize,
    tag: u64,
    step: u64,
    payload: Payload,
    deadline: Instant,
) -> Result<()> {
    if payload.len() > MESSAGE_FRAME_BYTES {
        if let Some(lane) = lane_to(core, peer)? {
            let mut leave = None;
            let what = (tag, step, payload.len());
            lane_leave(core, &lane, peer, what, deadline, &mut leave).await?;
            let send = send_with_leave(&lane, core.id, (tag, step), payload.to_bytes(), leave);
            return within(core, peer, deadline, send).await;
        }
    }
    send_frame(core, peer, core.id, tag, step, payload, deadline).await
}

/// After a point-to-point send of message `step` to `dst` under `tag` finished as `sent`:
/// if it gave up at its deadline (the receiver took nothing while its early-arrival budget
/// was full, or the path was too slow), tells the receiver, in the background, that this
/// message will not come, so that its receive of it fails at once
/// ([`NexarError::Abandoned`]) and the pair's later messages under `tag` stay in step.
/// Other failures get no word: a lost peer's messages are moot, and a receiver that
/// stopped the message's stream has done with it already (its receive gave up while
/// copying it, and counted it; or, a receiver whose `max_frame_bytes` is smaller than this
/// node's, it refused the message on its header and marked it abandoned itself, so that
/// its receive of it fails at once with `Abandoned`). (Messages over this node's own limit
/// are refused before they take a step.)
fn given_up(core: &Arc<CommCore>, dst: usize, tag: u64, step: u64, sent: &Result<()>) {
    if matches!(sent, Err(NexarError::Timeout { .. })) {
        tell_abandoned(core, dst, tag, step);
    }
}

/// Tells rank `dst`, in the background, that message `step` under `tag` will not come
/// (see [`given_up`]).
fn tell_abandoned(core: &Arc<CommCore>, dst: usize, tag: u64, step: u64) {
    tell_abandoned_on(core, core.id, dst, tag, step);
}

/// [`tell_abandoned`] on channel `comm` (the communicator's point-to-point or collective
/// one); `step` may name the whole tag ([`nexar_transport::WHOLE_TAG_STEP`]).
pub(crate) fn tell_abandoned_on(core: &Arc<CommCore>, comm: u64, dst: usize, tag: u64, step: u64) {
    let Ok(node) = sendable(core, dst) else {
        return;
    };
    let core = core.clone();
    tokio::spawn(async move {
        let shared = &core.shared;
        let marker = crate::relay::send_to(
            shared,
            node,
            FrameKind::Abandoned,
            comm,
            tag,
            step,
            Payload::default(),
        );
        match tokio::time::timeout(shared.config.op_timeout, marker).await {
            Ok(Ok(())) => debug!(dst, tag, step, "receiver told of an abandoned send"),
            Ok(Err(e)) => debug!(dst, tag, step, error = %e, "abandoned send not announced"),
            Err(_) => debug!(dst, tag, step, "announcing an abandoned send timed out"),
        }
    });
}

/// Retires an RPC request id when its call ends, whichever way (see `Communicator::rpc`),
/// dropping its reply if that came and was not taken. The reply is the one frame expected
/// under the id, so a large mailbox table is not scanned for others.
struct RetireRequest<'a> {
    table: &'a nexar_transport::MailboxTable,
    reply: MailboxKey,
}

impl Drop for RetireRequest<'_> {
    fn drop(&mut self) {
        self.table.retire_key(self.reply);
    }
}

/// A group of ranks that run point-to-point messages and collectives together.
///
/// Cheap to clone (`Clone + Send + Sync + 'static`). Every rank must call collectives on a
/// communicator in the same order with matching arguments: each call takes the next
/// sequence number of this communicator, which is how ranks agree on a collective's tag
/// without talking. The `async fn` forms take it when their future is first polled, the
/// `_nb` forms when called: futures run together (`join!`, `select!`, spawned tasks) must
/// be first polled in the same order on every rank, or calls with the same arguments
/// would pair up crosswise; where that order is not fixed, start them with the `_nb`
/// forms in program order. Every call has a deadline ([`NodeConfig::op_timeout`](crate::NodeConfig));
/// a lost peer ends it with [`NexarError::PeerLost`].
///
/// Collectives work directly in the caller's buffers (no copy in or out), and only while
/// the call's future is polled: when a call fails, or its future is dropped midway, its
/// output buffer may hold partial results, but nothing writes into it after the future is
/// gone. Inputs (`send` buffers) are only read, and [`reduce`](Communicator::reduce)
/// leaves the buffers of ranks other than the root as they were.
///
/// Poll a collective's future to the end or drop it. Over a trusted-fabric lane
/// ([`NodeConfig::trusted_fabric`](crate::NodeConfig)) a collective writes its sends from
/// your buffer while it is polled, holding the lane to that peer for the frame it is
/// writing: a future kept without being polled holds back other traffic to that peer
/// (until it is polled again or dropped; a dropped one releases the lane at once).
#[derive(Clone, Debug)]
pub struct Communicator {
    pub(crate) core: Arc<CommCore>,
}

fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_of_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    pub(crate) fn new(core: CommCore) -> Communicator {
        Communicator {
            core: Arc::new(core),
        }
    }

    /// This process's rank in the communicator, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.core.world()
    }

    /// The communicator's id (equal on every member).
    pub fn id(&self) -> u64 {
        self.core.id
    }

    /// The node id behind each rank, in rank order.
    pub fn members(&self) -> &[NodeId] {
        &self.core.members
    }

    /// Registers `handler` for RPC `id` on this communicator (replacing any previous one).
    /// The handler gets the caller's rank and the request bytes and returns the reply
    /// bytes or an error message; it is called, and its future run, in a task of its own,
    /// so it may await freely, and a panic in it (before its `async` block or inside it)
    /// fails the call with [`NexarError::RpcFailed`] (`panicked`). Only members of this
    /// communicator reach it: a request from any other node is answered as for an id with
    /// no handler ([`NexarError::RpcUnknown`] at its caller). At most
    /// [`NodeConfig::max_rpc_in_flight`](crate::NodeConfig) requests of one caller run at
    /// once (across this node's handlers); more are refused as busy
    /// ([`NexarError::RpcFailed`]) without calling the handler. The handler is dropped
    /// when it is unregistered or replaced, when the communicator is dropped (its last
    /// clone), and when the node shuts down (one registered after that is dropped at
    /// once, and never called): a handler that holds a clone of its own
    /// communicator keeps it (and the node's state) until one of the others. Calls in
    /// progress run on when the handler is unregistered, and are cancelled (their futures
    /// dropped) when the node shuts down.
    pub fn register_rpc<F, Fut>(&self, id: u32, handler: F)
    where
        F: Fn(usize, Bytes) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = crate::RpcResult> + Send + 'static,
    {
        let handler: crate::rpc::Handler =
            Arc::new(move |rank, bytes| Box::pin(handler(rank, bytes)));
        let reg = crate::rpc::Registration {
            handler,
            members: self.core.members.clone(),
        };
        let shared = &self.core.shared;
        shared.rpc.insert((self.core.id, id), reg);
        // After the insert: a shutdown that began before it may have cleared the handlers
        // already, and this one, holding its communicator maybe, would keep the node's
        // state for good.
        if shared.is_shutting_down() {
            drop(shared.rpc.remove(&(self.core.id, id)));
        }
    }

    /// Removes the handler for RPC `id`; later calls get [`NexarError::RpcUnknown`].
    pub fn unregister_rpc(&self, id: u32) {
        self.core.shared.rpc.remove(&(self.core.id, id));
    }

    /// Calls RPC `id` on rank `rank` with the node's op timeout.
    pub async fn rpc(&self, rank: usize, id: u32, payload: &[u8]) -> Result<Bytes> {
        self.rpc_with_timeout(rank, id, payload, self.core.shared.config.op_timeout)
            .await
    }

    /// Calls RPC `id` on rank `rank` and waits at most `timeout` for the reply. An unknown
    /// id, a handler error or a handler panic is a typed error as soon as the reply comes.
    /// Concurrent calls are matched by request id.
    pub async fn rpc_with_timeout(
        &self,
        rank: usize,
        id: u32,
        payload: &[u8],
        timeout: std::time::Duration,
    ) -> Result<Bytes> {
        self.check_rank(rank)?;
        if payload.len() > crate::rpc::MAX_RPC_REQUEST {
            return Err(NexarError::InvalidArgument(format!(
                "RPC request of {} bytes exceeds the {} byte limit",
                payload.len(),
                crate::rpc::MAX_RPC_REQUEST
            )));
        }
        let shared = &self.core.shared;
        // As every send: after an abort, at shutdown or to a lost rank, fail before the
        // handler runs anywhere (a call to oneself included).
        let node = sendable(&self.core, rank)?;
        let request = shared.next_request.fetch_add(1, Ordering::Relaxed);
        let deadline = crate::deadline_in(timeout);
        let key = MailboxKey {
            comm: crate::rpc::RPC_REPLY_CHANNEL,
            tag: request,
            step: 0,
            src: node,
        };
        // Completed, failed or cancelled (this future dropped): a late reply for this
        // request is discarded on arrival, and the retired-id set can collapse.
        let _retire = RetireRequest {
            table: &shared.table,
            reply: key,
        };
        let body: Result<Bytes> = if node == shared.id {
            // A call to oneself runs the handler here, under the same deadline.
            let serve = crate::rpc::serve(
                shared,
                self.core.id,
                u64::from(id),
                node,
                crate::pool::copied(payload),
            );
            let reply = tokio::time::timeout(timeout, serve)
                .await
                .map(|(reply, _running)| reply)
                .map_err(|_| NexarError::Timeout {
                    what: format!("RPC {id} to rank {rank}"),
                    after: timeout,
                });
            // A handler cancelled by a shutdown (or failed as it began): the call ends as
            // every other does then.
            let served = |r: &Bytes| r.first() == Some(&(crate::rpc::Status::Ok as u8));
            if shared.is_shutting_down() && !reply.as_ref().is_ok_and(served) {
                return Err(NexarError::Shutdown);
            }
            reply
        } else {
            let result = async {
                let send = crate::relay::send_to(
                    shared,
                    node,
                    FrameKind::Control,
                    self.core.id,
                    request,
                    u64::from(id),
                    Payload::from_bytes(crate::pool::copied(payload)),
                );
                match tokio::time::timeout(timeout, send).await {
                    // `PeerLost` when the callee was lost meanwhile, as for every send.
                    Ok(r) => r.map_err(|e| self.core.peer_error(rank, e, "RPC request"))?,
                    Err(_) => {
                        return Err(NexarError::Timeout {
                            what: format!("RPC {id} to rank {rank}"),
                            after: timeout,
                        })
                    }
                }
                let left = deadline.saturating_duration_since(Instant::now());
                shared
                    .table
                    .take(key, left)
                    .await
                    .map_err(|e| self.core.map_err(e, &format!("RPC {id} to rank {rank}")))
            }
            .await;
            result.and_then(|reply| {
                let mut body = vec![0u8; reply.len()];
                reply
                    .copy_to(&mut body)
                    .map_err(|_| NexarError::InvalidArgument("RPC reply length".into()))?;
                Ok(Bytes::from(body))
            })
        };
        let body = body?;
        let (status, rest) = body.split_first().ok_or_else(|| {
            NexarError::InvalidArgument(format!("empty RPC reply from rank {rank}"))
        })?;
        match crate::rpc::Status::from_byte(*status) {
            Some(crate::rpc::Status::Ok) => Ok(body.slice(1..)),
            Some(crate::rpc::Status::UnknownId) => Err(NexarError::RpcUnknown { rank, id }),
            Some(s) => Err(NexarError::RpcFailed {
                rank,
                id,
                message: String::from_utf8_lossy(rest).into_owned(),
                panicked: s == crate::rpc::Status::HandlerPanic,
            }),
            None => Err(NexarError::InvalidArgument(format!(
                "RPC reply with unknown status {status} from rank {rank}"
            ))),
        }
    }

    /// A watch of this communicator's lost ranks: [`Failures::changed`] waits for the next
    /// loss. Losses are seen by the ranks connected to the lost peer (every rank, in a
    /// full mesh).
    pub fn failures(&self) -> Failures {
        let mut f = self.unseen_failures();
        f.seen = f.current();
        f
    }

    /// A watch of this communicator's lost ranks that has reported none yet: its first
    /// [`Failures::changed`] returns at once if some are already known.
    fn unseen_failures(&self) -> Failures {
        Failures {
            rx: self.core.shared.failures.subscribe(),
            shared: self.core.shared.clone(),
            members: self.core.members.clone(),
            seen: Vec::new(),
        }
    }

    /// Under [`RecoveryPolicy::Automatic`](crate::RecoveryPolicy::Automatic): a stream of
    /// rebuilt communicators. After every loss the survivors run [`shrink`] on the latest
    /// communicator by themselves; each result is delivered here (every survivor gets the
    /// same communicator). Under other policies `next` returns `None`. Call it once per
    /// communicator, on every rank; losses already known when it is called are recovered
    /// from too. Called outside a Tokio runtime (the blocking facade's threads), the
    /// recoveries run on the runtime the node started on; only where the node started
    /// outside one too does `next` return [`NexarError::InvalidArgument`].
    ///
    /// [`shrink`]: Communicator::shrink
    pub fn recoveries(&self) -> Recoveries {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        if self.core.shared.config.recovery == crate::RecoveryPolicy::Automatic {
            let Some(runtime) = self.core.shared.runtime_handle() else {
                let _ = tx.try_send(Err(NexarError::InvalidArgument(
                    "recoveries need a Tokio runtime to run in".into(),
                )));
                return Recoveries { rx, _task: None };
            };
            let mut current = self.clone();
            // Taken here, not in the task: a loss between this call and the task's first
            // poll would otherwise count as seen, and this rank would never shrink.
            let mut watch = self.unseen_failures();
            let task = runtime.spawn(async move {
                loop {
                    if watch.changed().await.is_err() {
                        return;
                    }
                    match current.shrink_after_loss().await {
                        Ok(next) => {
                            // A member declared lost while the shrink ran (after its
                            // report came in) is inside `next` and already known: a
                            // watch from now on would never report it.
                            watch = next.unseen_failures();
                            current = next.clone();
                            if tx.send(Ok(next)).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            if tx.send(Err(e)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
            return Recoveries {
                rx,
                _task: Some(crate::AbortOnDrop(task)),
            };
        }
        Recoveries { rx, _task: None }
    }

    /// Per rank of this communicator on another node that this node reaches directly, the
    /// send window its connections take now: the bytes they may have sent and not yet had
    /// acknowledged ([`TransportConfig::send_window`](crate::TransportConfig), one and a
    /// half windows while the cluster has had no more than two nodes; see
    /// [`Connection::set_sole_peer`](nexar_transport::Connection::set_sole_peer)): the
    /// bulk connection's, which its control connection shares. In rank order; ranks on
    /// this node and those reached through a relay are left out. For diagnosing
    /// throughput.
    pub fn send_windows(&self) -> Vec<(usize, u64)> {
        let shared = &self.core.shared;
        self.core
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| **m != shared.id)
            .filter_map(|(r, m)| Some((r, shared.links.get(m)?.bulk.send_window())))
            .collect()
    }

    /// Ranks of this communicator whose peers have been declared lost (heartbeat timeout or
    /// closed connection), or that departed (left the cluster or finished) and closed
    /// their connections, in ascending order: the ranks a
    /// [`shrink`](Communicator::shrink) leaves out.
    pub fn failed_ranks(&self) -> Vec<usize> {
        let shared = &self.core.shared;
        (0..self.world_size())
            .filter(|r| {
                let m = self.core.members[*r];
                shared.lost.contains_key(&m) || shared.is_gone(m)
            })
            .collect()
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world_size() {
            return Err(NexarError::InvalidRank {
                rank,
                world: self.world_size(),
            });
        }
        Ok(())
    }

    fn deadline(&self) -> Instant {
        crate::deadline_in(self.core.shared.config.op_timeout)
    }

    /// Sends `data` to rank `dst` under `tag`. Messages between the same pair with the same
    /// tag are received in the order sent, whatever their sizes. Returns once the bytes are
    /// handed to the transport. A message over 1 MiB to a peer reached directly over QUIC
    /// is copied out in 1 MiB pieces of reused buffers while it is sent, at most
    /// [`NodeConfig::collective_send_budget_bytes`](crate::NodeConfig) ahead of what the
    /// peer has acknowledged, so sending it neither holds a second copy of it nor touches
    /// fresh memory; over a trusted lane it is written straight from `data`; smaller ones,
    /// and relayed ones, are copied whole first. Cancel-safe: if this future is dropped,
    /// what is not yet sent is copied at once and the send finishes in the background, so
    /// the sequence of messages under a tag never has a hole. A send that *fails* at its
    /// deadline (`op_timeout`: the receiver took no message while its early-arrival budget
    /// was full, say) tells the receiver so: the receive of that message fails with
    /// [`NexarError::Abandoned`], and the next one gets this rank's next message under
    /// `tag`, so the pair stays in step. A message that fails is never delivered unless
    /// it had already arrived whole.
    ///
    /// Over a trusted lane a large send writes from `data` while it is polled, holding the
    /// lane to that peer for the whole message, as a collective does (see [`Communicator`]):
    /// poll it to the end or drop it. There a message over 64 KiB goes at once on the
    /// lane's credit: [`LANE_CREDIT_BYTES`](nexar_transport::LANE_CREDIT_BYTES) (64 MiB)
    /// of such messages out, which the receiver gives back in batches once it has taken
    /// them (so up to about half of it may be messages already received). Past that (and
    /// a larger message always) the message waits until the receiver answers that it
    /// takes it: at once when a receive waits for it or the receiver's early-arrival
    /// budget holds it, otherwise when either comes; and a sender has at most
    /// [`LANE_ANNOUNCEMENTS`](nexar_transport::LANE_ANNOUNCEMENTS) (64) such messages
    /// waiting for their answer at once per peer, later ones waiting for a place (so with
    /// 64 waiting for receives that come only after a later message's, that later one
    /// times out, as with QUIC's `max_streams` below). So a sender running ahead of its
    /// receiver makes it hold at most 64 MiB plus its budget in such messages; one that
    /// never gets the answer fails at its deadline, and the receiver is told.
    ///
    /// Over QUIC the receiver's early-arrival budget
    /// ([`TransportConfig::early_budget_bytes`](crate::TransportConfig)) bounds only part
    /// of what a sender running ahead makes it hold. A message over 64 KiB
    /// ([`MESSAGE_FRAME_BYTES`](nexar_transport::MESSAGE_FRAME_BYTES)) travels on a QUIC
    /// stream of its own: once the budget is spent, the receiver leaves such a stream unread
    /// until the receive comes, and QUIC flow control holds the send back (it returns once
    /// QUIC has taken the bytes, so up to a stream window of each such message may wait at
    /// the receiver; one never let through fails at its deadline, and the receiver is told).
    /// But a stream left unread keeps its place among those the sender may open: with
    /// all of them (`max_streams`) waiting so, the message a receive waits for cannot get
    /// one, and that receive times out. Messages of 64 KiB or less (which share one stream
    /// with the sender's heartbeats over QUIC, and go at once over a trusted lane) and
    /// relayed ones (sparse topologies) are never held back for the budget: they are kept
    /// past it. So a sender that loops sends to a receiver that is not receiving grows the
    /// receiver's memory by what it sends in small messages; where that matters, pace it
    /// in the application (a reply, a barrier).
    ///
    /// A communicator counts the messages of each `(rank, tag)` it has sent to (and each
    /// it has received from) until it is dropped. A tag used for one message takes about
    /// 20 bytes on each side, or a bit to 9 bytes where 32 or more such tags share an
    /// aligned block of 65,536 (consecutive tags, a tag per step and kind of message), so
    /// a fresh tag per message (per training step, per request) is cheap; a tag used for
    /// more than one message keeps a counter of its own, some tens of bytes (about a
    /// hundred with its lock on the receiving side).
    pub async fn send<T: Element>(&self, data: &[T], dst: usize, tag: u64) -> Result<()> {
        let bytes = bytes_of(data);
        if bytes.len() > SEND_PIECE_BYTES {
            self.check_rank(dst)?;
            let node = sendable(&self.core, dst)?;
            // A direct neighbour on another node: over its trusted lane if it has one,
            // else over QUIC. Sends to this node itself and relayed ones copy whole.
            let links = (node != self.core.shared.id)
                .then(|| self.core.shared.links.get(&node).map(|l| l.clone()))
                .flatten();
            if let Some(links) = links {
                return match links.lane {
                    Some(lane) => self.send_direct(bytes, lane, dst, tag).await,
                    None => self.send_in_pieces(bytes, links.bulk, dst, tag).await,
                };
            }
        }
        self.send_bytes(crate::pool::copied(bytes), dst, tag).await
    }

    /// [`send`](Self::send) of a large message straight over QUIC: a writer task sends the
    /// frame while this future copies the pieces out for it, within the send budget.
    async fn send_in_pieces(
        &self,
        bytes: &[u8],
        bulk: nexar_transport::Connection,
        dst: usize,
        tag: u64,
    ) -> Result<()> {
        let step = self.next_send_step(dst, tag, bytes.len())?;
        let core = self.core.clone();
        let deadline = self.deadline();
        let len = bytes.len();
        let span = debug_span!("send", rank = self.rank(), dst, tag, bytes = len);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut writer = tokio::spawn(
            async move {
                let send = bulk.send_streamed(FrameKind::Data, core.id, tag, step, len, rx);
                let sent = within(&core, dst, deadline, send).await;
                given_up(&core, dst, tag, step, &sent);
                sent
            }
            .instrument(span),
        );
        let joined = |res: std::result::Result<Result<()>, tokio::task::JoinError>| {
            res.map_err(|e| NexarError::Actor(format!("send task failed: {e}")))?
        };
        let mut feed = PieceFeed {
            src: bytes,
            fed: 0,
            tx,
            pool: self.core.shared.pool.sends().clone(),
            flight: Arc::new(InFlight::default()),
        };
        let budget = self.core.shared.config.collective_send_budget_bytes;
        let f = &mut feed;
        while f.pool.copy_out(f.src, &mut f.fed, &f.tx, &f.flight, budget) == CopiedOut::Budget {
            // Wait for the peer to acknowledge some, or for the writer to give up (it has
            // the deadline).
            tokio::select! {
                () = f.flight.wait() => {}
                res = &mut writer => return joined(res),
            }
        }
        drop(feed);
        joined(writer.await)
    }

    /// [`send`](Self::send) of a large message over a trusted lane: written straight from
    /// `bytes`, with no copy (the lane is plain TCP). Dropped part-way, the rest is
    /// written from a copy in the background ([`DirectSend`]).
    async fn send_direct(&self, bytes: &[u8], lane: TcpLane, dst: usize, tag: u64) -> Result<()> {
        let step = self.next_send_step(dst, tag, bytes.len())?;
        let core = &*self.core;
        let deadline = self.deadline();
        let span = debug_span!("send", rank = self.rank(), dst, tag, bytes = bytes.len());
        let mut job = DirectSend {
            bytes,
            lane,
            core: self.core.clone(),
            dst,
            tag,
            step,
            deadline,
            leave: None,
            frame: None,
            settled: false,
        };
        let res = async {
            let what = (tag, step, bytes.len());
            lane_leave(core, &job.lane, dst, what, deadline, &mut job.leave).await?;
            let len = bytes.len();
            let begin = match job.leave.take() {
                Some(Leave::Credit(credit)) => {
                    // Dropped before the frame begins, the credit goes back, and the
                    // message goes from the copy with leave asked for again (see
                    // `DirectSend`).
                    let begin = job
                        .lane
                        .begin_credited_frame(core.id, tag, step, len, credit);
                    within(core, dst, deadline, begin).await
                }
                leave => {
                    // The answered announcement is kept until the frame begins.
                    job.leave = leave;
                    let lane = job.lane.clone();
                    let begin = async {
                        match job.leave.as_mut() {
                            Some(Leave::Announced(clearance)) => {
                                lane.begin_announced_frame(clearance).await
                            }
                            _ => lane.begin_frame(core.id, tag, step, len).await,
                        }
                    };
                    within(core, dst, deadline, begin).await
                }
            };
            let frame = job.frame.insert(begin?);
            job.leave = None;
            let written = tokio::time::timeout_at(deadline.into(), frame.write_all(bytes)).await;
            match written {
                Ok(Ok(())) => Ok(()),
                // The frame (and the lane's write lock) goes before the wait for the
                // verdict: held, it kept the lane's shutdown, and so the peer's sight of
                // the lane's end, which the verdict comes from, waiting. Nothing is left
                // to finish should this future be dropped meanwhile.
                Ok(Err(e)) => {
                    job.frame = None;
                    job.settled = true;
                    Err(crate::collective::failed_send(core, dst, e, deadline).await)
                }
                Err(_) => Err(crate::collective::send_timeout(core, dst)),
            }
        }
        .instrument(span)
        .await;
        given_up(&self.core, dst, tag, step, &res);
        // Written, or failed: either way nothing is left to finish.
        job.settled = true;
        res
    }

    /// The step of the next message to `dst` under `tag` (messages are numbered per pair
    /// and tag, so they are received in order), for a message of `len` bytes. A message
    /// over `max_frame_bytes` is refused first and takes no step: the pair stays in step,
    /// and the caller can send it in pieces.
    fn next_send_step(&self, dst: usize, tag: u64, len: usize) -> Result<u64> {
        let max = self.core.shared.payload_limit();
        if len as u64 > max {
            return Err(NexarError::Transport(TransportError::FrameTooLarge {
                len: len as u64,
                max,
            }));
        }
        let mut counts = self
            .core
            .send_seq
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Ok(counts.take(dst, tag))
    }

    /// [`send`](Self::send) without the copy: sends the bytes of `data` (elements in
    /// native byte order, as `recv` on the other side expects them) and hands `data` itself
    /// to the transport, which drops its reference once the bytes are written (QUIC:
    /// acknowledged). Send one `Bytes` many times, or a slice of a larger one, without
    /// copying.
    pub async fn send_bytes(&self, payload: Bytes, dst: usize, tag: u64) -> Result<()> {
        self.check_rank(dst)?;
        let step = self.next_send_step(dst, tag, payload.len())?;
        let core = self.core.clone();
        let deadline = self.deadline();
        let span = debug_span!("send", rank = self.rank(), dst, tag, bytes = payload.len());
        let task = tokio::spawn(
            async move {
                let payload = Payload::from_bytes(payload);
                let sent = send_message(&core, dst, tag, step, payload, deadline).await;
                given_up(&core, dst, tag, step, &sent);
                sent
            }
            .instrument(span),
        );
        task.await
            .map_err(|e| NexarError::Actor(format!("send task failed: {e}")))?
    }

    /// Receives the next message from rank `src` under `tag` into `buf`, whose length must
    /// equal the message's ([`NexarError::LengthMismatch`] otherwise; the message is then
    /// consumed). A message of 256 KiB or more that arrives while this receive waits (over
    /// QUIC) is copied into `buf` as its bytes arrive, so it is never held whole in memory;
    /// one that arrived earlier was buffered, and is copied at once. A receive that times
    /// out or is cancelled before its message starts arriving consumes nothing; one that
    /// times out, is cancelled or loses its sender while such a message is being copied in
    /// consumes it (the rest of it is refused, and the sender's send may fail), and the
    /// next receive gets the next message. A message whose sender gave up on it fails its
    /// receive with [`NexarError::Abandoned`] (or, when part of it was being copied in
    /// already, with the transport's `Truncated`), which consumes it too. So does the
    /// message a receive gave up on (timed out or cancelled) at the very moment it was
    /// handed to it as a stream: that message is lost, and the next receive fails with
    /// `Abandoned` for it; and so does a message over this node's
    /// [`max_frame_bytes`](crate::TransportConfig) (a sender whose limit is larger), which
    /// this node refuses. Receives of one `(src, tag)` made concurrently take its messages
    /// in turn; each fails with [`NexarError::Timeout`] `op_timeout` after it was called,
    /// its wait for the receives ahead of it included. A receive holds its turn from its
    /// first poll until it ends: poll it to the end or drop it, for one left pending
    /// unpolled holds back the later receives of its `(src, tag)`.
    ///
    /// A message of [`RECV_STREAM_BYTES`] (4 MiB) or more is written into `buf` with
    /// streaming stores, which bypass the CPU's caches: such a message cannot stay in a
    /// core's cache for its reader anyway, and writing through the cache would first read
    /// every line of `buf` in (bench/HISTORY.md, session 30: 15-18% less CPU per byte for
    /// 16 and 64 MiB messages, 1.1-1.5x the throughput). The first read of it comes from
    /// memory.
    pub async fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u64) -> Result<()> {
        self.check_rank(src)?;
        // The deadline counts from the call, not from the turn: receives queued on one
        // (src, tag) each wait at most `op_timeout` in all, however many are ahead.
        let deadline = self.deadline();
        let core = &*self.core;
        let turn = core.recv_seq.join(src, tag);
        let mut seq = match tokio::time::timeout_at(deadline.into(), turn.count().lock()).await {
            Ok(seq) => seq,
            Err(_) => {
                let after = core.shared.config.op_timeout;
                return Err(core.map_err(
                    TransportError::Timeout(after),
                    &format!("receive from rank {src} (tag {tag}; behind earlier receives)"),
                ));
            }
        };
        let step = *seq;
        let span = debug_span!("recv", rank = self.rank(), src, tag, seq = step);
        async {
            // A large message that arrives while this waits may come as its stream.
            let delivery = match core.take_delivery(src, core.id, tag, step, deadline).await {
                // Its sender gave up on it: the next receive waits for the next message.
                Err(NexarError::Transport(TransportError::Abandoned { .. })) => {
                    *seq += 1;
                    return Err(NexarError::Abandoned { rank: src, tag });
                }
                other => other?,
            };
            // The message belongs to this receive from here on, even if copying it fails
            // part-way: the next receive waits for the next message.
            *seq += 1;
            let esz = T::DTYPE.size();
            let left = deadline.saturating_duration_since(Instant::now());
            // A large message may still be arriving: copied as it comes, until the
            // deadline or until its sender is declared lost. The copy is polled first, so
            // a message already here is always taken.
            let streamed = std::mem::size_of_val(buf) >= RECV_STREAM_BYTES;
            let copy = delivery.copy_into_with(bytes_of_mut(buf), move |to, piece| {
                crate::collective::copy(to, piece, streamed)
            });
            tokio::select! {
                biased;
                res = copy => res.map_err(|e| match e {
                    // In elements when the message is whole elements, else in bytes.
                    TransportError::LengthMismatch { expected, actual } if actual % esz == 0 => {
                        NexarError::LengthMismatch {
                            what: "received message (elements)",
                            expected: expected / esz,
                            actual: actual / esz,
                        }
                    }
                    TransportError::LengthMismatch { expected, actual } => {
                        NexarError::LengthMismatch {
                            what: "received message (bytes; not whole elements)",
                            expected,
                            actual,
                        }
                    }
                    e => core.recv_error(e, src, tag, step),
                }),
                e = crate::collective::ranks_lost(core, Some(src)) => Err(e),
                () = tokio::time::sleep(left) => {
                    Err(core.recv_error(TransportError::Timeout(left), src, tag, step))
                }
            }
        }
        .instrument(span)
        .await
    }

    fn next_tag(&self) -> u64 {
        self.core.coll_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes the next sequence number now (every rank numbers its calls alike, as long as
    /// each polls them first in the same order: see [`Communicator`]) and
    /// returns the collective's claim on it, which can run the schedule later, in another
    /// task if need be. Every collective takes it first, before it checks its arguments:
    /// a call that one rank refuses (a length only its buffers get wrong, a root only it
    /// gets wrong) then uses up its number there as on the ranks that run it, and the
    /// communicator's later calls line up again. Dropped unused, the claim retires its
    /// tag, so the peers' frames for it are discarded, and tells them it gave up on it,
    /// so their parts fail at once instead of at their deadlines.
    pub(crate) fn claim(&self) -> Ticket {
        Ticket::new(self.core.clone(), self.next_tag(), 0)
    }

    /// `claim` with the call's fingerprint, once its arguments are known good.
    fn signed(
        claim: Ticket,
        kind: Kind,
        count: usize,
        root: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Ticket {
        claim.signed(signature(kind, count, dtype, op, root))
    }

    fn cfg(&self) -> &coll::CollectiveConfig {
        &self.core.shared.config.collectives
    }

    /// Blocks until every rank has entered the barrier (dissemination algorithm).
    pub async fn barrier(&self) -> Result<()> {
        let s = coll::barrier(self.rank(), self.world_size())?;
        Self::signed(
            self.claim(),
            Kind::Barrier,
            0,
            0,
            DataType::U8,
            ReduceOp::Sum,
        )
        .run(
            s,
            &mut Buffers::host(&mut [], &[]),
            DataType::U8,
            ReduceOp::Sum,
        )
        .await
    }

    /// Runs an in-place collective on `buf` itself, and finalises Avg in all of it when
    /// `finalize`.
    ///
    /// Running on `buf` is sound even if this future is dropped midway: the driver
    /// touches `buf` only while this future is polled (see `collective`).
    #[allow(clippy::too_many_arguments)]
    async fn run_in_place<T: Element>(
        &self,
        claim: Ticket,
        kind: Kind,
        root: usize,
        schedule: Box<dyn coll::Schedule>,
        buf: &mut [T],
        op: ReduceOp,
        finalize: bool,
    ) -> Result<()> {
        let ticket = Self::signed(claim, kind, buf.len(), root, T::DTYPE, op);
        let bufs = Buffers::host(bytes_of_mut(buf), &[]);
        self.run_on(
            ticket,
            schedule,
            bufs,
            T::DTYPE,
            op,
            Finalize::all_if(finalize),
        )
        .await
    }

    /// Runs `schedule` on `bufs`, then finalises Avg in the part of Data that `finalize`
    /// names (once the transport has returned every range it was lent).
    async fn run_on(
        &self,
        ticket: Ticket,
        schedule: Box<dyn coll::Schedule>,
        mut bufs: Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
        finalize: Finalize,
    ) -> Result<()> {
        // One deadline for the call: waiting for the loans to come back gets what is left.
        let deadline = crate::deadline_in(self.core.shared.config.op_timeout);
        let world = self.world_size();
        let result = finalize.range(bufs.data.len(), world);
        if prescales(dtype, op) {
            return Self::run_prescaled(ticket, schedule, bufs, dtype, op, result, world, deadline)
                .await;
        }
        ticket
            .run_by(schedule, &mut bufs, dtype, op, deadline)
            .await?;
        let Some(range) = result.filter(|_| op == ReduceOp::Avg) else {
            return Ok(());
        };
        let block = writable(&mut bufs.data, range, deadline).await?;
        nexar_device::finalize_bytes(dtype, op, block, world)?;
        Ok(())
    }

    /// [`run_on`](Self::run_on) for an op that [`prescales`]: every rank's contribution
    /// is divided by the world size before the reduction, and the result is not divided
    /// after. The contribution is the send buffer when there is one (scaled in a copy,
    /// which is then sent from instead of lending the caller's), else Data: scaled where
    /// it is when all of it is the result (`result`), else in a copy that the schedule
    /// runs on, whose `result` range is then written back, so the rest of Data stays as
    /// it was (a non-root's reduce, an in-place reduce-scatter's other blocks).
    #[allow(clippy::too_many_arguments)]
    async fn run_prescaled(
        ticket: Ticket,
        schedule: Box<dyn coll::Schedule>,
        mut bufs: Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
        result: Option<std::ops::Range<usize>>,
        world: usize,
        deadline: Instant,
    ) -> Result<()> {
        if !bufs.input.is_empty() {
            let scaled = scaled_copy(dtype, op, bufs.input, world)?;
            return ticket
                .run_by(schedule, &mut bufs.reading(&scaled), dtype, op, deadline)
                .await;
        }
        let len = bufs.data.len();
        if result == Some(0..len) {
            let all = writable(&mut bufs.data, 0..len, deadline).await?;
            nexar_device::finalize_bytes(dtype, op, all, world)?;
            return ticket
                .run_by(schedule, &mut bufs, dtype, op, deadline)
                .await;
        }
        let whole = bufs
            .data
            .get(0..len)
            .ok_or_else(|| NexarError::InvalidArgument("Data past its own length".into()))?;
        let mut scaled = scaled_copy(dtype, op, whole, world)?;
        ticket
            .run_by(
                schedule,
                &mut Buffers::host(&mut scaled, &[]),
                dtype,
                op,
                deadline,
            )
            .await?;
        if let Some(range) = result {
            let block = writable(&mut bufs.data, range.clone(), deadline).await?;
            block.copy_from_slice(&scaled[range]);
        }
        Ok(())
    }

    /// Which buffers of an input/output collective this rank uses, `(send, recv)`:
    /// gather's `recv` and scatter's `send` only on root (the schedule gives other ranks
    /// none), everything else both.
    fn io_used(&self, kind: Kind, root: usize) -> (bool, bool) {
        let is_root = self.rank() == root;
        (
            kind != Kind::Scatter || is_root,
            kind != Kind::Gather || is_root,
        )
    }

    /// Runs an input/output collective ([`Communicator::plan_io`]) that reads `send` and
    /// writes `recv`, both in place (finalising Avg in `recv`).
    async fn run_io<T: Element>(
        &self,
        kind: Kind,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.run_io_claimed(self.claim(), kind, send, recv, op, root)
            .await
    }

    /// [`run_io`](Self::run_io) on a number already claimed.
    async fn run_io_claimed<T: Element>(
        &self,
        claim: Ticket,
        kind: Kind,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let (s, count) = self.plan_io(kind, send.len(), recv.len(), T::DTYPE, op, root)?;
        let (uses_send, uses_recv) = self.io_used(kind, root);
        let send: &[T] = if uses_send { send } else { &[] };
        let recv: &mut [T] = if uses_recv { recv } else { &mut [] };
        let ticket = Self::signed(claim, kind, count, root, T::DTYPE, op);
        let bufs = Buffers::host(bytes_of_mut(recv), bytes_of(send));
        self.run_on(ticket, s, bufs, T::DTYPE, op, Finalize::All)
            .await
    }

    /// Reduces `buf` element-wise across all ranks; every rank gets the result.
    /// [`ReduceOp::Avg`] divides the sum by the world size (floats only; in `f16` each
    /// contribution is divided first, see [`ReduceOp::Avg`]). After an error `buf` holds
    /// no defined value (a partial reduction; in `f16` Avg it may already be divided).
    pub async fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_claimed(self.claim(), buf, op).await
    }

    /// [`all_reduce`](Self::all_reduce) on a number already claimed.
    pub(crate) async fn all_reduce_claimed<T: Element>(
        &self,
        claim: Ticket,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let s = coll::all_reduce(
            self.rank(),
            self.world_size(),
            buf.len(),
            T::DTYPE,
            op,
            self.cfg(),
        )?;
        self.run_in_place(claim, Kind::AllReduce, 0, s, buf, op, true)
            .await
    }

    /// Copies root's `buf` into every rank's `buf` (all the same length).
    pub async fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_claimed(self.claim(), buf, root).await
    }

    /// [`broadcast`](Self::broadcast) on a number already claimed.
    pub(crate) async fn broadcast_claimed<T: Element>(
        &self,
        claim: Ticket,
        buf: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_rank(root)?;
        let s = coll::broadcast(
            self.rank(),
            self.world_size(),
            buf.len(),
            T::DTYPE,
            root,
            self.cfg(),
        )?;
        self.run_in_place(claim, Kind::Broadcast, root, s, buf, ReduceOp::Sum, false)
            .await
    }

    /// Reduces `buf` across ranks into root's `buf`; other ranks' buffers are unchanged.
    pub async fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let claim = self.claim();
        self.check_rank(root)?;
        let s = coll::reduce(
            self.rank(),
            self.world_size(),
            buf.len(),
            T::DTYPE,
            op,
            root,
            self.cfg(),
        )?;
        // The schedules never write a non-root's Data (they reduce in scratch there), so
        // the caller's buffer serves as it is; only the root's result is finalised.
        let is_root = self.rank() == root;
        self.run_in_place(claim, Kind::Reduce, root, s, buf, op, is_root)
            .await
    }

    /// Checks the element counts of a collective that reads a send buffer and writes a
    /// receive buffer, and builds its schedule. Returns the schedule and the count that
    /// goes into the call fingerprint (equal on every rank). Shared by the slice and the
    /// `*_in` forms, so both enforce the same contract.
    #[allow(clippy::too_many_arguments)]
    fn plan_io(
        &self,
        kind: Kind,
        send: usize,
        recv: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(Box<dyn coll::Schedule>, usize)> {
        let (rank, world, cfg) = (self.rank(), self.world_size(), self.cfg());
        let is_root = rank == root;
        match kind {
            Kind::AllGather | Kind::SplitGather | Kind::CompressedGather => {
                expect_len("all_gather recv (elements)", per_rank(send, world)?, recv)?;
                Ok((coll::all_gather(rank, world, send, dtype, cfg)?, send))
            }
            Kind::ReduceScatter => {
                expect_len(
                    "reduce_scatter send (elements)",
                    per_rank(recv, world)?,
                    send,
                )?;
                Ok((
                    coll::reduce_scatter(rank, world, recv, dtype, op, cfg)?,
                    recv,
                ))
            }
            Kind::Gather => {
                self.check_rank(root)?;
                if is_root {
                    expect_len(
                        "gather recv on root (elements)",
                        per_rank(send, world)?,
                        recv,
                    )?;
                }
                Ok((coll::gather(rank, world, send, dtype, root, cfg)?, send))
            }
            Kind::Scatter => {
                self.check_rank(root)?;
                if is_root {
                    expect_len(
                        "scatter send on root (elements)",
                        per_rank(recv, world)?,
                        send,
                    )?;
                }
                Ok((coll::scatter(rank, world, recv, dtype, root, cfg)?, recv))
            }
            Kind::AllToAll => {
                expect_len("all_to_all recv (elements)", send, recv)?;
                if send % world != 0 {
                    return Err(NexarError::InvalidArgument(format!(
                        "all_to_all buffers of {send} elements do not split into {world} equal blocks"
                    )));
                }
                Ok((
                    coll::all_to_all(rank, world, send / world, dtype, cfg)?,
                    send,
                ))
            }
            other => Err(NexarError::InvalidArgument(format!(
                "{other:?} is not an input/output collective"
            ))),
        }
    }

    /// Gathers every rank's `send` into every rank's `recv`, rank-major:
    /// `recv.len() == send.len() * world_size()`.
    pub async fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.run_io(Kind::AllGather, send, recv, ReduceOp::Sum, 0)
            .await
    }

    /// [`all_gather`](Self::all_gather) on a number already claimed.
    pub(crate) async fn all_gather_claimed<T: Element>(
        &self,
        claim: Ticket,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        self.run_io_claimed(claim, Kind::AllGather, send, recv, ReduceOp::Sum, 0)
            .await
    }

    /// Reduces `send` across ranks and leaves block `rank` of the result in `recv`
    /// (MPI and NCCL order): `send.len() == recv.len() * world_size()`.
    pub async fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.run_io(Kind::ReduceScatter, send, recv, op, 0).await
    }

    /// [`Communicator::all_gather`] in place (MPI's `MPI_IN_PLACE`): `buf` holds
    /// `world_size()` blocks of equal length, this rank's contribution in block `rank()`;
    /// afterwards every block holds its rank's. There is no copy of the own block and no
    /// second buffer, except for small buffers (under `CollectiveConfig::small_bytes`) on
    /// worlds that are not a power of two, whose Bruck algorithm gathers into a scratch
    /// buffer of `buf`'s size and copies the blocks back. Ranks may mix this form with the
    /// others.
    pub async fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let bufs = Buffers::host(bytes_of_mut(buf), &[]);
        self.run_placed(Kind::AllGather, bufs, T::DTYPE, ReduceOp::Sum)
            .await
    }

    /// [`Communicator::reduce_scatter`] in place: `buf` holds this rank's input,
    /// `world_size()` blocks of equal length; afterwards block `rank()` holds that block
    /// reduced over all ranks, and the other blocks are as they were. Ranks may mix this
    /// form with the others.
    pub async fn reduce_scatter_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let bufs = Buffers::host(bytes_of_mut(buf), &[]);
        self.run_placed(Kind::ReduceScatter, bufs, T::DTYPE, op)
            .await
    }

    /// [`Communicator::all_gather_in_place`] on a [`ZeroCopyBuffer`] (sent from without
    /// copies).
    pub async fn all_gather_in_place_zero_copy<T: Element>(
        &self,
        buf: &mut ZeroCopyBuffer<T>,
    ) -> Result<()> {
        let bufs = Buffers::lending(buf.region(), &[], None);
        self.run_placed(Kind::AllGather, bufs, T::DTYPE, ReduceOp::Sum)
            .await
    }

    /// [`Communicator::reduce_scatter_in_place`] on a [`ZeroCopyBuffer`] (sent from
    /// without copies).
    pub async fn reduce_scatter_in_place_zero_copy<T: Element>(
        &self,
        buf: &mut ZeroCopyBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let bufs = Buffers::lending(buf.region(), &[], None);
        self.run_placed(Kind::ReduceScatter, bufs, T::DTYPE, op)
            .await
    }

    /// Runs all-gather or reduce-scatter in place on `bufs.data`, `world_size()` equal
    /// blocks of `dtype`; a reduce-scatter's Avg is finalised in block `rank()` alone.
    async fn run_placed(
        &self,
        kind: Kind,
        bufs: Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let claim = self.claim();
        let (rank, world, cfg) = (self.rank(), self.world_size(), self.cfg());
        let len = bufs.data.len() / dtype.size();
        if len % world != 0 {
            return Err(NexarError::InvalidArgument(format!(
                "{kind:?} in place: a buffer of {len} elements does not split into {world} equal blocks"
            )));
        }
        let count = len / world;
        let (s, finalize) = match kind {
            Kind::AllGather => (
                coll::all_gather_in_place(rank, world, count, dtype, cfg)?,
                Finalize::Nothing,
            ),
            Kind::ReduceScatter => (
                coll::reduce_scatter_in_place(rank, world, count, dtype, op, cfg)?,
                Finalize::Block(rank),
            ),
            other => {
                return Err(NexarError::InvalidArgument(format!(
                    "{other:?} has no in-place form"
                )))
            }
        };
        let ticket = Self::signed(claim, kind, count, 0, dtype, op);
        self.run_on(ticket, s, bufs, dtype, op, finalize).await
    }

    /// [`Communicator::all_reduce`] on a [`ZeroCopyBuffer`]: what it sends is read from
    /// the buffer itself instead of a copy (see the type for what that asks of writes).
    /// Sends under 64 KiB are still copied. With [`ReduceOp::Avg`] the final division
    /// waits until the peers have acknowledged every lent range, within the node's
    /// `op_timeout`.
    pub async fn all_reduce_zero_copy<T: Element>(
        &self,
        buf: &mut ZeroCopyBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let claim = self.claim();
        let (rank, world) = (self.rank(), self.world_size());
        let s = coll::all_reduce(rank, world, buf.len(), T::DTYPE, op, self.cfg())?;
        let ticket = Self::signed(claim, Kind::AllReduce, buf.len(), 0, T::DTYPE, op);
        let bufs = Buffers::lending(buf.region(), &[], None);
        self.run_on(ticket, s, bufs, T::DTYPE, op, Finalize::All)
            .await
    }

    /// [`Communicator::broadcast`] on a [`ZeroCopyBuffer`] (sent from without copies).
    pub async fn broadcast_zero_copy<T: Element>(
        &self,
        buf: &mut ZeroCopyBuffer<T>,
        root: usize,
    ) -> Result<()> {
        let claim = self.claim();
        self.check_rank(root)?;
        let (rank, world) = (self.rank(), self.world_size());
        let s = coll::broadcast(rank, world, buf.len(), T::DTYPE, root, self.cfg())?;
        let ticket = Self::signed(
            claim,
            Kind::Broadcast,
            buf.len(),
            root,
            T::DTYPE,
            ReduceOp::Sum,
        );
        let bufs = Buffers::lending(buf.region(), &[], None);
        self.run_on(ticket, s, bufs, T::DTYPE, ReduceOp::Sum, Finalize::Nothing)
            .await
    }

    /// [`Communicator::reduce`] on a [`ZeroCopyBuffer`]: what it sends is read from the
    /// buffer itself instead of a copy. The root's buffer ends with the result; the
    /// others' are only read (lent to the transport, never written), so they are as they
    /// were. With [`ReduceOp::Avg`] the root's final division waits until the peers have
    /// acknowledged every lent range, within the node's `op_timeout`.
    pub async fn reduce_zero_copy<T: Element>(
        &self,
        buf: &mut ZeroCopyBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let claim = self.claim();
        self.check_rank(root)?;
        let (rank, world) = (self.rank(), self.world_size());
        let s = coll::reduce(rank, world, buf.len(), T::DTYPE, op, root, self.cfg())?;
        let ticket = Self::signed(claim, Kind::Reduce, buf.len(), root, T::DTYPE, op);
        let bufs = Buffers::lending(buf.region(), &[], None);
        let finalize = Finalize::all_if(rank == root);
        self.run_on(ticket, s, bufs, T::DTYPE, op, finalize).await
    }

    /// [`Communicator::all_gather`] on [`ZeroCopyBuffer`]s (sent from without copies).
    pub async fn all_gather_zero_copy<T: Element>(
        &self,
        send: &ZeroCopyBuffer<T>,
        recv: &mut ZeroCopyBuffer<T>,
    ) -> Result<()> {
        self.run_io_zero_copy(Kind::AllGather, send, recv, ReduceOp::Sum, 0)
            .await
    }

    /// [`Communicator::reduce_scatter`] on [`ZeroCopyBuffer`]s (sent from without
    /// copies).
    pub async fn reduce_scatter_zero_copy<T: Element>(
        &self,
        send: &ZeroCopyBuffer<T>,
        recv: &mut ZeroCopyBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.run_io_zero_copy(Kind::ReduceScatter, send, recv, op, 0)
            .await
    }

    /// [`Communicator::gather`] on [`ZeroCopyBuffer`]s (sent from without copies); `recv`
    /// is used only on root.
    pub async fn gather_zero_copy<T: Element>(
        &self,
        send: &ZeroCopyBuffer<T>,
        recv: &mut ZeroCopyBuffer<T>,
        root: usize,
    ) -> Result<()> {
        self.run_io_zero_copy(Kind::Gather, send, recv, ReduceOp::Sum, root)
            .await
    }

    /// [`Communicator::scatter`] on [`ZeroCopyBuffer`]s (sent from without copies);
    /// `send` is used only on root.
    pub async fn scatter_zero_copy<T: Element>(
        &self,
        send: &ZeroCopyBuffer<T>,
        recv: &mut ZeroCopyBuffer<T>,
        root: usize,
    ) -> Result<()> {
        self.run_io_zero_copy(Kind::Scatter, send, recv, ReduceOp::Sum, root)
            .await
    }

    /// [`Communicator::all_to_all`] on [`ZeroCopyBuffer`]s (sent from without copies).
    pub async fn all_to_all_zero_copy<T: Element>(
        &self,
        send: &ZeroCopyBuffer<T>,
        recv: &mut ZeroCopyBuffer<T>,
    ) -> Result<()> {
        self.run_io_zero_copy(Kind::AllToAll, send, recv, ReduceOp::Sum, 0)
            .await
    }

    /// [`Communicator::run_io`] on zero-copy buffers.
    async fn run_io_zero_copy<T: Element>(
        &self,
        kind: Kind,
        send: &ZeroCopyBuffer<T>,
        recv: &mut ZeroCopyBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let claim = self.claim();
        let (s, count) = self.plan_io(kind, send.len(), recv.len(), T::DTYPE, op, root)?;
        let (uses_send, uses_recv) = self.io_used(kind, root);
        let data = if uses_recv {
            recv.region()
        } else {
            Region::new(&mut [])
        };
        let (input, lender) = if uses_send {
            let (input, lender) = send.lent_input();
            (input, Some(lender))
        } else {
            (&[][..], None)
        };
        let ticket = Self::signed(claim, kind, count, root, T::DTYPE, op);
        let bufs = Buffers::lending(data, input, lender);
        self.run_on(ticket, s, bufs, T::DTYPE, op, Finalize::All)
            .await
    }

    /// Gathers every rank's `send` into root's `recv` (rank-major, `send.len() * world`
    /// elements). `recv` is used only on root; elsewhere it may be empty.
    pub async fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.run_io(Kind::Gather, send, recv, ReduceOp::Sum, root)
            .await
    }

    /// Splits root's `send` (`recv.len() * world` elements, rank-major) so rank `i` gets
    /// block `i` in `recv`. `send` is used only on root.
    pub async fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.run_io(Kind::Scatter, send, recv, ReduceOp::Sum, root)
            .await
    }

    /// Block `j` of this rank's `send` lands as block `rank` of rank `j`'s `recv`. Both
    /// buffers hold `block * world_size()` elements.
    pub async fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.run_io(Kind::AllToAll, send, recv, ReduceOp::Sum, 0)
            .await
    }

    /// Inclusive prefix reduction: rank `r` gets `op` over ranks `0..=r`.
    /// [`ReduceOp::Avg`] is not supported for scans.
    pub async fn scan<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.scan_impl(buf, op, false).await
    }

    /// Exclusive prefix reduction: rank `r` gets `op` over ranks `0..r`; rank 0 gets the
    /// identity of `op`.
    pub async fn exclusive_scan<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.scan_impl(buf, op, true).await
    }

    async fn scan_impl<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        exclusive: bool,
    ) -> Result<()> {
        let claim = self.claim();
        let s = coll::scan(
            self.rank(),
            self.world_size(),
            buf.len(),
            T::DTYPE,
            op,
            exclusive,
            self.cfg(),
        )?;
        let kind = if exclusive {
            Kind::ExclusiveScan
        } else {
            Kind::Scan
        };
        self.run_in_place(claim, kind, 0, s, buf, op, false).await
    }

    /// Reduces many tensors as one bucketed all-reduce (what gradient synchronisation
    /// needs): the tensors are packed into one buffer, reduced once and unpacked.
    pub async fn all_reduce_many<T: Element>(
        &self,
        tensors: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let total: usize = tensors.iter().map(|t| t.len()).sum();
        let mut bucket = Vec::with_capacity(total);
        for t in tensors.iter() {
            bucket.extend_from_slice(t);
        }
        self.all_reduce(&mut bucket, op).await?;
        let mut off = 0;
        for t in tensors.iter_mut() {
            let n = t.len();
            t.copy_from_slice(&bucket[off..off + n]);
            off += n;
        }
        Ok(())
    }

    /// The runtime a `_nb` call runs its collective on: the caller's, else (a call made
    /// outside any runtime) the one its node started on. Looked up before the call takes
    /// its sequence number: where there is none at all, the call fails without taking
    /// one, so that this rank's later calls keep in step with the other ranks'. Callers
    /// enter it before they take the number: a call refused after that (a bad root, a
    /// length that does not split) tells the other ranks it gave up from this runtime,
    /// which it could not do from a thread outside any (they would wait for it until
    /// their deadline).
    fn background(&self) -> Result<tokio::runtime::Handle> {
        self.core.shared.runtime_handle().ok_or_else(|| {
            NexarError::InvalidArgument(
                "non-blocking collectives need a tokio runtime, and this node started \
                 outside one (the call took no sequence number)"
                    .into(),
            )
        })
    }

    fn spawn<R: Send + 'static>(
        runtime: tokio::runtime::Handle,
        fut: impl std::future::Future<Output = Result<R>> + Send + 'static,
    ) -> Pending<R> {
        Pending {
            task: runtime.spawn(fut),
        }
    }

    /// Non-blocking all-reduce that owns its buffer: the sequence number is taken now, the
    /// collective runs in the background, and [`Pending::wait`] gives the buffer back.
    /// Many may be in flight on one communicator; every rank must start them in the same
    /// order. Called outside a tokio runtime (from the blocking facade's threads, say),
    /// the `_nb` forms run their collective on the runtime their node started on.
    pub fn all_reduce_nb<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Pending<Vec<T>>> {
        let runtime = self.background()?;
        let _inside = runtime.enter();
        let claim = self.claim();
        let world = self.world_size();
        let s = coll::all_reduce(self.rank(), world, buf.len(), T::DTYPE, op, self.cfg())?;
        let ticket = Self::signed(claim, Kind::AllReduce, buf.len(), 0, T::DTYPE, op);
        Ok(Self::spawn(runtime.clone(), async move {
            let data = bytes_of_mut(&mut buf);
            divide_avg(T::DTYPE, op, data, world, true)?;
            ticket
                .run(s, &mut Buffers::host(data, &[]), T::DTYPE, op)
                .await?;
            divide_avg(T::DTYPE, op, data, world, false)?;
            Ok(buf)
        }))
    }

    /// Non-blocking [`broadcast`](Communicator::broadcast) that owns its buffer.
    pub fn broadcast_nb<T: Element>(
        &self,
        mut buf: Vec<T>,
        root: usize,
    ) -> Result<Pending<Vec<T>>> {
        let runtime = self.background()?;
        let _inside = runtime.enter();
        let claim = self.claim();
        self.check_rank(root)?;
        let s = coll::broadcast(
            self.rank(),
            self.world_size(),
            buf.len(),
            T::DTYPE,
            root,
            self.cfg(),
        )?;
        let (dtype, op) = (T::DTYPE, ReduceOp::Sum);
        let ticket = Self::signed(claim, Kind::Broadcast, buf.len(), root, dtype, op);
        Ok(Self::spawn(runtime.clone(), async move {
            let data = bytes_of_mut(&mut buf);
            ticket
                .run(s, &mut Buffers::host(data, &[]), dtype, op)
                .await?;
            Ok(buf)
        }))
    }

    /// Non-blocking [`all_gather`](Communicator::all_gather): returns the gathered vector
    /// (`send.len() * world` elements).
    pub fn all_gather_nb<T: Element>(&self, send: Vec<T>) -> Result<Pending<Vec<T>>> {
        let runtime = self.background()?;
        let _inside = runtime.enter();
        let claim = self.claim();
        let world = self.world_size();
        let s = coll::all_gather(self.rank(), world, send.len(), T::DTYPE, self.cfg())?;
        let (dtype, op) = (T::DTYPE, ReduceOp::Sum);
        let ticket = Self::signed(claim, Kind::AllGather, send.len(), 0, dtype, op);
        Ok(Self::spawn(runtime.clone(), async move {
            let mut out = vec![T::zeroed(); send.len() * world];
            ticket
                .run(
                    s,
                    &mut Buffers::host(bytes_of_mut(&mut out), bytes_of(&send)),
                    dtype,
                    op,
                )
                .await?;
            Ok(out)
        }))
    }

    /// Non-blocking [`reduce_scatter`](Communicator::reduce_scatter): returns this rank's
    /// block (`send.len() / world` elements).
    pub fn reduce_scatter_nb<T: Element>(
        &self,
        send: Vec<T>,
        op: ReduceOp,
    ) -> Result<Pending<Vec<T>>> {
        let runtime = self.background()?;
        let _inside = runtime.enter();
        let claim = self.claim();
        let world = self.world_size();
        if send.len() % world != 0 {
            return Err(NexarError::InvalidArgument(format!(
                "reduce_scatter of {} elements does not split into {world} equal blocks",
                send.len()
            )));
        }
        let n = send.len() / world;
        let s = coll::reduce_scatter(self.rank(), world, n, T::DTYPE, op, self.cfg())?;
        let ticket = Self::signed(claim, Kind::ReduceScatter, n, 0, T::DTYPE, op);
        Ok(Self::spawn(runtime.clone(), async move {
            let mut send = send;
            divide_avg(T::DTYPE, op, bytes_of_mut(&mut send), world, true)?;
            let mut out = vec![T::zeroed(); n];
            let data = bytes_of_mut(&mut out);
            ticket
                .run(s, &mut Buffers::host(data, bytes_of(&send)), T::DTYPE, op)
                .await?;
            divide_avg(T::DTYPE, op, data, world, false)?;
            Ok(out)
        }))
    }

    /// Sum all-reduce of a compressed gradient: each rank compresses `buf` (plus its error
    /// feedback `residual`, which this call updates with what was not sent) with `codec`,
    /// the compressed blocks are all-gathered, and every rank decodes and accumulates them
    /// in rank order, so all ranks end with the same `buf`: the sum of what every rank
    /// sent (divide by [`world_size`](Communicator::world_size) for a mean). A malformed
    /// block from a peer is an error, never an out-of-bounds write. Every rank must call
    /// it with the same codec and length.
    ///
    /// On any error `buf` and `residual` are left as they were, so the step can be retried
    /// or skipped without sending a gradient twice or losing what was held back.
    pub async fn all_reduce_compressed<T: coll::CompressElement>(
        &self,
        buf: &mut [T],
        codec: &coll::Codec,
        residual: &mut coll::Residual<T>,
    ) -> Result<()> {
        // Both numbers first, before any check, as every collective does (see `claim`).
        let claim = self.claim();
        let step = self.core.compress_seq.fetch_add(1, Ordering::Relaxed);
        expect_len(
            "all_reduce_compressed residual (elements)",
            buf.len(),
            residual.len(),
        )?;
        let mut held = residual.clone();
        let sparse = coll::compress_with_feedback(codec, step, buf, &mut held)?;
        let block = codec.wire_bytes(buf.len(), T::DTYPE);
        let encoded = coll::encode(&sparse);
        expect_len("compressed block (bytes)", block, encoded.len())?;
        let world = self.world_size();
        let mut all = vec![0u8; block * world];
        self.run_io_claimed(
            claim,
            Kind::CompressedGather,
            &encoded,
            &mut all,
            ReduceOp::Sum,
            0,
        )
        .await?;
        let mut sum = vec![T::zeroed(); buf.len()];
        for chunk in all.chunks_exact(block.max(1)).take(world) {
            let s = coll::decode::<T>(chunk, sum.len())?;
            coll::accumulate(&mut sum, &s)?;
        }
        buf.copy_from_slice(&sum);
        *residual = held;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_in<M: DeviceMemory>(
        &self,
        claim: Ticket,
        kind: Kind,
        count: usize,
        root: usize,
        schedule: Box<dyn coll::Schedule>,
        mut mem: M,
        mut input: Vec<u8>,
        op: ReduceOp,
        finalize: bool,
    ) -> Result<M> {
        let (dtype, world) = (mem.dtype(), self.world_size());
        let ticket = Self::signed(claim, kind, count, root, dtype, op);
        let first = prescales(dtype, op);
        // Where the contribution is divided first (see `prescales`): the staged send
        // buffer, or `mem` where it is the result; a non-root's reduce leaves `mem` as it
        // was and sends from a scaled host copy.
        if first && !input.is_empty() {
            nexar_device::finalize_bytes(dtype, op, &mut input, world)?;
        } else if first && finalize {
            mem.finalize(op, world)?;
        } else if first {
            let mut host = Self::staged(&mem)?;
            nexar_device::finalize_bytes(dtype, op, &mut host, world)?;
            ticket
                .run(schedule, &mut Buffers::host(&mut host, &[]), dtype, op)
                .await?;
            return Ok(mem);
        }
        ticket
            .run(schedule, &mut Buffers::device(&mut mem, &input), dtype, op)
            .await?;
        if finalize && !first {
            mem.finalize(op, world)?;
        }
        Ok(mem)
    }

    fn staged<M: DeviceMemory>(send: &M) -> Result<Vec<u8>> {
        let mut host = vec![0u8; send.byte_len()];
        send.read(0, &mut host)?;
        Ok(host)
    }

    /// The elements `mem` holds; a length that is not a whole number of them (the
    /// `DeviceMemory` contract forbids it) is an argument error, not rounded down.
    fn elements<M: DeviceMemory>(mem: &M) -> Result<usize> {
        let (len, size) = (mem.byte_len(), mem.dtype().size());
        if len % size != 0 {
            return Err(NexarError::InvalidArgument(format!(
                "a buffer of {len} bytes is not a whole number of {:?} elements ({size} bytes each)",
                mem.dtype()
            )));
        }
        Ok(len / size)
    }

    /// [`all_reduce`](Communicator::all_reduce) of a buffer where it lives (e.g. GPU memory
    /// through `nexar_device::CudaMemory`): received bytes are reduced into it in place by
    /// its adapter, so only the wire sees host memory. The buffer is moved in and given
    /// back; on error it is dropped.
    pub async fn all_reduce_in<M: DeviceMemory>(&self, mem: M, op: ReduceOp) -> Result<M> {
        let claim = self.claim();
        let count = Self::elements(&mem)?;
        let s = coll::all_reduce(
            self.rank(),
            self.world_size(),
            Self::elements(&mem)?,
            mem.dtype(),
            op,
            self.cfg(),
        )?;
        self.run_in(
            claim,
            Kind::AllReduce,
            count,
            0,
            s,
            mem,
            Vec::new(),
            op,
            true,
        )
        .await
    }

    /// [`broadcast`](Communicator::broadcast) of a buffer where it lives.
    pub async fn broadcast_in<M: DeviceMemory>(&self, mem: M, root: usize) -> Result<M> {
        let claim = self.claim();
        let count = Self::elements(&mem)?;
        self.check_rank(root)?;
        let s = coll::broadcast(
            self.rank(),
            self.world_size(),
            Self::elements(&mem)?,
            mem.dtype(),
            root,
            self.cfg(),
        )?;
        self.run_in(
            claim,
            Kind::Broadcast,
            count,
            root,
            s,
            mem,
            Vec::new(),
            ReduceOp::Sum,
            false,
        )
        .await
    }

    /// [`reduce`](Communicator::reduce) of a buffer where it lives (result on root only).
    pub async fn reduce_in<M: DeviceMemory>(&self, mem: M, op: ReduceOp, root: usize) -> Result<M> {
        let claim = self.claim();
        let count = Self::elements(&mem)?;
        self.check_rank(root)?;
        let s = coll::reduce(
            self.rank(),
            self.world_size(),
            Self::elements(&mem)?,
            mem.dtype(),
            op,
            root,
            self.cfg(),
        )?;
        let is_root = self.rank() == root;
        self.run_in(
            claim,
            Kind::Reduce,
            count,
            root,
            s,
            mem,
            Vec::new(),
            op,
            is_root,
        )
        .await
    }

    /// An input/output collective from `send` (staged to the host once, and only where the
    /// collective reads it) into `recv` where it lives.
    async fn run_io_in<M: DeviceMemory>(
        &self,
        kind: Kind,
        send: &M,
        recv: M,
        op: ReduceOp,
        root: usize,
    ) -> Result<M> {
        let claim = self.claim();
        if send.dtype() != recv.dtype() {
            return Err(NexarError::InvalidArgument(format!(
                "send holds {} but recv holds {}",
                send.dtype(),
                recv.dtype()
            )));
        }
        let (s, count) = self.plan_io(
            kind,
            Self::elements(send)?,
            Self::elements(&recv)?,
            recv.dtype(),
            op,
            root,
        )?;
        let (reads_send, _) = self.io_used(kind, root);
        let input = if reads_send {
            Self::staged(send)?
        } else {
            Vec::new()
        };
        let finalize = matches!(kind, Kind::ReduceScatter);
        self.run_in(claim, kind, count, root, s, recv, input, op, finalize)
            .await
    }

    /// [`all_gather`](Communicator::all_gather) into a buffer where it lives.
    pub async fn all_gather_in<M: DeviceMemory>(&self, send: &M, recv: M) -> Result<M> {
        self.run_io_in(Kind::AllGather, send, recv, ReduceOp::Sum, 0)
            .await
    }

    /// [`reduce_scatter`](Communicator::reduce_scatter) into a buffer where it lives.
    pub async fn reduce_scatter_in<M: DeviceMemory>(
        &self,
        send: &M,
        recv: M,
        op: ReduceOp,
    ) -> Result<M> {
        self.run_io_in(Kind::ReduceScatter, send, recv, op, 0).await
    }

    /// [`gather`](Communicator::gather) into root's buffer where it lives (`recv` may be
    /// empty on other ranks, but of `send`'s type, as on every rank: another type is
    /// refused).
    pub async fn gather_in<M: DeviceMemory>(&self, send: &M, recv: M, root: usize) -> Result<M> {
        self.run_io_in(Kind::Gather, send, recv, ReduceOp::Sum, root)
            .await
    }

    /// [`scatter`](Communicator::scatter) from root's `send` into a buffer where it lives
    /// (`send` may be empty on other ranks, but of `recv`'s type, as on every rank).
    pub async fn scatter_in<M: DeviceMemory>(&self, send: &M, recv: M, root: usize) -> Result<M> {
        self.run_io_in(Kind::Scatter, send, recv, ReduceOp::Sum, root)
            .await
    }

    /// [`all_to_all`](Communicator::all_to_all) into a buffer where it lives.
    pub async fn all_to_all_in<M: DeviceMemory>(&self, send: &M, recv: M) -> Result<M> {
        self.run_io_in(Kind::AllToAll, send, recv, ReduceOp::Sum, 0)
            .await
    }

    /// [`scan`](Communicator::scan) (or the exclusive scan) of a buffer where it lives.
    pub async fn scan_in<M: DeviceMemory>(
        &self,
        mem: M,
        op: ReduceOp,
        exclusive: bool,
    ) -> Result<M> {
        let claim = self.claim();
        let count = Self::elements(&mem)?;
        let s = coll::scan(
            self.rank(),
            self.world_size(),
            Self::elements(&mem)?,
            mem.dtype(),
            op,
            exclusive,
            self.cfg(),
        )?;
        let kind = if exclusive {
            Kind::ExclusiveScan
        } else {
            Kind::Scan
        };
        self.run_in(claim, kind, count, 0, s, mem, Vec::new(), op, false)
            .await
    }

    /// Splits this communicator: ranks passing the same `color` form a new communicator,
    /// ordered by `key` (ties by old rank). Collective: every rank must call it.
    pub async fn split(&self, color: u32, key: u32) -> Result<Communicator> {
        let world = self.world_size();
        let mine = [u64::from(color) << 32 | u64::from(key)];
        let mut all = vec![0u64; world];
        // The child's id comes from the all-gather's own number, which every rank gives
        // this call whatever became of the calls before it (one that failed on some ranks
        // only, or a mismatched one), so splits polled together number alike everywhere.
        let claim = self.claim();
        let seq = claim.tag();
        self.run_io_claimed(claim, Kind::SplitGather, &mine, &mut all, ReduceOp::Sum, 0)
            .await?;
        let mut group: Vec<(u32, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, v)| (**v >> 32) as u32 == color)
            .map(|(r, v)| (*v as u32, r))
            .collect();
        group.sort_unstable();
        let members: Arc<[NodeId]> = group.iter().map(|(_, r)| self.core.members[*r]).collect();
        let rank = group
            .iter()
            .position(|(_, r)| *r == self.rank())
            .ok_or_else(|| {
                NexarError::InvalidArgument("this rank is missing from its own split group".into())
            })?;
        let id = derive_comm_id(self.core.id, seq, color);
        Ok(Communicator::new(CommCore::new(
            self.core.shared.clone(),
            id,
            rank,
            members,
        )))
    }
}

/// Communicators rebuilt by automatic recovery, in order (see
/// [`Communicator::recoveries`]). Dropping it stops the recovery task.
#[derive(Debug)]
pub struct Recoveries {
    rx: tokio::sync::mpsc::Receiver<Result<Communicator>>,
    _task: Option<crate::AbortOnDrop>,
}

impl Recoveries {
    /// The next rebuilt communicator (or the error of a failed agreement); `None` when
    /// recovery stopped (node shut down, or the policy is not Automatic).
    pub async fn next(&mut self) -> Option<Result<Communicator>> {
        self.rx.recv().await
    }
}

/// The lost ranks of a communicator, as they are detected.
#[derive(Debug)]
pub struct Failures {
    rx: tokio::sync::watch::Receiver<std::collections::BTreeSet<NodeId>>,
    /// For telling a shutdown (which wakes the watch without a change) from a loss.
    shared: Arc<crate::node::NodeShared>,
    members: Arc<[NodeId]>,
    seen: Vec<usize>,
}

impl Failures {
    fn ranks(&self, set: &std::collections::BTreeSet<NodeId>) -> Vec<usize> {
        (0..self.members.len())
            .filter(|r| set.contains(&self.members[*r]))
            .collect()
    }

    /// The lost ranks known now, ascending.
    pub fn current(&self) -> Vec<usize> {
        self.ranks(&self.rx.borrow())
    }

    /// Waits until this communicator's lost ranks differ from what this watch last
    /// reported (from its creation on), and returns them. Errors when the node shuts down.
    pub async fn changed(&mut self) -> Result<Vec<usize>> {
        loop {
            let now = self.current();
            if now != self.seen {
                self.seen = now.clone();
                return Ok(now);
            }
            if self.shared.is_shutting_down() {
                return Err(NexarError::Shutdown);
            }
            self.rx.changed().await.map_err(|_| NexarError::Shutdown)?;
        }
    }
}

/// A collective running in the background; [`Pending::wait`] gives its result.
///
/// Dropping a `Pending` does not cancel the collective (the other ranks expect this rank's
/// part); it finishes in the background and its result is discarded.
#[derive(Debug)]
pub struct Pending<R> {
    task: tokio::task::JoinHandle<Result<R>>,
}

impl<R> Pending<R> {
    /// Waits for the collective and returns its result.
    pub async fn wait(self) -> Result<R> {
        self.task
            .await
            .map_err(|e| NexarError::Actor(format!("collective task failed: {e}")))?
    }

    /// True once the collective has finished (successfully or not).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// The elements of `world` blocks of `block` elements each; a count that overflows is an
/// argument error (a buffer that large cannot exist, but a `DeviceMemory` may claim it).
fn per_rank(block: usize, world: usize) -> Result<usize> {
    block.checked_mul(world).ok_or_else(|| {
        NexarError::InvalidArgument(format!(
            "{block} elements per rank on {world} ranks overflow the address space"
        ))
    })
}

fn expect_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(NexarError::LengthMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Mixes words into one well-spread u64 (splitmix64 steps): identical on every host and
/// every build, unlike `std`'s hashers.
pub(crate) fn mix(words: &[u64]) -> u64 {
    let mut z: u64 = 0x243F_6A88_85A3_08D3;
    for w in words {
        z = z.wrapping_add(*w).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
    }
    z
}

/// Every member computes the same child id from (parent, split number, color).
pub(crate) fn derive_comm_id(parent: u64, seq: u64, color: u32) -> u64 {
    comm_id(mix(&[parent, seq, u64::from(color)]))
}

/// A communicator id from `hash`: never 0 (the world communicator), and one whose
/// collective channel (`id | COLLECTIVE_CHANNEL`) is none of the reserved channels (RPC
/// replies, lane handshakes: [`is_collective_channel`]), which it would share otherwise.
pub(crate) fn comm_id(hash: u64) -> u64 {
    let mut id = (hash & !COLLECTIVE_CHANNEL).max(1);
    // The reserved channels are a few values at the top: ids just under them move below.
    while !is_collective_channel(id | COLLECTIVE_CHANNEL) {
        id -= 1;
    }
    id
}

/// Whether `op` on `dtype` divides every rank's contribution by the world size before
/// the reduction instead of the sum after it: `Avg` in `f16`, whose partial sums would
/// pass 65504 (and become infinite) where the mean does not, as NCCL does for its
/// averages. See [`ReduceOp::Avg`].
pub(crate) fn prescales(dtype: DataType, op: ReduceOp) -> bool {
    dtype == DataType::F16 && op == ReduceOp::Avg
}

/// Divides `buf` (the contribution `before` the reduction, else its result) by `world`
/// for `Avg`: before where `op` on `dtype` [`prescales`], else after.
fn divide_avg(
    dtype: DataType,
    op: ReduceOp,
    buf: &mut [u8],
    world: usize,
    before: bool,
) -> Result<()> {
    if op == ReduceOp::Avg && prescales(dtype, op) == before {
        nexar_device::finalize_bytes(dtype, op, buf, world)?;
    }
    Ok(())
}

/// A copy of the contribution `bytes`, divided by `world` for `op` (see [`prescales`]).
fn scaled_copy(dtype: DataType, op: ReduceOp, bytes: &[u8], world: usize) -> Result<Vec<u8>> {
    let mut scaled = bytes.to_vec();
    nexar_device::finalize_bytes(dtype, op, &mut scaled, world)?;
    Ok(scaled)
}

/// `r` of `data` writable once every loan of it is back, within `deadline`.
async fn writable<'d>(
    data: &'d mut Region<'_>,
    r: std::ops::Range<usize>,
    deadline: Instant,
) -> Result<&'d mut [u8]> {
    let within = deadline.saturating_duration_since(Instant::now());
    data.writable(r, within).await?.ok_or_else(|| {
        NexarError::InvalidArgument("the block to finalise lies past the buffer".into())
    })
}

/// Id of the communicator a membership change of `epoch` creates (the same on every node,
/// the joining ones included).
pub(crate) fn membership_comm_id(epoch: u64) -> u64 {
    derive_comm_id(0x454c_4153_5449_4300, epoch, 0)
}

/// Which part of Data a collective's [`ReduceOp::Avg`] divides when it is done: the part
/// that holds its result.
enum Finalize {
    Nothing,
    All,
    /// Block `i` of `world_size()` equal blocks.
    Block(usize),
}

impl Finalize {
    /// The byte range of a Data of `len` bytes that this names, over `world` blocks.
    fn range(&self, len: usize, world: usize) -> Option<std::ops::Range<usize>> {
        let blk = len / world.max(1);
        match self {
            Finalize::Nothing => None,
            Finalize::All => Some(0..len),
            Finalize::Block(i) => Some(i * blk..(i + 1) * blk),
        }
    }

    /// All of Data when `all`, else nothing.
    fn all_if(all: bool) -> Self {
        if all {
            Finalize::All
        } else {
            Finalize::Nothing
        }
    }
}

/// Which collective a call is, for the call fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Barrier = 1,
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    Gather,
    Scatter,
    AllToAll,
    Scan,
    ExclusiveScan,
    /// The all-gather of [`Communicator::split`]'s colours and keys: planned as an
    /// all-gather, but fingerprinted apart, so that a split never combines with a user's
    /// all-gather of one `u64` made on another rank.
    SplitGather,
    /// The all-gather of [`Communicator::all_reduce_compressed`]'s encoded blocks, apart
    /// from a user's all-gather of bytes for the same reason.
    CompressedGather,
}

/// Fingerprint of a collective call; equal on every rank that makes the same call.
fn signature(kind: Kind, count: usize, dtype: DataType, op: ReduceOp, root: usize) -> u32 {
    let dt = DataType::ALL
        .iter()
        .position(|d| *d == dtype)
        .unwrap_or(usize::MAX);
    let o = ReduceOp::ALL
        .iter()
        .position(|x| *x == op)
        .unwrap_or(usize::MAX);
    let h = mix(&[kind as u64, count as u64, dt as u64, o as u64, root as u64]);
    // Keep steps below 2^63 as u64 and never zero the fingerprint.
    ((h >> 33) as u32).max(1)
}

/// A large `send` over a trusted lane, with leave ([`lane_leave`]) and then written from
/// the caller's buffer. If the `send` is dropped before it settles, the frame is finished
/// (or, not begun yet, sent with the leave it has, or with leave it asks for then) from a
/// copy of the message in the background, within the send's deadline, so the sequence of
/// messages under the tag has no hole.
struct DirectSend<'a> {
    bytes: &'a [u8],
    lane: TcpLane,
    core: Arc<CommCore>,
    dst: usize,
    tag: u64,
    step: u64,
    deadline: Instant,
    /// Its leave to send, from when it has it until the frame begins.
    leave: Option<Leave>,
    frame: Option<nexar_transport::DirectFrame>,
    settled: bool,
}

impl Drop for DirectSend<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // Dropped where no runtime runs (after its own ended), nothing can finish it: the
        // frame begun pads itself (on the lane's runtime), and the receive waits to its
        // deadline, as for a sender that crashed.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let copy = crate::pool::copied(self.bytes);
        let until = self.deadline;
        let deadline = until.into();
        let (core, dst, tag, step) = (self.core.clone(), self.dst, self.tag, self.step);
        // Finished from the copy in the background; if that gives up at the deadline, the
        // receiver is told, as a failed `send` tells it.
        match self.frame.take() {
            Some(mut frame) => {
                rt.spawn(async move {
                    let written = tokio::time::timeout_at(deadline, frame.write_all(&copy)).await;
                    if written.is_err() {
                        tell_abandoned(&core, dst, tag, step);
                    }
                });
            }
            None => {
                let lane = self.lane.clone();
                let mut leave = self.leave.take();
                rt.spawn(async move {
                    let sent = async {
                        if leave.is_none() {
                            let what = (tag, step, copy.len());
                            lane_leave(&core, &lane, dst, what, until, &mut leave).await?;
                        }
                        let send = send_with_leave(&lane, core.id, (tag, step), copy, leave);
                        within(&core, dst, until, send).await
                    };
                    // Given up at the deadline: the receiver is told.
                    given_up(&core, dst, tag, step, &sent.await);
                });
            }
        }
    }
}

/// The part of a large `send`'s message copied out so far, and where its pieces go:
/// pooled buffers, counted in flight until the transport drops them
/// ([`SendPool::copy_out`](crate::pool::SendPool::copy_out)).
struct PieceFeed<'a> {
    src: &'a [u8],
    /// Bytes copied out so far.
    fed: usize,
    tx: tokio::sync::mpsc::UnboundedSender<Bytes>,
    pool: Arc<crate::pool::SendPool>,
    flight: Arc<InFlight>,
}

impl Drop for PieceFeed<'_> {
    /// A `send` dropped part-way: the rest goes out in one copy, so the message still
    /// arrives whole.
    fn drop(&mut self) {
        let rest = &self.src[self.fed..];
        if !rest.is_empty() && !self.tx.is_closed() {
            let _ = self.tx.send(crate::pool::copied(rest));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No hash makes a communicator whose collective channel is a reserved one, or whose
    /// id is the world communicator's. (The avoidance used to move the id meeting the RPC
    /// reply channel onto the lane handshakes' channel, and a shrink had none.)
    #[test]
    fn no_communicator_id_takes_a_reserved_channel() {
        let top = !COLLECTIVE_CHANNEL;
        for hash in (0..8).flat_map(|d| [top - d, u64::MAX - d, d, COLLECTIVE_CHANNEL | d]) {
            let id = comm_id(hash);
            assert_ne!(id, 0, "{hash:#x}");
            assert_eq!(id & COLLECTIVE_CHANNEL, 0, "{hash:#x}");
            assert!(
                is_collective_channel(id | COLLECTIVE_CHANNEL),
                "{hash:#x} gives {id:#x}"
            );
        }
        assert_eq!(comm_id(top - 3), top - 3, "ids clear of them stay");
    }

    /// A lost connection is a lost rank only for a node that is a member: one to a node of
    /// no rank here (a relay's) is passed on as the transport's error, where it used to
    /// name rank `usize::MAX`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_connection_names_a_rank_only_for_a_member() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let core = &cluster.communicators()[0].core;
        let lost = |peer| TransportError::ConnectionLost {
            peer,
            reason: "gone".into(),
        };
        assert!(matches!(
            core.map_err(lost(NodeId(1)), "a call"),
            NexarError::PeerLost { rank: 1, .. }
        ));
        let outside = core.map_err(lost(NodeId(999)), "a call");
        assert!(
            matches!(
                outside,
                NexarError::Transport(TransportError::ConnectionLost { .. })
            ),
            "{outside:?}"
        );
    }

    /// A block count whose `world` blocks overflow `usize` (a `DeviceMemory` may claim any
    /// length) is an argument error, not an overflow panic.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn block_counts_that_overflow_are_refused() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comm = &cluster.communicators()[0];
        let huge = usize::MAX / 2 + 1;
        for kind in [
            Kind::AllGather,
            Kind::ReduceScatter,
            Kind::Gather,
            Kind::Scatter,
        ] {
            let (send, recv) = match kind {
                Kind::AllGather | Kind::Gather => (huge, 0),
                _ => (0, huge),
            };
            let planned = comm.plan_io(kind, send, recv, DataType::U8, ReduceOp::Sum, 0);
            assert!(
                matches!(planned, Err(NexarError::InvalidArgument(ref why)) if why.contains("overflow")),
                "{kind:?}: {:?}",
                planned.err()
            );
        }
    }

    /// A send that gives up at its deadline (the receiver took nothing while its
    /// early-arrival budget could not hold the message) tells the receiver: its receive
    /// of that message fails with `Abandoned` instead of waiting for it, and the pair's
    /// next message under the tag is received as the next one. Both a message read whole
    /// on arrival (200 KiB: without the word, its receive waited for the rest until it
    /// timed out, and so did every later receive under the tag) and one handed to its
    /// receiver as a stream (8 MiB). Over QUIC, and over a trusted lane once a message
    /// nobody receives yet has spent the lane's credit: the messages are then announced and
    /// wait for an answer that does not come.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_given_up_at_its_deadline_leaves_the_pair_in_step() {
        for trusted in [false, true] {
            a_send_given_up_leaves_the_pair_in_step(trusted).await;
        }
    }

    async fn a_send_given_up_leaves_the_pair_in_step(trusted: bool) {
        use crate::NexarError;
        use std::time::Duration;
        let mut config = crate::NodeConfig {
            op_timeout: Duration::from_millis(1500),
            trusted_fabric: trusted,
            ..crate::NodeConfig::default()
        };
        config.transport.early_budget_bytes = 64 << 10;
        config.transport.stream_window = 64 << 10;
        let cluster = crate::Cluster::local_with(2, config)
            .await
            .expect("cluster");
        let comms = cluster.communicators();
        let credit = vec![3u8; nexar_transport::LANE_CREDIT_BYTES];
        if trusted {
            comms[0].send(&credit, 1, 8).await.expect("sent on credit");
        }
        for (tag, len) in [(9u64, 200 << 10), (10, 8 << 20)] {
            let failed = comms[0].send(&vec![7u8; len], 1, tag).await;
            assert!(
                matches!(failed, Err(NexarError::Timeout { .. })),
                "trusted {trusted}, {len} bytes: nothing is received, so the send gives up: {failed:?}"
            );
            comms[0]
                .send(&[1u8, 2, 3], 1, tag)
                .await
                .expect("next send");
            let key = MailboxKey {
                comm: comms[1].core.id,
                tag,
                step: 0,
                src: comms[1].core.members[0],
            };
            let table = &comms[1].core.shared.table;
            let deadline = Instant::now() + Duration::from_secs(10);
            while !table.is_abandoned(&key) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let mut buf = vec![0u8; len];
            let first = comms[1].recv(&mut buf, 0, tag).await;
            assert!(
                matches!(first, Err(NexarError::Abandoned { rank: 0, tag: t }) if t == tag),
                "{len} bytes: {first:?}"
            );
            let mut next = [0u8; 3];
            let got = comms[1].recv(&mut next, 0, tag).await;
            assert!(got.is_ok(), "{len} bytes: the next message: {got:?}");
            assert_eq!(next, [1, 2, 3]);
            // The message on credit, if any, waits.
            assert_eq!(
                table.len(),
                usize::from(trusted),
                "{len} bytes: nothing left behind: {table:?}"
            );
        }
        if trusted {
            let mut got = vec![0u8; credit.len()];
            comms[1].recv(&mut got, 0, 8).await.expect("recv");
            assert!(got == credit);
            assert!(comms[1].core.shared.table.is_empty());
        }
    }

    /// A dropped communicator's frames are let go: those buffered give their budget back,
    /// later ones are discarded (they used to hold early-arrival budget for good).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_communicators_frames_are_let_go() {
        use std::time::Duration;
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        let table = comms[1].core.shared.table.clone();
        let full = table.budget_available();
        let (a, b) = tokio::join!(comms[0].split(0, 0), comms[1].split(0, 1));
        let (a, b) = (a.expect("split"), b.expect("split"));
        let id = b.core.id;
        // A message rank 1 never asks for, and a collective it never joins.
        a.send(&[7u8; 4096], 1, 3).await.expect("sent");
        let mut v = vec![1f32; 1024];
        let early = tokio::time::timeout(
            Duration::from_millis(300),
            a.all_reduce(&mut v, ReduceOp::Sum),
        );
        assert!(early.await.is_err(), "rank 1 never joins");
        let deadline = Instant::now() + Duration::from_secs(10);
        while table.budget_available() == full && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            table.budget_available() < full,
            "the message is held: {table:?}"
        );
        drop(b);
        assert_eq!(table.budget_available(), full, "{table:?}");
        assert!(table.is_empty(), "{table:?}");
        // Later frames for it are discarded on arrival.
        assert!(table.is_retired(id, 3) && table.is_retired(id | COLLECTIVE_CHANNEL, 0));
    }

    /// Two ranks whose frames may carry at most 1 MiB.
    async fn small_frames_cluster() -> crate::Cluster {
        let mut config = crate::NodeConfig::default();
        config.transport.max_frame_bytes = 1 << 20;
        config.collectives.max_message_bytes = 1 << 20;
        crate::Cluster::local_with(2, config)
            .await
            .expect("cluster")
    }

    /// A fresh tag per message (a tag per step or per request) leaves no counter per tag
    /// behind on either side (here, some bits each in a bitmap); a tag used again
    /// continues its own sequence, and receives waiting in line on one tag take its
    /// messages in turn.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fresh_tags_per_message_keep_the_counts_small() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        // Tags with a count of their own on each side, and how the others are kept.
        let counts = |c: &Communicator| {
            let sent = c.core.send_seq.lock().expect("send counts");
            let (locks, received) = c.core.recv_seq.footprint();
            (sent.counters(), sent.once_kept(), locks, received)
        };
        let mailboxes = |c: &Communicator| c.core.shared.table.len();
        let before = (mailboxes(&comms[0]), mailboxes(&comms[1]));
        for tag in 1000..1300u64 {
            let v = [tag as u32];
            comms[0].send(&v, 1, tag).await.expect("send");
            let mut got = [0u32];
            comms[1].recv(&mut got, 0, tag).await.expect("recv");
            assert_eq!(got, v);
        }
        // Nor does the transport keep a mailbox per tag.
        assert_eq!((mailboxes(&comms[0]), mailboxes(&comms[1])), before);
        // 300 tags of one block: counted once, in the bitmap (some bits each) on both
        // sides.
        let (sent, sent_once, _, _) = counts(&comms[0]);
        let (_, _, received, received_once) = counts(&comms[1]);
        assert_eq!((sent, received), (0, 0));
        assert_eq!((sent_once, received_once), ((0, 300), (0, 300)));
        // Tag 1100 again: its second and third messages, in order, on two receives in
        // line at once.
        let (mut a, mut b) = ([0u32], [0u32]);
        let recvs = async {
            let (x, y) = tokio::join!(
                comms[1].recv(&mut a, 0, 1100),
                comms[1].recv(&mut b, 0, 1100)
            );
            x.and(y)
        };
        let sends = async {
            comms[0].send(&[1u32], 1, 1100).await?;
            comms[0].send(&[2u32], 1, 1100).await
        };
        let (r, s) = tokio::join!(recvs, sends);
        r.expect("receives");
        s.expect("sends");
        assert_eq!((a, b), ([1], [2]));
        // 1100 counted three times: a count of its own on both sides.
        assert_eq!(counts(&comms[0]).0, 1);
        assert_eq!(counts(&comms[1]).2, 1);
        cluster.shutdown().await;
    }

    /// A message over `max_frame_bytes` is refused before it takes its place in the pair's
    /// sequence (it used to take it, and the receiver then waited for it, and for every
    /// later message under the tag, until each receive timed out): the next message is
    /// received as the next one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_too_large_for_a_frame_takes_no_place_in_the_sequence() {
        use crate::NexarError;
        let cluster = small_frames_cluster().await;
        let comms = cluster.communicators();
        let too_large = |r: &Result<()>| {
            matches!(
                r,
                Err(NexarError::Transport(TransportError::FrameTooLarge { .. }))
            )
        };
        let sent = comms[0].send(&vec![7u8; 2 << 20], 1, 4).await;
        assert!(too_large(&sent), "{sent:?}");
        let sent = comms[0]
            .send_bytes(Bytes::from(vec![7u8; 2 << 20]), 1, 4)
            .await;
        assert!(too_large(&sent), "{sent:?}");
        comms[0].send(&[1u8, 2, 3], 1, 4).await.expect("next send");
        let mut next = [0u8; 3];
        comms[1]
            .recv(&mut next, 0, 4)
            .await
            .expect("the next message");
        assert_eq!(next, [1, 2, 3]);
        cluster.shutdown().await;
    }

    /// An RPC whose future is dropped before the reply comes retires its request id at
    /// once (a late reply is then discarded on arrival, and the retired ids collapse);
    /// one with no deadline (`Duration::MAX`) works instead of panicking; and a handler's
    /// reply too large for a frame comes back as the handler's error at once, not as a
    /// timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rpc_cancelled_unbounded_and_oversized() {
        use crate::NexarError;
        use std::time::Duration;
        let cluster = small_frames_cluster().await;
        let comms = cluster.communicators();
        let release = Arc::new(tokio::sync::Notify::new());
        let r = release.clone();
        comms[1].register_rpc(1, move |_, _| {
            let r = r.clone();
            async move {
                r.notified().await;
                Ok(b"late".to_vec())
            }
        });
        comms[1].register_rpc(2, |_, _| async { Ok(vec![0u8; 2 << 20]) });
        comms[1].register_rpc(3, |_, _| async { Ok(b"pong".to_vec()) });
        let shared = &comms[0].core.shared;
        let request = shared.next_request.load(Ordering::Relaxed);
        let call = comms[0].rpc(1, 1, b"ping");
        assert!(tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err());
        assert!(shared
            .table
            .is_retired(crate::rpc::RPC_REPLY_CHANNEL, request));
        release.notify_one();
        let call = comms[0].rpc_with_timeout(1, 3, b"ping", Duration::MAX);
        let pong = tokio::time::timeout(Duration::from_secs(30), call)
            .await
            .expect("the test's own deadline")
            .expect("an RPC without a deadline");
        assert_eq!(pong.as_ref(), b"pong");
        match comms[0].rpc(1, 2, b"big").await {
            Err(NexarError::RpcFailed { message, .. }) => {
                assert!(message.contains("max_frame_bytes"), "{message}")
            }
            other => panic!("expected the handler's error, got {other:?}"),
        }
        cluster.shutdown().await;
    }

    /// A node outside the communicator that calls one of its RPCs (here: rank 0 of the
    /// world, with a communicator of its own that has the id of rank 1's single-member
    /// split) is refused as for an unknown id, and the handler is never called (it used
    /// to be called with rank `usize::MAX`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_rpc_from_outside_the_communicator_is_refused_without_calling_the_handler() {
        use crate::NexarError;
        use std::time::Duration;
        let within = Duration::from_secs(30);
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        let (a, b) = tokio::time::timeout(within, async {
            tokio::join!(comms[0].split(0, 0), comms[1].split(1, 0))
        })
        .await
        .expect("split in time");
        let (_a, alone) = (a.expect("split"), b.expect("split"));
        assert_eq!(alone.members(), &comms[1].members()[1..]);
        let called = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = called.clone();
        alone.register_rpc(5, move |rank, _| {
            seen.lock().unwrap_or_else(|e| e.into_inner()).push(rank);
            async { Ok(b"hello".to_vec()) }
        });
        // Rank 0's view of a communicator with that id, and itself in it.
        let outsider = Communicator::new(CommCore::new(
            comms[0].core.shared.clone(),
            alone.id(),
            0,
            comms[0].members().into(),
        ));
        let got = tokio::time::timeout(within, outsider.rpc(1, 5, b"hi"))
            .await
            .expect("a reply in time");
        assert!(
            matches!(got, Err(NexarError::RpcUnknown { rank: 1, id: 5 })),
            "{got:?}"
        );
        assert!(
            called.lock().unwrap_or_else(|e| e.into_inner()).is_empty(),
            "the handler was called"
        );
        // A member still reaches it, with its rank.
        let pong = tokio::time::timeout(within, alone.rpc(0, 5, b"hi"))
            .await
            .expect("a reply in time")
            .expect("a member's call");
        assert_eq!(pong.as_ref(), b"hello");
        assert_eq!(*called.lock().unwrap_or_else(|e| e.into_inner()), vec![0]);
    }

    /// What automatic recovery watches after a shrink: a loss known before the watch
    /// was made is reported at once, where `failures()` reports only later ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_from_scratch_reports_a_loss_already_known() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comm = cluster.communicators().remove(0);
        let peer = comm.core.members[1];
        comm.core.shared.failures.send_modify(|lost| {
            lost.insert(peer);
        });
        let wait = std::time::Duration::from_millis(200);
        let mut later = comm.failures();
        assert!(
            tokio::time::timeout(wait, later.changed()).await.is_err(),
            "failures() reports only losses after it"
        );
        let mut fresh = comm.unseen_failures();
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), fresh.changed())
            .await
            .expect("reported at once")
            .expect("watch");
        assert_eq!(got, vec![1]);
    }
}
