//! NodeActor: one per process-local node. Accepts and dials connections, supervises one
//! PeerActor per peer, dispatches control frames, and reports when the mesh is formed.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use nexar_transport::{
    Connection, ControlFrame, Endpoint, FrameKind, Inbound, MailboxTable, NodeId,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn, Instrument};

use crate::peer::{Lane, PeerActor, PeerArgs, PeerMsg};
use crate::NodeConfig;

/// The sending lanes to one peer, published by its PeerActor once both QUIC lanes are
/// up; the trusted-fabric lane joins them when configured and handshaken.
#[derive(Clone, Debug)]
pub(crate) struct Links {
    pub(crate) control: Connection,
    pub(crate) bulk: Connection,
    pub(crate) lane: Option<nexar_transport::TcpLane>,
}

/// How long a node of a sparse topology keeps relaying once it has every member's
/// farewell, for the farewells between other members that pass through it.
const RELAY_LINGER: Duration = Duration::from_millis(500);

/// Mailbox channel on which a node tells a higher-numbered peer its trusted-lane TCP port.
pub(crate) const LANE_CHANNEL: u64 = u64::MAX - 2;

/// State shared by a node's actors and its communicators.
#[derive(Debug)]
pub(crate) struct NodeShared {
    pub(crate) id: NodeId,
    pub(crate) table: Arc<MailboxTable>,
    pub(crate) links: DashMap<NodeId, Links>,
    pub(crate) lost: DashMap<NodeId, String>,
    /// Reused working buffers for collectives.
    pub(crate) pool: crate::pool::BufferPool,
    /// Every node declared lost so far (for `Communicator::failures`).
    pub(crate) failures: tokio::sync::watch::Sender<std::collections::BTreeSet<NodeId>>,
    pub(crate) config: NodeConfig,
    pub(crate) endpoint: Endpoint,
    /// RPC handlers by (communicator id, RPC id).
    pub(crate) rpc: DashMap<(u64, u32), crate::rpc::Registration>,
    /// Next RPC request id issued by this node.
    pub(crate) next_request: std::sync::atomic::AtomicU64,
    /// Signs frames this node sends through relays.
    pub(crate) signer: nexar_transport::Signer,
    /// Checks relayed frames' origins against the cluster CA.
    pub(crate) verifier: nexar_transport::SignatureVerifier,
    /// The runtime the node started on: a `_nb` call or `recoveries()` made outside any
    /// runtime (from the blocking facade's threads, say) runs there
    /// ([`NodeShared::runtime_handle`]).
    pub(crate) runtime: Option<tokio::runtime::Handle>,
    /// Number of nodes in the cluster (known once the mesh is formed).
    world: std::sync::atomic::AtomicUsize,
    /// This node sends no heartbeats (tests: a peer whose heartbeats are held up).
    #[cfg(test)]
    pub(crate) mute_heartbeats: std::sync::atomic::AtomicBool,
    /// This node's heartbeat sends never finish (tests: sends that wait for room on a
    /// connection that moves nothing).
    #[cfg(test)]
    pub(crate) stall_heartbeats: std::sync::atomic::AtomicBool,
    /// Test only: peer actors leave the losses they see unrecorded, as a busy runtime
    /// leaves them for a moment.
    #[cfg(test)]
    pub(crate) hold_losses: std::sync::atomic::AtomicBool,
    /// Control frames forwarded to the node actor and not yet handled, the most there
    /// were at once, and the RPC requests (`FrameKind::Control`) handled (tests).
    #[cfg(test)]
    pub(crate) control_queued: std::sync::atomic::AtomicUsize,
    #[cfg(test)]
    pub(crate) control_most: std::sync::atomic::AtomicUsize,
    #[cfg(test)]
    pub(crate) control_handled: std::sync::atomic::AtomicUsize,
    /// The readers' side of the control channel (tests: whether it is full).
    #[cfg(test)]
    pub(crate) control_tx: std::sync::OnceLock<mpsc::Sender<ControlFrame>>,
    /// Next-hop cache: the next hop by node, per set of nodes avoided (those lost here,
    /// and those a relayed frame's earlier routers named) and world size; a few sets at
    /// most ([`crate::relay::ROUTE_SETS`]).
    pub(crate) routes: std::sync::Mutex<crate::relay::Routes>,
    /// Nodes that left the cluster gracefully (an agreed membership change): their
    /// connections closing is a departure, not a failure.
    departed: DashMap<NodeId, ()>,
    /// Nodes that said farewell (their job is done): departed for good, whatever a resize
    /// point takes back ([`undo_departed`](Self::undo_departed) leaves them be).
    farewelled: DashMap<NodeId, ()>,
    /// Relayed frames taken so far, by origin and public key
    /// ([`crate::relay::origin_key`]; see [`crate::relay::ReplayWindow`]).
    pub(crate) relayed_seen: DashMap<[u8; 32], crate::relay::ReplayWindow>,
    /// The number of the next frame this node relays, by destination (see
    /// [`crate::relay::ReplayWindow`]).
    pub(crate) relay_seq: DashMap<NodeId, u64>,
    /// The certificate (SHA-256 of its DER) that the membership names for each node: a
    /// connection or relayed frame from a node with another certificate, even one the
    /// cluster CA issued for that id (say to an earlier holder of a rank freed before
    /// formation), is refused. Nodes without an entry are checked against the CA only.
    pub(crate) pins: DashMap<NodeId, [u8; 32]>,
    /// Trusted-fabric lane keys by peer (see [`NodeConfig::trusted_fabric`]), with the
    /// addresses the peer's QUIC connections come from: the only ones its lane is taken
    /// from.
    pub(crate) lane_keys: DashMap<NodeId, ([u8; 32], Vec<IpAddr>)>,
    /// The trusted-fabric lane's TCP listener, until the NodeActor takes it, and its port.
    lane_listener: std::sync::Mutex<Option<std::net::TcpListener>>,
    pub(crate) lane_port: Option<u16>,
    shutting_down: AtomicBool,
    /// Woken when a peer says farewell or is lost (see [`NodeHandle::farewell`]).
    farewells: tokio::sync::Notify,
    /// RPC requests being served, by caller (see [`NodeConfig::max_rpc_in_flight`]).
    pub(crate) rpc_in_flight: Arc<DashMap<NodeId, usize>>,
    /// Refusals of RPC requests whose replies are being sent, by caller (see
    /// [`NodeConfig::max_rpc_in_flight`]).
    pub(crate) rpc_refusals: Arc<DashMap<NodeId, usize>>,
    /// The tasks of RPC handler calls in progress, aborted when the node shuts down (see
    /// [`NodeShared::track_handler`]).
    rpc_running: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
    /// Peers this node was connected to and is no more, lost or departed: their actors
    /// are stopped, connections from them are refused (a lost peer does not come back),
    /// and relays route around them. A watch, so that a collective waiting on a member
    /// that departed and went learns at once ([`crate::collective::ranks_lost`]).
    gone: tokio::sync::watch::Sender<std::collections::BTreeSet<NodeId>>,
}

impl NodeShared {
    /// Whether `fingerprint` is the certificate the membership names for `node` (true when
    /// it names none).
    pub(crate) fn pinned(&self, node: NodeId, fingerprint: &[u8; 32]) -> bool {
        self.pins.get(&node).is_none_or(|p| *p == *fingerprint)
    }

    /// The runtime to run this node's background work on from a plain call: the caller's,
    /// else (a call made outside any runtime, from the blocking facade's threads, say) the
    /// one the node started on; `None` where there is neither.
    pub(crate) fn runtime_handle(&self) -> Option<tokio::runtime::Handle> {
        tokio::runtime::Handle::try_current()
            .ok()
            .or_else(|| self.runtime.clone())
    }

    /// Whether the membership names `node` at all, and `fingerprint`'s certificate for
    /// it: what a relayed frame's origin must be. A certificate the cluster CA issued to
    /// a node that is no member (one queued to join, an earlier holder of a rank freed
    /// before formation) proves nothing about the membership, so frames signed with it
    /// are not taken, where [`pinned`](Self::pinned) leaves such a node's direct
    /// connection to the membership checks that follow.
    pub(crate) fn pinned_member(&self, node: NodeId, fingerprint: &[u8; 32]) -> bool {
        self.pins.get(&node).is_some_and(|p| *p == *fingerprint)
    }

    /// The largest payload one message from this node may carry ([`payload_limit`]).
    pub(crate) fn payload_limit(&self) -> u64 {
        payload_limit(&self.config)
    }

    /// Keeps the task of an RPC handler call in progress with the others, to be aborted
    /// (its handler's future dropped) when the node shuts down; one started as it shuts
    /// down is aborted at once.
    pub(crate) fn track_handler(&self, task: tokio::task::AbortHandle) {
        {
            let mut running = self
                .rpc_running
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            running.retain(|t| !t.is_finished());
            running.push(task.clone());
        }
        // After the push: a shutdown that began before it may have swept the list already.
        if self.shutting_down.load(Ordering::Acquire) {
            task.abort();
        }
    }

    /// Pins each node's certificate (see [`NodeShared::pins`]).
    pub(crate) fn pin(&self, certs: impl IntoIterator<Item = (NodeId, [u8; 32])>) {
        for (node, fingerprint) in certs {
            self.pins.insert(node, fingerprint);
        }
    }

    pub(crate) fn new(
        endpoint: Endpoint,
        config: NodeConfig,
        identity: &nexar_transport::NodeIdentity,
    ) -> crate::Result<NodeShared> {
        Ok(NodeShared {
            id: endpoint.node(),
            table: Arc::new(
                MailboxTable::new(config.transport.early_budget_bytes)
                    .with_relay_budget(config.transport.relay_budget_bytes)
                    .with_overdraft(
                        (config.transport.max_streams as usize)
                            .saturating_mul(config.transport.stream_window as usize),
                    )
                    .with_whole_tag_channels(crate::comm::is_collective_channel),
            ),
            links: DashMap::new(),
            lost: DashMap::new(),
            config,
            endpoint,
            rpc: DashMap::new(),
            // Up to 8 buffers and 512 MiB kept for reuse per node.
            pool: crate::pool::BufferPool::new(8, 512 << 20),
            failures: tokio::sync::watch::Sender::new(std::collections::BTreeSet::new()),
            next_request: std::sync::atomic::AtomicU64::new(0),
            signer: nexar_transport::Signer::new(identity)?,
            verifier: nexar_transport::SignatureVerifier::new(identity.ca_der())?,
            runtime: tokio::runtime::Handle::try_current().ok(),
            world: std::sync::atomic::AtomicUsize::new(0),
            #[cfg(test)]
            mute_heartbeats: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            stall_heartbeats: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            hold_losses: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            control_queued: std::sync::atomic::AtomicUsize::new(0),
            #[cfg(test)]
            control_most: std::sync::atomic::AtomicUsize::new(0),
            #[cfg(test)]
            control_handled: std::sync::atomic::AtomicUsize::new(0),
            #[cfg(test)]
            control_tx: std::sync::OnceLock::new(),
            routes: std::sync::Mutex::default(),
            departed: DashMap::new(),
            farewelled: DashMap::new(),
            relayed_seen: DashMap::new(),
            relay_seq: DashMap::new(),
            lane_keys: DashMap::new(),
            pins: DashMap::new(),
            lane_listener: std::sync::Mutex::new(None),
            lane_port: None,
            shutting_down: AtomicBool::new(false),
            rpc_running: std::sync::Mutex::new(Vec::new()),
            farewells: tokio::sync::Notify::new(),
            gone: tokio::sync::watch::Sender::new(std::collections::BTreeSet::new()),
            rpc_in_flight: Arc::default(),
            rpc_refusals: Arc::default(),
        })
    }

    /// Binds the trusted-fabric lane's TCP listener on the QUIC endpoint's IP.
    fn bind_lane_listener(&mut self) -> crate::Result<()> {
        let ip = self.endpoint.local_addr()?.ip();
        let listener = nexar_transport::bind_lane_listener(ip, &self.config.transport)?;
        self.lane_port = Some(
            listener
                .local_addr()
                .map_err(|e| crate::NexarError::Transport(e.into()))?
                .port(),
        );
        self.lane_listener = std::sync::Mutex::new(Some(listener));
        Ok(())
    }

    /// Drops the RPC handlers registered on communicator `comm` (on every communicator
    /// when `None`). Each is dropped outside the map's locks: a handler may hold a
    /// communicator whose own drop unregisters its handlers.
    pub(crate) fn unregister_rpcs(&self, comm: Option<u64>) {
        let keys: Vec<(u64, u32)> = self
            .rpc
            .iter()
            .map(|e| *e.key())
            .filter(|(c, _)| comm.is_none_or(|x| *c == x))
            .collect();
        for key in keys {
            drop(self.rpc.remove(&key));
        }
    }

    /// Records `peer` as lost and applies the recovery policy: under
    /// [`RecoveryPolicy::Abort`](crate::RecoveryPolicy::Abort) every pending and future
    /// call on this node fails at once.
    pub(crate) fn record_loss(&self, peer: NodeId, reason: &str) {
        self.lost.insert(peer, reason.to_string());
        self.failures.send_modify(|f| {
            f.insert(peer);
        });
        self.table.fail_peer(peer, reason);
        self.farewells.notify_waiters();
        if self.config.recovery == crate::RecoveryPolicy::Abort {
            self.table
                .close(&format!("aborting: node {peer} lost ({reason})"));
        }
    }

    /// What a peer's end means to this node: unless it left by agreement, it is recorded
    /// lost (see [`record_loss`](Self::record_loss)); either way it is gone, its links go,
    /// whoever waits for it learns at once, and `conns` (its connections) are closed.
    /// Its node actor is told separately ([`NodeMsg::PeerLost`]).
    pub(crate) fn lose_peer(
        &self,
        peer: NodeId,
        reason: &str,
        graceful: bool,
        conns: &[&Connection],
    ) {
        if self.has_departed(peer) {
            // It left by agreement (or is a joiner not yet confirmed): not a failure,
            // nothing to recover from; but whoever still waits for it learns at once.
            info!(%peer, reason, "departed peer disconnected");
            // Gone before its links go, so that relays never pick a neighbour with none.
            self.mark_gone(peer);
            self.links.remove(&peer);
            self.table.fail_peer(peer, reason);
            // The membership change that made it departing may have been taken back
            // meanwhile (undo_departed): then this is a loss after all.
            if !self.has_departed(peer) && !self.lost.contains_key(&peer) {
                self.record_loss(peer, reason);
            }
            for c in conns {
                c.close("peer departed");
            }
            return;
        }
        if graceful {
            info!(%peer, reason, "peer left");
        } else {
            warn!(%peer, reason, "peer declared lost");
        }
        // Recorded lost (which relays route around) before it is gone and its links go,
        // so that whoever sees it gone finds the reason.
        self.record_loss(peer, reason);
        self.mark_gone(peer);
        self.links.remove(&peer);
        for c in conns {
            c.close("peer declared lost");
        }
        debug!(%peer, "connections to lost peer closed");
    }

    /// Marks `peer` as having left by agreement: its connections closing later is not a
    /// failure.
    pub(crate) fn mark_departed(&self, peer: NodeId) {
        self.departed.insert(peer, ());
    }

    /// `peer` said farewell (its job is done, see [`NodeHandle::farewell`]): it departs,
    /// and a farewell wait on this node looks again.
    pub(crate) fn farewell_from(&self, peer: NodeId) {
        self.farewelled.insert(peer, ());
        self.farewells.notify_waiters();
    }

    /// Node ids relays route around: lost, or a neighbour whose connections are gone
    /// (one that finished and closed). A departed node this one never had a connection to
    /// is still reached through relays.
    pub(crate) fn unreachable(&self) -> std::collections::BTreeSet<usize> {
        self.lost
            .iter()
            .map(|e| *e.key())
            .chain(self.gone.borrow().iter().copied())
            .filter_map(|p| usize::try_from(p.0).ok())
            .collect()
    }

    /// Records that this node's connections to `peer` are gone for good (lost, or departed
    /// and closed).
    pub(crate) fn mark_gone(&self, peer: NodeId) {
        self.gone.send_if_modified(|g| g.insert(peer));
    }

    /// True once [`mark_gone`](Self::mark_gone) was called for `peer`.
    pub(crate) fn is_gone(&self, peer: NodeId) -> bool {
        self.gone.borrow().contains(&peer)
    }

    /// Watches the set of peers that are gone.
    pub(crate) fn watch_gone(
        &self,
    ) -> tokio::sync::watch::Receiver<std::collections::BTreeSet<NodeId>> {
        self.gone.subscribe()
    }

    /// True when `peer` said farewell (its job done) and was not lost before that.
    pub(crate) fn finished_normally(&self, peer: NodeId) -> bool {
        self.farewelled.contains_key(&peer) && !self.lost.contains_key(&peer)
    }

    /// Why `peer`'s connections closed, when they closed in a way its peer actor records
    /// as a loss (not its finish, nor a departure, nor this node's shutdown) and the
    /// actor may not have recorded it yet: a send or receive that failed on that close is
    /// the loss, and says so, as one a moment later would.
    pub(crate) fn closed_as_lost(&self, peer: NodeId) -> Option<String> {
        if self.is_shutting_down() || self.has_departed(peer) {
            return None;
        }
        let links = self.links.get(&peer)?;
        let closed = [&links.control, &links.bulk].into_iter().find_map(|c| {
            let reason = c.quic().close_reason()?;
            (!c.peer_finished()).then(|| format!("connection closed: {reason}"))
        });
        closed
    }

    /// True when `peer` left by agreement.
    pub(crate) fn has_departed(&self, peer: NodeId) -> bool {
        self.departed.contains_key(&peer) || self.farewelled.contains_key(&peer)
    }

    /// Takes back [`mark_departed`](Self::mark_departed) (a membership change that did not
    /// happen).
    pub(crate) fn undo_departed(&self, peer: NodeId) {
        self.departed.remove(&peer);
        if self.farewelled.contains_key(&peer) {
            // It finished its job meanwhile (a joiner told it is in may do so at once):
            // a departure still.
            return;
        }
        // Its connections went while it counted as departing: that is a loss after all.
        // (Gone is set before its links go, so a disconnection in progress counts too.)
        if (self.is_gone(peer) || !self.links.contains_key(&peer)) && !self.is_shutting_down() {
            self.record_loss(peer, "disconnected during a resize point");
        }
    }

    /// Closes every connection to a departed `peer` (its PeerActor then winds down without
    /// recording a failure).
    pub(crate) fn drop_peer(&self, peer: NodeId, why: &str) {
        self.mark_departed(peer);
        if let Some((_, links)) = self.links.remove(&peer) {
            links.control.close(why);
            links.bulk.close(why);
            if let Some(lane) = &links.lane {
                lane.close();
            }
        }
        self.table.fail_peer(peer, why);
    }

    /// The first lost node, when the policy is Abort and one was lost.
    pub(crate) fn aborted(&self) -> Option<(NodeId, String)> {
        if self.config.recovery != crate::RecoveryPolicy::Abort {
            return None;
        }
        self.lost
            .iter()
            .map(|e| (*e.key(), e.value().clone()))
            .min_by_key(|(n, _)| *n)
    }

    /// Number of nodes in the cluster (0 before formation).
    pub(crate) fn world(&self) -> usize {
        self.world.load(Ordering::Acquire)
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    /// Stops everything synchronously: no new frames, every wait fails, sockets close
    /// (as a node whose job is done when `finished`, else as any other clean close).
    pub(crate) fn close_as(&self, finished: bool) {
        if self.shutting_down.swap(true, Ordering::AcqRel) {
            return;
        }
        self.table.close("node shut down");
        if finished {
            // The peers' connections first, and at once (the endpoint's close reaches each
            // connection later, after anything else that closes it with another code).
            for links in self.links.iter() {
                links.control.close_finished();
                links.bulk.close_finished();
            }
            self.endpoint.close_finished();
        } else {
            self.endpoint.close();
        }
        // Lanes after the QUIC connections: a peer that sees its lane end waits a while
        // for the QUIC close to say whether this node finished.
        for links in self.links.iter() {
            if let Some(lane) = &links.lane {
                lane.close();
            }
        }
        // Wakes every `Failures::changed` (and so automatic recovery) and a farewell wait
        // to see the shutdown.
        self.failures.send_modify(|_| {});
        self.farewells.notify_waiters();
        // Handlers may hold their communicators, and so this node's state; so may the
        // calls in progress, whose futures are dropped here too.
        self.unregister_rpcs(None);
        let running = std::mem::take(
            &mut *self
                .rpc_running
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for task in running {
            task.abort();
        }
    }

    /// [`close_as`](Self::close_as) a node that stops for any reason but a finished job.
    pub(crate) fn close(&self) {
        self.close_as(false);
    }
}

/// Keeps `task` with the node's other tasks (aborted when it stops), and lets go of those
/// that have finished: every resize point and parked connection adds some, for the
/// node's lifetime.
fn track(tasks: &mut Vec<JoinHandle<()>>, task: JoinHandle<()>) {
    tasks.retain(|t| !t.is_finished());
    tasks.push(task);
}

/// Messages the [`NodeActor`] handles.
#[derive(Debug)]
pub(crate) enum NodeMsg {
    /// Connect to these peers (dialling each; they become members) and reply once every
    /// one has both lanes, or with an error naming the missing peers at the connect
    /// deadline. The first `Connect` forms the mesh; later ones grow it.
    Connect {
        peers: Vec<(NodeId, SocketAddr)>,
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// An authenticated connection, dialled by us (`dialled`) or accepted.
    Connected { conn: Connection, dialled: bool },
    /// Dialling a peer failed for good.
    DialFailed(NodeId, String),
    /// A control or heartbeat frame from a reader, with its place among the
    /// [`CONTROL_IN_MAILBOX`] such frames the mailbox may hold.
    Control(ControlFrame, tokio::sync::OwnedSemaphorePermit),
    /// Handle nothing until the sender resolves (tests: an actor that is busy).
    #[cfg(test)]
    Hold(tokio::sync::oneshot::Receiver<()>),
    /// A PeerActor has both lanes up.
    PeerReady(NodeId),
    /// The peers that have an actor (tests).
    #[cfg(test)]
    Peers(RpcReplyPort<Vec<NodeId>>),
    /// A PeerActor declared its peer lost.
    PeerLost(NodeId, String),
    /// A trusted-fabric lane handshaken by the listener.
    Lane(nexar_transport::LaneParts),
    /// The connect deadline of wait `id` passed.
    ConnectDeadline(u64),
    /// A connection from a node that is not (yet) a member was parked as `id`; close it if
    /// it is still parked.
    ParkExpired(u64),
}

/// At most this many control and heartbeat frames wait in the node actor's mailbox. Past
/// it the task that forwards them waits for the actor and the control channel behind it
/// (shared by every peer) fills. Then heartbeats that arrive are dropped (liveness counts
/// any traffic from a peer, not heartbeats alone), and an RPC request's stream waits,
/// unread, for room in the channel: each comes on a stream of its own, so QUIC's limit
/// on open streams holds back a peer that sends more. A mailbox without a bound let a
/// flood of them take memory without limit while the actor was busy; now at most the
/// channel's 1024 and these 256 wait.
const CONTROL_IN_MAILBOX: usize = 256;

/// At most this many connections from not-yet-members are held at once: peers that dial
/// before this node has the peer list, or a node joining a running cluster that dials a
/// member before the member learns of it. Only holders of a cluster certificate get here.
const MAX_PARKED: usize = 4096;

/// A pending `Connect`: the peers it waits for and where to reply.
struct ConnectWait {
    id: u64,
    peers: HashSet<NodeId>,
    reply: RpcReplyPort<Result<(), String>>,
}

pub(crate) struct NodeActor;

pub(crate) struct NodeState {
    shared: Arc<NodeShared>,
    inbound: Inbound,
    peers: HashMap<NodeId, ActorRef<PeerMsg>>,
    /// Members this node connects to (`None` before the first `Connect`).
    expected: Option<HashSet<NodeId>>,
    /// Connections from nodes that are not (yet) members, by park id.
    parked: HashMap<u64, (Connection, bool)>,
    next_id: u64,
    ready: HashSet<NodeId>,
    waits: Vec<ConnectWait>,
    dial_errors: HashMap<NodeId, String>,
    tasks: Vec<JoinHandle<()>>,
}

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = Arc<NodeShared>;

    async fn pre_start(
        &self,
        myself: ActorRef<NodeMsg>,
        shared: Arc<NodeShared>,
    ) -> Result<NodeState, ActorProcessingErr> {
        let (ctl_tx, mut ctl_rx) = mpsc::channel::<ControlFrame>(1024);
        let (relay_tx, relay_rx) = mpsc::channel(256);
        let inbound = Inbound {
            table: shared.table.clone(),
            control: ctl_tx,
            relay: relay_tx,
        };
        let mut tasks = vec![crate::relay::spawn_dispatch(shared.clone(), relay_rx)];
        let listener = shared.lane_listener.lock().ok().and_then(|mut l| l.take());
        if let Some(listener) = listener {
            tasks.push(spawn_lane_accept(listener, shared.clone(), myself.clone())?);
        }
        let me = myself.clone();
        let endpoint = shared.endpoint.clone();
        tasks.push(tokio::spawn(accept_loop(endpoint, me)));
        #[cfg(test)]
        let _ = shared.control_tx.set(inbound.control.clone());
        let me = myself.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(CONTROL_IN_MAILBOX));
        #[cfg(test)]
        let counts = shared.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(frame) = ctl_rx.recv().await {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    break;
                };
                #[cfg(test)]
                {
                    use std::sync::atomic::Ordering::AcqRel;
                    let queued = counts.control_queued.fetch_add(1, AcqRel) + 1;
                    counts.control_most.fetch_max(queued, AcqRel);
                }
                if me.send_message(NodeMsg::Control(frame, slot)).is_err() {
                    break;
                }
            }
        }));
        Ok(NodeState {
            shared,
            inbound,
            peers: HashMap::new(),
            expected: None,
            parked: HashMap::new(),
            next_id: 0,
            ready: HashSet::new(),
            waits: Vec::new(),
            dial_errors: HashMap::new(),
            tasks,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        st: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Connect { peers, reply } => {
                let me = st.shared.id;
                let listed = peers.len();
                let topology = st.shared.config.topology;
                let peers: Vec<(NodeId, SocketAddr)> = if topology == crate::Topology::FullMesh {
                    peers
                } else {
                    // Only the topology's neighbours are dialled; others are reached by
                    // relay. Sparse topologies need node ids 0..world.
                    let world = peers.len();
                    let rank = usize::try_from(me.0).unwrap_or(usize::MAX);
                    let neighbors = topology.neighbors(rank, world);
                    peers
                        .into_iter()
                        .filter(|(id, _)| {
                            usize::try_from(id.0).is_ok_and(|r| neighbors.contains(&r))
                        })
                        .collect()
                };
                let peers: Vec<(NodeId, SocketAddr)> =
                    peers.into_iter().filter(|(id, _)| *id != me).collect();
                let expected = st.expected.get_or_insert_with(HashSet::new);
                expected.extend(peers.iter().map(|(id, _)| *id));
                let world = listed.max(expected.len() + 1);
                let before = st.shared.world.fetch_max(world, Ordering::AcqRel);
                if before <= 2 && world > 2 {
                    // No peer is the only one now: the connections in use go back to one
                    // send window at once, and every peer's actor sees to the rest of its
                    // connections (one it is attaching may have read the old world). The
                    // world never shrinks here, so neither does this come undone.
                    debug!(
                        world,
                        "a third node: every connection back to one send window"
                    );
                    for links in st.shared.links.iter() {
                        links.control.set_sole_peer(false);
                        links.bulk.set_sole_peer(false);
                    }
                    for actor in st.peers.values() {
                        let _ = actor.send_message(PeerMsg::WorldGrew);
                    }
                }
                let id = st.next_id;
                st.next_id += 1;
                st.waits.push(ConnectWait {
                    id,
                    peers: peers.iter().map(|(p, _)| *p).collect(),
                    reply,
                });
                let deadline = st.shared.config.connect_timeout;
                for (peer, addr) in peers {
                    let dial = spawn_dial(
                        st.shared.endpoint.clone(),
                        peer,
                        addr,
                        deadline,
                        myself.clone(),
                    );
                    track(&mut st.tasks, dial);
                }
                let me = myself.clone();
                let expiry = tokio::spawn(async move {
                    tokio::time::sleep(deadline).await;
                    let _ = me.send_message(NodeMsg::ConnectDeadline(id));
                });
                track(&mut st.tasks, expiry);
                // Connections that arrived before these peers were members.
                let parked: Vec<u64> = st
                    .parked
                    .iter()
                    .filter(|(_, (c, _))| {
                        st.expected.as_ref().is_some_and(|e| e.contains(&c.peer()))
                    })
                    .map(|(k, _)| *k)
                    .collect();
                for k in parked {
                    if let Some((conn, dialled)) = st.parked.remove(&k) {
                        attach(&myself, st, conn, dialled).await?;
                    }
                }
                check_formed(st);
            }
            NodeMsg::Connected { conn, dialled } => {
                attach(&myself, st, conn, dialled).await?;
            }
            NodeMsg::ParkExpired(id) => {
                if let Some((conn, _)) = st.parked.remove(&id) {
                    debug!(peer = %conn.peer(), "parked connection from a non-member expired");
                    conn.close("not a member of this cluster");
                }
            }
            NodeMsg::DialFailed(peer, reason) => {
                st.dial_errors.insert(peer, reason);
            }
            #[cfg(test)]
            NodeMsg::Hold(until) => {
                let _ = until.await;
            }
            NodeMsg::Control(frame, _slot) => {
                #[cfg(test)]
                {
                    use std::sync::atomic::Ordering::AcqRel;
                    st.shared.control_queued.fetch_sub(1, AcqRel);
                    if frame.header.kind == FrameKind::Control {
                        st.shared.control_handled.fetch_add(1, AcqRel);
                    }
                }
                match frame.header.kind {
                    FrameKind::Heartbeat => {
                        if let Some(p) = st.peers.get(&frame.from) {
                            let _ = p.send_message(PeerMsg::Heartbeat);
                        }
                    }
                    FrameKind::Control => crate::rpc::dispatch(st.shared.clone(), frame),
                    FrameKind::Farewell => {
                        // Done with us: its connections closing from now on is no failure.
                        debug!(peer = %frame.from, "peer said farewell");
                        st.shared.farewell_from(frame.from);
                    }
                    kind => debug!(from = %frame.from, ?kind, "control frame ignored"),
                }
            }
            NodeMsg::PeerReady(peer) => {
                st.ready.insert(peer);
                check_formed(st);
            }
            NodeMsg::Lane(parts) => match st.peers.get(&parts.lane.peer()) {
                Some(p) => {
                    let _ = p.send_message(PeerMsg::AttachLane(parts));
                }
                None => parts.lane.close(),
            },
            NodeMsg::PeerLost(peer, reason) => {
                debug!(%peer, %reason, "node notified of lost peer");
                // Its actor, heartbeat timer and readers go too (they used to run for as
                // long as the node did, for every peer that ever left or failed).
                if let Some(actor) = forget_peer(st, peer, &reason) {
                    actor.stop(Some(reason));
                }
            }
            #[cfg(test)]
            NodeMsg::Peers(reply) => {
                let _ = reply.send(st.peers.keys().copied().collect());
            }
            NodeMsg::ConnectDeadline(id) => {
                if let Some(pos) = st.waits.iter().position(|w| w.id == id) {
                    let wait = st.waits.swap_remove(pos);
                    let mut missing: Vec<_> = wait.peers.difference(&st.ready).copied().collect();
                    missing.sort();
                    let detail: Vec<String> = missing
                        .iter()
                        .map(|p| match st.dial_errors.get(p) {
                            Some(e) => format!("node {p} ({e})"),
                            None => format!("node {p}"),
                        })
                        .collect();
                    let _ = wait.reply.send(Err(format!(
                        "after {:?} these peers did not connect: {}",
                        st.shared.config.connect_timeout,
                        detail.join(", ")
                    )));
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<NodeMsg>,
        evt: SupervisionEvent,
        st: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(cell, err) = evt {
            let id = cell.get_id();
            let peer = st
                .peers
                .iter()
                .find(|(_, actor)| actor.get_id() == id)
                .map(|(peer, _)| *peer);
            warn!(actor = ?id, ?peer, error = %err, "peer actor failed");
            // Its post_stop did not run, nor will its heartbeats and liveness checks:
            // the peer is lost to this node, which the peer will see as well.
            if let Some(peer) = peer.filter(|_| !st.shared.is_shutting_down()) {
                let reason = format!("this node's actor for it failed: {err}");
                // Lost already (its actor declared it, and failed after): recorded once.
                if st.shared.lost.contains_key(&peer) || st.shared.is_gone(peer) {
                    forget_peer(st, peer, &reason);
                    return Ok(());
                }
                let conns: Vec<Connection> = st
                    .shared
                    .links
                    .get(&peer)
                    .map(|l| vec![l.control.clone(), l.bulk.clone()])
                    .unwrap_or_default();
                if let Some(l) = st.shared.links.get(&peer).and_then(|l| l.lane.clone()) {
                    l.close();
                }
                st.shared
                    .lose_peer(peer, &reason, false, &conns.iter().collect::<Vec<_>>());
                forget_peer(st, peer, &reason);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<NodeMsg>,
        st: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        st.shared.close();
        for t in st.tasks.drain(..) {
            t.abort();
        }
        // Waited for: ractor kills the children still running once this returns, and a
        // killed peer actor skips its own post_stop, leaving its tasks (a trusted lane's
        // dialling among them) running and its links published.
        myself
            .stop_children_and_wait(Some("node stopped".into()), Some(PEER_STOP_WAIT))
            .await;
        Ok(())
    }
}

/// How long a stopping node waits for its peer actors to stop (each only aborts tasks and
/// drops handles).
const PEER_STOP_WAIT: Duration = Duration::from_secs(2);

/// The node's own records of `peer`, once lost or failed: no longer ready, gone (it can
/// never come back), its lane key dropped, and a formation waiting for it fails now
/// rather than at its deadline. Returns its actor, to stop.
fn forget_peer(st: &mut NodeState, peer: NodeId, reason: &str) -> Option<ActorRef<PeerMsg>> {
    st.ready.remove(&peer);
    st.shared.mark_gone(peer);
    st.shared.lane_keys.remove(&peer);
    let (failed, waiting): (Vec<ConnectWait>, Vec<ConnectWait>) = std::mem::take(&mut st.waits)
        .into_iter()
        .partition(|w| w.peers.contains(&peer));
    st.waits = waiting;
    for w in failed {
        let _ = w.reply.send(Err(format!(
            "node {peer} was lost while connecting: {reason}"
        )));
    }
    st.peers.remove(&peer)
}

fn check_formed(st: &mut NodeState) {
    let ready = &st.ready;
    let (done, pending): (Vec<ConnectWait>, Vec<ConnectWait>) = std::mem::take(&mut st.waits)
        .into_iter()
        .partition(|w| w.peers.iter().all(|p| ready.contains(p)));
    st.waits = pending;
    for w in done {
        let _ = w.reply.send(Ok(()));
    }
}

async fn attach(
    myself: &ActorRef<NodeMsg>,
    st: &mut NodeState,
    conn: Connection,
    dialled: bool,
) -> Result<(), ActorProcessingErr> {
    let peer = conn.peer();
    let me = st.shared.id;
    if !st.shared.pinned(peer, &conn.peer_fingerprint()) {
        warn!(%peer, "closing a connection whose certificate is not the one the membership names for its node");
        conn.close("not the certificate this node holds in the membership");
        return Ok(());
    }
    if st.shared.is_gone(peer) {
        debug!(%peer, "closing a connection from a peer that was declared lost or left");
        conn.close("peer already declared lost");
        return Ok(());
    }
    let member = st.expected.as_ref().is_some_and(|e| e.contains(&peer));
    if member {
        conn.open_receive_window();
    } else {
        if st.parked.len() >= MAX_PARKED {
            warn!(%peer, "closing connection from a node that is not a member");
            conn.close("not a member of this cluster");
            return Ok(());
        }
        // Maybe a node joining (or the mesh forming) that dialled before this node learnt
        // of it: hold the connection until a `Connect` names it, or the connect deadline.
        let id = st.next_id;
        st.next_id += 1;
        debug!(%peer, "parking a connection from a node that is not yet a member");
        st.parked.insert(id, (conn, dialled));
        let me = myself.clone();
        let after = st.shared.config.connect_timeout;
        let expiry = tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = me.send_message(NodeMsg::ParkExpired(id));
        });
        track(&mut st.tasks, expiry);
        return Ok(());
    }
    // The connection dialled by the lower node id is the control lane, the one dialled by
    // the higher id the bulk lane: both sides agree without a message.
    let dialler = if dialled { me } else { peer };
    let lane = if dialler == me.min(peer) {
        Lane::Control
    } else {
        Lane::Bulk
    };
    let actor = match st.peers.get(&peer) {
        Some(a) => a.clone(),
        None => {
            let args = PeerArgs {
                peer,
                shared: st.shared.clone(),
                inbound: st.inbound.clone(),
                node: myself.clone(),
            };
            let (a, _) = Actor::spawn_linked(None, PeerActor, args, myself.get_cell()).await?;
            st.peers.insert(peer, a.clone());
            a
        }
    };
    let _ = actor.send_message(PeerMsg::Attach {
        conn,
        lane: Some(lane),
    });
    Ok(())
}

/// The transport settings a node's endpoint takes: `config.transport`, with what the
/// node's own settings need of it.
pub(crate) fn endpoint_transport(config: &NodeConfig) -> nexar_transport::TransportConfig {
    let mut transport = config.transport.clone();
    // A peer's frame may pause mid-body while its sender waits for send budget, for at
    // most that sender's call deadline: frames are given up only after it.
    transport.body_timeout = transport.body_timeout.max(config.op_timeout);
    // QUIC closes a connection silent for its idle timeout, and a closed connection is a
    // lost peer: below `heartbeat_timeout`, a peer that stalls (a long pause of its
    // process) would be declared lost before that timeout said it was.
    // (No longer than QUIC can say: a variable-length integer of milliseconds.)
    let longest = Duration::from_millis((1 << 62) - 1);
    transport.idle_timeout = transport
        .idle_timeout
        .max(config.heartbeat_timeout.min(longest));
    // A connection's window opens once it is a member's ([`attach`]): one from a node of
    // the cluster that is not a member, held unread, holds no more than this here.
    transport.admission_window.get_or_insert(ADMISSION_WINDOW);
    transport
}

/// The receive window of a connection's streams together until it is known for a
/// member's (`TransportConfig::admission_window`): a node of the cluster that is not a
/// member (a joiner that dialled before this node learnt of it, or one that never will
/// be) can make this node hold at most this much per connection while it is parked,
/// [`MAX_PARKED`] times this (256 MiB) in all. A member whose connection is parked at
/// first (it dialled before this node had the peer list) sends at most this much until
/// the node attaches it: flow control holds the rest back, nothing is lost.
const ADMISSION_WINDOW: u32 = 64 << 10;

/// Inbound handshakes a node runs at once, a quarter of them from any one address; more
/// are refused (their dialers try again).
const MAX_INBOUND_HANDSHAKES: usize = 1024;

/// Accepts inbound mesh connections, each handshake in a task of its own (at most
/// [`MAX_INBOUND_HANDSHAKES`] at once, a quarter of them from one address), so that a
/// client that starts a handshake and goes silent holds only its own task, for at most
/// the handshake timeout, and not every connection behind it, and one host cannot hold
/// them all. Clients at addresses they have not shown they receive at are sent a QUIC
/// retry first ([`Endpoint::incoming`]), so forged addresses hold none.
async fn accept_loop(endpoint: Endpoint, node: ActorRef<NodeMsg>) {
    let admission = crate::admission::Admission::new(MAX_INBOUND_HANDSHAKES);
    let rejected = crate::admission::Rejections::default();
    while let Some(accepting) = endpoint.incoming().await {
        let remote = accepting.remote_address();
        let admitted = admission.admit_or_refuse(accepting, remote, "inbound", |c| c.refuse());
        let Some((accepting, slot)) = admitted else {
            continue;
        };
        let node = node.clone();
        let rejected = rejected.clone();
        tokio::spawn(async move {
            let res = accepting.handshake().await;
            drop(slot);
            match res {
                Ok(conn) => {
                    let _ = node.send_message(NodeMsg::Connected {
                        conn,
                        dialled: false,
                    });
                }
                Err(e) => {
                    rejected.report(remote, &e, "inbound");
                }
            }
        });
    }
}

/// Accepts trusted-fabric lanes: each connection from an address that a peer's QUIC
/// connection comes from runs the listener side of the handshake in its own task (at most
/// 64 at once, each for 5 s at most); one from any other address is closed at once, so
/// that nobody else can hold the handshake slots and keep the peers' lanes from forming.
fn spawn_lane_accept(
    listener: std::net::TcpListener,
    shared: Arc<NodeShared>,
    node: ActorRef<NodeMsg>,
) -> Result<JoinHandle<()>, ActorProcessingErr> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let mut handshakes = LaneHandshakes::default();
    let mut warned = std::collections::HashSet::new();
    Ok(tokio::spawn(async move {
        loop {
            let (stream, from) = match listener.accept().await {
                Ok(v) => v,
                Err(e) => {
                    warn!(error = %e, "trusted lane accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let ip = from.ip().to_canonical();
            if !shared.lane_keys.iter().any(|s| s.value().1.contains(&ip)) {
                // Said once per address (a few of them): a peer whose lane comes from
                // another address than its QUIC connections is misconfigured, and this
                // is where it shows.
                if warned.len() < 64 && warned.insert(ip) {
                    warn!(%from, "trusted lane connection from an address no peer's QUIC connection comes from; closed");
                } else {
                    debug!(%from, "trusted lane connection from an address of no peer; closed");
                }
                continue;
            }
            if handshakes.make_room() {
                debug!(%from, "too many trusted lane handshakes at once; the oldest ended");
            }
            let shared = shared.clone();
            let node = node.clone();
            let task = tokio::spawn(async move {
                let res = nexar_transport::accept_lane(
                    stream,
                    shared.id,
                    |peer| {
                        let session = shared.lane_keys.get(&peer)?;
                        session.1.contains(&ip).then_some(session.0)
                    },
                    &shared.config.transport,
                    shared.config.connect_timeout,
                )
                .await;
                match res {
                    Ok(parts) => {
                        let _ = node.send_message(NodeMsg::Lane(parts));
                    }
                    Err(e) => warn!(%from, error = %e, "trusted lane handshake refused"),
                }
            });
            handshakes.push(task.abort_handle());
        }
    }))
}

/// Trusted-lane handshakes a node runs at once.
const LANE_HANDSHAKES: usize = 64;

/// The trusted-lane handshakes under way, oldest first. With every slot taken, the oldest
/// is ended to make room for a new one (not the new one refused): anyone who shares a
/// peer's address can open connections that say nothing, but each then holds a slot only
/// until [`LANE_HANDSHAKES`] newer connections arrive, where a real peer's handshake
/// needs one round trip.
#[derive(Default)]
struct LaneHandshakes(std::collections::VecDeque<tokio::task::AbortHandle>);

impl LaneHandshakes {
    /// Makes room for one more handshake: forgets those that ended and, with every slot
    /// still taken, ends the oldest (`true` then).
    fn make_room(&mut self) -> bool {
        self.0.retain(|h| !h.is_finished());
        if self.0.len() < LANE_HANDSHAKES {
            return false;
        }
        if let Some(oldest) = self.0.pop_front() {
            oldest.abort();
        }
        true
    }

    fn push(&mut self, handshake: tokio::task::AbortHandle) {
        self.0.push_back(handshake);
    }
}

fn spawn_dial(
    endpoint: Endpoint,
    peer: NodeId,
    addr: SocketAddr,
    deadline: Duration,
    node: ActorRef<NodeMsg>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        // Peers may still be starting: retry until the deadline.
        let res = retry_until(
            deadline,
            |_| endpoint.connect(addr, peer),
            |e| {
                debug!(%peer, %addr, error = %e, "dial failed; retrying");
            },
        )
        .await;
        let _ = node.send_message(match res {
            Ok(conn) => NodeMsg::Connected {
                conn,
                dialled: true,
            },
            Err(e) => NodeMsg::DialFailed(peer, e.to_string()),
        });
    })
}

/// Runs `attempt` (given the time left) until it succeeds or `deadline` from now would pass
/// during the next backoff (20 ms, doubling, capped at 500 ms); `on_retry` sees each error
/// that is retried. Returns the last error at the deadline.
pub(crate) async fn retry_until<T, E, F, Fut>(
    deadline: Duration,
    mut attempt: F,
    mut on_retry: impl FnMut(&E),
) -> Result<T, E>
where
    F: FnMut(Duration) -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let until = crate::deadline_in(deadline);
    let mut backoff = Backoff::default();
    loop {
        match attempt(until.saturating_duration_since(Instant::now())).await {
            Ok(v) => return Ok(v),
            Err(e) if crate::deadline_in(backoff.next()) >= until => return Err(e),
            Err(e) => {
                on_retry(&e);
                backoff.wait().await;
            }
        }
    }
}

/// The pause between two tries: 20 ms, doubling, capped at 500 ms.
pub(crate) struct Backoff(Duration);

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff(Duration::from_millis(20))
    }
}

impl Backoff {
    /// The next pause.
    pub(crate) fn next(&self) -> Duration {
        self.0
    }

    /// Sleeps the next pause, and doubles the one after (up to the cap).
    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Duration::from_millis(500));
    }
}

/// The largest payload one message from a node with `config` may carry:
/// `max_frame_bytes`, less room for a relay's envelope where messages may be relayed
/// (sparse topologies).
pub(crate) fn payload_limit(config: &crate::NodeConfig) -> u64 {
    let max = config.transport.max_frame_bytes;
    if config.topology == crate::Topology::FullMesh {
        max
    } else {
        max.saturating_sub(crate::relay::RELAY_ROOM)
    }
}

/// A running node: its shared state and its NodeActor.
pub(crate) struct NodeHandle {
    pub(crate) shared: Arc<NodeShared>,
    pub(crate) actor: ActorRef<NodeMsg>,
    handle: Option<JoinHandle<()>>,
}

impl NodeHandle {
    /// Binds an endpoint for `identity` at `bind` and starts its NodeActor.
    pub(crate) async fn start(
        identity: &nexar_transport::NodeIdentity,
        bind: SocketAddr,
        config: NodeConfig,
    ) -> crate::Result<NodeHandle> {
        config.check()?;
        let endpoint = Endpoint::bind(bind, identity, endpoint_transport(&config))?;
        let trusted = config.trusted_fabric;
        let mut shared = NodeShared::new(endpoint, config, identity)?;
        if trusted {
            shared.bind_lane_listener()?;
        }
        let shared = Arc::new(shared);
        let rank = identity.node().0;
        let (actor, handle) = Actor::spawn(None, NodeActor, shared.clone())
            .instrument(tracing::info_span!("node", rank))
            .await
            .map_err(|e| crate::NexarError::Actor(e.to_string()))?;
        Ok(NodeHandle {
            shared,
            actor,
            handle: Some(handle),
        })
    }

    /// A handle for calling into a node owned elsewhere (it does not own the actor's join
    /// handle).
    pub(crate) fn borrowed(shared: Arc<NodeShared>, actor: ActorRef<NodeMsg>) -> NodeHandle {
        NodeHandle {
            shared,
            actor,
            handle: None,
        }
    }

    /// Dials every peer (making it a member) and waits until each is connected or the
    /// connect deadline passes. The first call forms the mesh; later calls grow it.
    pub(crate) async fn form(&self, peers: Vec<(NodeId, SocketAddr)>) -> crate::Result<()> {
        let wait = self
            .shared
            .config
            .connect_timeout
            .saturating_add(Duration::from_secs(2));
        match self
            .actor
            .call(|reply| NodeMsg::Connect { peers, reply }, Some(wait))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(Ok(()))) => Ok(()),
            Ok(ractor::rpc::CallResult::Success(Err(e))) => Err(crate::NexarError::Formation(e)),
            Ok(other) => Err(crate::NexarError::Formation(format!("{other:?}"))),
            Err(e) => Err(crate::NexarError::Formation(e.to_string())),
        }
    }

    /// Closes the endpoint and stops the actors (returns at once).
    pub(crate) fn stop(&self, why: &str) {
        self.shared.close();
        self.actor.stop(Some(why.to_string()));
    }

    /// Says farewell to every other node of `members` (directly, or through relays) and
    /// waits until each has said the same, is lost, or `within` has passed: closing a
    /// QUIC connection drops whatever it still carries, so a node that closed as soon as
    /// its job ended could take its last messages (or a peer's to it) with it. A peer
    /// says farewell once its own job is over, having received everything it needed.
    pub(crate) async fn farewell(&self, members: &[NodeId], within: Duration) {
        let shared = &*self.shared;
        let deadline = tokio::time::Instant::from_std(crate::deadline_in(within));
        let others: Vec<NodeId> = members
            .iter()
            .copied()
            .filter(|p| *p != shared.id)
            .collect();
        let says = others.iter().map(|&peer| async move {
            // To a neighbour on a stream of its own, until it has the frame: the last node
            // to finish closes right after, which would discard a farewell not yet sent.
            let direct = shared.links.get(&peer).map(|l| l.control.clone());
            let bye = async {
                match direct {
                    Some(control) => control.send_confirmed(FrameKind::Farewell, 0, 0, 0).await,
                    None => {
                        let none = nexar_transport::Payload::default();
                        crate::relay::send_to(shared, peer, FrameKind::Farewell, 0, 0, 0, none)
                            .await
                    }
                }
            };
            match tokio::time::timeout_at(deadline, bye).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, error = %e, "farewell not sent"),
                Err(_) => debug!(%peer, "farewell not sent by the deadline"),
            }
        });
        futures::future::join_all(says).await;
        let waiting = || -> Vec<NodeId> {
            others
                .iter()
                .copied()
                .filter(|p| !shared.has_departed(*p) && !shared.lost.contains_key(p))
                .collect()
        };
        loop {
            let woken = shared.farewells.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if shared.is_shutting_down() {
                return;
            }
            if waiting().is_empty() {
                // Every job is done, but on a sparse topology farewells between other
                // nodes may still be on their way through this one: closing now would
                // leave their destinations to wait out their deadline.
                if shared.config.topology != crate::Topology::FullMesh {
                    let linger = tokio::time::Instant::now() + RELAY_LINGER;
                    tokio::time::sleep_until(linger.min(deadline)).await;
                }
                return;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                debug!(waiting = ?waiting(), "peers had not finished by the farewell deadline");
                return;
            }
        }
    }

    /// Closes as a node whose job is done (see [`NodeShared::close_as`]) and waits for the
    /// actors and the endpoint to wind down.
    pub(crate) async fn shutdown_finished(&mut self) {
        self.shared.close_as(true);
        self.shutdown().await;
    }

    /// Stops and waits for the actors and the endpoint to wind down.
    pub(crate) async fn shutdown(&mut self) {
        self.stop("shutdown");
        if let Some(h) = self.handle.take() {
            let _ = h.await;
        }
        self.shared.endpoint.wait_idle().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's endpoint keeps a connection open at least as long as the node waits for
    /// a silent peer (a `heartbeat_timeout` over the transport's idle timeout did nothing:
    /// QUIC closed the connection first, a loss all the same), reads a stalled frame at
    /// least as long as a call may wait, and starts connections at the admission window;
    /// what the user set above those stays.
    #[test]
    fn the_endpoint_outlasts_the_nodes_own_timeouts() {
        let mut config = NodeConfig {
            heartbeat_timeout: Duration::from_secs(60),
            op_timeout: Duration::from_secs(300),
            ..NodeConfig::default()
        };
        let t = endpoint_transport(&config);
        assert_eq!(t.idle_timeout, Duration::from_secs(60));
        assert_eq!(t.body_timeout, Duration::from_secs(300));
        assert_eq!(t.admission_window, Some(ADMISSION_WINDOW));
        config.transport.idle_timeout = Duration::from_secs(90);
        config.transport.admission_window = Some(1 << 20);
        let t = endpoint_transport(&config);
        assert_eq!(t.idle_timeout, Duration::from_secs(90));
        assert_eq!(t.admission_window, Some(1 << 20));
        // A heartbeat timeout past what QUIC can say takes the longest it can.
        config.heartbeat_timeout = Duration::MAX;
        let t = endpoint_transport(&config);
        assert_eq!(t.idle_timeout, Duration::from_millis((1 << 62) - 1));
    }

    /// A zero `op_timeout` or `connect_timeout` (every call or connection failing at
    /// once) is refused with an argument error naming it.
    #[tokio::test]
    async fn zero_call_and_connect_timeouts_are_refused() {
        for (name, zero) in [
            (
                "op_timeout",
                NodeConfig {
                    op_timeout: Duration::ZERO,
                    ..NodeConfig::default()
                },
            ),
            (
                "connect_timeout",
                NodeConfig {
                    connect_timeout: Duration::ZERO,
                    ..NodeConfig::default()
                },
            ),
        ] {
            let res = crate::Cluster::local_with(1, zero).await;
            assert!(
                matches!(&res, Err(crate::NexarError::InvalidArgument(why)) if why.contains(name)),
                "{name}: {res:?}"
            );
        }
    }

    /// Shutting a cluster down stops each node's peer actors and waits for them: ractor
    /// killed those still running once the node actor's post_stop returned, and a killed
    /// peer actor skipped its own (its tasks ran on, its links stayed published).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shut_down_node_lets_its_peer_actors_stop_in_order() {
        let cluster = crate::Cluster::local(3).await.expect("cluster");
        let shared: Vec<_> = cluster.nodes.iter().map(|n| n.shared.clone()).collect();
        assert!(shared.iter().all(|s| s.links.len() == 2), "a full mesh");
        tokio::time::timeout(Duration::from_secs(30), cluster.shutdown())
            .await
            .expect("shut down within its deadline");
        for (rank, s) in shared.iter().enumerate() {
            assert!(
                s.links.is_empty(),
                "rank {rank}: {} links left published",
                s.links.len()
            );
        }
    }

    /// A peer actor that fails (a bug in a handler, say) loses its peer on its node: the
    /// loss is recorded, its links go, and calls waiting on it learn at once. It used to
    /// be only logged, leaving the peer's links published with no heartbeats or liveness
    /// checks behind them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_peer_actor_loses_its_peer() {
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let comms = cluster.communicators();
        let mut watch = comms[0].failures();
        let children = cluster.nodes[0].actor.get_children();
        assert_eq!(children.len(), 1, "one peer actor");
        children[0]
            .send_message(PeerMsg::Fail)
            .expect("the peer actor takes it");
        let seen = tokio::time::timeout(Duration::from_secs(10), watch.changed())
            .await
            .expect("the loss is recorded")
            .expect("watch");
        assert_eq!(seen, vec![1]);
        // Asked after the failure's handling (which recorded the loss): answered once
        // that is done.
        let peers = match cluster.nodes[0]
            .actor
            .call(NodeMsg::Peers, Some(Duration::from_secs(10)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(p)) => p,
            other => panic!("no answer: {other:?}"),
        };
        assert!(peers.is_empty(), "{peers:?}");
        assert!(!cluster.nodes[0].shared.links.contains_key(&NodeId(1)));
        assert!(cluster.nodes[0].shared.is_gone(NodeId(1)));
        cluster.shutdown().await;
    }

    /// A heartbeat whose send does not finish (it waits for room on a connection that
    /// moves nothing) is the only one in flight: later ticks start no more until it ends,
    /// where each used to start one more, without bound while the stall lasted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_heartbeat_is_the_only_one_in_flight() {
        // The ticker's own ticks (one at the start, the next 20 s on) stay out of the
        // way: the test's ticks are the ones counted.
        let config = NodeConfig {
            heartbeat_interval: Duration::from_secs(20),
            heartbeat_timeout: Duration::from_secs(60),
            ..NodeConfig::default()
        };
        let cluster = crate::Cluster::local_with(2, config)
            .await
            .expect("cluster");
        cluster.nodes[0]
            .shared
            .stall_heartbeats
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let children = cluster.nodes[0].actor.get_children();
        assert_eq!(children.len(), 1, "one peer actor");
        let peer = ActorRef::<PeerMsg>::from(children[0].clone());
        let started = || async {
            match peer
                .call(PeerMsg::HeartbeatsStarted, Some(Duration::from_secs(10)))
                .await
            {
                Ok(ractor::rpc::CallResult::Success(n)) => n,
                other => panic!("no answer: {other:?}"),
            }
        };
        // Ticks until one starts a send that stalls (one started before the stall may
        // still be on its way, and holds the next ticks back until it ends).
        let before = started().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let stalled = loop {
            peer.send_message(PeerMsg::Tick)
                .expect("the peer actor runs");
            let n = started().await;
            if n > before {
                break n;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no heartbeat started within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        for _ in 0..10 {
            peer.send_message(PeerMsg::Tick)
                .expect("the peer actor runs");
        }
        assert_eq!(started().await, stalled, "ticks behind a stalled heartbeat");
        cluster.shutdown().await;
    }

    /// A peer lost while a formation waits for it fails the formation at once, naming it
    /// (a lost peer never comes back), instead of at the connect deadline as "did not
    /// connect".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_lost_while_the_mesh_forms_fails_the_formation_at_once() {
        let ca = nexar_transport::ClusterCa::generate().expect("ca");
        let ids: Vec<_> = (0..3)
            .map(|n| ca.issue(NodeId(n)).expect("identity"))
            .collect();
        let config = NodeConfig {
            connect_timeout: Duration::from_secs(60),
            ..NodeConfig::default()
        };
        let local = SocketAddr::from(([127, 0, 0, 1], 0));
        let n0 = NodeHandle::start(&ids[0], local, config.clone())
            .await
            .expect("node 0");
        let n1 = NodeHandle::start(&ids[1], local, config)
            .await
            .expect("node 1");
        let certs: Vec<_> = ids
            .iter()
            .map(|i| (i.node(), nexar_transport::cert_fingerprint(i.cert_der())))
            .collect();
        n0.shared.pin(certs.iter().copied());
        n1.shared.pin(certs.iter().copied());
        // Node 2 never starts: a socket that reads nothing holds its address (held for
        // the test, so no other test can take the port).
        let silent = std::net::UdpSocket::bind(local).expect("a silent socket");
        let dead = silent.local_addr().expect("its address");
        let a0 = n0.shared.endpoint.local_addr().expect("address");
        let a1 = n1.shared.endpoint.local_addr().expect("address");
        let shared0 = n0.shared.clone();
        let actor0 = n0.actor.clone();
        let forming = tokio::spawn(async move {
            NodeHandle::borrowed(shared0, actor0)
                .form(vec![(NodeId(0), a0), (NodeId(1), a1), (NodeId(2), dead)])
                .await
        });
        let shared1 = n1.shared.clone();
        let actor1 = n1.actor.clone();
        tokio::spawn(async move {
            let _ = NodeHandle::borrowed(shared1, actor1)
                .form(vec![(NodeId(0), a0), (NodeId(1), a1)])
                .await;
        });
        tokio::time::timeout(Duration::from_secs(20), async {
            while !n0.shared.links.contains_key(&NodeId(1)) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("node 0 reaches node 1");
        n1.stop("test: node 1 goes away");
        let res = tokio::time::timeout(Duration::from_secs(20), forming)
            .await
            .expect("the formation fails before its deadline")
            .expect("no panic");
        match res {
            Err(crate::NexarError::Formation(why)) => {
                assert!(why.contains("node 1 was lost"), "{why}")
            }
            other => panic!("expected a formation error, got {other:?}"),
        }
        n0.stop("test over");
        drop(silent);
    }

    /// The node's task list keeps the tasks still running and drops finished ones as
    /// new ones come (a long elastic job adds some at every resize point).
    #[tokio::test]
    async fn tracked_tasks_let_go_of_finished_ones() {
        let mut tasks = Vec::new();
        track(&mut tasks, tokio::spawn(std::future::pending::<()>()));
        for _ in 0..100 {
            let done = tokio::spawn(async {});
            let finished = tokio::time::timeout(std::time::Duration::from_secs(10), async {
                while !done.is_finished() {
                    tokio::task::yield_now().await;
                }
            });
            finished.await.expect("a task that does nothing finishes");
            track(&mut tasks, done);
        }
        assert_eq!(tasks.len(), 2, "the running task and the last one tracked");
        assert!(!tasks[0].is_finished());
        tasks[0].abort();
    }

    /// A flood of RPC requests that comes while the node actor is busy waits in the
    /// control channel and at the readers (whose peer QUIC's stream limit then holds
    /// back), not in the actor's mailbox: never more than `CONTROL_IN_MAILBOX` there. Once
    /// the actor is free, every one is handled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control_frames_wait_outside_a_busy_node_actors_mailbox() {
        use std::sync::atomic::Ordering;
        let cluster = crate::Cluster::local(2).await.expect("cluster");
        let shared = cluster.nodes[1].shared.clone();
        let (free, hold) = tokio::sync::oneshot::channel();
        cluster.nodes[1]
            .actor
            .send_message(NodeMsg::Hold(hold))
            .expect("hold the actor");
        let to_1 = cluster.nodes[0]
            .shared
            .links
            .get(&NodeId(1))
            .expect("a link to node 1")
            .control
            .clone();
        let tx = shared.control_tx.get().expect("control channel").clone();
        let frames = CONTROL_IN_MAILBOX + tx.max_capacity() + 500;
        // Requests for an RPC nobody serves (answered with an error once handled).
        let flood = tokio::spawn(async move {
            for step in 0..frames as u64 {
                to_1.send(FrameKind::Control, 0, 1 << 40, step, bytes::Bytes::new())
                    .await?;
            }
            Ok::<_, nexar_transport::TransportError>(())
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let queued = || shared.control_queued.load(Ordering::Acquire);
        while queued() < CONTROL_IN_MAILBOX || tx.capacity() > 0 {
            assert!(
                Instant::now() < deadline,
                "the mailbox and the channel never filled: {} in the mailbox, {} free in \
                 the channel",
                queued(),
                tx.capacity()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(!flood.is_finished(), "the flood was never held back");
        free.send(()).expect("the actor holds");
        tokio::time::timeout(Duration::from_secs(30), flood)
            .await
            .expect("the flood was never taken")
            .expect("task")
            .expect("every request sent");
        while shared.control_handled.load(Ordering::Acquire) < frames {
            assert!(
                Instant::now() < deadline,
                "{} of {frames} requests handled",
                shared.control_handled.load(Ordering::Acquire)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            shared.control_most.load(Ordering::Acquire),
            CONTROL_IN_MAILBOX,
            "the most frames in the mailbox at once"
        );
        cluster.shutdown().await;
    }

    /// A node reads a peer's stalled frame for at least its call deadline before it gives
    /// the frame up: a sender may pause mid-frame that long waiting for send budget.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_are_given_up_no_sooner_than_the_call_deadline() {
        let long = Duration::from_secs(600);
        for (op, body, want) in [
            (long, Duration::from_secs(1), long),
            (Duration::from_secs(5), long, long),
        ] {
            let mut config = NodeConfig {
                op_timeout: op,
                ..NodeConfig::default()
            };
            config.transport.body_timeout = body;
            let cluster = crate::Cluster::local_with(1, config)
                .await
                .expect("cluster");
            let got = cluster.nodes[0].shared.endpoint.config().body_timeout;
            assert_eq!(got, want, "op_timeout {op:?}, body_timeout {body:?}");
            cluster.shutdown().await;
        }
    }

    #[tokio::test]
    async fn a_full_set_of_lane_handshakes_ends_its_oldest_for_a_new_one() {
        let mut handshakes = LaneHandshakes::default();
        let mut tasks: Vec<_> = (0..LANE_HANDSHAKES)
            .map(|_| tokio::spawn(std::future::pending::<()>()))
            .collect();
        for t in &tasks {
            assert!(!handshakes.make_room(), "room while slots are free");
            handshakes.push(t.abort_handle());
        }
        assert!(
            handshakes.make_room(),
            "all slots taken: the oldest makes room"
        );
        let oldest = tasks.remove(0);
        let ended = tokio::time::timeout(Duration::from_secs(60), oldest)
            .await
            .expect("the oldest handshake did not end");
        assert!(ended.is_err_and(|e| e.is_cancelled()));
        assert!(
            tasks.iter().all(|t| !t.is_finished()),
            "only the oldest ends"
        );
        assert!(!handshakes.make_room(), "one slot free now");
        for t in tasks {
            t.abort();
        }
    }
}
