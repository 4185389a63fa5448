//! RPC: handlers registered per communicator and id, requests matched to replies.
//!
//! A request travels as a control frame (`comm`, `tag` = request id, `step` = RPC id),
//! on the control connection up to `small_message_bytes` (64 KiB), so it never queues
//! behind bulk data, and on the bulk one above; requests are limited to 1 MiB, and to the
//! callee's `max_frame_bytes` (its transport refuses a larger one unread, and the callee
//! answers it with an error where the request came straight from its caller; a relay
//! drops one over its own limit, and the caller waits for its deadline).
//! The node dispatches it to the registered handler in a task of its own (a slow handler
//! never blocks the peer's other traffic). The reply travels as a data frame keyed by the
//! request id on a reserved channel and is taken from the mailbox table like any message,
//! with the call's own deadline. A reply that arrives after its caller gave up is discarded.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use nexar_transport::{ControlFrame, FrameKind, NodeId, Payload};
use tracing::{debug, warn};

use crate::node::NodeShared;

/// Channel (mailbox `comm`) on which RPC replies arrive. Reserved: communicator ids never
/// take this value.
pub(crate) const RPC_REPLY_CHANNEL: u64 = u64::MAX - 1;

/// Largest RPC request payload.
pub const MAX_RPC_REQUEST: usize = (1 << 20) - 64;

/// What a handler returns: the reply bytes, or an error message for the caller.
pub type RpcResult = Result<Vec<u8>, String>;

/// A registered RPC handler: called with the caller's rank and the request payload.
pub(crate) type Handler =
    Arc<dyn Fn(usize, Bytes) -> Pin<Box<dyn Future<Output = RpcResult> + Send>> + Send + Sync>;

/// A registration: the handler and the member list to turn node ids into ranks.
#[derive(Clone)]
pub(crate) struct Registration {
    pub(crate) handler: Handler,
    pub(crate) members: Arc<[NodeId]>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("members", &self.members.len())
            .finish_non_exhaustive()
    }
}

/// Reply status byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Status {
    Ok = 0,
    UnknownId = 1,
    HandlerError = 2,
    HandlerPanic = 3,
}

impl Status {
    pub(crate) fn from_byte(b: u8) -> Option<Status> {
        match b {
            0 => Some(Status::Ok),
            1 => Some(Status::UnknownId),
            2 => Some(Status::HandlerError),
            3 => Some(Status::HandlerPanic),
            _ => None,
        }
    }
}

/// A caller's request in hand (its handler runs, or its reply is being sent): counted in
/// `NodeShared::rpc_in_flight` from [`InFlight::take`] until dropped.
pub(crate) struct InFlight {
    counts: Arc<dashmap::DashMap<NodeId, usize>>,
    from: NodeId,
}

impl InFlight {
    /// Counts a request from `from`, unless `max_rpc_in_flight` of its requests run
    /// already.
    fn take(shared: &NodeShared, from: NodeId) -> Option<InFlight> {
        let cap = shared.config.max_rpc_in_flight;
        InFlight::take_below(&shared.rpc_in_flight, from, cap)
    }

    /// The place a refusal's reply holds while it is sent ([`dispatch`]): counted apart
    /// from the requests being served (refusals never take their room), up to
    /// [`REFUSALS_PER_SERVED`] times `max_rpc_in_flight`, so that a caller that sends
    /// requests without reading the replies cannot make this node hold a task per request.
    fn for_refusal(shared: &NodeShared, from: NodeId) -> Option<InFlight> {
        let cap = shared
            .config
            .max_rpc_in_flight
            .saturating_mul(REFUSALS_PER_SERVED);
        InFlight::take_below(&shared.rpc_refusals, from, cap)
    }

    fn take_below(
        counts: &Arc<dashmap::DashMap<NodeId, usize>>,
        from: NodeId,
        cap: usize,
    ) -> Option<InFlight> {
        let mut n = counts.entry(from).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(InFlight {
            counts: counts.clone(),
            from,
        })
    }
}

/// How many refusals' replies to one caller may be in hand at once, per request that
/// `max_rpc_in_flight` lets it have served: a burst of calls from a caller that reads
/// its replies is answered (busy) well past the requests served, and only a caller that
/// leaves them unread meets the cap.
pub(crate) const REFUSALS_PER_SERVED: usize = 4;

impl Drop for InFlight {
    fn drop(&mut self) {
        if let dashmap::mapref::entry::Entry::Occupied(mut e) = self.counts.entry(self.from) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }
}

fn reply_bytes(status: Status, body: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(1 + body.len());
    b.put_u8(status as u8);
    b.put_slice(body);
    b.freeze()
}

/// Runs the handler registered for `(comm, id)` for a caller (node `from`) and returns the
/// status-coded reply. The handler is called, and its future run, in a task of its own, so
/// a panic is caught wherever it happens: in the handler's synchronous part (before its
/// `async` block) as in its future. A caller that is not a member of the communicator the
/// handler was registered on has no rank to give the handler: it is refused as if no
/// handler were registered for it ([`Status::UnknownId`]), and the handler is not called.
/// Nor is it for a caller with [`NodeConfig::max_rpc_in_flight`](crate::NodeConfig)
/// requests in hand (this node's own calls to itself included): that one is told the
/// server is busy. A request that ran its handler comes back with its place among the
/// caller's requests in hand, for whoever sends the reply to hold until it is sent (a
/// handler that panicked gives it up at once).
pub(crate) async fn serve(
    shared: &NodeShared,
    comm: u64,
    id: u64,
    from: NodeId,
    payload: Bytes,
) -> (Bytes, Option<InFlight>) {
    let reg = u32::try_from(id)
        .ok()
        .and_then(|id| shared.rpc.get(&(comm, id)).map(|r| r.clone()));
    match reg {
        None => (
            reply_bytes(
                Status::UnknownId,
                format!("no RPC handler {id} on communicator {comm}").as_bytes(),
            ),
            None,
        ),
        Some(reg) => {
            let Some(caller) = reg.members.iter().position(|n| *n == from) else {
                debug!(%from, comm, id, "RPC request from a node outside the communicator");
                let msg = format!("node {from} is not a member of communicator {comm}");
                return (reply_bytes(Status::UnknownId, msg.as_bytes()), None);
            };
            let Some(running) = InFlight::take(shared, from) else {
                debug!(%from, comm, id, "RPC request refused: too many from this caller in flight");
                let msg = format!(
                    "server busy: {} requests from this node are being served \
                     (max_rpc_in_flight)",
                    shared.config.max_rpc_in_flight
                );
                return (reply_bytes(Status::HandlerError, msg.as_bytes()), None);
            };
            let handler = reg.handler;
            // Called inside the task: a panic before the handler's future exists is caught
            // there too, instead of ending this dispatch (or the caller's own task, for a
            // call to oneself) without a reply. The task holds its place among the
            // caller's requests in flight until the handler is done, even when whoever
            // waits for it gives up, and hands it back with the result.
            let task = tokio::spawn(async move {
                let res = handler(caller, payload).await;
                (res, running)
            });
            shared.track_handler(task.abort_handle());
            match task.await {
                Ok((Ok(body), running)) => (reply_bytes(Status::Ok, &body), Some(running)),
                Ok((Err(msg), running)) => (
                    reply_bytes(Status::HandlerError, msg.as_bytes()),
                    Some(running),
                ),
                Err(e) if e.is_panic() => {
                    warn!(comm, id, "RPC handler panicked");
                    (
                        reply_bytes(Status::HandlerPanic, b"the handler panicked"),
                        None,
                    )
                }
                Err(_) => (
                    reply_bytes(Status::HandlerError, b"the handler was cancelled"),
                    None,
                ),
            }
        }
    }
}

/// Serves an incoming request (in its own task) and sends the reply back to the caller,
/// over QUIC, within the node's `op_timeout`; the request keeps its place among the
/// caller's requests in hand until then. A refusal (no such handler, a caller outside the
/// communicator, busy, a handler that panicked) takes a place of another count while its
/// reply is sent, among up to [`REFUSALS_PER_SERVED`] times `max_rpc_in_flight`
/// ([`InFlight::for_refusal`]); past that it is dropped without a reply (its caller waits
/// to its deadline). So a caller that does not read its replies cannot make this node
/// hold more than five times `max_rpc_in_flight` of them. A request whose header says it is over
/// [`MAX_RPC_REQUEST`] (one relayed, or sent straight by a caller that skipped its own
/// check: the transport refuses control frames only past 1 MiB), or one the
/// transport refused unread for being over this node's `max_frame_bytes`
/// ([`ControlFrame::oversized`]), is answered with an error and not served.
pub(crate) fn dispatch(shared: Arc<NodeShared>, frame: ControlFrame) {
    let ControlFrame {
        from,
        header,
        payload,
        oversized,
    } = frame;
    tokio::spawn(async move {
        let (mut reply, running) = if oversized {
            let msg = format!(
                "RPC request of {} bytes exceeds the {} bytes this rank reads in one frame \
                 (its transport.max_frame_bytes)",
                header.len, shared.config.transport.max_frame_bytes
            );
            (reply_bytes(Status::HandlerError, msg.as_bytes()), None)
        } else if header.len > MAX_RPC_REQUEST as u64 {
            let msg = format!(
                "RPC request of {} bytes exceeds the {MAX_RPC_REQUEST} byte limit",
                header.len
            );
            (reply_bytes(Status::HandlerError, msg.as_bytes()), None)
        } else {
            serve(&shared, header.comm, header.step, from, payload).await
        };
        let Some(_running) = running.or_else(|| InFlight::for_refusal(&shared, from)) else {
            debug!(%from, id = header.step, "RPC refusal dropped: too many replies to this caller in hand");
            return;
        };
        // The reply travels as one message: its status byte, then the handler's bytes.
        let max = shared.payload_limit().saturating_sub(1);
        let body = reply.len().saturating_sub(1);
        if body as u64 > max {
            // The caller would wait for its deadline: tell it why instead.
            let msg = format!(
                "the handler's reply of {body} bytes exceeds the {max} bytes a reply may \
                 carry (max_frame_bytes, less a status byte and, on a sparse topology, \
                 room for a relay's envelope)"
            );
            warn!(%from, id = header.step, "{msg}");
            reply = reply_bytes(Status::HandlerError, msg.as_bytes());
        }
        let sent = crate::relay::send_to(
            &shared,
            from,
            FrameKind::Data,
            RPC_REPLY_CHANNEL,
            header.tag,
            0,
            Payload::from_bytes(reply),
        );
        match tokio::time::timeout(shared.config.op_timeout, sent).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => debug!(%from, error = %e, "RPC reply not delivered"),
            Err(_) => debug!(%from, "RPC reply not delivered within op_timeout"),
        }
    });
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use nexar_transport::NodeId;

    use super::{InFlight, REFUSALS_PER_SERVED};

    /// Refusals' replies hold places of their own count, up to `REFUSALS_PER_SERVED`
    /// times `max_rpc_in_flight` per caller; past that a refusal gets none (and is dropped
    /// unanswered); they never take the room of requests to serve; and places come back
    /// as replies go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refusals_hold_places_of_their_own_up_to_a_cap() {
        let config = crate::NodeConfig {
            max_rpc_in_flight: 2,
            ..crate::NodeConfig::default()
        };
        let cluster = crate::Cluster::local_with(1, config).await.expect("a node");
        let shared = &cluster.nodes[0].shared;
        let (caller, other) = (NodeId(77), NodeId(78));
        let cap = 2 * REFUSALS_PER_SERVED;
        let refusals: Vec<_> = (0..cap)
            .map(|_| InFlight::for_refusal(shared, caller))
            .collect();
        assert!(refusals.iter().all(Option::is_some));
        assert!(
            InFlight::for_refusal(shared, caller).is_none(),
            "past the cap"
        );
        assert!(InFlight::for_refusal(shared, other).is_some(), "per caller");
        let served: Vec<_> = (0..2).map(|_| InFlight::take(shared, caller)).collect();
        assert!(
            served.iter().all(Option::is_some),
            "refusals take no room to serve"
        );
        assert!(InFlight::take(shared, caller).is_none(), "busy");
        drop(refusals);
        assert!(InFlight::for_refusal(shared, caller).is_some());
        drop(served);
        assert!(InFlight::take(shared, caller).is_some());
    }

    /// With a trusted-fabric lane between two nodes, the reply to an RPC still travels over
    /// QUIC, as the request does (it was sent as a data frame, and so over the lane): with
    /// the lane's writer held by a frame begun and never written, the call still gets its
    /// reply.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replies_stay_on_quic_beside_a_trusted_lane() {
        let config = crate::NodeConfig {
            trusted_fabric: true,
            ..crate::NodeConfig::default()
        };
        let cluster = crate::Cluster::local_with(2, config)
            .await
            .expect("two nodes with a lane");
        let comms = cluster.communicators();
        comms[1].register_rpc(7, |_caller, req: Bytes| async move { Ok(req.to_vec()) });
        let lane = cluster.nodes[1]
            .shared
            .links
            .get(&NodeId(0))
            .and_then(|l| l.lane.clone())
            .expect("a lane from node 1 to node 0");
        // Node 1's writer to node 0 is taken until `held` is dropped.
        let held = tokio::time::timeout(Duration::from_secs(30), lane.begin_frame(0, 0, 0, 8))
            .await
            .expect("in time")
            .expect("a frame begun");
        let reply = comms[0]
            .rpc_with_timeout(1, 7, b"ping", Duration::from_secs(10))
            .await
            .expect("the reply, over QUIC");
        assert_eq!(reply.as_ref(), b"ping");
        drop(held);
    }
}
