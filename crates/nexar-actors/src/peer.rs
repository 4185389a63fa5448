//! PeerActor: one per remote node. Owns that node's connections (a control lane and a
//! bulk lane, plus any extra authenticated connection the peer opens), their readers,
//! heartbeats and failure detection.

use std::time::Instant;

use bytes::Bytes;
use nexar_transport::{Connection, FrameKind, Inbound, NodeId, TcpLane};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;
use tracing::debug;

use crate::node::{Links, NodeMsg, NodeShared};
use std::sync::Arc;

/// Messages a [`PeerActor`] handles.
#[derive(Debug)]
pub(crate) enum PeerMsg {
    /// A new authenticated connection to this peer; `control` says which lane it is
    /// (`None`: an extra connection, read but not used for sending).
    Attach {
        conn: Connection,
        lane: Option<Lane>,
    },
    /// A handshaken trusted-fabric lane to this peer.
    AttachLane(nexar_transport::LaneParts),
    /// The cluster grew past two nodes: this peer is no longer its node's only one, so its
    /// connections go back to one send window each ([`Connection::set_sole_peer`]).
    WorldGrew,
    /// A heartbeat arrived from the peer.
    Heartbeat,
    /// Timer: send a heartbeat and check the peer's liveness.
    Tick,
    /// A connection closed (`graceful`: the peer shut down cleanly) or heartbeats stopped.
    Lost {
        /// What was observed.
        reason: String,
        /// True for a clean close (code 0): logged quietly, but still a failure.
        graceful: bool,
        /// True when the peer closed because its job is done (after its farewell): a
        /// departure, not a failure.
        finished: bool,
    },
    /// The actor fails (tests: what a bug in a handler would do).
    #[cfg(test)]
    Fail,
    /// How many heartbeat sends the actor has started (tests).
    #[cfg(test)]
    HeartbeatsStarted(ractor::RpcReplyPort<usize>),
}

/// How long a trusted lane's clean end waits for the peer's QUIC close to say whether it
/// finished its job (a departure) or not (a loss).
const LANE_END_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Extra authenticated connections a peer may hold open besides its two lanes (read, not
/// used for sending). Nodes that keep to the protocol make few (a dial retried after a
/// handshake that timed out on one side only); the cap bounds what one that keeps
/// dialling makes this node hold.
const MAX_EXTRA_CONNECTIONS: usize = 4;

/// Which of the two sending lanes a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Heartbeats, barriers, small messages.
    Control,
    /// Large payloads.
    Bulk,
}

pub(crate) struct PeerActor;

pub(crate) struct PeerArgs {
    pub(crate) peer: NodeId,
    pub(crate) shared: Arc<NodeShared>,
    pub(crate) inbound: Inbound,
    pub(crate) node: ActorRef<NodeMsg>,
}

pub(crate) struct PeerState {
    peer: NodeId,
    shared: Arc<NodeShared>,
    inbound: Inbound,
    node: ActorRef<NodeMsg>,
    control: Option<Connection>,
    bulk: Option<Connection>,
    extra: Vec<Connection>,
    /// The trusted-fabric lane, when configured and handshaken, and its reader.
    lane: Option<nexar_transport::TcpLane>,
    lane_reader: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
    /// The last heartbeat's send, in its own task (an actor never awaits network I/O).
    heartbeat: Option<JoinHandle<()>>,
    #[cfg(test)]
    heartbeats_started: usize,
    /// When the peer was last heard from: a heartbeat, or any data on its connections.
    last_heard: Instant,
    /// Stream frames its connections, and bytes its trusted lane, had received at the
    /// last tick (a count that moves while its data arrives).
    stream_frames: u64,
    published: bool,
    ready: bool,
    lost: bool,
}

/// True while the cluster has had no more than two nodes: this node's one peer is then also
/// the only node that sends to it, so their connections may take more than one send
/// window ([`Connection::set_sole_peer`]). The world the node knows only grows, so a
/// cluster that shrinks back to two keeps one window.
fn sole_peer(shared: &NodeShared) -> bool {
    shared.world() <= 2
}

impl PeerState {
    fn all_conns(&self) -> impl Iterator<Item = &Connection> {
        self.control
            .iter()
            .chain(self.bulk.iter())
            .chain(self.extra.iter())
    }
}

impl Actor for PeerActor {
    type Msg = PeerMsg;
    type State = PeerState;
    type Arguments = PeerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PeerMsg>,
        args: PeerArgs,
    ) -> Result<PeerState, ActorProcessingErr> {
        let interval = args.shared.config.heartbeat_interval;
        let ticker = tokio::spawn(async move {
            let mut t = tokio::time::interval(interval);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                t.tick().await;
                if myself.send_message(PeerMsg::Tick).is_err() {
                    break;
                }
            }
        });
        Ok(PeerState {
            peer: args.peer,
            shared: args.shared,
            inbound: args.inbound,
            node: args.node,
            control: None,
            bulk: None,
            extra: Vec::new(),
            lane: None,
            lane_reader: None,
            tasks: vec![ticker],
            heartbeat: None,
            #[cfg(test)]
            heartbeats_started: 0,
            last_heard: Instant::now(),
            stream_frames: 0,
            published: false,
            ready: false,
            lost: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PeerMsg>,
        msg: PeerMsg,
        st: &mut PeerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PeerMsg::Attach { conn, lane } => {
                if st.lost {
                    conn.close("peer already declared lost");
                    return Ok(());
                }
                let filled = match lane {
                    Some(Lane::Control) => st.control.is_some(),
                    Some(Lane::Bulk) => st.bulk.is_some(),
                    None => true,
                };
                if filled {
                    // Extra connections that closed go, with their readers; past the cap a
                    // member that keeps dialling gets its new ones closed, not kept.
                    st.extra.retain(|c| c.quic().close_reason().is_none());
                    st.tasks.retain(|t| !t.is_finished());
                    if st.extra.len() >= MAX_EXTRA_CONNECTIONS {
                        debug!(peer = %st.peer, "extra connection refused: too many");
                        conn.close("too many connections from this node");
                        return Ok(());
                    }
                }
                st.tasks.push(conn.spawn_reader(st.inbound.clone()));
                conn.set_sole_peer(sole_peer(&st.shared));
                let slot = match lane {
                    Some(Lane::Control) => &mut st.control,
                    Some(Lane::Bulk) => &mut st.bulk,
                    None => {
                        debug!(peer = %st.peer, "extra connection attached");
                        st.extra.push(conn);
                        return Ok(());
                    }
                };
                if slot.is_some() {
                    debug!(peer = %st.peer, ?lane, "lane already present; keeping the new one as extra");
                    st.extra.push(conn);
                } else {
                    // Losing a lane loses the peer; extra connections may come and go.
                    let watch = conn.clone();
                    let me = myself.clone();
                    st.tasks.push(tokio::spawn(async move {
                        let (reason, graceful) = watch.closed().await;
                        let _ = me.send_message(PeerMsg::Lost {
                            reason: format!("connection closed: {reason}"),
                            graceful,
                            finished: watch.peer_finished(),
                        });
                    }));
                    *slot = Some(conn);
                }
                if !st.published {
                    if let (Some(control), Some(bulk)) = (&st.control, &st.bulk) {
                        st.shared.links.insert(
                            st.peer,
                            Links {
                                control: control.clone(),
                                bulk: bulk.clone(),
                                lane: None,
                            },
                        );
                        st.published = true;
                        st.last_heard = Instant::now();
                        if st.shared.config.trusted_fabric {
                            // Ready once the trusted lane is up too.
                            let control = control.clone();
                            start_lane(st, &myself, &control);
                        } else {
                            st.ready = true;
                            let _ = st.node.send_message(NodeMsg::PeerReady(st.peer));
                        }
                    }
                }
            }
            PeerMsg::AttachLane(parts) => {
                if st.lost || st.lane.is_some() {
                    parts.lane.close();
                    return Ok(());
                }
                let me = myself.clone();
                let control = st.control.clone();
                // Enough for the QUIC close, sent before the lane's end, to arrive; a peer
                // that crashed is reported that much later.
                let grace = st.shared.config.heartbeat_timeout.min(LANE_END_GRACE);
                st.lane_reader = Some(parts.lane.spawn_reader(
                    parts.read,
                    st.inbound.clone(),
                    move |reason, graceful| {
                        let reason = format!("trusted lane: {reason}");
                        // A lane that ended cleanly: the peer is closing, and its QUIC
                        // close, on its way, says whether it finished its job.
                        if let (true, Some(control)) = (graceful, control) {
                            tokio::spawn(async move {
                                let closed = tokio::time::timeout(grace, control.closed());
                                let finished = closed.await.is_ok() && control.peer_finished();
                                let _ = me.send_message(PeerMsg::Lost {
                                    reason,
                                    graceful,
                                    finished,
                                });
                            });
                            return;
                        }
                        let _ = me.send_message(PeerMsg::Lost {
                            reason,
                            graceful,
                            finished: false,
                        });
                    },
                ));
                if let Some(mut links) = st.shared.links.get_mut(&st.peer) {
                    links.lane = Some(parts.lane.clone());
                }
                debug!(peer = %st.peer, "trusted lane attached");
                st.lane = Some(parts.lane);
                if st.published && !st.ready {
                    st.ready = true;
                    let _ = st.node.send_message(NodeMsg::PeerReady(st.peer));
                }
            }
            PeerMsg::WorldGrew => {
                let sole = sole_peer(&st.shared);
                for conn in st.all_conns() {
                    conn.set_sole_peer(sole);
                }
            }
            PeerMsg::Heartbeat => st.last_heard = Instant::now(),
            PeerMsg::Tick => {
                if !st.published || st.lost {
                    return Ok(());
                }
                // Any data from the peer counts as a sign of life, not only a heartbeat:
                // heartbeats share the message stream with small messages, and on a slow
                // path they can wait behind many of them while the peer's data keeps
                // arriving, over QUIC or over a trusted lane (its bytes, counted as they
                // come, within a frame too). (Not its acknowledgements: its QUIC stack
                // sends those even when its node is wedged. A wedged node's kernel still
                // sends what its lane's socket buffer holds, a few MiB at most, so that
                // delays the loss by no more than those bytes take to arrive.)
                let frames = st
                    .all_conns()
                    .map(Connection::stream_frames_received)
                    .chain(st.lane.iter().map(TcpLane::bytes_received))
                    .fold(0u64, u64::wrapping_add);
                if frames != st.stream_frames {
                    st.stream_frames = frames;
                    st.last_heard = Instant::now();
                }
                let silent = st.last_heard.elapsed();
                if silent > st.shared.config.heartbeat_timeout {
                    let reason = format!("nothing heard for {silent:?} (no heartbeat, no data)");
                    declare_lost(st, &reason, false);
                    return Ok(());
                }
                #[cfg(test)]
                if st
                    .shared
                    .mute_heartbeats
                    .load(std::sync::atomic::Ordering::Relaxed)
                {
                    return Ok(());
                }
                if st.heartbeat.as_ref().is_some_and(|h| !h.is_finished()) {
                    // The last heartbeat is still on its way: its send waits for room on
                    // a connection that moves nothing. One in flight says all there is to
                    // say; a send started at every tick would pile up while that lasts.
                    return Ok(());
                }
                if let Some(control) = st.control.clone() {
                    #[cfg(test)]
                    let stall = st
                        .shared
                        .stall_heartbeats
                        .load(std::sync::atomic::Ordering::Relaxed);
                    st.heartbeat = Some(tokio::spawn(async move {
                        #[cfg(test)]
                        if stall {
                            std::future::pending::<()>().await;
                        }
                        let _ = control
                            .send(FrameKind::Heartbeat, 0, 0, 0, Bytes::new())
                            .await;
                    }));
                    #[cfg(test)]
                    {
                        st.heartbeats_started += 1;
                    }
                }
            }
            #[cfg(test)]
            PeerMsg::Fail => return Err("test: this peer actor fails".into()),
            #[cfg(test)]
            PeerMsg::HeartbeatsStarted(reply) => {
                let _ = reply.send(st.heartbeats_started);
            }
            PeerMsg::Lost {
                reason,
                graceful,
                finished,
            } => {
                #[cfg(test)]
                if st
                    .shared
                    .hold_losses
                    .load(std::sync::atomic::Ordering::SeqCst)
                {
                    return Ok(());
                }
                if finished {
                    // Its farewell may still be on its way: the close says as much.
                    st.shared.farewell_from(st.peer);
                }
                if !st.lost && !st.shared.is_shutting_down() {
                    declare_lost(st, &reason, graceful);
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PeerMsg>,
        st: &mut PeerState,
    ) -> Result<(), ActorProcessingErr> {
        // When the node shuts down it has closed every connection already, perhaps as
        // finished: closing them here too could get in first, with another code.
        if !st.shared.is_shutting_down() {
            for c in st.all_conns() {
                c.close("peer actor stopped");
            }
        }
        if let Some(l) = &st.lane {
            l.close();
        }
        if let Some(r) = st.lane_reader.take() {
            r.abort();
        }
        for t in st.tasks.drain(..).chain(st.heartbeat.take()) {
            t.abort();
        }
        st.shared.links.remove(&st.peer);
        Ok(())
    }
}

/// Opens the trusted-fabric lane to this peer: both ends derive the lane key from the
/// control connection's TLS session; the lower node id listens and sends its TCP port over
/// QUIC, the higher one waits for it and dials. A lane that cannot be opened within the
/// connect deadline loses the peer (the user asked for the lane; running without it
/// silently would hide the misconfiguration).
fn start_lane(st: &mut PeerState, myself: &ActorRef<PeerMsg>, control: &Connection) {
    let key = match nexar_transport::lane_key(control) {
        Ok(k) => k,
        Err(e) => {
            let _ = myself.send_message(PeerMsg::Lost {
                reason: format!("trusted lane: {e}"),
                graceful: false,
                finished: false,
            });
            return;
        }
    };
    // Where the peer's lane may come from: where its QUIC connections come from (the one it
    // dialled shows its source address as its routing picks it, as the lane's will be).
    let mut peer_ips: Vec<std::net::IpAddr> = st
        .all_conns()
        .map(|c| c.remote_addr().ip().to_canonical())
        .collect();
    peer_ips.sort();
    peer_ips.dedup();
    st.shared.lane_keys.insert(st.peer, (key, peer_ips));
    let (me, peer) = (st.shared.id, st.peer);
    let shared = st.shared.clone();
    let actor = myself.clone();
    let control = control.clone();
    st.tasks.push(tokio::spawn(async move {
        let deadline = shared.config.connect_timeout;
        let res: Result<Option<nexar_transport::LaneParts>, String> = async {
            if me < peer {
                let port = shared
                    .lane_port
                    .ok_or("this node has no trusted lane listener")?;
                control
                    .send(
                        FrameKind::Data,
                        crate::node::LANE_CHANNEL,
                        0,
                        0,
                        Bytes::copy_from_slice(&port.to_be_bytes()),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                return Ok(None);
            }
            let key_in = nexar_transport::MailboxKey {
                comm: crate::node::LANE_CHANNEL,
                tag: 0,
                step: 0,
                src: peer,
            };
            let got = shared
                .table
                .take(key_in, deadline)
                .await
                .map_err(|e| format!("no lane port from the peer: {e}"))?;
            let mut port = [0u8; 2];
            got.copy_to(&mut port)
                .map_err(|_| "malformed lane port message".to_string())?;
            let addr =
                std::net::SocketAddr::new(control.remote_addr().ip(), u16::from_be_bytes(port));
            // From this node's QUIC address, where the peer expects its lane from.
            let from = shared.endpoint.local_addr().ok().map(|a| a.ip());
            // Retry until the deadline: a handshake slot at the listener may be busy.
            crate::node::retry_until(
                deadline,
                |left| {
                    nexar_transport::dial_lane(
                        addr,
                        from,
                        me,
                        peer,
                        key,
                        &shared.config.transport,
                        left,
                    )
                },
                |e| debug!(%peer, error = %e, "trusted lane dial failed; retrying"),
            )
            .await
            .map(Some)
            .map_err(|e| e.to_string())
        }
        .await;
        match res {
            Ok(Some(parts)) => {
                let _ = actor.send_message(PeerMsg::AttachLane(parts));
            }
            Ok(None) => {}
            Err(e) => {
                let _ = actor.send_message(PeerMsg::Lost {
                    reason: format!("trusted lane: {e}"),
                    graceful: false,
                    finished: false,
                });
            }
        }
    }));
}

fn declare_lost(st: &mut PeerState, reason: &str, graceful: bool) {
    st.lost = true;
    if let Some(l) = &st.lane {
        l.close();
    }
    // Nothing more from a lost peer reaches the mailboxes, even if it is only slow.
    if let Some(r) = st.lane_reader.take() {
        r.abort();
    }
    let conns: Vec<&Connection> = st.all_conns().collect();
    st.shared.lose_peer(st.peer, reason, graceful, &conns);
    let _ = st
        .node
        .send_message(NodeMsg::PeerLost(st.peer, reason.to_string()));
}
