//! RPC: handlers registered per communicator and id, requests matched to replies.
//!
//! A request travels as a control frame (`comm`, `tag` = request id, `step` = RPC id) on
//! the control lane, so it never queues behind bulk data; requests are limited to 1 MiB.
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

/// A caller's request whose handler runs: counted in `NodeShared::rpc_in_flight` from
/// [`InFlight::take`] until dropped.
struct InFlight {
    counts: Arc<dashmap::DashMap<NodeId, usize>>,
    from: NodeId,
}

impl InFlight {
    /// Counts a request from `from`, unless `max_rpc_in_flight` of its requests run
    /// already.
    fn take(shared: &NodeShared, from: NodeId) -> Option<InFlight> {
        let mut n = shared.rpc_in_flight.entry(from).or_insert(0);
        if *n >= shared.config.max_rpc_in_flight {
            return None;
        }
        *n += 1;
        Some(InFlight {
            counts: shared.rpc_in_flight.clone(),
            from,
        })
    }
}

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
/// requests whose handlers still run (this node's own calls to itself included): that
/// one is told the server is busy.
pub(crate) async fn serve(
    shared: &NodeShared,
    comm: u64,
    id: u64,
    from: NodeId,
    payload: Bytes,
) -> Bytes {
    let reg = u32::try_from(id)
        .ok()
        .and_then(|id| shared.rpc.get(&(comm, id)).map(|r| r.clone()));
    match reg {
        None => reply_bytes(
            Status::UnknownId,
            format!("no RPC handler {id} on communicator {comm}").as_bytes(),
        ),
        Some(reg) => {
            let Some(caller) = reg.members.iter().position(|n| *n == from) else {
                debug!(%from, comm, id, "RPC request from a node outside the communicator");
                return reply_bytes(
                    Status::UnknownId,
                    format!("node {from} is not a member of communicator {comm}").as_bytes(),
                );
            };
            let Some(running) = InFlight::take(shared, from) else {
                debug!(%from, comm, id, "RPC request refused: too many from this caller in flight");
                return reply_bytes(
                    Status::HandlerError,
                    format!(
                        "server busy: {} requests from this node are being served \
                         (max_rpc_in_flight)",
                        shared.config.max_rpc_in_flight
                    )
                    .as_bytes(),
                );
            };
            let handler = reg.handler;
            // Called inside the task: a panic before the handler's future exists is caught
            // there too, instead of ending this dispatch (or the caller's own task, for a
            // call to oneself) without a reply. The task holds its place among the
            // caller's requests in flight until the handler is done, even when whoever
            // waits for it gives up.
            let task = tokio::spawn(async move {
                let _running = running;
                handler(caller, payload).await
            });
            match task.await {
                Ok(Ok(body)) => reply_bytes(Status::Ok, &body),
                Ok(Err(msg)) => reply_bytes(Status::HandlerError, msg.as_bytes()),
                Err(e) if e.is_panic() => {
                    warn!(comm, id, "RPC handler panicked");
                    reply_bytes(Status::HandlerPanic, b"the handler panicked")
                }
                Err(_) => reply_bytes(Status::HandlerError, b"the handler was cancelled"),
            }
        }
    }
}

/// Serves an incoming request (in its own task) and sends the reply back to the caller.
pub(crate) fn dispatch(shared: Arc<NodeShared>, frame: ControlFrame) {
    let ControlFrame {
        from,
        header,
        payload,
    } = frame;
    tokio::spawn(async move {
        let mut reply = serve(&shared, header.comm, header.step, from, payload).await;
        let max = shared.payload_limit();
        if reply.len() as u64 > max {
            // The caller would wait for its deadline: tell it why instead.
            let msg = format!(
                "the handler's reply of {} bytes exceeds the {max} bytes a message may \
                 carry (max_frame_bytes, less room for a relay's envelope on a sparse \
                 topology)",
                reply.len() - 1
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
        if let Err(e) = sent.await {
            debug!(%from, error = %e, "RPC reply not delivered");
        }
    });
}
