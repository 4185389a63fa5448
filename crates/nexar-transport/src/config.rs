//! Transport tuning.
//!
//! Defaults come from measurements of quinn 0.11 on a 2-vCPU loopback (see
//! `shared/TRANSPORT-NOTES.md` and the crate docs): one connection is CPU-bound per packet,
//! so the UDP payload size is the largest lever (1472 B: ~0.55 GB/s, 6500 B with GSO:
//! ~1.4 GB/s, 65000 B: ~25% less CPU per byte again). quinn's GSO batches above 64 KiB are
//! refused by the kernel (EMSGSIZE, silently dropped), so the endpoint's socket splits
//! them, and MTU discovery may go up to 65000 bytes (it settles at the path's MTU).
//! Receive windows are sized so one stream is never window-bound on a LAN and so that the
//! streams a receiver may park (early arrivals past the budget) can never use up the
//! connection window needed by the stream it is waiting for. The send window is sized so
//! that what a sender has in flight fits in the receiver's socket buffer (see
//! [`TransportConfig::send_window`]).

use std::sync::Arc;
use std::time::Duration;

use crate::TransportError;

/// Settings for a nexar QUIC endpoint. Every field has a documented default.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TransportConfig {
    /// Largest payload one frame may carry; bigger frames are refused (default 1 GiB).
    /// One message of `send` or `rpc` is one frame, and so is one message of a
    /// collective, which cuts larger blocks at its `CollectiveConfig::max_message_bytes`
    /// (default 64 MiB; a node refuses to start with that over this, less a relay's
    /// envelope on sparse topologies). Should a collective's message still be larger,
    /// the call fails where it would be sent ([`TransportError::FrameTooLarge`]), and on
    /// the other ranks of that call with [`TransportError::TagAbandoned`] once that rank
    /// tells them.
    pub max_frame_bytes: u64,
    /// Bytes of early arrivals (frames nobody waits for yet) buffered per endpoint before
    /// readers stop reading and QUIC flow control pushes back (default 256 MiB). The push
    /// back is by stream window: behind each stream left unread, QUIC still takes in up to
    /// [`stream_window`](Self::stream_window) of its payload, so a peer sending frames
    /// nobody asks for can make this node hold up to `max_streams * stream_window` per
    /// connection on top of the budget, and as much again in small and relayed frames
    /// (its overdraft, below). Small
    /// frames (at most [`MESSAGE_FRAME_BYTES`](crate::MESSAGE_FRAME_BYTES)), which share
    /// one stream per connection with the peer's heartbeats, frames on a trusted lane and
    /// relayed messages for this node take it when it is free but cannot wait for it when
    /// it is not (a trusted lane's point-to-point messages come on credit or once this
    /// node answered their announcement: see
    /// [`TcpLane::announce`](crate::TcpLane::announce)): parked, they would hold up
    /// everything behind them on their stream (a relayed one: the relay budget it holds,
    /// which the relay frames after it wait for). A trusted lane's are kept without it;
    /// the others take their sender's overdraft, `max_streams * stream_window` per peer
    /// (what a peer may make this node hold in frames left unread on streams of their
    /// own), and past that are dropped, their receives failing at once
    /// ([`TransportError::Abandoned`](crate::TransportError::Abandoned); a peer with
    /// [`ABANDONED_MARKERS_PER_PEER`](crate::ABANDONED_MARKERS_PER_PEER) of those not yet
    /// asked for is disconnected instead: see
    /// [`MailboxTable::with_overdraft`](crate::MailboxTable::with_overdraft)). Each frame
    /// takes at least [`EARLY_FRAME_MIN_CHARGE`](crate::EARLY_FRAME_MIN_CHARGE) of
    /// either, however small.
    pub early_budget_bytes: usize,
    /// Bytes that relay frames (sparse topologies: frames that neighbours pass on to or
    /// through this node) may hold at this node between their arrival and their being
    /// passed on, to the next hop or into the mailbox table, for each hop count (default
    /// 32 MiB; see [`MailboxTable::with_relay_budget`](crate::MailboxTable::with_relay_budget)).
    /// A relay frame waits on its own stream for it before it is read, so QUIC flow control
    /// holds back neighbours that relay faster than this node passes frames on (QUIC
    /// itself buffers up to a stream window per waiting stream); a frame larger than the
    /// whole budget waits until all of it is free, and takes it; every frame takes at least
    /// [`RELAY_FRAME_MIN_CHARGE`](crate::RELAY_FRAME_MIN_CHARGE) (4 KiB), so many tiny
    /// frames run it out as well. Frames that passed
    /// different numbers of relays have budgets of their own, so relays that forward to
    /// each other cannot wait on each other for good (on routes of up to
    /// [`RELAY_HOP_CLASSES`](crate::RELAY_HOP_CLASSES) relays).
    ///
    /// Not a hard bound: a waiting frame keeps its stream's place among the peer's
    /// [`max_streams`](Self::max_streams), and once half of those wait (for either
    /// budget), that peer's next relay frames are read without budget, so that waiting
    /// streams never leave it unable to open the streams those waits may depend on. Under
    /// sustained overload from a neighbour, relaying can so hold more than its budgets.
    pub relay_budget_bytes: usize,
    /// Per-stream receive window (default 16 MiB).
    pub stream_window: u32,
    /// Concurrent unidirectional streams a peer may open on one connection (default 32).
    /// The connection window is `stream_window * (max_streams + 1)`, so streams parked on
    /// the budget can never block the one a receiver waits for. A stream parked on either
    /// budget keeps its place among the `max_streams` until it is read, so a peer with
    /// that many parked waits to open the next one; relay frames wait for relay budget on
    /// at most half of them and are read without it past that.
    /// At least [`MIN_STREAMS`].
    pub max_streams: u32,
    /// Largest UDP payload, also the MTU discovery upper bound (default 65000: datagrams
    /// grow to what the path carries, from `initial_mtu` up; on loopback that is all of it,
    /// found with a single probe, as the `lo` interface's MTU bounds it). From
    /// [`MIN_UDP_PAYLOAD`] to [`MAX_UDP_PAYLOAD`].
    pub max_udp_payload: u16,
    /// Starting UDP payload before MTU discovery (default 1200, safe on any path). At most
    /// [`MAX_INITIAL_MTU`] (a jumbo frame's): larger ones stall the QUIC handshake here
    /// (12000 never connected), and MTU discovery raises the payload from there anyway.
    pub initial_mtu: u16,
    /// Bytes a connection may have sent and not yet had acknowledged (default 2 MiB).
    ///
    /// A receiver that is busy (decrypting, reducing, or sending its own data) lets
    /// datagrams queue in its UDP socket buffer, and what overflows it is lost: with
    /// 65000-byte datagrams each loss costs a retransmission and a congestion-window cut.
    /// With no bound below the congestion window (this was the whole connection window,
    /// 528 MiB), a sender keeps growing its congestion window until the receiver's buffer
    /// overflows: 1-2% of datagrams were lost in 2-rank runs here, and 4-rank in-process
    /// runs of all-reduce, all-gather and all-to-all lost about 6,000 each. With 2 MiB
    /// nothing was lost,
    /// 64 MiB all-reduces across 2 processes ran 1.6x faster at 0.6x the CPU per byte, and
    /// the one-way p2p stream lost 10-13% of its throughput at 16-64 MiB (BENCHMARKS.md).
    /// Keep (peers sending to one node at once) x this under the receive buffer the kernel
    /// grants (`socket_buffer_bytes`, capped by `net.core.rmem_max`: 4 MiB here, which the
    /// kernel doubles for its accounting). On paths with a large bandwidth-delay product
    /// (a millisecond of round trip at tens of Gb/s) raise it, or throughput is bounded to
    /// this much per round trip. Must be at least `max_udp_payload`. An endpoint logs a
    /// warning when the kernel grants less receive buffer than two windows. A node whose
    /// cluster has one other node gives that peer one and a half windows, as far as its
    /// receive buffer holds them (`Connection::set_sole_peer`): nothing else sends to it.
    /// Once the cluster had a third node, every connection keeps one window, also should
    /// it shrink back to two. A connection with one window hands QUIC its payloads in
    /// pieces of at most half of it (never under 64 KiB), so that the next is written
    /// while one is acknowledged; a sole peer with a larger window gets them whole.
    pub send_window: u32,
    /// UDP socket send and receive buffer request in bytes (default 8 MiB; the kernel may
    /// clamp it). At most `i32::MAX`, the most the request can say.
    pub socket_buffer_bytes: usize,
    /// The longest a peer may wait before acknowledging what it received (default 1 ms,
    /// against QUIC's 25 ms; requested with QUIC's ACK frequency extension, and 1 ms is
    /// the least a quinn peer accepts). Peers acknowledge every second datagram at once;
    /// this bounds the wait for the last one of a burst, and a sender holds sent bytes
    /// until they are acknowledged: the loans of a `ZeroCopyBuffer` that a collective
    /// must wait for before writing their range again, and a collective's in-flight
    /// budget. With 25 ms, a 4-rank zero-copy broadcast of 4 MiB took 30 ms instead of 9
    /// (bench/HISTORY.md, session 10).
    pub max_ack_delay: Duration,
    /// A connection silent this long is closed (default 10 s; at least 1 ms).
    pub idle_timeout: Duration,
    /// QUIC keep-alive interval (default 1 s; above 0 and under `idle_timeout`).
    pub keep_alive: Duration,
    /// Deadline for reading a frame header once a stream opens (default 10 s).
    pub header_timeout: Duration,
    /// How long a frame's body may go without a new byte while this node reads it, holding
    /// early-arrival or relay budget for it (default 120 s). Past that the frame is given
    /// up: its stream is stopped ([`StreamRefusal::Stalled`](crate::StreamRefusal)) and
    /// its budget freed, where a peer that stalled mid-frame used to hold it until its
    /// connection ended (which keep-alives and heartbeats may never let happen). A sender
    /// may pause mid-frame on purpose, waiting for its own send budget while another peer
    /// is slow, but no longer than its call's deadline: a node sets this to at least its
    /// `op_timeout` (nexar-actors' `NodeConfig`), so give every node the same
    /// `op_timeout` (a sender with a longer one may pause longer than its receiver waits).
    /// A small frame on the stream that small frames share must come whole within it.
    pub body_timeout: Duration,
    /// Deadline for a QUIC/TLS handshake (default 10 s).
    pub handshake_timeout: Duration,
    /// The TCP congestion control of the trusted lane's connections (Linux; elsewhere
    /// ignored). Default `Some("reno")`; `None` keeps the system's default
    /// (`net.ipv4.tcp_congestion_control`). On this project's machine the system default
    /// is BBR, which paces every lane send from a timer and splits it into small segments
    /// in software: a 4 MiB all-reduce over the lane, 4 processes on loopback, ran at 0.98
    /// GB/s busbw with BBR, 1.2-1.4 with CUBIC and 1.73 with Reno, whose CPU per byte was
    /// 0.61x BBR's (bench/HISTORY.md, session 29). Reno suits the lane's fabric, a trusted
    /// network of short round trips; over long paths of high bandwidth, CUBIC grows its
    /// window faster. A name the kernel does not have, or does not let this process use
    /// (`net.ipv4.tcp_allowed_congestion_control`, which lists Reno by default), fails the
    /// node's start with an error that names it. A lane connection whose route fixes its
    /// congestion control (`congctl lock`) keeps the route's, with a warning. At most 15
    /// bytes, as the kernel takes.
    pub lane_congestion: Option<String>,
    /// The receive window, in bytes, of all of a connection's streams together, that a
    /// connection starts with until its runtime admits it
    /// ([`Connection::open_receive_window`] opens it to the full `stream_window *
    /// (max_streams + 1)`). QUIC grants a peer that much
    /// credit in the handshake, and buffers what it sends on streams nobody reads: a
    /// connection the runtime holds unread (a node of the cluster that is not a member,
    /// say) could otherwise make it hold the full window, 528 MiB by default. `None`
    /// (the default): the full window from the start. A nexar node sets it to 64 KiB
    /// where it is `None`, and opens the connections of its members.
    ///
    /// [`Connection::open_receive_window`]: crate::Connection::open_receive_window
    pub admission_window: Option<u32>,
}

impl TransportConfig {
    /// The full receive window of a connection's streams together:
    /// `stream_window * (max_streams + 1)`, so that streams parked on budget never hold
    /// back the one a receiver waits for.
    pub(crate) fn connection_window(&self) -> u64 {
        u64::from(self.stream_window) * (u64::from(self.max_streams) + 1)
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            max_frame_bytes: 1 << 30,
            early_budget_bytes: 256 << 20,
            relay_budget_bytes: crate::DEFAULT_RELAY_BUDGET_BYTES,
            stream_window: 16 << 20,
            max_streams: 32,
            max_udp_payload: 65_000,
            initial_mtu: 1200,
            send_window: 2 << 20,
            socket_buffer_bytes: 8 << 20,
            max_ack_delay: Duration::from_millis(1),
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(1),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(10),
            lane_congestion: Some("reno".into()),
            admission_window: None,
        }
    }
}

/// The largest [`TransportConfig::initial_mtu`] (as taken: no more than
/// `max_udp_payload`): a jumbo frame's 9000 bytes. Measured on loopback with quinn's
/// default congestion controller, payloads up to 11000 formed a cluster and 12000 or more
/// never did (every handshake stalled until the connect deadline).
pub const MAX_INITIAL_MTU: u16 = 9000;

/// The fewest streams per connection [`TransportConfig::max_streams`] may allow.
pub const MIN_STREAMS: u32 = 4;

impl TransportConfig {
    /// Builds the quinn transport configuration for a path of the given kind.
    ///
    /// MTU discovery normally runs quinn's binary search from `initial_mtu` up to
    /// `max_udp_payload`: about a dozen probes, each padded to its size. On loopback every
    /// probe arrives, so they are all large (33 to 65 KB), and quinn's receiver walks their
    /// padding one byte at a time: measured at about 0.2 CPU-seconds for the mesh of a
    /// 4-rank in-process cluster, five times what the rest of its start-up costs. Loopback's
    /// MTU is the interface's, so there the search probes the upper bound (clamped to the
    /// `lo` interface's MTU where Linux reports it) once and stops: one probe per direction.
    /// Should that probe be lost, the path stays at `initial_mtu`.
    pub(crate) fn quinn_transport(
        &self,
        path: PathKind,
    ) -> Result<Arc<quinn::TransportConfig>, TransportError> {
        let bad = |e: &dyn std::fmt::Display| TransportError::Config(e.to_string());
        self.check()?;
        let mut t = quinn::TransportConfig::default();
        let conn_window = self.connection_window();
        let first_window = self
            .admission_window
            .map_or(conn_window, |a| conn_window.min(u64::from(a)));
        t.stream_receive_window(quinn::VarInt::from_u32(self.stream_window));
        quinn::VarInt::from_u64(conn_window).map_err(|e| bad(&e))?;
        t.receive_window(quinn::VarInt::from_u64(first_window).map_err(|e| bad(&e))?);
        t.send_window(u64::from(self.send_window));
        t.max_concurrent_uni_streams(quinn::VarInt::from_u32(self.max_streams));
        t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(0));
        // quinn raises anything under its 1200-byte minimum to it.
        let initial = self.initial_mtu.min(self.max_udp_payload).max(1200);
        t.initial_mtu(initial);
        t.min_mtu(1200);
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        match path {
            PathKind::Network => {
                mtu.upper_bound(self.max_udp_payload);
            }
            PathKind::Loopback => {
                let upper = loopback_udp_payload()
                    .map_or(self.max_udp_payload, |lo| lo.min(self.max_udp_payload));
                mtu.upper_bound(upper);
                // quinn stops its search once a step would change the MTU by less than
                // `minimum_change`, after probing the upper bound if that is still far
                // enough away: with the whole range as the minimum, the first probe is the
                // upper bound and there is no second.
                mtu.minimum_change(upper.saturating_sub(initial).max(1));
            }
        }
        t.mtu_discovery_config(Some(mtu));
        // Never used: no buffer for a peer's datagrams (quinn's default keeps 1.25 MB of
        // them, each holding its whole packet).
        t.datagram_receive_buffer_size(None);
        t.keep_alive_interval(Some(self.keep_alive));
        let mut acks = quinn::AckFrequencyConfig::default();
        acks.max_ack_delay(Some(self.max_ack_delay));
        t.ack_frequency_config(Some(acks));
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout).map_err(|e| bad(&e))?;
        t.max_idle_timeout(Some(idle));
        Ok(Arc::new(t))
    }

    /// Refuses values that quinn does not take, or takes but that leave a connection
    /// unable to work, naming the setting: fewer than [`MIN_STREAMS`] streams (the
    /// message stream holds one for good, and relay frames may park half of them), a zero
    /// stream window, a connection window (`stream_window * (max_streams + 1)`) past what
    /// QUIC can say, a UDP payload QUIC cannot use, a send window under one datagram, a
    /// socket buffer request past what the kernel's call takes (it would wrap around to
    /// another size), an idle timeout under a millisecond (quinn reads 0 as "never") or
    /// past what QUIC can say, an initial MTU over [`MAX_INITIAL_MTU`] (handshakes
    /// stall), a keep-alive that is zero or not shorter than the idle timeout (quiet
    /// connections would close), and zero header, body or handshake deadlines (every
    /// stream or handshake would fail). Binding an endpoint checks the same; so does a
    /// worker's bootstrap, before the seed admits it.
    ///
    /// ```
    /// let mut config = nexar_transport::TransportConfig::default();
    /// assert!(config.check().is_ok());
    /// config.send_window = 1500;
    /// assert!(config.check().unwrap_err().to_string().contains("send_window"));
    /// ```
    pub fn check(&self) -> Result<(), TransportError> {
        let refuse = |what: String| Err(TransportError::Config(what));
        if self.max_streams < MIN_STREAMS {
            return refuse(format!(
                "max_streams ({}) is under {MIN_STREAMS}",
                self.max_streams
            ));
        }
        if self.stream_window == 0 {
            return refuse("stream_window is 0: no stream could carry a byte".into());
        }
        if !(MIN_UDP_PAYLOAD..=MAX_UDP_PAYLOAD).contains(&self.max_udp_payload) {
            return refuse(format!(
                "max_udp_payload ({}) is outside {MIN_UDP_PAYLOAD}..={MAX_UDP_PAYLOAD}, the \
                 UDP payloads QUIC can use",
                self.max_udp_payload
            ));
        }
        if i32::try_from(self.socket_buffer_bytes).is_err() {
            return refuse(format!(
                "socket_buffer_bytes ({}) is over {}, the most a socket buffer request \
                 can say",
                self.socket_buffer_bytes,
                i32::MAX
            ));
        }
        if self.send_window < u32::from(self.max_udp_payload) {
            return refuse(format!(
                "send_window ({} bytes) is smaller than one datagram (max_udp_payload, {} bytes)",
                self.send_window, self.max_udp_payload
            ));
        }
        if quinn::VarInt::from_u64(self.connection_window()).is_err() {
            return refuse(format!(
                "stream_window ({}) times max_streams + 1 ({}) is over {}, the largest \
                 window QUIC can say",
                self.stream_window,
                u64::from(self.max_streams) + 1,
                quinn::VarInt::MAX
            ));
        }
        if self.initial_mtu.min(self.max_udp_payload) > MAX_INITIAL_MTU {
            return refuse(format!(
                "initial_mtu ({}) is over {MAX_INITIAL_MTU}: QUIC handshakes stall with a \
                 first datagram that large (MTU discovery grows it from there)",
                self.initial_mtu
            ));
        }
        if self.idle_timeout < Duration::from_millis(1) {
            return refuse(format!(
                "idle_timeout ({:?}) is under 1 ms",
                self.idle_timeout
            ));
        }
        if quinn::IdleTimeout::try_from(self.idle_timeout).is_err() {
            return refuse(format!(
                "idle_timeout ({:?}) is over the longest QUIC can say ({} ms)",
                self.idle_timeout,
                quinn::VarInt::MAX
            ));
        }
        if self.keep_alive.is_zero() || self.keep_alive >= self.idle_timeout {
            return refuse(format!(
                "keep_alive ({:?}) must be above 0 and under idle_timeout ({:?})",
                self.keep_alive, self.idle_timeout
            ));
        }
        if let Some(name) = &self.lane_congestion {
            if name.is_empty()
                || name.len() > MAX_CONGESTION_NAME
                || !name.bytes().all(|b| b.is_ascii_graphic())
            {
                return refuse(format!(
                    "lane_congestion ({name:?}) is not a congestion control's name: 1 to \
                     {MAX_CONGESTION_NAME} printable ASCII characters"
                ));
            }
        }
        for (name, d) in [
            ("header_timeout", self.header_timeout),
            ("body_timeout", self.body_timeout),
            ("handshake_timeout", self.handshake_timeout),
        ] {
            if d.is_zero() {
                return refuse(format!("{name} is 0"));
            }
        }
        Ok(())
    }

    /// Builds the quinn endpoint configuration.
    pub(crate) fn quinn_endpoint(&self) -> Result<quinn::EndpointConfig, TransportError> {
        let mut e = quinn::EndpointConfig::default();
        e.max_udp_payload_size(self.max_udp_payload)
            .map_err(|err| TransportError::Config(err.to_string()))?;
        Ok(e)
    }
}

/// The least [`TransportConfig::max_udp_payload`]: QUIC's smallest datagram.
pub const MIN_UDP_PAYLOAD: u16 = 1200;

/// The largest [`TransportConfig::max_udp_payload`]: the most a UDP datagram carries
/// (65535 bytes less UDP's 8-byte header), and the most quinn takes.
pub const MAX_UDP_PAYLOAD: u16 = 65_527;

/// The longest TCP congestion control name the kernel takes (`TCP_CA_NAME_MAX` less its
/// terminating zero).
const MAX_CONGESTION_NAME: usize = 15;

/// Which kind of path a connection runs over; it decides how MTU discovery searches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PathKind {
    /// A peer at a loopback address: the MTU is the `lo` interface's.
    Loopback,
    /// Any other peer: the path MTU is found by quinn's binary search.
    Network,
}

impl PathKind {
    /// The kind of path to `addr` (IPv4-mapped IPv6 loopback addresses count as loopback).
    pub(crate) fn of(addr: std::net::SocketAddr) -> PathKind {
        if addr.ip().to_canonical().is_loopback() {
            PathKind::Loopback
        } else {
            PathKind::Network
        }
    }
}

/// The largest UDP payload the `lo` interface carries (its MTU less an IPv6 and a UDP
/// header), where the system reports the MTU; `None` elsewhere.
pub(crate) fn loopback_udp_payload() -> Option<u16> {
    let text = std::fs::read_to_string("/sys/class/net/lo/mtu").ok()?;
    udp_payload_for_mtu(&text)
}

/// The UDP payload that fits an interface MTU given as text (`None` if it does not parse
/// or leaves less than quinn's 1200-byte minimum).
fn udp_payload_for_mtu(text: &str) -> Option<u16> {
    let mtu: u32 = text.trim().parse().ok()?;
    let payload = mtu.checked_sub(40 + 8)?;
    (payload >= 1200).then(|| u16::try_from(payload).unwrap_or(u16::MAX))
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    /// A table made without a node's config gets the overdraft a node with the default
    /// config sets (`max_streams * stream_window`), as README says: 512 MiB.
    #[test]
    fn the_default_overdraft_is_the_default_streams_times_their_window() {
        let d = TransportConfig::default();
        let product = d.max_streams as usize * d.stream_window as usize;
        assert_eq!(crate::DEFAULT_OVERDRAFT_BYTES, product);
        assert_eq!(product, 512 << 20);
    }

    #[test]
    fn path_kind_follows_the_peer_address() {
        let kind = |s: &str| {
            PathKind::of(
                s.parse::<SocketAddr>()
                    .unwrap_or_else(|e| panic!("{s}: {e}")),
            )
        };
        assert_eq!(kind("127.0.0.1:9"), PathKind::Loopback);
        assert_eq!(kind("127.3.2.1:9"), PathKind::Loopback);
        assert_eq!(kind("[::1]:9"), PathKind::Loopback);
        assert_eq!(kind("[::ffff:127.0.0.1]:9"), PathKind::Loopback);
        assert_eq!(kind("10.0.0.1:9"), PathKind::Network);
        assert_eq!(kind("[fe80::1]:9"), PathKind::Network);
    }

    #[test]
    fn settings_that_leave_a_connection_unable_to_work_are_refused() {
        let d = TransportConfig::default;
        let ms = Duration::from_millis;
        for (bad, says) in [
            (
                TransportConfig {
                    max_streams: 0,
                    ..d()
                },
                "max_streams",
            ),
            (
                TransportConfig {
                    max_streams: 3,
                    ..d()
                },
                "max_streams",
            ),
            (
                TransportConfig {
                    stream_window: 0,
                    ..d()
                },
                "stream_window",
            ),
            (
                TransportConfig {
                    initial_mtu: MAX_INITIAL_MTU + 1,
                    ..d()
                },
                "initial_mtu",
            ),
            (
                TransportConfig {
                    idle_timeout: Duration::ZERO,
                    ..d()
                },
                "idle_timeout",
            ),
            (
                TransportConfig {
                    idle_timeout: Duration::from_micros(999),
                    keep_alive: Duration::from_micros(1),
                    ..d()
                },
                "idle_timeout",
            ),
            (
                TransportConfig {
                    keep_alive: Duration::ZERO,
                    ..d()
                },
                "keep_alive",
            ),
            (
                TransportConfig {
                    keep_alive: ms(10_000),
                    ..d()
                },
                "keep_alive",
            ),
            (
                TransportConfig {
                    max_udp_payload: MIN_UDP_PAYLOAD - 1,
                    ..d()
                },
                "max_udp_payload",
            ),
            (
                TransportConfig {
                    max_udp_payload: MAX_UDP_PAYLOAD + 1,
                    ..d()
                },
                "max_udp_payload",
            ),
            (
                TransportConfig {
                    socket_buffer_bytes: (1 << 32) + (64 << 10),
                    ..d()
                },
                "socket_buffer_bytes",
            ),
            (
                TransportConfig {
                    header_timeout: Duration::ZERO,
                    ..d()
                },
                "header_timeout",
            ),
            (
                TransportConfig {
                    body_timeout: Duration::ZERO,
                    ..d()
                },
                "body_timeout",
            ),
            (
                TransportConfig {
                    handshake_timeout: Duration::ZERO,
                    ..d()
                },
                "handshake_timeout",
            ),
            (
                TransportConfig {
                    lane_congestion: Some(String::new()),
                    ..d()
                },
                "lane_congestion",
            ),
            (
                TransportConfig {
                    lane_congestion: Some("a-name-of-16-ch".to_owned() + "x"),
                    ..d()
                },
                "lane_congestion",
            ),
            (
                TransportConfig {
                    lane_congestion: Some("re no".into()),
                    ..d()
                },
                "lane_congestion",
            ),
            (
                TransportConfig {
                    idle_timeout: Duration::MAX,
                    ..d()
                },
                "idle_timeout",
            ),
            (
                TransportConfig {
                    stream_window: u32::MAX,
                    max_streams: u32::MAX,
                    ..d()
                },
                "stream_window",
            ),
            (
                TransportConfig {
                    send_window: 1500,
                    ..d()
                },
                "send_window",
            ),
        ] {
            match bad.quinn_transport(PathKind::Network) {
                Err(TransportError::Config(msg)) => assert!(msg.contains(says), "{msg}"),
                other => panic!("{says}: expected a configuration error, got {other:?}"),
            }
            // What the bootstrap checks, before the seed admits a node.
            match bad.check() {
                Err(TransportError::Config(msg)) => assert!(msg.contains(says), "{msg}"),
                other => panic!("{says}: check passed what the endpoint refuses: {other:?}"),
            }
        }
        let least = TransportConfig {
            max_streams: MIN_STREAMS,
            stream_window: 1,
            idle_timeout: ms(2),
            keep_alive: ms(1),
            initial_mtu: MAX_INITIAL_MTU,
            lane_congestion: Some("a-name-of-15-ch".into()),
            ..d()
        };
        assert!(least.quinn_transport(PathKind::Network).is_ok());
        let system_default = TransportConfig {
            lane_congestion: None,
            ..d()
        };
        assert!(system_default.quinn_transport(PathKind::Network).is_ok());
        // The initial MTU counts as taken: no more than the largest payload.
        let capped = TransportConfig {
            initial_mtu: u16::MAX,
            max_udp_payload: MAX_INITIAL_MTU,
            send_window: u32::from(MAX_INITIAL_MTU),
            ..d()
        };
        assert!(capped.quinn_transport(PathKind::Network).is_ok());
    }

    #[test]
    fn a_send_window_under_one_datagram_is_refused() {
        let small = TransportConfig {
            send_window: 64_999,
            ..TransportConfig::default()
        };
        for path in [PathKind::Loopback, PathKind::Network] {
            match small.quinn_transport(path) {
                Err(TransportError::Config(msg)) => assert!(msg.contains("send_window"), "{msg}"),
                other => panic!("expected a configuration error, got {other:?}"),
            }
        }
        let one = TransportConfig {
            send_window: 65_000,
            ..TransportConfig::default()
        };
        assert!(one.quinn_transport(PathKind::Network).is_ok());
        assert!(TransportConfig::default()
            .quinn_transport(PathKind::Loopback)
            .is_ok());
    }

    #[test]
    fn interface_mtus_become_udp_payloads() {
        assert_eq!(udp_payload_for_mtu("65536\n"), Some(65488));
        assert_eq!(udp_payload_for_mtu("1500"), Some(1452));
        assert_eq!(udp_payload_for_mtu("1248"), Some(1200));
        assert_eq!(udp_payload_for_mtu("1247"), None);
        assert_eq!(udp_payload_for_mtu("20"), None);
        assert_eq!(udp_payload_for_mtu("lots"), None);
        assert_eq!(udp_payload_for_mtu("1000000"), Some(u16::MAX));
    }
}
