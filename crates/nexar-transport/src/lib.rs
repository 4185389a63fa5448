//! Authenticated, multiplexed QUIC transport for nexar.
//!
//! - [`ClusterCa`] issues each node a certificate whose subject alternative name is
//!   `n<id>.nexar`; every connection is mutual TLS 1.3 (ALPN [`ALPN`]) and a peer's
//!   [`NodeId`] is read from its verified certificate, never from what it claims.
//! - Each frame is one unidirectional stream: a postcard [`FrameHeader`] and raw payload
//!   bytes (never through serde). Inbound data frames land in the [`MailboxTable`] keyed by
//!   [`MailboxKey`] `{comm, tag, step, src}`, where early arrivals wait, within a budget,
//!   until taken.
//! - Bad frames (oversize, undecodable header, wrong version, wrong length, forged source)
//!   get their stream stopped with a [`StreamRefusal`] code and a `tracing` warning; the
//!   connection and its other streams carry on.
//!
//! # Tuning ([`TransportConfig`])
//! Measured on a 2-vCPU loopback (quinn 0.11, ring, 256 MiB between two processes; see
//! `shared/TRANSPORT-NOTES.md`): quinn defaults 0.54 GB/s at 3.1 CPU-s/GB; a 6500-byte
//! UDP payload with GSO 1.39 GB/s at 1.2 CPU-s/GB; payloads over ~6550 bytes break GSO
//! batching. Defaults: UDP payload up to 6500 (MTU discovery from 1200), 4 MiB stream
//! windows, 32 streams, a connection window covering all of them, 8 MiB socket buffers.
//! `nexar-transport`'s own point-to-point figures are in the repository's BENCHMARKS.md.

mod config;
mod endpoint;
mod error;
mod identity;
mod mailbox;
mod pinned;
mod signing;
mod tls;
mod wire;

pub use config::TransportConfig;
pub use endpoint::{Connection, ControlFrame, Endpoint, Inbound, RelayFrame};
pub use error::TransportError;
pub use identity::{
    fingerprint_hex, generate_csr, node_id_from_cert, ClusterCa, NodeId, NodeIdentity,
};
pub use mailbox::{MailboxKey, MailboxTable, Payload};
pub use pinned::{bootstrap_client, bootstrap_server, BOOTSTRAP_ALPN};
pub use signing::{SignatureVerifier, Signer};
pub use tls::ALPN;
pub use wire::{FrameHeader, FrameKind, StreamRefusal, MAX_HEADER_BYTES, PROTOCOL_VERSION};
