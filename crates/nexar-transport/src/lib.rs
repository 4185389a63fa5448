//! Authenticated, multiplexed QUIC transport for nexar.
//!
//! - [`ClusterCa`] issues each node a certificate whose subject alternative name is
//!   `n<id>.nexar`; every connection is mutual TLS 1.3 (ALPN [`ALPN`]) and a peer's
//!   [`NodeId`] is read from its verified certificate, never from what it claims.
//! - A frame is a postcard [`FrameHeader`] and raw payload bytes (never through serde).
//!   Frames over [`MESSAGE_FRAME_BYTES`] (64 KiB), and control and relay frames, each
//!   travel on a unidirectional stream of their own; smaller data frames, heartbeats,
//!   abandonment notices and farewells follow each other on one long-lived stream per
//!   connection and direction, which saves a stream's set-up, tear-down and credit
//!   updates per message
//!   (the wire format is in `wire.rs`). Inbound data frames land in the [`MailboxTable`]
//!   keyed by [`MailboxKey`] `{comm, tag, step, src}`, where early arrivals wait, within a
//!   budget, until taken. A frame of 256 KiB or more whose receiver waits in
//!   [`MailboxTable::take_delivery`], or starts to wait while the frame is still arriving,
//!   goes to it as its stream ([`Delivery`]), with what was read so far first, to be
//!   copied into the receiver's buffer as it arrives: a receive posted a little late
//!   does not make the frame be held whole. [`Connection::send_streamed`] is the
//!   sending side's counterpart, for payloads produced while they are sent.
//! - Bad frames (oversize, undecodable header, wrong version, wrong length, forged source)
//!   get their stream stopped with a [`StreamRefusal`] code and a `tracing` warning (a
//!   message stream is stopped as a whole, and the sender's next frame opens a new one);
//!   the connection and its other streams carry on.
//!
//! # Tuning ([`TransportConfig`])
//! Defaults chosen from measurements on this project's 2-vCPU machines, loopback, two
//! ranks of an in-process cluster (`cargo bench -p nexar-actors --bench p2p -- --payload N
//! --stream-window MIB`; medians of 5 runs, other work on the machine, so read ~25% as noise):
//!
//! | setting | 64 x 4 MiB messages | 4 x 64 MiB messages |
//! |---|---|---|
//! | UDP payload 1472 (quinn's default cap), 4 MiB stream window | 0.64 GB/s | 0.60 GB/s |
//! | UDP payload 6500, 4 MiB stream window | 1.14 to 1.74 GB/s | 0.75 to 0.85 GB/s |
//! | UDP payload 6500, 16 MiB stream window | 1.32 to 1.50 GB/s | 0.90 to 1.09 GB/s |
//!
//! Later, with GSO batches split to fit (below), 4 ranks in one process, 4 MiB, three
//! alternating runs (`nexar local --world 4 bench --ops p2p,all_reduce --min-bytes 4M
//! --max-bytes 4M --max-udp-payload N`): p2p 1.07-1.30 GB/s and 1.27-1.60 CPU-s/GB at
//! 6500, 1.37-1.68 GB/s and 1.02-1.23 CPU-s/GB at 65000 (the default now); all-reduce
//! busbw 0.32-0.37 against 0.38-0.46.
//!
//! `iperf3 -c 127.0.0.1` on the same machine: 3.06 GB/s (plain TCP, one stream). The
//! payload size is the largest lever (quinn is CPU-bound per packet: 1.3 CPU-s/GB at 6500
//! against 3.1 at 1472, measured by `nexar bench`). quinn's own socket breaks GSO batching
//! above ~6550 bytes (it asks the kernel for batches over 64 KiB, which are refused and
//! silently lost), so the endpoint's socket splits such batches (`socket.rs`) and MTU
//! discovery may go up to 65000 bytes: loopback (same-host ranks, one probe) and
//! jumbo-frame fabrics get large datagrams, other paths settle at their MTU. Congestion
//! control stays quinn's Cubic (NewReno and BBR measured as ties in
//! `shared/TRANSPORT-NOTES.md`). A stream per frame costs nothing at the sizes that get
//! one. The connection window covers every stream a peer may open
//! (`stream_window * (max_streams + 1)`, 528 MiB of flow-control credit, not memory):
//! streams parked on the early-arrival budget can never starve the stream a receiver waits
//! for. It is memory too, though: QUIC acknowledges what arrives, not what is read, so
//! behind a stream parked on the budget (its header read, its payload not) quinn takes in
//! up to a stream window of its payload; what a peer's frames nobody asked for hold here is
//! so bounded by the budget plus a stream window per stream it may have open (16 MiB x 32
//! per connection with the defaults: lower `stream_window` or `max_streams` where that
//! matters). What a sender has in flight unacknowledged is bounded by its send window
//! (2 MiB per connection), not by that credit: a busy receiver's UDP socket buffer (4 MiB here, `net.core.rmem_max`) then
//! holds it, where an unbounded sender grew its congestion window until the buffer
//! overflowed and lost 1-2% of its datagrams ([`TransportConfig::send_window`]). Payloads go
//! to QUIC in pieces of at most half that window (quinn counts a written piece against the
//! window until all of it is acknowledged, so a piece as large as the window would wait for
//! its last acknowledgement before the next could be written); a sole peer's larger window
//! takes them whole (`Connection::set_sole_peer`).

// Library code: no `expect` where a peer's bytes or a caller's input could make it fail
// (the workspace lints `unwrap_used` everywhere; tests may expect).
#![warn(clippy::expect_used)]
#![cfg_attr(test, allow(clippy::expect_used))]

mod config;
mod endpoint;
mod error;
mod identity;
mod lane;
mod mailbox;
mod pinned;
mod signing;
mod socket;
mod throttle;
mod tls;
mod wire;

pub use config::{TransportConfig, MAX_INITIAL_MTU, MAX_UDP_PAYLOAD, MIN_STREAMS, MIN_UDP_PAYLOAD};
pub use endpoint::{
    cert_fingerprint, Accepting, Connection, ControlFrame, Endpoint, Inbound, RelayFrame,
    FINISHED_CODE, MESSAGE_FRAME_BYTES,
};
pub use error::{TransportError, GAVE_UP_ON_ITS_OWN};
pub use identity::{
    fingerprint_hex, generate_csr, node_id_from_cert, ClusterCa, NodeId, NodeIdentity,
};
pub use lane::{
    accept_lane, bind_lane_listener, dial_lane, lane_key, Clearance, Credit, DirectFrame,
    LaneParts, TcpLane, CREDIT_MIN_CHARGE, LANE_ANNOUNCEMENTS, LANE_CREDIT_BYTES,
};
pub use mailbox::{
    Delivery, ElementCutter, MailboxKey, MailboxTable, Payload, ABANDONED_MARKERS_PER_PEER,
    ABANDONED_TAGS_PER_PEER, DEFAULT_OVERDRAFT_BYTES, DEFAULT_RELAY_BUDGET_BYTES,
    EARLY_FRAME_MIN_CHARGE, RELAY_FRAME_MIN_CHARGE, RELAY_HOP_CLASSES, RETIRE_SCAN_SLOTS,
    WHOLE_TAG_STEP,
};
pub use pinned::{bootstrap_client, bootstrap_client_config, bootstrap_server, BOOTSTRAP_ALPN};
pub use signing::{SignatureVerifier, Signer, SIGNING_CONTEXT};
pub use throttle::{WarnThrottle, EVENTS_PER_SUMMARY, WARNED_EVENTS};
pub use tls::ALPN;
pub use wire::{FrameHeader, FrameKind, StreamRefusal, MAX_HEADER_BYTES, PROTOCOL_VERSION};
