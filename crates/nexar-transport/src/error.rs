use crate::identity::NodeId;

/// Errors raised by the transport layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Generating or parsing a certificate or key failed.
    #[error("certificate error: {0}")]
    Certificate(String),
    /// Building the TLS or QUIC configuration failed.
    #[error("tls configuration error: {0}")]
    TlsConfig(String),
    /// A [`TransportConfig`](crate::TransportConfig) value is out of range.
    #[error("invalid transport configuration: {0}")]
    Config(String),
    /// Binding or configuring the UDP socket failed.
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    /// The QUIC handshake could not be started.
    #[error("connect to {addr} failed: {reason}")]
    Connect {
        /// Address dialled.
        addr: std::net::SocketAddr,
        /// What went wrong.
        reason: String,
    },
    /// The connection failed or was closed.
    #[error("connection to node {peer} lost: {reason}")]
    ConnectionLost {
        /// The remote node.
        peer: NodeId,
        /// The underlying QUIC error.
        reason: String,
    },
    /// The peer presented no certificate, or one that does not name a nexar node.
    #[error("peer identity rejected: {0}")]
    BadPeerIdentity(String),
    /// The peer's certificate names a different node than the one expected.
    #[error("expected node {expected} but the peer's certificate names node {actual}")]
    UnexpectedPeer {
        /// The node this side meant to reach.
        expected: NodeId,
        /// The node the verified certificate names.
        actual: NodeId,
    },
    /// A frame payload is larger than the configured maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Payload length.
        len: u64,
        /// Configured maximum.
        max: u64,
    },
    /// Writing a frame failed.
    #[error("send to node {peer} failed: {reason}")]
    Send {
        /// The remote node.
        peer: NodeId,
        /// The underlying error.
        reason: String,
    },
    /// No frame arrived for a mailbox before the deadline.
    #[error("timed out after {0:?} waiting for a message")]
    Timeout(std::time::Duration),
    /// A message being copied as it arrived stopped short (its stream failed or was
    /// reset by the sender, or the connection closed).
    #[error("message from node {peer} cut short: {reason}")]
    Truncated {
        /// The sender.
        peer: NodeId,
        /// What happened to the stream.
        reason: String,
    },
    /// A message does not fit the buffer it is received into.
    #[error("a message of {actual} bytes does not fit a buffer of {expected} bytes")]
    LengthMismatch {
        /// The buffer's length in bytes.
        expected: usize,
        /// The message's length in bytes.
        actual: usize,
    },
    /// The message this receive waited for will never arrive: its sender gave up on it
    /// (its send failed part-way and it said so), or this node refused it (over this
    /// node's `max_frame_bytes`, or, for one that could not wait for budget, past the
    /// early-arrival budget and the sender's overdraft: see
    /// [`MailboxTable::with_overdraft`](crate::MailboxTable::with_overdraft)). The receive
    /// that gets this error has used up its place in the sequence.
    #[error("the message from node {peer} will never arrive (its send failed, or this node refused it: over max_frame_bytes, or past the early-arrival budget and the sender's overdraft)")]
    Abandoned {
        /// The sender.
        peer: NodeId,
    },
    /// A member gave up on the whole tag this receive belongs to (a collective that failed
    /// there because it lost rank `lost` of the communicator, or, with `lost` =
    /// [`GAVE_UP_ON_ITS_OWN`], one that failed, was refused or was dropped there for
    /// another reason, and said so): nothing more of the tag comes from that member, so
    /// the collective cannot complete.
    #[error("node {by} gave up on this collective ({})", gave_up_why(*lost))]
    TagAbandoned {
        /// The member that gave up, by node id (its rank in the communicator is the
        /// position of this id in the communicator's members, nexar-actors'
        /// `Communicator::members`; the two differ in a split or shrunk communicator).
        by: NodeId,
        /// The communicator rank it lost, or [`GAVE_UP_ON_ITS_OWN`].
        lost: u32,
    },
    /// Another receiver is already waiting on the same mailbox key.
    #[error("a receive for this mailbox is already pending")]
    AlreadyWaiting,
    /// The mailbox table was closed (the node is shutting down or the peer died).
    #[error("mailbox closed: {0}")]
    Closed(String),
}

/// [`TransportError::TagAbandoned`]'s `lost` when the member that gave up lost no rank:
/// its part failed there (it timed out, or a send of its own failed), its arguments were
/// refused there, or its call was dropped; its own error says which.
pub const GAVE_UP_ON_ITS_OWN: u32 = u32::MAX;

fn gave_up_why(lost: u32) -> String {
    if lost == GAVE_UP_ON_ITS_OWN {
        "its part failed, was refused or was dropped there: its own error says why".to_string()
    } else {
        format!("it lost rank {lost}")
    }
}
