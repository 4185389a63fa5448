//! The nexar runtime: ractor actors over the nexar QUIC transport, and the public API.
//!
//! - `NodeActor` (one per node) accepts and dials connections and supervises one
//!   `PeerActor` per peer, which owns that peer's connections, readers and heartbeats.
//!   Each pair of nodes keeps two connections: a control lane (heartbeats, barriers,
//!   small messages) and a bulk lane, so control traffic never queues behind bulk data
//!   (plus, with `NodeConfig::trusted_fabric`, a TCP lane for bulk data).
//! - Collectives run a schedule from `nexar-collectives` over the transport inside the
//!   caller's future, on the caller's buffers (no actor or task per collective); dropping
//!   the future stops it, and nothing writes into the caller's memory afterwards.
//! - [`Cluster`] builds in-process clusters; [`Seed`] and [`Node`] (`Node::join`,
//!   `Node::from_env`) build clusters of processes on many hosts; [`Communicator`] is the
//!   user API ([`SyncCluster`] / [`SyncCommunicator`] without an async runtime, and
//!   [`ZeroCopyBuffer`] for collectives that send without a copy).
//!
//! ```no_run
//! # async fn demo() -> Result<(), nexar_actors::NexarError> {
//! use nexar_actors::Cluster;
//! use nexar_device::ReduceOp;
//! let cluster = Cluster::local(4).await?;
//! let mut tasks = Vec::new();
//! for comm in cluster.communicators() {
//!     tasks.push(tokio::spawn(async move {
//!         let mut v = vec![comm.rank() as f32; 1024];
//!         comm.all_reduce(&mut v, ReduceOp::Sum).await?;
//!         assert_eq!(v[0], 6.0);
//!         comm.barrier().await
//!     }));
//! }
//! for t in tasks {
//!     t.await.expect("task panicked")?;
//! }
//! # Ok(()) }
//! ```

// Library code: no `expect` where a peer's bytes or a caller's input could make it fail
// (the workspace lints `unwrap_used` everywhere; tests may expect).
#![warn(clippy::expect_used)]
#![cfg_attr(test, allow(clippy::expect_used))]

mod admission;
mod bootstrap;
mod cluster;
mod collective;
mod comm;
mod config;
mod error;
mod node;
mod peer;
mod pool;
mod relay;
mod rpc;
mod shrink;
mod sync;
mod tags;
mod topology;
mod zero_copy;

/// A task that ends with its owner: aborted when this is dropped.
#[derive(Debug)]
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The instant `d` from now; far in the future (not a panic) when `d` is too long to add,
/// such as `Duration::MAX` for "no deadline".
pub(crate) fn deadline_in(d: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(30 * 365 * 86_400))
}

pub use bootstrap::{
    from_env_vars, with_env_overrides, world_mismatch, BootstrapError, EnvJoin, JoinOptions,
    JoinString, Node, Secret, Seed, SeedOptions, SeedReport,
};
pub use cluster::Cluster;
pub use comm::{Communicator, Failures, Pending, Recoveries, RECV_STREAM_BYTES};
pub use config::{NodeConfig, RecoveryPolicy, AUTO_SPIN_WAIT, MAX_WORLD, MIN_MESSAGE_BYTES};
pub use error::{NexarError, Result};
pub use nexar_collectives::{
    accumulate, compress_with_feedback, Algorithm, Codec, CodecError, CollectiveConfig,
    CompressElement, Residual,
};
pub use nexar_transport::{NodeId, TransportConfig};
pub use rpc::{RpcResult, MAX_RPC_REQUEST};
pub use sync::{SyncCluster, SyncCommunicator};
pub use topology::Topology;
pub use zero_copy::ZeroCopyBuffer;

/// The README's examples, compiled and run as doctests so they stay true.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
