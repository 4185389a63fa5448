use std::time::Duration;

use nexar_collectives::ScheduleError;
use nexar_device::DeviceError;
use nexar_transport::TransportError;

/// Errors returned by the nexar runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NexarError {
    /// A transport failure (connection, TLS, framing).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The collective's arguments do not form a valid schedule (bad root, world, op).
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// A reduction or data-type error.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A compressed block was malformed or a codec argument is invalid.
    #[error(transparent)]
    Codec(#[from] nexar_collectives::CodecError),
    /// A buffer has the wrong length for the call.
    #[error("{what}: expected {expected}, got {actual}")]
    LengthMismatch {
        /// Which buffer or message, and the unit of the lengths (elements or bytes).
        what: &'static str,
        /// Length the call requires.
        expected: usize,
        /// Length supplied or received.
        actual: usize,
    },
    /// A rank outside `0..world`.
    #[error("rank {rank} is out of range for a world of {world}")]
    InvalidRank {
        /// The offending rank.
        rank: usize,
        /// Communicator size.
        world: usize,
    },
    /// The peer holding this rank is gone (connection closed or heartbeats stopped): this
    /// node declared it lost, or is declaring it (a call that failed on the closed
    /// connection before the loss was recorded). It is in
    /// [`Communicator::failed_ranks`](crate::Communicator) once recorded, a moment later
    /// at most: wait on [`Communicator::failures`](crate::Communicator) rather than read
    /// the list once.
    #[error("peer rank {rank} lost: {reason}")]
    PeerLost {
        /// The communicator rank of the lost peer.
        rank: usize,
        /// What was observed.
        reason: String,
    },
    /// A collective failed because another member, rank `by`, lost rank `rank` and gave
    /// up on it, while this node has declared no member lost (it waited up to its
    /// `heartbeat_timeout`, within the call's `op_timeout`, to see a loss itself, which
    /// would have been `PeerLost`): a failure only some ranks see, such as one broken
    /// link, or in a sparse topology a rank only its neighbours notice. Nothing is
    /// declared lost here, so no automatic recovery starts on this node: call
    /// [`shrink`](crate::Communicator::shrink), which agrees with the others on who is
    /// left.
    #[error("rank {by} lost rank {rank} and gave up on this collective (this node has not declared rank {rank} lost)")]
    PeerLostElsewhere {
        /// The rank the other member lost.
        rank: usize,
        /// The member that lost it.
        by: usize,
    },
    /// Under [`RecoveryPolicy::Abort`](crate::RecoveryPolicy::Abort), a node that is not
    /// a member of this communicator was lost: every call on this node fails. (A lost
    /// member is reported as [`PeerLost`](NexarError::PeerLost), with its rank.)
    #[error("node {node} (not a member of this communicator) lost; calls abort: {reason}")]
    Aborted {
        /// The lost node's id.
        node: u64,
        /// What was observed.
        reason: String,
    },
    /// The operation did not finish before its deadline.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// The operation.
        what: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// A recovery found this rank on the minority side: the ranks it can still reach are
    /// not a quorum of the communicator, so the majority may go on without it (a slow or
    /// partitioned rank that the others declared lost gets this, rather than carrying on
    /// alone).
    #[error("only {survivors} of {world} ranks remain reachable, not a quorum: the majority goes on without this rank")]
    QuorumLost {
        /// Ranks this side could reach, itself included.
        survivors: usize,
        /// Size of the communicator that was recovered.
        world: usize,
    },
    /// The message a receive waited for will not come: its sender's `send` failed at its
    /// deadline and said so, or this node refused it (over its `max_frame_bytes`, or, sent
    /// far ahead of its receive, past the early-arrival budget and the sender's overdraft:
    /// see `TransportConfig::early_budget_bytes`). The receive that gets this has used up
    /// the message's place in the sequence: the next receive from `rank` under `tag` gets
    /// the sender's next message.
    #[error("rank {rank}'s message under tag {tag} will not come (its send failed, or this node refused it: over max_frame_bytes, or past the early-arrival budget and the sender's overdraft)")]
    Abandoned {
        /// The sender.
        rank: usize,
        /// The point-to-point tag.
        tag: u64,
    },
    /// A collective reached its deadline while frames of rank `rank` for the same call
    /// (the same place in the communicator's sequence) carried another fingerprint: that
    /// rank called another collective, or the same one with another count, type, op or
    /// root. Every rank must make the same calls in the same order.
    #[error("rank {rank} made another call than this one (another collective, or another count, type, op or root) at call {call} of this communicator; every rank must make the same calls in the same order")]
    CallMismatch {
        /// A rank whose frames carried another call's fingerprint.
        rank: usize,
        /// The call's number in the communicator's sequence (its tag).
        call: u64,
    },
    /// The cluster could not be formed.
    #[error("cluster formation failed: {0}")]
    Formation(String),
    /// An actor could not be started or stopped unexpectedly.
    #[error("runtime actor failure: {0}")]
    Actor(String),
    /// The node has been shut down.
    #[error("the node is shut down")]
    Shutdown,
    /// Joining a cluster through a seed failed.
    #[error(transparent)]
    Bootstrap(crate::bootstrap::BootstrapError),
    /// The remote rank has no handler for this RPC id.
    #[error("rank {rank} has no RPC handler {id}")]
    RpcUnknown {
        /// The rank called.
        rank: usize,
        /// The RPC id.
        id: u32,
    },
    /// The remote handler returned an error or panicked.
    #[error("RPC {id} on rank {rank} failed: {message}")]
    RpcFailed {
        /// The rank called.
        rank: usize,
        /// The RPC id.
        id: u32,
        /// The handler's error message (or a note that it panicked).
        message: String,
        /// True when the handler panicked.
        panicked: bool,
    },
    /// A call argument is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Result alias for the runtime.
pub type Result<T, E = NexarError> = std::result::Result<T, E>;
