//! Seed/worker bootstrap: one seed and N workers, on one host or many, form a mesh.
//!
//! 1. [`Seed::start`] binds a real address, creates the cluster CA and a random 32-byte
//!    cluster secret (or takes one), and publishes a [`JoinString`]: the seed address,
//!    the secret and the SHA-256 of the seed's certificate.
//! 2. A worker ([`Node::join`](crate::Node::join)) dials the seed over QUIC and accepts only
//!    the pinned certificate, so it sends nothing to an impostor. It proves it knows the
//!    secret without sending it: an HMAC-SHA256, keyed by the secret, over keying material
//!    exported from this very TLS session (RFC 5705), which a relay cannot reuse.
//! 3. It generates its own key pair and sends a certificate request: private keys never
//!    cross the network. The seed assigns the rank (the one requested, if free) and issues
//!    a certificate naming that node id.
//! 4. The worker binds its mesh endpoint and tells the seed its port; once every rank is
//!    in, the seed hands every worker the peer list and the mesh forms directly, worker to
//!    worker, with mutual TLS, each side checking that the peer's certificate names the
//!    rank it expected.
//!
//! 5. Elastic membership (see [`Node::resize`](crate::Node::resize)): with
//!    [`SeedOptions::max_world`] above the formation world, nodes that join a running
//!    cluster are admitted the same way, then wait in the seed's queue until the members
//!    reach a resize point; a member leaves gracefully with
//!    [`Node::leave`](crate::Node::leave). Every member, joiners included, gets the same
//!    new communicator, within [`SeedOptions::min_world`] and `max_world`.
//!
//! Every handshake has a size cap and a deadline and runs in its own task, so a slow,
//! silent or hostile client cannot stall the seed; formation has a deadline and its error
//! names the ranks that did not arrive.

mod elastic;
mod env;
mod proto;
mod seed;
mod worker;

pub use env::{from_env_vars, with_env_overrides, world_mismatch, EnvJoin};
pub use proto::{JoinString, Secret};
pub use seed::{Seed, SeedOptions, SeedReport};
pub use worker::{JoinOptions, Node};

/// Errors of the bootstrap protocol, each saying what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The join string does not parse.
    #[error("invalid join string: {0} (expected nexar://ADDR/SECRET_HEX/FINGERPRINT_HEX, as printed by `nexar seed`)")]
    BadJoinString(String),
    /// A cluster secret (in a join string, `NEXAR_SECRET` or a secret file) is malformed.
    #[error("invalid cluster secret: {0} (expected 64 hex digits)")]
    BadSecret(String),
    /// The seed could not be reached.
    #[error("seed {addr} unreachable: {reason} (is `nexar seed` running there, and is UDP to that port open?)")]
    SeedUnreachable {
        /// The seed address dialled.
        addr: std::net::SocketAddr,
        /// The transport error.
        reason: String,
    },
    /// The seed refused every connection until the join's timeout: it held as many
    /// clients as it takes that had not proved the secret yet
    /// ([`SeedOptions::max_handshakes`], in all or from this node's address).
    #[error("seed {addr} busy: it refused every connection for {waited:?}, holding as many clients as it takes that have not proved the secret yet (many joining at once from this address, or someone holding its handshakes)")]
    SeedBusy {
        /// The seed address dialled.
        addr: std::net::SocketAddr,
        /// How long this node kept asking.
        waited: std::time::Duration,
    },
    /// The seed's certificate does not match the pinned fingerprint.
    #[error("the server at {0} is not the seed in the join string (certificate fingerprint mismatch); refusing to talk to it")]
    FingerprintMismatch(std::net::SocketAddr),
    /// The seed refused this worker.
    #[error("the seed refused to admit this node: {0}")]
    Refused(String),
    /// The protocol broke (a malformed or unexpected message, or the connection dropped).
    #[error("bootstrap protocol error: {0}")]
    Protocol(String),
    /// Formation did not complete in time.
    #[error("cluster formation failed: {0}")]
    Formation(String),
    /// A membership change at a resize point failed or was refused.
    #[error("membership change failed: {0}")]
    Resize(String),
    /// [`Node::leave`](crate::Node::leave) was refused (the world would drop below the
    /// seed's minimum): the resize point passed, and this node stays a member of the new
    /// communicator.
    #[error("leaving refused; this node stays a member: {0}")]
    LeaveRefused(String),
    /// A launcher variable is missing or malformed.
    #[error("environment: {0}")]
    Environment(String),
}

impl From<BootstrapError> for crate::NexarError {
    fn from(e: BootstrapError) -> Self {
        crate::NexarError::Bootstrap(e)
    }
}
