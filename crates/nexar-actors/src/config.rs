use std::time::Duration;

use nexar_collectives::CollectiveConfig;
use nexar_transport::TransportConfig;

/// What a node does when a peer is lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecoveryPolicy {
    /// Only calls that involve the lost peer fail (with `PeerLost`); the application can
    /// watch [`Communicator::failures`](crate::Communicator::failures) and call
    /// [`Communicator::shrink`](crate::Communicator::shrink) for a communicator of the
    /// survivors. The default.
    #[default]
    Manual,
    /// Every pending and future call on the node fails at once: with `PeerLost` naming
    /// the lowest lost rank on a communicator with a lost member, with `Aborted` naming
    /// the lost node on one without.
    Abort,
    /// Like `Manual`, and in addition the survivors agree on the lost ranks and rebuild
    /// the communicator by themselves: applications get it from
    /// [`Communicator::recoveries`](crate::Communicator::recoveries). Only a node that
    /// saw a loss starts that: a call that fails with
    /// [`NexarError::PeerLostElsewhere`](crate::NexarError) (another rank saw it) gets no
    /// recovery of its own; call `shrink` there.
    Automatic,
}

/// The largest world a cluster may have, and so one more than the largest rank: the most
/// ranks a collective's schedule is built for ([`nexar_collectives::MAX_WORLD`], 2^24;
/// ranks travel as 32-bit numbers in the bootstrap protocol, with room to spare).
pub const MAX_WORLD: usize = nexar_collectives::MAX_WORLD;

/// How long a collective polls before sleeping when [`NodeConfig::spin_wait`] is `None`
/// and the node runs on a runtime with one worker thread. Long enough to span the gaps
/// between the chunks of a transfer in progress; short enough that ranks waiting for a
/// late peer soon give the cores back (20 ms, the earlier default, let 4 processes on 2
/// cores starve each other: bench/HISTORY.md, session 8).
pub const AUTO_SPIN_WAIT: Duration = Duration::from_millis(1);

/// The smallest [`CollectiveConfig::max_message_bytes`] a node starts with: smaller
/// messages would only make schedules of one action per few bytes.
pub const MIN_MESSAGE_BYTES: usize = 4096;

/// Runtime settings for a node. Every field has a documented default.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NodeConfig {
    /// QUIC and framing settings.
    pub transport: TransportConfig,
    /// Algorithm selection thresholds, and the most bytes one message of a collective
    /// carries (`max_message_bytes`, which must fit this node's `transport.max_frame_bytes`
    /// or the node refuses to start). Every node must use the same: a collective's
    /// algorithm and its messages are chosen from them, and ranks that chose differently
    /// exchange frames that do not match (the call fails, or times out).
    pub collectives: CollectiveConfig,
    /// Interval between heartbeats sent to each peer (default 250 ms; zero is refused).
    pub heartbeat_interval: Duration,
    /// A peer not heard from for this long (no heartbeat, and no data on any of its
    /// connections, its trusted lane included) is declared lost (default 5 s; under twice `heartbeat_interval` is
    /// refused). The transport's `idle_timeout` is raised to it where lower: QUIC would
    /// otherwise close a stalled peer's connection first, and that is a loss too.
    pub heartbeat_timeout: Duration,
    /// Deadline for one collective or point-to-point call (default 120 s). The node reads
    /// a peer's frame for at least this long without a new byte before it gives the frame
    /// up (`transport.body_timeout` is raised to it where lower). Zero is refused.
    pub op_timeout: Duration,
    /// Deadline for forming the mesh (default 20 s). Zero is refused.
    pub connect_timeout: Duration,
    /// How long [`Node::finish`](crate::Node::finish) waits for the peers to finish too
    /// before closing its connections (default 20 s).
    pub finish_timeout: Duration,
    /// What to do when a peer is lost (default [`RecoveryPolicy::Manual`]).
    pub recovery: RecoveryPolicy,
    /// Which ranks connect directly; others are reached through relays (default
    /// [`Topology::FullMesh`](crate::Topology::FullMesh)). Every rank must use the same.
    pub topology: crate::Topology,
    /// Payloads up to this size travel on the control connection, larger ones on the bulk
    /// connection, so small messages never queue behind bulk data (default 64 KiB).
    pub small_message_bytes: usize,
    /// Opt-in, **plaintext** data lane for trusted fabrics (default `false`). When set,
    /// every pair of nodes also opens a plain TCP connection, bound to their authenticated
    /// QUIC session by a one-time key (see `nexar_transport::lane_key`), and sends all
    /// data frames over it: kernel TCP costs a fraction of the CPU of QUIC with TLS. The
    /// bytes on it are neither encrypted nor integrity-protected, so set this only where
    /// nobody untrusted can read or inject packets on the network between the nodes.
    /// Heartbeats, RPC (requests and replies) and formation stay on QUIC, and so do
    /// frames relayed on sparse topologies; a communicator's own frames (its messages and
    /// collectives, and the shrink and resize agreements run on it) take the lane. Every
    /// node must use the same setting.
    pub trusted_fabric: bool,
    /// Send bytes one collective may have in the transport at once (queued, or sent and
    /// not yet acknowledged by the peer) before it waits to copy out more; one send is
    /// always allowed, whatever its size (default 4 MiB). Received blocks a collective
    /// passes on unchanged count too, and are kept for that only up to this much more, so
    /// a collective adds at most about twice this to its buffers on each rank: a 4-rank 64
    /// MiB all-reduce in one process peaks at about 1.3x its buffers with 4 MiB (1.2x
    /// before blocks were passed on; then 1.4x with 8 MiB, 1.7x with 16 MiB and 2x
    /// unbounded, with the same throughput; BENCHMARKS.md). Reduced blocks that would
    /// otherwise be stored in scratch and copied out again (the partials a ring or
    /// recursive-halving reduce-scatter passes on, a reduce's on ranks that pass partial
    /// results on) are kept up to four times this instead, so those collectives add up
    /// to about five times this (session 27, a 4-rank 64 MiB ring reduce-scatter in one
    /// process: 1.7x its buffers instead of 1.5x, for 6-8% less CPU per byte at 64
    /// MiB). A point-to-point `send` of more than 1 MiB over QUIC
    /// copies its message out within the same budget, in 1 MiB pieces, and so does a
    /// collective's send of more than 1 MiB that it copies (from the caller's buffers
    /// or its scratch; not a `ZeroCopyBuffer`'s, which is lent) to a peer reached
    /// directly over QUIC (relayed ones are copied whole): a whole
    /// buffer's or block's in a 2-rank reduce, linear gather and scatter, pairwise
    /// all-to-all and the non-pipelined algorithms.
    pub collective_send_budget_bytes: usize,
    /// How long a collective waiting on the network keeps polling for progress before it
    /// sleeps until woken, after its last send or receive progressed (zero: never poll).
    /// Between polls it yields both its task and its thread, so other tasks and other
    /// processes on the core run. Polling saves the wake-up of a sleeping thread for every
    /// arriving chunk (an interrupt to another CPU, costly in virtual machines) and the
    /// idle gaps those leave. `None` (the default) polls for [`AUTO_SPIN_WAIT`] (1 ms)
    /// when the node runs on a runtime with one worker thread, the setup for one rank per
    /// process with several processes per host, and
    /// not at all on a multi-threaded runtime, where polling makes the other workers wake
    /// and steal work: across 4 processes on 2 cores that cost more CPU than it saved. With
    /// one worker per process, 4 processes on 2 cores, trusted lane: a 4 KiB all-reduce
    /// in about 85 us instead of 130-190, and about a fifth more busbw at 4 MiB
    /// (BENCHMARKS.md). `Some(Duration::ZERO)` never polls. The price
    /// is CPU while a collective waits: at most this long per wait, and given away to
    /// anything else runnable. Polling for 20 ms instead of 1 ms made 4 processes on 2
    /// cores stall now and then (4 KiB all-reduces of 2-4 ms instead of 0.3, the polling
    /// ranks holding the cores) and cost more CPU per byte with 2 and 8 processes, for the
    /// same throughput (bench/HISTORY.md, session 8). While a large block streams in over
    /// QUIC, a collective polls only if its host runs more of the communicator's ranks
    /// (those reached over loopback) than it has CPUs: with a core per rank, polling
    /// between the block's chunks cost 10-20% of a large collective's CPU for no time
    /// saved (bench/HISTORY.md, session 9). With no more ranks on a host than cores,
    /// measure against `Some(Duration::ZERO)` too.
    pub spin_wait: Option<Duration>,
    /// How many RPC requests from one caller this node serves at once (default 256): a
    /// request counts from its arrival until its reply is sent (at most `op_timeout`).
    /// Past that, a request is answered at once with an error saying the server is busy
    /// ([`NexarError::RpcFailed`](crate::NexarError)) and its handler is not called: a
    /// handler runs to its end even after its caller gave up, so callers that keep giving
    /// up on a slow handler, or that do not read their replies, would otherwise pile up
    /// tasks (and requests of up to 1 MiB, and replies) without bound. Refusals' replies
    /// count apart while they are sent, up to four times this per caller; past that a
    /// request is dropped unanswered (its caller waits to its deadline). Must be at
    /// least 1.
    pub max_rpc_in_flight: usize,
}

impl NodeConfig {
    /// Refuses settings a node cannot run with, naming the setting: what starting a node
    /// checks first ([`Cluster::local_with`](crate::Cluster::local_with), and
    /// [`Node::join`](crate::Node::join) before it contacts the seed, so that a worker
    /// with such settings is not admitted and given a rank it cannot take up). The
    /// transport's settings are checked as the mesh's endpoint will take them (its
    /// timeouts raised to the node's own).
    ///
    /// ```
    /// let mut config = nexar_actors::NodeConfig::default();
    /// assert!(config.check().is_ok());
    /// config.op_timeout = std::time::Duration::ZERO;
    /// let refused = config.check().unwrap_err();
    /// assert!(refused.to_string().contains("op_timeout"));
    /// ```
    pub fn check(&self) -> crate::Result<()> {
        if self.heartbeat_interval.is_zero() {
            return Err(crate::NexarError::InvalidArgument(
                "heartbeat_interval must be greater than zero".into(),
            ));
        }
        // Under two intervals, one heartbeat a little late (or the first, before any
        // came) would declare a healthy peer lost.
        if self.heartbeat_timeout < self.heartbeat_interval.saturating_mul(2) {
            return Err(crate::NexarError::InvalidArgument(format!(
                "heartbeat_timeout ({:?}) must be at least twice heartbeat_interval ({:?})",
                self.heartbeat_timeout, self.heartbeat_interval
            )));
        }
        if self.max_rpc_in_flight == 0 {
            return Err(crate::NexarError::InvalidArgument(
                "max_rpc_in_flight must be at least 1".into(),
            ));
        }
        // A collective cuts its messages at `max_message_bytes`: over what this node may
        // send, its large collectives would fail (and every rank's with them).
        let cap = self.collectives.max_message_bytes;
        let limit = crate::node::payload_limit(self);
        if cap < crate::MIN_MESSAGE_BYTES || u64::try_from(cap).unwrap_or(u64::MAX) > limit {
            let room = if self.topology == crate::Topology::FullMesh {
                String::new()
            } else {
                format!(
                    " less {} bytes for a relay's envelope",
                    crate::relay::RELAY_ROOM
                )
            };
            return Err(crate::NexarError::InvalidArgument(format!(
                "collectives.max_message_bytes ({cap}) must be {} to \
                 {limit}, the largest message this node may send \
                 (transport.max_frame_bytes{room})",
                crate::MIN_MESSAGE_BYTES
            )));
        }
        if let crate::Topology::KRegular { k } = self.topology {
            if k < 2 {
                return Err(crate::NexarError::InvalidArgument(format!(
                    "Topology::KRegular needs k >= 2 (k = {k} leaves ranks that reach no \
                     other)"
                )));
            }
        }
        for (name, t) in [
            ("op_timeout", self.op_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if t.is_zero() {
                return Err(crate::NexarError::InvalidArgument(format!(
                    "{name} must be greater than zero (every call or connection would \
                     fail at once)"
                )));
            }
        }
        crate::node::endpoint_transport(self).check()?;
        Ok(())
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            transport: TransportConfig::default(),
            collectives: CollectiveConfig::default(),
            heartbeat_interval: Duration::from_millis(250),
            heartbeat_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(20),
            finish_timeout: Duration::from_secs(20),
            topology: crate::Topology::FullMesh,
            recovery: RecoveryPolicy::Manual,
            small_message_bytes: 64 << 10,
            trusted_fabric: false,
            collective_send_budget_bytes: 4 << 20,
            spin_wait: None,
            max_rpc_in_flight: 256,
        }
    }
}
