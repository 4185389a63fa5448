//! QUIC endpoints and authenticated connections.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::config::PathKind;
use crate::mailbox::{
    Admitted, MailboxKey, MailboxTable, Park, PartialFrame, Payload, Refused, STREAM_HANDOVER_BYTES,
};
use crate::wire::{FrameHeader, FrameKind, StreamRefusal, MAX_HEADER_BYTES, PROTOCOL_VERSION};
use crate::{node_id_from_cert, tls, NodeId, NodeIdentity, TransportConfig, TransportError};

/// The application close code of a node that closes its connections because its job is
/// done ([`Endpoint::close_finished`]), after saying farewell; 0 is any other clean close.
pub const FINISHED_CODE: u32 = 0x6e78_6669;

/// The application close code of a connection this node closed because its peer sent
/// frames nobody asked for past the early-arrival budget, its overdraft and the markers of
/// those dropped: not a clean close, so both ends report the peer lost, not departed.
const OVERDRAFT_CODE: u32 = 0x6e78_6f64;

/// A bound QUIC endpoint for one node: it dials peers and accepts their connections.
#[derive(Debug, Clone)]
pub struct Endpoint {
    inner: quinn::Endpoint,
    node: NodeId,
    config: TransportConfig,
    paths: PathConfigs,
    windows: SendWindows,
}

/// The send windows this endpoint's connections take ([`Connection::set_sole_peer`]).
#[derive(Debug, Clone, Copy)]
struct SendWindows {
    /// [`TransportConfig::send_window`]: what one peer may have in flight toward a node
    /// that others send to as well.
    shared: u64,
    /// What the sole peer of a node may have in flight: one and a half windows, as far as
    /// this node's own receive buffer holds them (taken as the peer's: a peer whose
    /// kernel grants it less may drop datagrams), and never less than one.
    sole: u64,
}

impl SendWindows {
    /// The windows for `send_window` and a receive buffer the kernel reported as
    /// `granted` bytes (twice the usable size; `None` when unknown: one window only).
    fn new(send_window: u32, granted: Option<usize>) -> SendWindows {
        let shared = u64::from(send_window);
        let usable = granted.map_or(0, |g| (g / 2) as u64);
        SendWindows {
            shared,
            sole: (shared + shared / 2).min(usable).max(shared),
        }
    }
}

/// The configurations for loopback peers (the endpoint's defaults serve every other peer):
/// they differ in how MTU discovery searches ([`TransportConfig`]'s `quinn_transport`).
#[derive(Debug, Clone)]
struct PathConfigs {
    loopback_server: Arc<quinn::ServerConfig>,
    loopback_client: quinn::ClientConfig,
}

impl Endpoint {
    /// Binds a UDP socket at `addr` (port 0 picks a free port) and starts a QUIC endpoint
    /// that presents `identity` and accepts only peers certified by the same cluster CA.
    /// Must be called inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        identity: &NodeIdentity,
        config: TransportConfig,
    ) -> Result<Endpoint, TransportError> {
        let server_tls = Arc::new(
            QuicServerConfig::try_from(tls::server_config(identity)?)
                .map_err(|e| TransportError::TlsConfig(e.to_string()))?,
        );
        let client_tls = Arc::new(
            QuicClientConfig::try_from(tls::client_config(identity)?)
                .map_err(|e| TransportError::TlsConfig(e.to_string()))?,
        );
        let server = |path| -> Result<quinn::ServerConfig, TransportError> {
            let mut server = quinn::ServerConfig::with_crypto(server_tls.clone());
            server.transport_config(config.quinn_transport(path)?);
            Ok(server)
        };
        let client = |path| -> Result<quinn::ClientConfig, TransportError> {
            let mut client = quinn::ClientConfig::new(client_tls.clone());
            client.transport_config(config.quinn_transport(path)?);
            Ok(client)
        };
        let paths = PathConfigs {
            loopback_server: Arc::new(server(PathKind::Loopback)?),
            loopback_client: client(PathKind::Loopback)?,
        };

        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::DGRAM,
            Some(socket2::Protocol::UDP),
        )?;
        if addr.is_ipv6() {
            // Accept IPv4-mapped peers too when bound to [::].
            let _ = socket.set_only_v6(false);
        }
        // Best effort: the kernel clamps these to its limits.
        if let Err(e) = socket.set_recv_buffer_size(config.socket_buffer_bytes) {
            debug!(error = %e, "could not raise the UDP receive buffer");
        }
        if let Err(e) = socket.set_send_buffer_size(config.socket_buffer_bytes) {
            debug!(error = %e, "could not raise the UDP send buffer");
        }
        let granted = socket.recv_buffer_size().ok();
        if let Some(advice) = granted.and_then(|g| receive_buffer_advice(g, config.send_window)) {
            warn!("{advice}");
        }
        let windows = SendWindows::new(config.send_window, granted);
        socket.bind(&addr.into())?;
        let runtime = Arc::new(quinn::TokioRuntime);
        let udp = quinn::Runtime::wrap_udp_socket(&*runtime, socket.into())?;
        let udp = Arc::new(crate::socket::CappedOffload::new(
            udp,
            config.max_udp_payload,
        ));
        let mut inner = quinn::Endpoint::new_with_abstract_socket(
            config.quinn_endpoint()?,
            Some(server(PathKind::Network)?),
            udp,
            runtime,
        )?;
        inner.set_default_client_config(client(PathKind::Network)?);
        Ok(Endpoint {
            inner,
            node: identity.node(),
            config,
            paths,
            windows,
        })
    }

    /// The local socket address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.inner.local_addr()?)
    }

    /// This endpoint's node id.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The configuration this endpoint was built with.
    pub fn config(&self) -> &TransportConfig {
        &self.config
    }

    /// Dials `expected` at `addr`. TLS checks that the server's certificate is issued by the
    /// cluster CA for exactly that node; the handshake has the configured deadline.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        expected: NodeId,
    ) -> Result<Connection, TransportError> {
        let connecting = match PathKind::of(addr) {
            PathKind::Loopback => self.inner.connect_with(
                self.paths.loopback_client.clone(),
                addr,
                &expected.dns_name(),
            ),
            PathKind::Network => self.inner.connect(addr, &expected.dns_name()),
        }
        .map_err(|e| TransportError::Connect {
            addr,
            reason: e.to_string(),
        })?;
        let conn = handshaken(connecting, addr, self.config.handshake_timeout).await?;
        let conn = self.authenticated(conn)?;
        if conn.peer != expected {
            conn.conn
                .close(quinn::VarInt::from_u32(1), b"unexpected node");
            return Err(TransportError::UnexpectedPeer {
                expected,
                actual: conn.peer,
            });
        }
        Ok(conn)
    }

    /// A handshaken QUIC connection as a [`Connection`] to the node its certificate names.
    fn authenticated(&self, conn: quinn::Connection) -> Result<Connection, TransportError> {
        authenticated(conn, self.node, &self.config, self.windows)
    }

    /// The send window a connection of this endpoint takes as its node's sole peer
    /// ([`Connection::set_sole_peer`]): one and a half [`TransportConfig::send_window`]s
    /// where this node's UDP receive buffer holds that, else as much as it holds, and
    /// never less than one window.
    pub fn sole_peer_send_window(&self) -> u64 {
        self.windows.sole
    }

    /// Accepts the next incoming connection and authenticates it. `None` once the endpoint
    /// is closed. A failed handshake is returned as an error; keep accepting after it.
    ///
    /// This waits for each handshake in turn (up to the handshake timeout): a server that
    /// must not let one silent client hold up the others takes [`Endpoint::incoming`]
    /// and runs the handshakes side by side.
    pub async fn accept(&self) -> Option<Result<Connection, TransportError>> {
        Some(self.incoming().await?.handshake().await)
    }

    /// The next incoming connection whose client has shown that it receives at its source
    /// address (others are sent a stateless QUIC retry first, so a forged address gets
    /// no handshake); its handshake is still to run ([`Accepting::handshake`]). `None` once
    /// the endpoint is closed.
    pub async fn incoming(&self) -> Option<Accepting> {
        loop {
            let incoming = self.inner.accept().await?;
            if !incoming.remote_address_validated() && incoming.may_retry() {
                let _ = incoming.retry();
                continue;
            }
            return Some(Accepting {
                incoming,
                loopback_server: self.paths.loopback_server.clone(),
                node: self.node,
                config: self.config.clone(),
                windows: self.windows,
            });
        }
    }

    /// Closes every connection and stops accepting.
    pub fn close(&self) {
        self.inner.close(quinn::VarInt::from_u32(0), b"shutdown");
    }

    /// Closes every connection as a node whose job is done ([`FINISHED_CODE`]): its peers
    /// can tell that from a crash or an abort ([`Connection::peer_finished`]).
    pub fn close_finished(&self) {
        self.inner
            .close(quinn::VarInt::from_u32(FINISHED_CODE), b"finished");
    }

    /// Waits until every connection's close has been sent (bounded by the idle timeout).
    pub async fn wait_idle(&self) {
        self.inner.wait_idle().await;
    }
}

/// An incoming connection from a validated address, its handshake still to run
/// ([`Endpoint::incoming`]).
pub struct Accepting {
    incoming: quinn::Incoming,
    loopback_server: Arc<quinn::ServerConfig>,
    node: NodeId,
    config: TransportConfig,
    windows: SendWindows,
}

impl fmt::Debug for Accepting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Accepting")
            .field("remote", &self.incoming.remote_address())
            .finish_non_exhaustive()
    }
}

impl Accepting {
    /// The client's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.incoming.remote_address()
    }

    /// Refuses the connection at once (the client is told so).
    pub fn refuse(self) {
        self.incoming.refuse();
    }

    /// Runs the handshake (within the configured handshake timeout) and authenticates the
    /// client by its certificate.
    pub async fn handshake(self) -> Result<Connection, TransportError> {
        let remote = self.incoming.remote_address();
        let connecting = match PathKind::of(remote) {
            PathKind::Loopback => self.incoming.accept_with(self.loopback_server),
            PathKind::Network => self.incoming.accept(),
        }
        .map_err(|e| TransportError::Connect {
            addr: remote,
            reason: e.to_string(),
        })?;
        let conn = handshaken(connecting, remote, self.config.handshake_timeout).await?;
        authenticated(conn, self.node, &self.config, self.windows)
    }
}

/// The connection once its handshake with `addr` is done, within `timeout`.
async fn handshaken(
    connecting: quinn::Connecting,
    addr: SocketAddr,
    timeout: std::time::Duration,
) -> Result<quinn::Connection, TransportError> {
    let failed = |reason: String| TransportError::Connect { addr, reason };
    tokio::time::timeout(timeout, connecting)
        .await
        .map_err(|_| failed("handshake timed out".into()))?
        .map_err(|e| failed(e.to_string()))
}

/// A handshaken QUIC connection as a [`Connection`] (of `node`) to the node its
/// certificate names.
fn authenticated(
    conn: quinn::Connection,
    node: NodeId,
    config: &TransportConfig,
    windows: SendWindows,
) -> Result<Connection, TransportError> {
    let (peer, fingerprint) = peer_node(&conn)?;
    Ok(Connection::new(
        conn,
        peer,
        fingerprint,
        node,
        config,
        windows,
    ))
}

/// The peer's node id and the SHA-256 of its certificate.
fn peer_node(conn: &quinn::Connection) -> Result<(NodeId, [u8; 32]), TransportError> {
    let certs = conn
        .peer_identity()
        .and_then(|id| {
            id.downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or_else(|| TransportError::BadPeerIdentity("no peer certificate".into()))?;
    let leaf = certs
        .first()
        .ok_or_else(|| TransportError::BadPeerIdentity("empty certificate chain".into()))?;
    Ok((node_id_from_cert(leaf)?, cert_fingerprint(leaf)))
}

/// The SHA-256 of a certificate's DER: what a membership list pins a node's certificate
/// by (the cluster CA may have issued more than one certificate naming a node id).
pub fn cert_fingerprint(der: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(der).into()
}

/// A frame delivered to the node's control channel (kinds other than [`FrameKind::Data`]).
#[derive(Debug)]
pub struct ControlFrame {
    /// Authenticated sender.
    pub from: NodeId,
    /// The frame header.
    pub header: FrameHeader,
    /// The payload (control payloads are small and assembled into one buffer).
    pub payload: Bytes,
    /// True for a [`FrameKind::Control`] frame (an RPC request) over this node's
    /// `max_frame_bytes`, its sender's limit being larger: its stream was stopped unread
    /// and `payload` is empty. Only its header comes through, so that the runtime can
    /// answer it with an error instead of leaving its caller to wait for its deadline.
    pub oversized: bool,
}

/// A relay frame as it arrived (its payload is an envelope for the runtime to check).
#[derive(Debug)]
pub struct RelayFrame {
    /// The neighbour it came from (authenticated).
    pub from: NodeId,
    /// The frame header.
    pub header: FrameHeader,
    /// The envelope and inner payload.
    pub payload: Payload,
}

/// Where a connection's reader delivers what arrives.
#[derive(Debug, Clone)]
pub struct Inbound {
    /// Data frames go to keyed mailboxes.
    pub table: Arc<MailboxTable>,
    /// Heartbeat and control frames go here (bounded; heartbeats are dropped when full).
    /// A control frame that finds the channel full waits for room with the frame read
    /// whole: its stream has ended, so QUIC no longer holds its sender back, and only a
    /// consumer that keeps up bounds what such frames hold (a node's forwards each to its
    /// actor at once).
    pub control: mpsc::Sender<ControlFrame>,
    /// Relay frames go here, each holding its share of the table's relay budget (see
    /// [`MailboxTable::with_relay_budget`]) until dropped, unless it was read without
    /// (when half the peer's streams wait: see `TransportConfig::relay_budget_bytes`).
    /// The channel is bounded too; a frame that finds it full waits for room read whole,
    /// as a control frame does: the relay budget, not the channel, bounds what frames
    /// read with budget hold.
    pub relay: mpsc::Sender<RelayFrame>,
}

/// An authenticated connection to one peer node.
#[derive(Debug, Clone)]
pub struct Connection {
    conn: quinn::Connection,
    peer: NodeId,
    fingerprint: [u8; 32],
    local: NodeId,
    max_frame: u64,
    header_timeout: std::time::Duration,
    body_timeout: std::time::Duration,
    /// The message stream small frames are written to in turn (see [`MESSAGE_FRAME_BYTES`]);
    /// `None` until the first, and again after a write that failed or was cut part-way.
    messages: Arc<tokio::sync::Mutex<Option<MessageStream>>>,
    /// Message streams opened so far (tests).
    #[cfg(test)]
    messages_opened: Arc<AtomicUsize>,
    /// The lengths of the pieces handed to QUIC for each frame's payload on a stream of
    /// its own (tests).
    #[cfg(test)]
    pieces_written: Arc<std::sync::Mutex<Vec<Vec<usize>>>>,
    /// This peer's streams whose readers wait for budget now (relay frames for relay
    /// budget, data frames for early-arrival budget or their receiver), and how many may
    /// before a relay frame is read without budget: half the streams the peer may have
    /// open (`max_streams`). Data frames always wait. (A data frame's reader counts itself
    /// while it is let in, whether it waits or not.)
    parked_streams: Arc<AtomicUsize>,
    max_parked: usize,
    /// The inbound frames refused on this connection, warned of through a throttle: a
    /// misbehaving peer can have a frame refused as often as it opens a stream.
    refused: crate::WarnThrottle,
    windows: SendWindows,
    /// The send window set last (one window until [`Connection::set_sole_peer`]). Set
    /// together with quinn's under `setting_window`, so concurrent calls cannot leave the
    /// two apart (this one also sizes the pieces written, [`write_segment`]).
    window: Arc<AtomicU64>,
    setting_window: Arc<std::sync::Mutex<()>>,
    /// The full receive window [`Connection::open_receive_window`] opens
    /// ([`TransportConfig::admission_window`]); `None` when it was full from the start.
    admit_to: Option<u64>,
}

/// The connection's message stream ([`Connection::send_message`]).
#[derive(Debug)]
struct MessageStream {
    stream: quinn::SendStream,
    /// Whether its opening mark has been written: a stream opened for a frame whose
    /// future was dropped before any of it went out is kept unmarked, and the next frame
    /// writes the mark. (Dropped, a stream with nothing written would reach the peer as
    /// an empty stream, which it refuses as a bad header, and spend one of the streams the
    /// peer lets this node open.)
    marked: bool,
    /// When it was opened: an unmarked stream is used only within half the header
    /// deadline of that (this node's `header_timeout`, taken for the peer's: nodes of a
    /// cluster are configured alike). The peer's reader starts that deadline once it
    /// learns of the stream (at the latest when a later stream's bytes arrive), and
    /// refuses the stream at its end.
    opened: std::time::Instant,
}

/// A small frame being written on the message stream ([`Connection::send_message`]).
/// Dropped before any of it went out, it puts the stream back in its slot, as it was.
struct MessageWrite<'a> {
    slot: &'a mut Option<MessageStream>,
    stream: Option<MessageStream>,
    /// What is left to write: quinn empties the chunks it has taken and cuts the one it
    /// took part of.
    chunks: Vec<Bytes>,
    /// The frame's bytes (with the mark, on a new stream).
    unwritten: usize,
}

impl MessageWrite<'_> {
    /// Writes the frame and puts the stream back in its slot; a failed write drops it.
    async fn run(&mut self) -> Result<(), quinn::WriteError> {
        let Some(message) = self.stream.as_mut() else {
            return Ok(());
        };
        if let Err(e) = message.stream.write_all_chunks(&mut self.chunks).await {
            self.stream = None;
            return Err(e);
        }
        message.marked = true;
        *self.slot = self.stream.take();
        Ok(())
    }
}

impl Drop for MessageWrite<'_> {
    fn drop(&mut self) {
        let untouched = self.chunks.iter().map(Bytes::len).sum::<usize>() == self.unwritten;
        if untouched {
            *self.slot = self.stream.take();
        }
    }
}

/// A frame's stream of its own while the frame is written
/// ([`Connection::send_payload`], [`Connection::send_streamed`]). Dropped before the
/// frame is finished (its future dropped, say at a deadline), it resets the stream: QUIC
/// then discards what it holds of the frame unsent, where finishing the stream (what
/// dropping a quinn stream does) would still send up to a send window of it, for the
/// receiver to discard, ahead of later frames.
struct FrameStream {
    stream: quinn::SendStream,
    finished: bool,
}

impl FrameStream {
    fn new(stream: quinn::SendStream) -> FrameStream {
        FrameStream {
            stream,
            finished: false,
        }
    }

    /// Ends the stream after the whole frame.
    fn finish(mut self) -> Result<(), quinn::ClosedStream> {
        self.finished = true;
        self.stream.finish()
    }
}

impl std::ops::Deref for FrameStream {
    type Target = quinn::SendStream;
    fn deref(&self) -> &quinn::SendStream {
        &self.stream
    }
}

impl std::ops::DerefMut for FrameStream {
    fn deref_mut(&mut self) -> &mut quinn::SendStream {
        &mut self.stream
    }
}

impl Drop for FrameStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.stream.reset(StreamRefusal::LengthMismatch.code());
        }
    }
}

/// Pushes `chunk` onto `out` in pieces of at most `segment` bytes (`None`: whole). The
/// pieces share the chunk's memory.
fn push_segments(out: &mut Vec<Bytes>, mut chunk: Bytes, segment: Option<usize>) {
    if let Some(seg) = segment.filter(|&s| s > 0) {
        while chunk.len() > seg {
            out.push(chunk.split_to(seg));
        }
    }
    out.push(chunk);
}

/// The smallest piece [`write_segment`] cuts payloads into, whatever the window: a window
/// under twice this (configurable down to one datagram) gets pieces of this size, so a
/// large frame is not cut into millions of pieces.
const MIN_WRITE_SEGMENT: usize = 64 << 10;

/// The largest piece of a payload handed to QUIC in one write on a connection whose send
/// window is `window`: half of it (at least [`MIN_WRITE_SEGMENT`]) when that is the
/// shared window, whole when it is larger (a sole peer's, [`Connection::set_sole_peer`]).
///
/// quinn counts a written piece against the connection's send window until it and every
/// earlier byte of its stream are acknowledged (acknowledged bytes of a piece stay held by
/// its memory), and cuts a write down to the room left in the window. So a message larger
/// than the window went window by window, each piece waiting for its last datagram's
/// acknowledgement, which a peer may delay up to its `max_ack_delay` (longer when its
/// process is not running): across 3 processes, messages of 4 MiB went at 1.4-2.4 GB/s
/// against 2.9-3.0 for 2 and 3 MiB ones, and slower with a longer `max_ack_delay`. In
/// halves of the window, one half is written while the other is acknowledged: 4 MiB
/// messages at 3.3-3.8 GB/s on 3 to 8 processes (BENCHMARKS.md, session 37). A sole
/// peer's writes stay whole, as measured best: pieces of 1 or 1.5 MiB cost the largest
/// exchanges of 2 processes up to 12% more CPU and a quarter more time (more of its
/// larger window in flight queues at the receiver, past the cache).
fn write_segment(window: u64, windows: &SendWindows) -> Option<usize> {
    (window <= windows.shared).then(|| {
        usize::try_from(window / 2)
            .unwrap_or(usize::MAX)
            .max(MIN_WRITE_SEGMENT)
    })
}

/// Data frames and heartbeats with payloads up to this many bytes go on the connection's
/// message stream: one long-lived unidirectional stream per direction that carries them
/// one after another. A stream per frame costs a stream's set-up and tear-down at both
/// ends, and every few streams a MAX_STREAMS update and the acknowledgement it draws:
/// about a tenth of the datagrams of a 4 KiB all-reduce. Larger frames keep a stream each,
/// so that they do not queue behind each other and a waiting receiver can take one over as
/// it arrives. So do control and relay frames, whatever their size: their receiver hands
/// them to a bounded channel whose reader may be slow (a relay waits on the next hop), and
/// a full channel must hold up only that frame, not the data and heartbeats behind it.
pub const MESSAGE_FRAME_BYTES: usize = 64 << 10;

/// The largest control frame, heartbeat or farewell a node reads (RPC requests are held
/// to less by their callers).
const MAX_CONTROL_FRAME: u64 = 1 << 20;

/// How many frames a message stream's reader takes before it lets the runtime run
/// something else.
const MESSAGES_PER_POLL: usize = 64;

/// The first bytes of a message stream: a zero header length, which no frame has.
const MESSAGE_STREAM_MARK: [u8; 2] = [0, 0];

/// Why a frame of `kind` with a payload of `len` bytes is never taken over QUIC, if it is:
/// a rule of its kind, whatever its sender. Receivers refuse such a frame's stream
/// (`Connection::check`); senders refuse to send one ([`Connection::send_payload`]), as
/// on the message stream its refusal would take the frames queued behind it too.
fn kind_refusal(kind: FrameKind, len: u64) -> Option<ReadFail> {
    if matches!(
        kind,
        FrameKind::Announce | FrameKind::Clear | FrameKind::Credit
    ) {
        return Some((
            StreamRefusal::BadHeader,
            format!("a {kind:?} frame, which only a trusted lane carries"),
        ));
    }
    if matches!(
        kind,
        FrameKind::Abandoned | FrameKind::Farewell | FrameKind::Heartbeat
    ) && len != 0
    {
        // None carries a payload: one would be read with no budget (up to the 1 MiB of
        // a control frame each, queued for the node as control frames are).
        return Some((
            StreamRefusal::FrameTooLarge,
            "an abandonment marker, a farewell or a heartbeat with a payload".into(),
        ));
    }
    // Control frames are small by contract.
    let control = matches!(
        kind,
        FrameKind::Control | FrameKind::Heartbeat | FrameKind::Farewell
    );
    if control && len > MAX_CONTROL_FRAME {
        return Some((
            StreamRefusal::FrameTooLarge,
            "control frame over 1 MiB".into(),
        ));
    }
    None
}

impl Connection {
    fn new(
        conn: quinn::Connection,
        peer: NodeId,
        fingerprint: [u8; 32],
        local: NodeId,
        cfg: &TransportConfig,
        windows: SendWindows,
    ) -> Connection {
        Connection {
            conn,
            peer,
            fingerprint,
            local,
            max_frame: cfg.max_frame_bytes,
            header_timeout: cfg.header_timeout,
            body_timeout: cfg.body_timeout,
            messages: Arc::default(),
            #[cfg(test)]
            messages_opened: Arc::default(),
            #[cfg(test)]
            pieces_written: Arc::default(),
            parked_streams: Arc::default(),
            max_parked: cfg.max_streams as usize / 2,
            refused: crate::WarnThrottle::default(),
            windows,
            window: Arc::new(AtomicU64::new(windows.shared)),
            setting_window: Arc::default(),
            admit_to: cfg.admission_window.map(|_| cfg.connection_window()),
        }
    }

    /// Opens the connection's receive window to its full size, for a connection that
    /// began with [`TransportConfig::admission_window`]: what the runtime does once it
    /// knows the peer for one it will read (a member). Until then the peer may have at
    /// most that window in flight and unread here. Nothing to do for a connection whose
    /// window was full from the start; calling it again changes nothing.
    pub fn open_receive_window(&self) {
        if let Some(window) = self.admit_to.and_then(|w| quinn::VarInt::from_u64(w).ok()) {
            self.conn.set_receive_window(window);
        }
    }

    /// Sets how much this connection may have sent and not yet had acknowledged: one
    /// [`TransportConfig::send_window`], or, when `sole` (the peer is the only other node
    /// of the cluster, so nothing else sends to it), [`Endpoint::sole_peer_send_window`]:
    /// one and a half windows where the receive buffer holds them. A node's receive
    /// buffer is sized for two peers sending at once (the endpoint warns when it holds
    /// less than two windows), and one window held a lone stream back: across 2
    /// processes, messages of 2 MiB and more went at 1.6-2.8 GB/s against 3.7 for 1 MiB
    /// ones, and at 3.6-3.8 with one and a half windows. Two windows cost the stream of
    /// 1 MiB messages more CPU (datagrams queue past the cache) and were dearer than one
    /// and a half in 12 of 15 rows (BENCHMARKS.md, session 35). The window is capped by
    /// this node's receive buffer, taken for the peer's: on two unlike hosts, size
    /// `net.core.rmem_max` alike. Applies to bytes sent from now on; a smaller window
    /// holds new bytes back until enough are acknowledged.
    pub fn set_sole_peer(&self, sole: bool) {
        let window = if sole {
            self.windows.sole
        } else {
            self.windows.shared
        };
        // A panic elsewhere while holding the guard leaves nothing half set that matters.
        let _setting = self
            .setting_window
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.window.store(window, Ordering::Release);
        self.conn.set_send_window(window);
    }

    /// The send window set last ([`Connection::set_sole_peer`]).
    pub fn send_window(&self) -> u64 {
        self.window.load(Ordering::Acquire)
    }

    /// The largest piece of a payload handed to QUIC in one write now ([`write_segment`]).
    fn write_segment(&self) -> Option<usize> {
        write_segment(self.send_window(), &self.windows)
    }

    /// A frame's header and payload as the pieces written to QUIC
    /// ([`Connection::write_segment`]).
    fn write_pieces(&self, header: Bytes, payload: Payload) -> Vec<Bytes> {
        let segment = self.write_segment();
        let count: usize = payload
            .chunks()
            .iter()
            .map(|c| segment.map_or(1, |s| c.len().div_ceil(s).max(1)))
            .sum();
        let mut pieces = Vec::with_capacity(1 + count);
        pieces.push(header);
        for chunk in payload.into_chunks() {
            push_segments(&mut pieces, chunk, segment);
        }
        pieces
    }

    /// The peer's node id, from its verified certificate.
    pub fn peer(&self) -> NodeId {
        self.peer
    }

    /// QUIC stream frames received on this connection so far: data the peer's node sent
    /// (its frames and heartbeats), not its QUIC stack's acknowledgements or keep-alives,
    /// which a peer whose node is wedged still sends.
    pub fn stream_frames_received(&self) -> u64 {
        self.conn.stats().frame_rx.stream
    }

    /// The SHA-256 of the peer's certificate ([`cert_fingerprint`]).
    pub fn peer_fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// This end's node id.
    pub fn local_node(&self) -> NodeId {
        self.local
    }

    /// The peer's address.
    pub fn remote_addr(&self) -> SocketAddr {
        self.conn.remote_address()
    }

    /// The underlying quinn connection (statistics, raw streams in tests).
    pub fn quic(&self) -> &quinn::Connection {
        &self.conn
    }

    /// Sends one frame: a data frame, heartbeat, abandonment marker or farewell whose
    /// payload is at most [`MESSAGE_FRAME_BYTES`] on the connection's message stream, any
    /// other on a fresh unidirectional stream. Returns once the
    /// bytes are queued in QUIC's send buffer (not when the peer has read them).
    pub async fn send(
        &self,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        self.send_payload(kind, comm, tag, step, Payload::from_bytes(payload))
            .await
    }

    /// [`Connection::send`] for a payload in chunks (received ones passed on, say): QUIC
    /// takes the chunks as they are, without joining them.
    pub async fn send_payload(
        &self,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        payload: Payload,
    ) -> Result<(), TransportError> {
        let len = payload.len();
        let header = self.header(kind, comm, tag, step, len)?;
        let mut chunks = self.write_pieces(header, payload);
        let small = matches!(
            kind,
            FrameKind::Data | FrameKind::Heartbeat | FrameKind::Abandoned | FrameKind::Farewell
        );
        if len <= MESSAGE_FRAME_BYTES && small {
            return self.send_message(chunks).await;
        }
        let mut stream =
            FrameStream::new(self.conn.open_uni().await.map_err(|e| self.send_err(&e))?);
        #[cfg(test)]
        self.record_pieces(chunks[1..].iter().map(Bytes::len).collect());
        stream
            .write_all_chunks(&mut chunks)
            .await
            .map_err(|e| self.send_err(&e))?;
        stream.finish().map_err(|e| self.send_err(&e))?;
        Ok(())
    }

    /// Records the lengths of a frame's payload pieces as handed to QUIC (tests).
    #[cfg(test)]
    fn record_pieces(&self, lens: Vec<usize>) {
        let mut written = self
            .pieces_written
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        written.push(lens);
    }

    /// Writes one small frame (header and payload chunks) on the message stream, opening
    /// it first if there is none, or if the receiver stopped it (it refused an earlier
    /// frame there and reads nothing more on it). Frames never interleave: the stream is
    /// held for the whole write. A write that fails, or whose future is dropped after part
    /// of the frame went out, takes the stream along: dropping it finishes it, the
    /// receiver discards the partial frame at its end, and the next frame opens a new
    /// stream. One dropped before any of its frame went out (waiting for room in the send
    /// window, as under load) gives the stream back: it keeps its place among the streams
    /// the peer lets this node open, which a new one could wait for.
    async fn send_message(&self, mut chunks: Vec<Bytes>) -> Result<(), TransportError> {
        let mut slot = self.messages.lock().await;
        let fresh_enough =
            |m: &MessageStream| m.marked || m.opened.elapsed() < self.header_timeout / 2;
        let message = match slot.take() {
            Some(m) if !ended(&m.stream) && fresh_enough(&m) => m,
            stale => {
                if let Some(mut m) = stale.filter(|m| !m.marked) {
                    // Never written to: reset, so QUIC says at once that it carries nothing.
                    let _ = m.stream.reset(StreamRefusal::LengthMismatch.code());
                }
                #[cfg(test)]
                self.messages_opened.fetch_add(1, Ordering::Relaxed);
                let stream = self.conn.open_uni().await.map_err(|e| self.send_err(&e))?;
                MessageStream {
                    stream,
                    marked: false,
                    opened: std::time::Instant::now(),
                }
            }
        };
        if !message.marked {
            chunks.insert(0, Bytes::from_static(&MESSAGE_STREAM_MARK));
        }
        let unwritten = chunks.iter().map(Bytes::len).sum();
        let mut write = MessageWrite {
            slot: &mut slot,
            stream: Some(message),
            chunks,
            unwritten,
        };
        write.run().await.map_err(|e| self.send_err(&e))
    }

    /// [`Connection::send`] for a payload of `len` bytes produced while it is sent: its
    /// chunks are taken from `chunks` in order and written as they come (each waits for
    /// room in QUIC's send window), so the sender need not hold the whole payload at once.
    /// Should `chunks` close before `len` bytes, or carry more (in the chunk that crosses
    /// `len`, or queued by the time the last of `len` is written), the stream is reset
    /// (the receiver discards the partial frame) and the send fails.
    pub async fn send_streamed(
        &self,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
        mut chunks: mpsc::UnboundedReceiver<Bytes>,
    ) -> Result<(), TransportError> {
        let header = self.header(kind, comm, tag, step, len)?;
        let mut stream =
            FrameStream::new(self.conn.open_uni().await.map_err(|e| self.send_err(&e))?);
        stream
            .write_chunk(header)
            .await
            .map_err(|e| self.send_err(&e))?;
        let mut sent = 0usize;
        #[cfg(test)]
        let mut written_lens = Vec::new();
        while sent < len {
            let Some(chunk) = chunks.recv().await else {
                break;
            };
            sent += chunk.len();
            if sent > len {
                break;
            }
            let written = match self.write_segment() {
                Some(seg) if chunk.len() > seg => {
                    let mut pieces = Vec::with_capacity(chunk.len().div_ceil(seg));
                    push_segments(&mut pieces, chunk, Some(seg));
                    #[cfg(test)]
                    written_lens.extend(pieces.iter().map(Bytes::len));
                    stream.write_all_chunks(&mut pieces).await
                }
                _ => {
                    #[cfg(test)]
                    written_lens.push(chunk.len());
                    stream.write_chunk(chunk).await
                }
            };
            written.map_err(|e| self.send_err(&e))?;
        }
        #[cfg(test)]
        self.record_pieces(written_lens);
        // More queued behind the last chunk is a producer that carries more too.
        if sent == len {
            while let Ok(extra) = chunks.try_recv() {
                sent += extra.len();
            }
        }
        if sent != len {
            // Dropping the unfinished stream resets it.
            return Err(self.send_err(&format!(
                "the payload's producer gave {sent} bytes where {len} were announced"
            )));
        }
        stream.finish().map_err(|e| self.send_err(&e))?;
        Ok(())
    }

    /// The encoded header of a frame of `len` payload bytes from this node.
    fn header(
        &self,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
    ) -> Result<Bytes, TransportError> {
        if let Some((_, why)) = kind_refusal(kind, len as u64) {
            return Err(self.send_err(&format!("not sent, as every receiver refuses it: {why}")));
        }
        FrameHeader::for_payload(kind, comm, tag, step, self.local.0, len, self.max_frame)
    }

    fn send_err(&self, e: &dyn std::fmt::Display) -> TransportError {
        TransportError::Send {
            peer: self.peer,
            reason: e.to_string(),
        }
    }

    /// Closes the connection.
    pub fn close(&self, reason: &str) {
        self.conn
            .close(quinn::VarInt::from_u32(0), reason.as_bytes());
    }

    /// Closes the connection as a node whose job is done ([`FINISHED_CODE`]). Takes
    /// effect at once: a later close of this connection (say by dropping it) keeps it.
    pub fn close_finished(&self) {
        self.conn
            .close(quinn::VarInt::from_u32(FINISHED_CODE), b"finished");
    }

    /// Sends a frame without payload on a stream of its own and waits until the peer has
    /// acknowledged all of it (it has the frame, though it may not have read it yet): for
    /// a last frame before closing, which a close would otherwise discard unsent.
    pub async fn send_confirmed(
        &self,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
    ) -> Result<(), TransportError> {
        let header = self.header(kind, comm, tag, step, 0)?;
        let mut stream = self.conn.open_uni().await.map_err(|e| self.send_err(&e))?;
        stream
            .write_all_chunks(&mut [header])
            .await
            .map_err(|e| self.send_err(&e))?;
        stream.finish().map_err(|e| self.send_err(&e))?;
        match stream.stopped().await {
            Ok(None) => Ok(()),
            Ok(Some(code)) => Err(self.send_err(&format!("stopped by the peer ({code})"))),
            Err(e) => Err(self.send_err(&e)),
        }
    }

    /// True once the peer has closed the connection as a node whose job is done
    /// ([`Endpoint::close_finished`]).
    pub fn peer_finished(&self) -> bool {
        matches!(
            self.conn.close_reason(),
            Some(quinn::ConnectionError::ApplicationClosed(c))
                if c.error_code == quinn::VarInt::from_u32(FINISHED_CODE)
        )
    }

    /// Resolves when the connection is closed, with the reason and whether the peer (or
    /// this side) closed it deliberately, with code 0 as a clean shutdown does or with
    /// [`FINISHED_CODE`].
    pub async fn closed(&self) -> (String, bool) {
        let e = self.conn.closed().await;
        let clean = [0, FINISHED_CODE].map(quinn::VarInt::from_u32);
        let graceful = matches!(
            &e,
            quinn::ConnectionError::ApplicationClosed(c) if clean.contains(&c.error_code)
        ) || matches!(e, quinn::ConnectionError::LocallyClosed);
        (e.to_string(), graceful)
    }

    /// Reads inbound streams until the connection closes: each stream is one frame, read in
    /// its own task. The task ends when the connection does; deciding whether that means
    /// the peer is lost (and calling [`MailboxTable::fail_peer`]) is the owner's job.
    pub fn spawn_reader(&self, inbound: Inbound) -> tokio::task::JoinHandle<()> {
        use std::future::Future as _;
        let this = self.clone();
        tokio::spawn(async move {
            let reason = loop {
                match this.conn.accept_uni().await {
                    Ok(stream) => {
                        let this = this.clone();
                        let inbound = inbound.clone();
                        let mut read =
                            Box::pin(async move { this.read_stream(stream, inbound).await });
                        // A small frame has usually arrived whole with its stream: read it
                        // here, saving a task spawn and a wake-up on the latency path. A
                        // frame that is not complete yet goes on in its own task (which
                        // polls it again, registering its own waker), so a slow stream
                        // never holds up the others.
                        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                        if read.as_mut().poll(&mut cx).is_pending() {
                            tokio::spawn(read);
                        }
                    }
                    Err(e) => break e.to_string(),
                }
            };
            debug!(peer = %this.peer, %reason, "connection reader stopped");
        })
    }

    fn refuse(&self, stream: &mut quinn::RecvStream, why: StreamRefusal, detail: &str) {
        match self.refused.count() {
            Some(so_far) => {
                warn!(peer = %self.peer, reason = ?why, detail, so_far, "refusing inbound frame")
            }
            None => debug!(peer = %self.peer, reason = ?why, detail, "refusing inbound frame"),
        }
        let _ = stream.stop(why.code());
    }

    /// Reads one inbound stream: a single frame, or a message stream's frames in turn.
    async fn read_stream(&self, mut stream: quinn::RecvStream, inbound: Inbound) {
        match tokio::time::timeout(self.header_timeout, read_opening(&mut stream)).await {
            Ok(Ok(Opening::Frame(header))) => self.read_frame(stream, header, inbound).await,
            Ok(Ok(Opening::Messages)) => self.read_messages(stream, inbound).await,
            Ok(Err((why, detail))) => self.refuse(&mut stream, why, &detail),
            Err(_) => self.refuse(&mut stream, StreamRefusal::BadHeader, "header timed out"),
        }
    }

    /// Why a frame from this peer is refused on its header alone, if it is.
    fn check(&self, header: &FrameHeader) -> Result<(), ReadFail> {
        if header.version != PROTOCOL_VERSION {
            return Err((
                StreamRefusal::BadVersion,
                format!("version {}", header.version),
            ));
        }
        if header.src != self.peer.0 {
            return Err((
                StreamRefusal::SourceMismatch,
                format!("claims node {}", header.src),
            ));
        }
        if header.len > self.max_frame {
            return Err((
                StreamRefusal::FrameTooLarge,
                format!("{} bytes", header.len),
            ));
        }
        match kind_refusal(header.kind, header.len) {
            Some(refusal) => Err(refusal),
            None => Ok(()),
        }
    }

    /// A stream's single frame: its payload, then the end of the stream. A data frame
    /// nobody waits for yet waits here, unread, for early-arrival budget or its receiver
    /// (its sender too, up to its deadline), so what a peer sends unasked on streams stays
    /// within the budget. The price: a peer with all of its `max_streams` streams waiting
    /// so cannot open one for a frame a receiver here waits for, and that receive times
    /// out (an error within its deadline, where reading them anyway would let a sender
    /// grow this node's memory without bound).
    async fn read_frame(
        &self,
        mut stream: quinn::RecvStream,
        header: FrameHeader,
        inbound: Inbound,
    ) {
        if let Err((why, detail)) = self.check(&header) {
            self.oversized(&header, &inbound.table);
            self.refuse(&mut stream, why, &detail);
            // Told only where the control channel has room now: the stream, stopped,
            // no longer holds the peer back, so waiting for room here would let a peer
            // that sends such headers fast grow the tasks that wait.
            if self.oversized_request(&header) {
                if let Ok(slot) = inbound.control.clone().try_reserve_owned() {
                    let mut frame = self.control_frame(header, Payload::from_bytes(Bytes::new()));
                    frame.oversized = true;
                    slot.send(frame);
                }
            }
            return;
        }
        let len = header.len as usize;
        if header.kind != FrameKind::Data {
            let mut permit = None;
            if header.kind == FrameKind::Relay {
                match self.relay_budget(&inbound.table, header.step, len).await {
                    Some(p) => permit = p,
                    None => {
                        let _ = stream.stop(StreamRefusal::Shutdown.code());
                        return;
                    }
                }
            }
            // A frame bound for the control channel that waits for room there (an RPC
            // request, a farewell) takes its place before its body is read: its stream,
            // unread meanwhile, keeps its place among those the peer may open, so QUIC
            // holds back a peer that sends more than this node handles (read first, each
            // would wait in a task of its own, holding its payload, without bound).
            let waits = !matches!(
                header.kind,
                FrameKind::Relay | FrameKind::Abandoned | FrameKind::Heartbeat
            );
            let slot = if waits {
                // Or until the connection ends: its frame could not be read then anyway,
                // and the wait would hold this task until the node's queue had room.
                let reserved = tokio::select! {
                    slot = inbound.control.clone().reserve_owned() => slot.ok(),
                    _ = self.conn.closed() => None,
                };
                let Some(slot) = reserved else {
                    let _ = stream.stop(StreamRefusal::Shutdown.code());
                    return;
                };
                Some(slot)
            } else {
                None
            };
            match read_payload(&mut stream, len, self.body_timeout).await {
                Ok(chunks) => {
                    let payload = Payload::from_chunks(chunks, permit);
                    match slot {
                        Some(slot) => {
                            slot.send(self.control_frame(header, payload));
                        }
                        None => self.deliver(header, payload, &inbound).await,
                    }
                }
                Err((why, detail)) => self.refuse(&mut stream, why, &detail),
            }
            return;
        }
        let key = self.key(&header);
        let table = &inbound.table;
        let admitted = {
            let _parked = ParkedStream::enter(&self.parked_streams);
            self.admit(table, key, len, Park::UntilBudget).await
        };
        let Admitted {
            permit,
            waited_for,
            wanted,
        } = match admitted {
            Ok(a) => a,
            Err(why) => {
                let _ = stream.stop(why.code());
                return;
            }
        };
        // A large frame goes to its receiver as a stream (if it takes deliveries), to be
        // copied into its buffer as it arrives: at once if the receiver already waits,
        // or as soon as it starts to wait while the frame is being read (with what was
        // read so far). Otherwise the frame is read whole.
        let mut frame = PartialFrame {
            key,
            stream,
            len,
            read: Vec::new(),
            permit,
        };
        let mut offer = len >= STREAM_HANDOVER_BYTES;
        let mut asked = waited_for;
        let mut got = 0;
        loop {
            if offer && (asked || table.has_waiter_for(&key, &wanted)) {
                match table.hand_over(frame, &wanted) {
                    Ok(()) => return,
                    // The receiver takes the frame whole: read on.
                    Err(back) => frame = back,
                }
                offer = false;
            }
            asked = false;
            match stalling(self.body_timeout, &mut frame.stream, got, len).await {
                Ok(Some(chunk)) => {
                    got += chunk.len();
                    frame.read.push(chunk);
                    // Its tag retired, its sender gave it up or the table closed while it
                    // was read: nothing will take it, so its sender is told to stop
                    // instead of the frame being read to its end and dropped.
                    if let Some(refused) = table.left_behind(&key, &wanted) {
                        let _ = frame.stream.stop(self.refusal(key, refused).code());
                        return;
                    }
                }
                Ok(None) => break,
                Err((why, detail)) => {
                    table.forget_incoming(key, &wanted);
                    return self.refuse(&mut frame.stream, why, &detail);
                }
            }
        }
        table.finish_incoming(key, &wanted, Payload::from_chunks(frame.read, frame.permit));
    }

    /// Relay budget for a relay frame of `len` bytes and hop count `hops` (which its
    /// header's step carries), before it is read: taken at once if free, else waited for
    /// on the frame's own stream, so that QUIC flow control holds back what neighbours
    /// relay to this node while the frames before it are still being passed on. But a
    /// waiting stream keeps its place among those the peer may open, and a peer with all
    /// of them waiting could open no other (its data, its control frames, the next relay
    /// frame of another hop count, on which those waits may depend): with
    /// `max_parked` of its streams waiting (for either budget), a relay frame is
    /// read without budget. `None`: the table or the connection closed.
    async fn relay_budget(
        &self,
        table: &MailboxTable,
        hops: u64,
        len: usize,
    ) -> Option<Option<crate::mailbox::BudgetPermit>> {
        if let Some(p) = table.try_relay_budget(hops, len) {
            return Some(Some(p));
        }
        let parked = ParkedStream::enter(&self.parked_streams);
        if parked.before >= self.max_parked {
            debug!(peer = %self.peer, len, hops, "relay budget spent and streams scarce: reading a relay frame without budget");
            return Some(None);
        }
        tokio::select! {
            p = table.take_relay_budget(hops, len) => p.ok(),
            _ = self.conn.closed() => None,
        }
    }

    /// Reads a message stream's frames in turn until it ends. Between frames it waits
    /// without a deadline: the stream lives as long as the connection, whose idle timeout
    /// ends a silent peer. A frame that breaks the format stops the whole stream (the
    /// sender's next frame opens a new one); a frame for a duplicate key or a retired
    /// collective is skipped, and the frames behind it are read on, and so is a data frame
    /// over this node's `max_frame_bytes` that a message stream may carry (its key marked
    /// abandoned: see [`Connection::oversized`]). A data frame nobody waits for yet takes
    /// early-arrival budget when it is free and is read at once without it when it is
    /// not, as on a trusted lane: parked for budget, it would hold up every frame behind
    /// it, the peer's heartbeats (its liveness) and the frame a receiver waits for among
    /// them. Each such frame is at most [`MESSAGE_FRAME_BYTES`],
    /// and what the budget does not cover is what the authenticated peer sent unasked.
    async fn read_messages(&self, stream: quinn::RecvStream, inbound: Inbound) {
        let mut frames = Frames {
            stream,
            buf: Bytes::new(),
        };
        let mut since_yield = 0usize;
        loop {
            // Reads of buffered data never wait, so a backlog of small frames would keep
            // this loop (first polled inline by the accept loop) running, and the
            // connection's other streams unaccepted, for as long as it lasts.
            since_yield += 1;
            if since_yield == MESSAGES_PER_POLL {
                since_yield = 0;
                tokio::task::yield_now().await;
            }
            let header = match frames.header(self.body_timeout).await {
                Ok(Some(h)) => h,
                Ok(None) => return,
                Err((why, detail)) => return self.refuse(&mut frames.stream, why, &detail),
            };
            if let Err((why, detail)) = self.check(&header) {
                if self.oversized(&header, &inbound.table)
                    && header.len <= MESSAGE_FRAME_BYTES as u64
                {
                    // Well formed, only over this node's limit: skipped unread, and the
                    // frames behind it read on.
                    match self.skip_small(&mut frames, header.len as usize).await {
                        Ok(()) => continue,
                        Err((why, detail)) => return self.refuse(&mut frames.stream, why, &detail),
                    }
                }
                return self.refuse(&mut frames.stream, why, &detail);
            }
            let len = header.len as usize;
            if header.kind == FrameKind::Relay {
                // Relay frames come on streams of their own (where they can wait for relay
                // budget without holding up the frames behind them).
                return self.refuse(
                    &mut frames.stream,
                    StreamRefusal::BadHeader,
                    "a relay frame on the message stream",
                );
            }
            if header.kind == FrameKind::Data && len > MESSAGE_FRAME_BYTES {
                // Read past the budget only because a peer keeps them small: a larger one
                // belongs on a stream of its own, where it waits for budget.
                return self.refuse(
                    &mut frames.stream,
                    StreamRefusal::FrameTooLarge,
                    &format!("a data frame of {len} bytes on the message stream"),
                );
            }
            if header.kind != FrameKind::Data {
                match self.take_small(&mut frames, len).await {
                    Ok(chunks) => {
                        let payload = Payload::from_chunks(chunks, None);
                        self.deliver(header, payload, &inbound).await;
                    }
                    Err((why, detail)) => return self.refuse(&mut frames.stream, why, &detail),
                }
                continue;
            }
            let key = self.key(&header);
            let table = &inbound.table;
            let read = match self.admit(table, key, len, Park::Overdraft).await {
                Ok(Admitted { permit, wanted, .. }) => self
                    .take_small(&mut frames, len)
                    .await
                    .map(|chunks| {
                        let payload = Payload::from_chunks(chunks, permit);
                        table.finish_incoming(key, &wanted, payload);
                    })
                    .inspect_err(|_| table.forget_incoming(key, &wanted)),
                Err(StreamRefusal::Shutdown) => {
                    let _ = frames.stream.stop(StreamRefusal::Shutdown.code());
                    return;
                }
                Err(_) => self.skip_small(&mut frames, len).await,
            };
            if let Err((why, detail)) = read {
                return self.refuse(&mut frames.stream, why, &detail);
            }
        }
    }

    /// The `len` bytes of a small frame's body on the message stream, given up as
    /// [`StreamRefusal::Stalled`] when they do not all come within `body_timeout` (a
    /// sender writes each small frame whole).
    async fn take_small(&self, frames: &mut Frames, len: usize) -> Result<Vec<Bytes>, ReadFail> {
        self.small_body(len, frames.take(len)).await
    }

    /// [`take_small`](Self::take_small) for a frame that is skipped unread.
    async fn skip_small(&self, frames: &mut Frames, len: usize) -> Result<(), ReadFail> {
        self.small_body(len, frames.take_with(len, drop)).await
    }

    /// `read`, the body of a small frame of `len` bytes on the message stream, within
    /// `body_timeout`.
    async fn small_body<T>(
        &self,
        len: usize,
        read: impl std::future::Future<Output = Result<T, ReadFail>>,
    ) -> Result<T, ReadFail> {
        let stall = self.body_timeout;
        tokio::time::timeout(stall, read).await.unwrap_or_else(|_| {
            Err((
                StreamRefusal::Stalled,
                format!("a frame of {len} bytes not whole after {stall:?}"),
            ))
        })
    }

    fn key(&self, header: &FrameHeader) -> MailboxKey {
        MailboxKey {
            comm: header.comm,
            tag: header.tag,
            step: header.step,
            src: self.peer,
        }
    }

    /// A data frame from this peer over this node's `max_frame_bytes` (its sender's limit
    /// is larger), which is refused: its key is marked abandoned, so that its receiver
    /// fails at once ([`TransportError::Abandoned`]) instead of waiting for it until its
    /// deadline, and the pair's later messages under its tag stay in step. True for such a
    /// frame; other refusals leave the table alone.
    fn oversized(&self, header: &FrameHeader, table: &MailboxTable) -> bool {
        let oversized = header.kind == FrameKind::Data && self.only_over_limit(header);
        if oversized {
            debug!(peer = %self.peer, len = header.len, max = self.max_frame, "a data frame over max_frame_bytes: its receive is told it will not come");
            table.abandon(self.key(header));
        }
        oversized
    }

    /// Whether `header` is an RPC request ([`FrameKind::Control`]) from this peer whose
    /// only fault is its size: over this node's `max_frame_bytes` (its sender's limit is
    /// larger) and within the 1 MiB every control frame is held to. It is refused unread,
    /// and passed on as [`ControlFrame::oversized`] so that its caller is answered.
    fn oversized_request(&self, header: &FrameHeader) -> bool {
        header.kind == FrameKind::Control
            && self.only_over_limit(header)
            && header.len <= MAX_CONTROL_FRAME
    }

    /// Whether a frame from this peer (of this protocol version, its source the peer's)
    /// is over this node's `max_frame_bytes`: refused for its size, its sender's limit
    /// being larger, where [`oversized`](Self::oversized) and
    /// [`oversized_request`](Self::oversized_request) tell its receiver or its caller.
    fn only_over_limit(&self, header: &FrameHeader) -> bool {
        header.version == PROTOCOL_VERSION
            && header.src == self.peer.0
            && header.len > self.max_frame
    }

    /// Lets in a data frame of `len` bytes ([`MailboxTable::admit`]), or says why its
    /// stream is to be refused (the frame discarded). A frame waiting for budget stops
    /// waiting when this connection closes; one past the peer's overdraft with no room
    /// left for its marker closes the connection.
    async fn admit(
        &self,
        table: &MailboxTable,
        key: MailboxKey,
        len: usize,
        park: Park,
    ) -> Result<Admitted, StreamRefusal> {
        let gone = async {
            self.conn.closed().await;
        };
        table.admit(key, len, park, gone).await.map_err(|refused| {
            if refused == (Refused::OverBudget { told: false }) {
                // Its receive would wait to its deadline, and every later one of its pair
                // behind it: the peer is that far ahead, and is given up on (its receives
                // here fail with its loss), as the only bound left.
                warn!(peer = %self.peer, "closing the connection: the peer {}", crate::mailbox::OVERDRAFT_BEYOND_MARKERS);
                self.conn.close(
                    quinn::VarInt::from_u32(OVERDRAFT_CODE),
                    crate::mailbox::OVERDRAFT_BEYOND_MARKERS.as_bytes(),
                );
            }
            self.refusal(key, refused)
        })
    }

    /// The refusal a frame's stream is stopped with when the table will not take it.
    fn refusal(&self, key: MailboxKey, refused: Refused) -> StreamRefusal {
        match refused {
            Refused::Duplicate => {
                match self.refused.count() {
                    Some(so_far) => {
                        warn!(peer = %self.peer, ?key, so_far, "discarding a frame for a key already buffered")
                    }
                    None => {
                        debug!(peer = %self.peer, ?key, "discarding a frame for a key already buffered")
                    }
                }
                StreamRefusal::Duplicate
            }
            Refused::Retired => {
                debug!(peer = %self.peer, ?key, "discarding frame for a retired collective");
                StreamRefusal::Retired
            }
            Refused::Abandoned => {
                debug!(peer = %self.peer, ?key, "discarding a frame its sender abandoned");
                StreamRefusal::Retired
            }
            Refused::Closed => StreamRefusal::Shutdown,
            // Its receive is told (the table logged it); a frame on the message stream
            // only, which is skipped, not stopped.
            Refused::OverBudget { told: true } => StreamRefusal::Retired,
            // The connection is closed ([`Connection::admit`]).
            Refused::OverBudget { told: false } => StreamRefusal::Shutdown,
        }
    }

    /// Passes on a frame of another kind than data: relay frames to the relay channel,
    /// heartbeats and control frames to the control channel, abandonment markers to the
    /// mailbox table.
    fn control_frame(&self, header: FrameHeader, payload: Payload) -> ControlFrame {
        ControlFrame {
            from: self.peer,
            header,
            payload: payload.to_bytes(),
            oversized: false,
        }
    }

    async fn deliver(&self, header: FrameHeader, payload: Payload, inbound: &Inbound) {
        if header.kind == FrameKind::Abandoned {
            return inbound.table.abandon(self.key(&header));
        }
        if header.kind == FrameKind::Relay {
            let frame = RelayFrame {
                from: self.peer,
                header,
                payload,
            };
            let _ = inbound.relay.send(frame).await;
            return;
        }
        let frame = self.control_frame(header, payload);
        if header.kind == FrameKind::Heartbeat {
            let _ = inbound.control.try_send(frame);
        } else {
            let _ = inbound.control.send(frame).await;
        }
    }
}

/// One stream's reader counted among those waiting for budget while it lives.
struct ParkedStream<'a> {
    count: &'a AtomicUsize,
    /// How many were counted before this one.
    before: usize,
}

impl<'a> ParkedStream<'a> {
    fn enter(count: &'a AtomicUsize) -> ParkedStream<'a> {
        let before = count.fetch_add(1, Ordering::AcqRel);
        ParkedStream { count, before }
    }
}

impl Drop for ParkedStream<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(crate) type ReadFail = (StreamRefusal, String);

/// How an inbound stream starts.
enum Opening {
    /// With the header of its one frame.
    Frame(FrameHeader),
    /// With [`MESSAGE_STREAM_MARK`]: frames follow one after another.
    Messages,
}

async fn read_opening(stream: &mut quinn::RecvStream) -> Result<Opening, ReadFail> {
    let mut prefix = [0u8; 2];
    stream.read_exact(&mut prefix).await.map_err(|e| {
        (
            StreamRefusal::BadHeader,
            format!("reading header length: {e}"),
        )
    })?;
    if prefix == MESSAGE_STREAM_MARK {
        return Ok(Opening::Messages);
    }
    let n = header_length(prefix)?;
    let mut buf = [0u8; MAX_HEADER_BYTES];
    stream
        .read_exact(&mut buf[..n])
        .await
        .map_err(|e| (StreamRefusal::BadHeader, format!("reading header: {e}")))?;
    decode_header(&buf[..n]).map(Opening::Frame)
}

/// The header length a prefix gives, if a header may have it.
fn header_length(prefix: [u8; 2]) -> Result<usize, ReadFail> {
    let n = u16::from_be_bytes(prefix) as usize;
    if n == 0 || n > MAX_HEADER_BYTES {
        return Err((StreamRefusal::BadHeader, format!("header length {n}")));
    }
    Ok(n)
}

fn decode_header(bytes: &[u8]) -> Result<FrameHeader, ReadFail> {
    FrameHeader::decode(bytes)
        .map_err(|e| (StreamRefusal::BadHeader, format!("decoding header: {e}")))
}

/// A message stream's bytes as QUIC hands them over, cut into frames; payloads are not
/// copied, only a header that straddles two chunks.
struct Frames {
    stream: quinn::RecvStream,
    /// Received and not consumed yet.
    buf: Bytes,
}

impl Frames {
    /// Makes sure `buf` holds something, unless the stream has ended (`false`): finished,
    /// or with its connection, as every message stream does when its connection closes.
    async fn fill(&mut self) -> Result<bool, ReadFail> {
        while self.buf.is_empty() {
            match self.stream.read_chunk(usize::MAX, true).await {
                Ok(Some(c)) => self.buf = c.bytes,
                Ok(None) | Err(quinn::ReadError::ConnectionLost(_)) => return Ok(false),
                Err(e) => return Err((StreamRefusal::LengthMismatch, format!("read failed: {e}"))),
            }
        }
        Ok(true)
    }

    /// Consumes exactly `n` bytes, passing them to `each` in the chunks they arrived in.
    async fn take_with(&mut self, n: usize, mut each: impl FnMut(Bytes)) -> Result<(), ReadFail> {
        let mut got = 0;
        while got < n {
            if !self.fill().await? {
                return Err((
                    StreamRefusal::LengthMismatch,
                    format!("stream ended after {got} of {n} bytes"),
                ));
            }
            let piece = self.buf.split_to((n - got).min(self.buf.len()));
            got += piece.len();
            each(piece);
        }
        Ok(())
    }

    async fn take(&mut self, n: usize) -> Result<Vec<Bytes>, ReadFail> {
        let mut chunks = Vec::new();
        self.take_with(n, |c| chunks.push(c)).await?;
        Ok(chunks)
    }

    /// Copies exactly `out.len()` bytes into `out`.
    async fn take_into(&mut self, out: &mut [u8]) -> Result<(), ReadFail> {
        let mut at = 0;
        self.take_with(out.len(), |c| {
            out[at..at + c.len()].copy_from_slice(&c);
            at += c.len();
        })
        .await
    }

    /// The next frame's header, or `None` if the stream ends before it. Waits for its
    /// first byte without a deadline (between frames), and for the rest within `stall`
    /// ([`StreamRefusal::Stalled`]): a sender writes each header whole.
    async fn header(
        &mut self,
        stall: std::time::Duration,
    ) -> Result<Option<FrameHeader>, ReadFail> {
        if !self.fill().await? {
            return Ok(None);
        }
        let rest = async {
            let mut prefix = [0u8; 2];
            self.take_into(&mut prefix).await?;
            let n = header_length(prefix)?;
            let mut buf = [0u8; MAX_HEADER_BYTES];
            self.take_into(&mut buf[..n]).await?;
            decode_header(&buf[..n]).map(Some)
        };
        tokio::time::timeout(stall, rest).await.unwrap_or_else(|_| {
            Err((
                StreamRefusal::Stalled,
                format!("a header not whole after {stall:?}"),
            ))
        })
    }
}

/// A warning when the UDP receive buffer the kernel granted (as Linux reports it: twice
/// the usable size, the other half being its bookkeeping) cannot hold two send windows:
/// what one peer may have in flight toward this node, and room for a second. Datagrams
/// that overflow it are lost, and each loss costs a retransmission and a stall.
fn receive_buffer_advice(granted: usize, send_window: u32) -> Option<String> {
    let usable = granted / 2;
    let needed = 2 * send_window as usize;
    (usable < needed).then(|| {
        format!(
            "the UDP receive buffer holds {usable} bytes (reported as {granted}), under twice \
             the {send_window}-byte send window: a busy node may drop datagrams (raise \
             net.core.rmem_max to at least {needed}, or lower TransportConfig::send_window)"
        )
    })
}

/// Reads exactly `len` payload bytes and then expects the end of the stream, giving up
/// when no byte comes for `stall`.
async fn read_payload(
    stream: &mut quinn::RecvStream,
    len: usize,
    stall: std::time::Duration,
) -> Result<Vec<Bytes>, ReadFail> {
    let mut chunks = Vec::new();
    read_body(stream, len, stall, |_, c| chunks.push(c)).await?;
    Ok(chunks)
}

/// [`next_body_chunk`], failed as [`StreamRefusal::Stalled`] when nothing comes for
/// `stall`.
async fn stalling(
    stall: std::time::Duration,
    stream: &mut quinn::RecvStream,
    got: usize,
    len: usize,
) -> Result<Option<Bytes>, ReadFail> {
    tokio::time::timeout(stall, next_body_chunk(stream, got, len))
        .await
        .unwrap_or_else(|_| {
            Err((
                StreamRefusal::Stalled,
                format!("no byte for {stall:?} after {got} of {len}"),
            ))
        })
}

/// Reads exactly `len` payload bytes, passing each chunk to `each` with its offset as it
/// arrives, and then expects the end of the stream; gives up when no byte comes for
/// `stall`.
pub(crate) async fn read_body(
    stream: &mut quinn::RecvStream,
    len: usize,
    stall: std::time::Duration,
    mut each: impl FnMut(usize, Bytes),
) -> Result<(), ReadFail> {
    let mut got = 0usize;
    while let Some(chunk) = stalling(stall, stream, got, len).await? {
        let n = chunk.len();
        each(got, chunk);
        got += n;
    }
    Ok(())
}

/// The next chunk of a frame body of `len` bytes of which `got` have been read (at most
/// the `len - got` still due); `None` once all of it has been read and the stream is seen
/// to end there.
pub(crate) async fn next_body_chunk(
    stream: &mut quinn::RecvStream,
    got: usize,
    len: usize,
) -> Result<Option<Bytes>, ReadFail> {
    if got < len {
        return match stream.read_chunk(len - got, true).await {
            Ok(Some(c)) => Ok(Some(c.bytes)),
            Ok(None) => Err((
                StreamRefusal::LengthMismatch,
                format!("stream ended after {got} of {len} bytes"),
            )),
            Err(e) => Err((
                StreamRefusal::LengthMismatch,
                format!("read failed after {got} of {len} bytes: {e}"),
            )),
        };
    }
    match stream.read_chunk(1, true).await {
        Ok(None) => Ok(None),
        Ok(Some(_)) => Err((
            StreamRefusal::LengthMismatch,
            format!("more than the {len} bytes announced"),
        )),
        Err(e) => Err((
            StreamRefusal::LengthMismatch,
            format!("reading end of stream: {e}"),
        )),
    }
}

/// True once `stream` can take no more writes: its receiver stopped it (or the stream or
/// its connection ended). Looked at without waiting.
fn ended(stream: &quinn::SendStream) -> bool {
    use std::future::Future;
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::pin!(stream.stopped()).poll(&mut cx).is_ready()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::net::Ipv4Addr;
    use std::time::{Duration, Instant};
    use tokio::time::timeout;

    use super::*;
    use crate::{ClusterCa, Delivery, MailboxKey};

    /// A payload just under the size handed over as a stream.
    const STREAM_SMALL: usize = STREAM_HANDOVER_BYTES - 1;

    /// Waits (bounded) until `conn`'s MTU discovery has settled at `mtu`; returns the
    /// number of probes it sent.
    async fn probes_to_reach(conn: &Connection, mtu: u16) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let path = conn.quic().stats().path;
            if path.current_mtu == mtu {
                return path.sent_plpmtud_probes;
            }
            assert!(
                Instant::now() < deadline,
                "MTU stuck at {} (wanted {mtu}) after {} probes",
                path.current_mtu,
                path.sent_plpmtud_probes
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Two connected endpoints: `a` dials, `b`'s reader delivers into the returned table
    /// (early-arrival budget `budget`).
    async fn reading_pair(budget: usize) -> (Endpoint, Endpoint, Connection, Arc<MailboxTable>) {
        reading_pair_with(budget, TransportConfig::default(), mpsc::channel(16).0).await
    }

    /// [`reading_pair`] with `a` configured by `sender`, and `b`'s control frames to
    /// `control`.
    async fn reading_pair_with(
        budget: usize,
        sender: TransportConfig,
        control: mpsc::Sender<ControlFrame>,
    ) -> (Endpoint, Endpoint, Connection, Arc<MailboxTable>) {
        let table = Arc::new(MailboxTable::new(budget));
        let inbound = Inbound {
            table: table.clone(),
            control,
            relay: mpsc::channel(16).0,
        };
        let (a, b, conn) = reading_into(inbound, sender).await;
        (a, b, conn, table)
    }

    /// Two connected endpoints: `a` dials (configured by `sender`), `b`'s reader delivers
    /// to `inbound`.
    async fn reading_into(
        inbound: Inbound,
        sender: TransportConfig,
    ) -> (Endpoint, Endpoint, Connection) {
        let (a, b, dialled, _) = reading_both(inbound, sender, TransportConfig::default()).await;
        (a, b, dialled)
    }

    /// [`reading_into`] with `b` configured by `receiver`; also returns `b`'s end of the
    /// connection (the one whose reader delivers to `inbound`).
    async fn reading_both(
        inbound: Inbound,
        sender: TransportConfig,
        receiver: TransportConfig,
    ) -> (Endpoint, Endpoint, Connection, Connection) {
        let ca = ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), sender).unwrap();
        let b = Endpoint::bind(localhost, &ca.issue(NodeId(1)).unwrap(), receiver).unwrap();
        let addr = b.local_addr().unwrap();
        let (dialled, accepted) = tokio::join!(a.connect(addr, NodeId(1)), b.accept());
        let accepted = accepted.unwrap().unwrap();
        accepted.spawn_reader(inbound);
        (a, b, dialled.unwrap(), accepted)
    }

    /// A reading pair (early-arrival budget `budget`, receiver configured by `receiver`)
    /// that also returns the receiving end of the connection.
    async fn reading_pair_seen(
        budget: usize,
        receiver: TransportConfig,
    ) -> (
        Endpoint,
        Endpoint,
        Connection,
        Connection,
        Arc<MailboxTable>,
    ) {
        let table = Arc::new(MailboxTable::new(budget));
        let inbound = inbound_to(&table);
        let (a, b, dialled, accepted) =
            reading_both(inbound, TransportConfig::default(), receiver).await;
        (a, b, dialled, accepted, table)
    }

    /// A connection that began with an admission window lets its peer have at most that
    /// much in flight and unread: with nothing reading its streams (as a node holds a
    /// connection from a node that is not a member), a 1 MiB frame cannot all be sent
    /// until the window is opened, and then it is. A connection without one takes the
    /// whole frame at once.
    #[tokio::test]
    async fn an_unread_connection_holds_no_more_than_its_admission_window() {
        let ca = ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        for admission_window in [None, Some(64 << 10)] {
            let receiver = TransportConfig {
                admission_window,
                ..TransportConfig::default()
            };
            let cfg = TransportConfig::default();
            let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), cfg).unwrap();
            let b = Endpoint::bind(localhost, &ca.issue(NodeId(1)).unwrap(), receiver).unwrap();
            let addr = b.local_addr().unwrap();
            let (dialled, accepted) = tokio::join!(a.connect(addr, NodeId(1)), b.accept());
            let (dialled, accepted) = (dialled.unwrap(), accepted.unwrap().unwrap());
            let mut send = Box::pin(dialled.send(FrameKind::Data, 1, 2, 0, pattern(1 << 20, 1)));
            let early = tokio::time::timeout(Duration::from_millis(500), send.as_mut()).await;
            if admission_window.is_none() {
                early.expect("sent at once").unwrap();
            } else {
                assert!(early.is_err(), "sent past the admission window: {early:?}");
                accepted.open_receive_window();
                tokio::time::timeout(Duration::from_secs(10), send)
                    .await
                    .expect("sent once the window is open")
                    .unwrap();
            }
            a.close();
            b.close();
        }
    }

    /// Waits (bounded) until `ok()` holds; panics with `what` otherwise.
    async fn until(what: &str, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ok() {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// A message stream that arrives with a backlog of small frames is read a share at a
    /// time: the accept loop's first, inline poll returns after `MESSAGES_PER_POLL` frames
    /// (it read the whole backlog, holding up the connection's other streams), and the
    /// rest follow.
    #[tokio::test]
    async fn a_message_stream_backlog_is_read_a_share_at_a_time() {
        use std::future::Future as _;
        let ca = crate::ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from(([127, 0, 0, 1], 0));
        let config = TransportConfig::default;
        let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), config()).unwrap();
        let b = Endpoint::bind(localhost, &ca.issue(NodeId(1)).unwrap(), config()).unwrap();
        let to_b = b.local_addr().unwrap();
        let within = Duration::from_secs(20);
        let (conn, accepted) = timeout(within, async {
            tokio::join!(a.connect(to_b, NodeId(1)), async {
                b.accept().await.unwrap().unwrap()
            })
        })
        .await
        .unwrap();
        let conn = conn.unwrap();
        let frames = 4 * MESSAGES_PER_POLL;
        let mut stream = conn.quic().open_uni().await.unwrap();
        stream.write_all(&MESSAGE_STREAM_MARK).await.unwrap();
        for step in 0..frames as u64 {
            let header = conn.header(FrameKind::Data, 1, 2, step, 4).unwrap();
            stream.write_all(&header).await.unwrap();
            stream.write_all(&[7; 4]).await.unwrap();
        }
        stream.finish().unwrap();
        // Every byte is at the receiver (acknowledged) before its reader starts.
        assert_eq!(
            timeout(within, stream.stopped()).await.unwrap().unwrap(),
            None
        );
        let table = Arc::new(MailboxTable::new(1 << 20));
        let inbound = inbound_to(&table);
        let recv = timeout(within, accepted.quic().accept_uni())
            .await
            .unwrap()
            .unwrap();
        let mut read = Box::pin(accepted.read_stream(recv, inbound));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(read.as_mut().poll(&mut cx).is_pending());
        assert!(
            table.len() < frames,
            "{} frames read in one poll",
            table.len()
        );
        timeout(within, read).await.unwrap();
        assert_eq!(table.len(), frames);
    }

    /// Delivery into `table`, control and relay frames to channels nobody reads.
    fn inbound_to(table: &Arc<MailboxTable>) -> Inbound {
        Inbound {
            table: table.clone(),
            control: mpsc::channel(16).0,
            relay: mpsc::channel(16).0,
        }
    }

    /// The key of the dialling node's (`NodeId(0)`) data frame of step `step` under
    /// channel 1, tag 2.
    fn dialler_key(step: u64) -> MailboxKey {
        MailboxKey {
            comm: 1,
            tag: 2,
            step,
            src: NodeId(0),
        }
    }

    /// Small frames on the message stream past the early-arrival budget take their
    /// sender's overdraft; past that they are dropped (read on, not stopped) and their
    /// receives fail at once, and the frames behind them are read on. They used to be kept
    /// without budget however many came: a peer could grow this node's memory without
    /// bound with messages nobody receives.
    #[tokio::test]
    async fn small_frames_past_the_budget_and_the_overdraft_are_dropped_and_their_receives_told() {
        const CHARGE: usize = crate::EARLY_FRAME_MIN_CHARGE;
        let table = Arc::new(MailboxTable::new(2 * CHARGE).with_overdraft(2 * CHARGE));
        let (_a, _b, conn) = reading_into(inbound_to(&table), TransportConfig::default()).await;
        let within = Duration::from_secs(20);
        let key = dialler_key;
        for step in 0..8u64 {
            conn.send(FrameKind::Data, 1, 2, step, pattern(100, step as u8))
                .await
                .unwrap();
        }
        // Every frame is seen, kept or marked: 4 within the budget and the overdraft.
        until("the frames were not all read", || {
            (0..8).all(|s| table.is_ready(&key(s)) || table.is_abandoned(&key(s)))
        })
        .await;
        for step in 0..4 {
            let got = timeout(within, table.take(key(step), within))
                .await
                .unwrap();
            assert!(
                got.unwrap().to_bytes() == pattern(100, step as u8),
                "frame {step}"
            );
        }
        for step in 4..8 {
            let got = timeout(within / 4, table.take(key(step), within))
                .await
                .unwrap();
            assert!(
                matches!(got, Err(TransportError::Abandoned { .. })),
                "frame {step}: {got:?}"
            );
        }
        // Taken, the kept frames gave their budget and overdraft back: the stream was
        // read on, and takes the next one.
        conn.send(FrameKind::Data, 1, 2, 8, pattern(100, 8))
            .await
            .unwrap();
        let got = timeout(within, table.take(key(8), within)).await.unwrap();
        assert!(got.unwrap().to_bytes() == pattern(100, 8));
        assert_eq!(table.budget_available(), 2 * CHARGE);
    }

    /// A peer so far ahead on the message stream that the frames dropped past its
    /// overdraft find no room for their markers is given up on: its connection is closed
    /// with the reason (its receives here then fail with its loss), rather than a receive
    /// left waiting to its deadline, and its pair on that message for good.
    #[tokio::test]
    async fn a_peer_past_its_overdraft_and_its_markers_is_disconnected() {
        const CHARGE: usize = crate::EARLY_FRAME_MIN_CHARGE;
        let table = Arc::new(MailboxTable::new(CHARGE).with_overdraft(CHARGE));
        let key = dialler_key;
        for step in 0..crate::ABANDONED_MARKERS_PER_PEER as u64 {
            table.abandon(key(1000 + step));
        }
        let (_a, _b, conn) = reading_into(inbound_to(&table), TransportConfig::default()).await;
        // One within the budget, one on the overdraft, one past both.
        for step in 0..3u64 {
            // A send may fail once the close arrives.
            let _ = conn
                .send(FrameKind::Data, 1, 2, step, pattern(100, step as u8))
                .await;
        }
        let closed = timeout(Duration::from_secs(20), conn.quic().closed())
            .await
            .expect("the connection was not closed");
        assert!(
            matches!(&closed, quinn::ConnectionError::ApplicationClosed(c)
                if c.reason.as_ref() == crate::mailbox::OVERDRAFT_BEYOND_MARKERS.as_bytes()),
            "{closed}"
        );
        // Not a clean close: the peer is reported lost, not gone by its choice.
        assert!(
            !conn.closed().await.1,
            "a close past the overdraft reads as graceful"
        );
        assert!(table.is_ready(&key(0)) && table.is_ready(&key(1)));
    }

    /// Mesh connections take no QUIC datagrams (nexar sends none; a peer's would be
    /// buffered, each holding its whole packet).
    #[tokio::test]
    async fn mesh_connections_take_no_datagrams() {
        let (_a, _b, conn, accepted, _table) =
            reading_pair_seen(1024, TransportConfig::default()).await;
        assert_eq!(conn.conn.max_datagram_size(), None);
        assert_eq!(accepted.conn.max_datagram_size(), None);
    }

    /// A data frame larger than the whole early-arrival budget, which nobody asks for,
    /// waits for its receiver on its stream; when the connection ends, its reader stops
    /// and forgets the frame (it used to wait for good, holding its task and slot).
    #[tokio::test]
    async fn a_data_frame_waiting_for_budget_is_let_go_when_its_connection_ends() {
        let (a, b, conn, accepted, table) =
            reading_pair_seen(1024, TransportConfig::default()).await;
        conn.send(FrameKind::Data, 1, 2, 0, pattern(200 << 10, 1))
            .await
            .unwrap();
        let parked = || accepted.parked_streams.load(Ordering::Acquire);
        until("the frame never waited for budget", || parked() == 1).await;
        assert!(!table.is_empty());
        conn.close("done");
        until("the reader still waits after the connection closed", || {
            parked() == 0
        })
        .await;
        until("the frame's slot was left behind", || table.is_empty()).await;
        a.close();
        b.close();
    }

    /// Frames a peer has refused are counted on its connection's throttle, so that a peer
    /// sending malformed streams without end has the first few warned of and then one in
    /// `EVENTS_PER_SUMMARY` (every refusal used to be a warning).
    #[tokio::test]
    async fn refused_frames_are_warned_of_through_the_connections_throttle() {
        let (a, b, conn, accepted, _table) =
            reading_pair_seen(1024, TransportConfig::default()).await;
        let malformed = 40;
        for _ in 0..malformed {
            let mut stream = conn.quic().open_uni().await.unwrap();
            stream.write_all(&[0xff; 8]).await.unwrap();
            stream.finish().unwrap();
        }
        until("not every malformed stream was refused", || {
            accepted.refused.counted() == malformed
        })
        .await;
        a.close();
        b.close();
    }

    /// A control frame waiting, unread, for room in the node's full control queue is let
    /// go when its connection ends (it used to wait for room however long that took).
    #[tokio::test]
    async fn a_control_frame_waiting_for_room_is_let_go_when_its_connection_ends() {
        let (control, queue) = mpsc::channel(1);
        let (a, b, conn, _table) =
            reading_pair_with(1024, TransportConfig::default(), control.clone()).await;
        for tag in [2, 3] {
            conn.send(
                FrameKind::Control,
                1,
                tag,
                0,
                Bytes::from_static(b"request"),
            )
            .await
            .unwrap();
        }
        until("the first frame never filled the queue", || {
            control.capacity() == 0
        })
        .await;
        // This test's sender, the reader's, and the second frame's task's (its own and the
        // one it waits for room with).
        let senders = || control.strong_count();
        until("the second frame never waited for room", || senders() >= 3).await;
        conn.close("done");
        until(
            "the frame still waits for room after its connection ended",
            || senders() == 1,
        )
        .await;
        drop(queue);
        a.close();
        b.close();
    }

    /// Half of a data frame of `len` bytes, then nothing, on a stream of its own or on a
    /// message stream: the receiver, with a `body_timeout` of 300 ms, stops the stream as
    /// stalled, the budget the frame took comes back, and the sender's next frame arrives.
    /// Waits (10 s at most) until the receiver stops `stream`, and checks that it did so
    /// for `why`.
    async fn stopped_for(stream: &mut quinn::SendStream, why: StreamRefusal, what: &str) {
        let code = timeout(Duration::from_secs(10), stream.stopped())
            .await
            .unwrap_or_else(|_| panic!("{what}"))
            .unwrap();
        assert_eq!(code, Some(why.code()));
    }

    /// The frame of step 0 was let go: its budget came back (within 10 s) and it is not
    /// kept.
    async fn let_go(table: &MailboxTable, budget: usize) {
        until("the frame's budget never came back", || {
            table.budget_available() == budget
        })
        .await;
        assert!(!table.is_ready(&data_key(0)));
    }

    /// The sender's next frame (step 1, of `len` bytes) arrives whole: the connection
    /// reads on.
    async fn next_frame_arrives(conn: &Connection, table: &MailboxTable, len: usize) {
        let next = pattern(len, 2);
        conn.send(FrameKind::Data, 1, 2, 1, next.clone())
            .await
            .unwrap();
        assert!(taken(table, 1).await.unwrap() == next);
    }

    async fn a_stalled_frame_is_given_up(len: usize, on_message_stream: bool) {
        let budget = 1 << 20;
        let receiver = TransportConfig {
            body_timeout: Duration::from_millis(300),
            ..TransportConfig::default()
        };
        let (a, b, conn, _accepted, table) = reading_pair_seen(budget, receiver).await;
        let mut stream = conn.quic().open_uni().await.unwrap();
        let mut bytes = if on_message_stream {
            MESSAGE_STREAM_MARK.to_vec()
        } else {
            Vec::new()
        };
        let whole = frame(0, &vec![7u8; len]);
        bytes.extend_from_slice(&whole[..whole.len() / 2]);
        stream.write_all(&bytes).await.unwrap();
        until("the frame never took budget", || {
            table.budget_available() < budget
        })
        .await;
        let what = "the stalled frame was never given up";
        stopped_for(&mut stream, StreamRefusal::Stalled, what).await;
        let_go(&table, budget).await;
        next_frame_arrives(&conn, &table, 100 << 10).await;
        a.close();
        b.close();
    }

    /// A frame whose body brings no new byte for the receiver's `body_timeout` while it is
    /// read is given up and its budget freed (a peer that stalled mid-frame held it until
    /// its connection ended, which keep-alives may never let happen).
    #[tokio::test]
    async fn a_frame_whose_body_stalls_is_given_up_and_its_budget_freed() {
        a_stalled_frame_is_given_up(100 << 10, false).await;
    }

    /// A small frame on the shared message stream that does not come whole within the
    /// receiver's `body_timeout` is given up too (the whole message stream is stopped; the
    /// sender's next frame goes on a new one).
    #[tokio::test]
    async fn a_small_frame_that_stalls_stops_the_message_stream_and_frees_its_budget() {
        a_stalled_frame_is_given_up(40 << 10, true).await;
    }

    /// A header on the message stream that does not come whole within the receiver's
    /// `body_timeout` stops the stream (its reader waited without a deadline once the
    /// header's first byte was in), and the sender's next frame goes on a new one.
    #[tokio::test]
    async fn a_header_that_stalls_stops_the_message_stream() {
        let receiver = TransportConfig {
            body_timeout: Duration::from_millis(300),
            ..TransportConfig::default()
        };
        let (a, b, conn, _accepted, table) = reading_pair_seen(1 << 20, receiver).await;
        let mut stream = conn.quic().open_uni().await.unwrap();
        let mut bytes = MESSAGE_STREAM_MARK.to_vec();
        bytes.extend_from_slice(&frame(0, b"x")[..3]);
        stream.write_all(&bytes).await.unwrap();
        let what = "the stalled header was waited for without end";
        stopped_for(&mut stream, StreamRefusal::Stalled, what).await;
        next_frame_arrives(&conn, &table, 100).await;
        a.close();
        b.close();
    }

    /// A heartbeat with a payload is refused on its header, as a marker with one is: it
    /// was read whole with no budget (up to 1 MiB each) and queued for the node.
    #[tokio::test]
    async fn a_heartbeat_with_a_payload_is_refused_on_its_header() {
        let (a, b, conn, _accepted, table) =
            reading_pair_seen(1 << 20, TransportConfig::default()).await;
        let mut stream = conn.quic().open_uni().await.unwrap();
        let mut bytes = MESSAGE_STREAM_MARK.to_vec();
        bytes.extend_from_slice(&FrameHeader::new(FrameKind::Heartbeat, 0, 0, 0, 0, 4).encode());
        bytes.extend_from_slice(b"beat");
        stream.write_all(&bytes).await.unwrap();
        let what = "the heartbeat with a payload was read";
        stopped_for(&mut stream, StreamRefusal::FrameTooLarge, what).await;
        next_frame_arrives(&conn, &table, 100).await;
        a.close();
        b.close();
    }

    /// A frame whose tag retires while it is read is refused as soon as more of it comes
    /// (its sender stopped with `Retired`), and its budget freed: nothing would take it,
    /// and it used to be read to its end (up to `max_frame_bytes`, held whole) only to be
    /// dropped, or to wait out the body timeout when its sender stalled.
    #[tokio::test]
    async fn a_frame_whose_tag_retires_while_it_is_read_is_refused() {
        let budget = 1 << 20;
        let (a, b, conn, _accepted, table) =
            reading_pair_seen(budget, TransportConfig::default()).await;
        let mut stream = conn.quic().open_uni().await.unwrap();
        let whole = frame(0, &vec![7u8; 512 << 10]);
        stream.write_all(&whole[..100 << 10]).await.unwrap();
        until("the frame never took budget", || {
            table.budget_available() < budget
        })
        .await;
        table.retire(1, 2);
        // The rest of the frame, as a sender that has not heard yet would write it.
        let rest = stream.write_all(&whole[100 << 10..]);
        let _ = timeout(Duration::from_secs(10), rest).await;
        let what = "the frame of a retired tag was read on";
        stopped_for(&mut stream, StreamRefusal::Retired, what).await;
        let_go(&table, budget).await;
        a.close();
        b.close();
    }

    /// A data frame over the receiver's `max_frame_bytes` (its sender's limit is larger)
    /// is refused on its header and its key marked abandoned: its receive fails at once
    /// instead of waiting for its deadline, on a stream of its own as on the message
    /// stream (which is read on past it), and the next frame arrives.
    #[tokio::test]
    async fn a_data_frame_over_the_receivers_limit_fails_its_receive_at_once() {
        let receiver = TransportConfig {
            max_frame_bytes: 4096,
            ..TransportConfig::default()
        };
        let (a, b, conn, _accepted, table) = reading_pair_seen(64 << 20, receiver).await;
        let abandoned = |r: Result<Delivery, TransportError>| {
            matches!(r, Err(TransportError::Abandoned { peer: NodeId(0) }))
        };
        // On the message stream, then on a stream of its own.
        for (step, len) in [(0u64, 8192usize), (2, 200 << 10)] {
            let rx = waiting_receiver(&table, data_key(step)).await;
            // The send itself may fail (its stream is refused) or not.
            let _ = conn
                .send(FrameKind::Data, 1, 2, step, pattern(len, 1))
                .await;
            let got = timeout(Duration::from_secs(10), rx)
                .await
                .expect("the receive waited for a refused frame")
                .unwrap();
            assert!(abandoned(got), "{len} bytes");
            let next = pattern(100, 2);
            conn.send(FrameKind::Data, 1, 2, step + 1, next.clone())
                .await
                .unwrap();
            assert!(taken(&table, step + 1).await.unwrap() == next);
        }
        assert!(table.is_empty());
        a.close();
        b.close();
    }

    /// A receiver that gives up just as its message is handed over as a stream loses that
    /// message (the stream is refused): the next receiver of its key is told so at once
    /// instead of waiting for it until its deadline (and every later one under its tag
    /// after it).
    #[tokio::test]
    async fn a_stream_handed_to_a_receiver_that_gave_up_leaves_a_marker() {
        use std::future::Future as _;
        let (_a, _b, conn, table) = reading_pair(64 << 20).await;
        let key = data_key(0);
        let mut take = Box::pin(table.take_delivery(key, Duration::from_secs(20)));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(take.as_mut().poll(&mut cx).is_pending());
        let frame = pattern(4 << 20, 5);
        let send = tokio::spawn(async move { conn.send(FrameKind::Data, 1, 2, 0, frame).await });
        // Handed over: the slot is gone, the stream waits in the receiver's channel.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !table.is_empty() {
            assert!(Instant::now() < deadline, "the frame was never handed over");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(take);
        assert!(table.is_abandoned(&key));
        match table.take_delivery(key, Duration::from_secs(5)).await {
            Err(TransportError::Abandoned { peer }) => assert_eq!(peer, NodeId(0)),
            other => panic!("expected the marker, got {:?}", other.map(|_| ())),
        }
        assert!(table.is_empty());
        let _ = tokio::time::timeout(Duration::from_secs(10), send)
            .await
            .expect("the send ends");
    }

    /// Two connected endpoints whose reader delivers into a table with `early` bytes of
    /// early-arrival budget and `relay` of relay budget, and relay frames to the returned
    /// channel (which nothing drains but the test).
    async fn relay_reading(
        early: usize,
        relay: usize,
    ) -> (
        Endpoint,
        Endpoint,
        Connection,
        Arc<MailboxTable>,
        mpsc::Receiver<RelayFrame>,
    ) {
        let table = Arc::new(MailboxTable::new(early).with_relay_budget(relay));
        let (relay_tx, relayed) = mpsc::channel(64);
        let inbound = Inbound {
            table: table.clone(),
            control: mpsc::channel(16).0,
            relay: relay_tx,
        };
        let (a, b, conn) = reading_into(inbound, TransportConfig::default()).await;
        (a, b, conn, table, relayed)
    }

    /// Relay frames waiting for relay budget keep their streams' places among those a peer
    /// may open; past half of them (`max_streams` 32: 16), a relay frame is read without
    /// budget, so the peer can still open streams for everything else.
    #[tokio::test]
    async fn past_half_the_streams_waiting_a_relay_frame_is_read_without_budget() {
        let within = Duration::from_secs(10);
        let budget = 1 << 20;
        let (_a, _b, conn, table, mut relayed) = relay_reading(64 << 20, budget).await;
        assert_eq!(TransportConfig::default().max_streams, 32);
        let frame = |i: u8| pattern(600 << 10, i);
        conn.send(FrameKind::Relay, 0, 0, 0, frame(0))
            .await
            .unwrap();
        let held = timeout(within, relayed.recv()).await.unwrap().unwrap();
        // 16 wait for the budget the first one holds; the 17th is read without it.
        for i in 1..=17 {
            conn.send(FrameKind::Relay, 0, 0, 0, frame(i))
                .await
                .unwrap();
        }
        let over = timeout(within, relayed.recv()).await.unwrap().unwrap();
        assert!((1..=17).any(|i| over.payload.to_bytes() == frame(i)));
        assert!(
            timeout(Duration::from_millis(300), relayed.recv())
                .await
                .is_err(),
            "more than one relay frame was read past the relay budget"
        );
        // Budget freed: the 16 waiting are read in turn.
        drop((held, over));
        for _ in 0..16 {
            drop(timeout(within, relayed.recv()).await.unwrap().unwrap());
        }
        assert_eq!(table.relay_budget_available(0), budget);
    }

    /// Data frames waiting for early-arrival budget count too: with half a peer's streams
    /// waiting for that, its relay frame is read without relay budget.
    #[tokio::test]
    async fn streams_waiting_for_early_budget_count_towards_reading_relay_frames_anyway() {
        let within = Duration::from_secs(10);
        let budget = 1 << 20;
        let (_a, _b, conn, table, mut relayed) = relay_reading(1024, budget).await;
        conn.send(FrameKind::Relay, 0, 0, 0, pattern(budget, 0))
            .await
            .unwrap();
        let held = timeout(within, relayed.recv()).await.unwrap().unwrap();
        // 16 data frames nobody asks for, each on its own stream and over the budget.
        for step in 0..16 {
            let frame = pattern(100 << 10, step as u8);
            conn.send(FrameKind::Data, 1, 2, step, frame).await.unwrap();
        }
        let deadline = Instant::now() + within;
        while table.len() < 16 {
            assert!(Instant::now() < deadline, "the data frames never arrived");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let late = pattern(4096, 9);
        conn.send(FrameKind::Relay, 0, 0, 0, late.clone())
            .await
            .unwrap();
        let got = timeout(within, relayed.recv()).await.unwrap().unwrap();
        assert!(got.payload.to_bytes() == late);
        assert_eq!(table.relay_budget_available(0), 0);
        drop((held, got));
        assert_eq!(table.relay_budget_available(0), budget);
    }

    /// A relay frame is read only once the relay budget of its hop count has room for it
    /// (a frame larger than the whole budget, once all of it is free), and holds its share
    /// until dropped: what neighbours relay to a node that does not pass it on is not
    /// taken in. Frames of another hop count are not held up by it.
    #[tokio::test]
    async fn relay_frames_wait_for_the_relay_budget_before_they_are_read() {
        let within = Duration::from_secs(10);
        let budget = 1 << 20;
        let (_a, _b, conn, table, mut relayed) = relay_reading(64 << 20, budget).await;
        let first = pattern(600 << 10, 1);
        conn.send(FrameKind::Relay, 0, 0, 0, first.clone())
            .await
            .unwrap();
        let got = timeout(within, relayed.recv()).await.unwrap().unwrap();
        assert!(got.payload.to_bytes() == first);
        assert_eq!(table.relay_budget_available(0), budget - first.len());
        // The second does not fit beside the first, which is still held.
        let second = pattern(600 << 10, 2);
        conn.send(FrameKind::Relay, 0, 0, 0, second.clone())
            .await
            .unwrap();
        assert!(
            timeout(Duration::from_millis(300), relayed.recv())
                .await
                .is_err(),
            "a relay frame was read past the relay budget"
        );
        // A frame that passed one relay more has a budget of its own.
        let further = pattern(600 << 10, 4);
        conn.send(FrameKind::Relay, 0, 0, 1, further.clone())
            .await
            .unwrap();
        let got_further = timeout(within, relayed.recv()).await.unwrap().unwrap();
        assert!(got_further.payload.to_bytes() == further);
        assert_eq!(got_further.header.step, 1);
        assert_eq!(table.relay_budget_available(1), budget - further.len());
        drop(got_further);
        drop(got);
        let got = timeout(within, relayed.recv()).await.unwrap().unwrap();
        assert!(got.payload.to_bytes() == second);
        assert_eq!(table.relay_budget_available(0), budget - second.len());
        // Larger than the whole budget: read once all of it is free, holding all of it.
        let large = pattern(budget + 4096, 3);
        conn.send(FrameKind::Relay, 0, 0, 0, large.clone())
            .await
            .unwrap();
        drop(got);
        let got = timeout(within, relayed.recv()).await.unwrap().unwrap();
        assert!(got.payload.to_bytes() == large);
        assert_eq!(table.relay_budget_available(0), 0);
        drop(got);
        assert_eq!(table.relay_budget_available(0), budget);
    }

    fn data_key(step: u64) -> MailboxKey {
        MailboxKey {
            comm: 1,
            tag: 2,
            step,
            src: NodeId(0),
        }
    }

    fn pattern(len: usize, seed: u8) -> Bytes {
        (0..len)
            .map(|i| (i % 251) as u8 ^ seed)
            .collect::<Vec<u8>>()
            .into()
    }

    /// Starts `take_delivery(key)` on its own task and waits (bounded) until it waits.
    async fn waiting_receiver(
        table: &Arc<MailboxTable>,
        key: MailboxKey,
    ) -> tokio::task::JoinHandle<Result<Delivery, TransportError>> {
        let t = table.clone();
        let rx = tokio::spawn(async move { t.take_delivery(key, Duration::from_secs(20)).await });
        let deadline = Instant::now() + Duration::from_secs(10);
        while table.is_empty() {
            assert!(Instant::now() < deadline, "receiver never registered");
            tokio::task::yield_now().await;
        }
        rx
    }

    #[tokio::test]
    async fn a_large_frame_goes_to_its_waiting_receiver_as_a_stream() {
        let budget = 64 << 20;
        let (a, b, conn, table) = reading_pair(budget).await;
        let rx = waiting_receiver(&table, data_key(0)).await;
        let sent = pattern(4 << 20, 1);
        conn.send(FrameKind::Data, 1, 2, 0, sent.clone())
            .await
            .unwrap();
        let delivery = rx.await.unwrap().unwrap();
        assert!(delivery.is_streamed());
        assert_eq!(delivery.len(), sent.len());
        // Handed over: the mailbox is gone and no budget was ever taken for it.
        assert!(table.is_empty());
        assert_eq!(table.budget_available(), budget);
        let mut got = vec![0u8; sent.len()];
        delivery.copy_into(&mut got).await.unwrap();
        assert!(got == sent[..], "streamed payload differs");
        a.close();
        b.close();
    }

    #[tokio::test]
    async fn a_streamed_payload_is_taken_piece_by_piece_as_it_arrives() {
        let (a, b, conn, table) = reading_pair(64 << 20).await;
        let rx = waiting_receiver(&table, data_key(0)).await;
        let sent = pattern(1 << 20, 9);
        let half = sent.len() / 2;
        // Only the first half is produced until the receiver has taken it.
        let (tx, pieces) = mpsc::unbounded_channel();
        tx.send(sent.slice(..half)).unwrap();
        let sending = conn.send_streamed(FrameKind::Data, 1, 2, 0, sent.len(), pieces);
        let receiving = async {
            let mut delivery = rx.await.unwrap().unwrap();
            assert!(delivery.is_streamed());
            let mut got = Vec::new();
            while got.len() < half {
                let next = tokio::time::timeout(Duration::from_secs(10), delivery.next_chunk());
                let chunk = next.await.expect("first half in time").unwrap();
                got.extend_from_slice(&chunk.expect("a piece of the first half"));
            }
            assert_eq!(got.len(), half, "more than was sent");
            tx.send(sent.slice(half..)).unwrap();
            let in_time = Duration::from_secs(10);
            loop {
                let next = tokio::time::timeout(in_time, delivery.next_chunk());
                match next.await.expect("the rest in time").unwrap() {
                    Some(chunk) => got.extend_from_slice(&chunk),
                    None => break,
                }
            }
            let end = tokio::time::timeout(in_time, delivery.next_chunk());
            assert!(end.await.expect("its end in time").unwrap().is_none());
            got
        };
        let (sent_res, got) = tokio::join!(sending, receiving);
        sent_res.unwrap();
        assert!(got == sent[..], "pieces differ from the payload");
        a.close();
        b.close();
    }

    #[tokio::test]
    async fn a_receiver_that_comes_while_a_large_frame_is_read_takes_the_rest_as_a_stream() {
        let budget = 64 << 20;
        let (a, b, conn, table) = reading_pair(budget).await;
        let key = data_key(0);
        let sent = pattern(2 << 20, 7);
        let half = sent.len() / 2;
        // The first half goes out before anyone waits; the second once a receiver does.
        let (tx, pieces) = mpsc::unbounded_channel();
        tx.send(sent.slice(..half)).unwrap();
        let sending = conn.send_streamed(FrameKind::Data, 1, 2, 0, sent.len(), pieces);
        let receiving = async {
            let deadline = Instant::now() + Duration::from_secs(10);
            // Admitted as an early arrival: its budget is taken and it is being read.
            while table.budget_available() == budget {
                assert!(Instant::now() < deadline, "frame never admitted");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let t = table.clone();
            let rx =
                tokio::spawn(async move { t.take_delivery(key, Duration::from_secs(20)).await });
            // Registered, or already handed the stream by a chunk of the first half that
            // arrived after it registered (the mailbox is then gone).
            while !(table.has_waiter(&key) || table.is_empty()) {
                assert!(Instant::now() < deadline, "receiver never registered");
                tokio::task::yield_now().await;
            }
            tx.send(sent.slice(half..)).unwrap();
            let delivery = rx.await.unwrap().unwrap();
            assert!(
                delivery.is_streamed(),
                "read whole although its receiver came"
            );
            assert_eq!(delivery.len(), sent.len());
            // The receiver has the frame: nothing of it counts as an early arrival now.
            assert!(table.is_empty());
            assert_eq!(table.budget_available(), budget);
            // Copied by a routine of the caller's, which sees every piece in order, each
            // with a destination of its own length.
            let mut got = vec![0u8; sent.len()];
            let (mut pieces, mut copied) = (0, 0);
            let copy = |to: &mut [u8], piece: &[u8]| {
                assert_eq!(to.len(), piece.len());
                to.copy_from_slice(piece);
                pieces += 1;
                copied += piece.len();
            };
            delivery.copy_into_with(&mut got, copy).await.unwrap();
            assert_eq!(copied, sent.len());
            assert!(pieces > 1, "a streamed frame came as one piece");
            got
        };
        let (sent_res, got) = tokio::join!(sending, receiving);
        sent_res.unwrap();
        assert!(
            got == sent[..],
            "what was read before and after the hand-over differs"
        );
        a.close();
        b.close();
    }

    #[tokio::test]
    async fn small_frames_and_early_arrivals_are_delivered_whole() {
        let budget = 64 << 20;
        let (a, b, conn, table) = reading_pair(budget).await;
        // Small, with a receiver waiting: read whole.
        let rx = waiting_receiver(&table, data_key(0)).await;
        let small = pattern(STREAM_SMALL, 2);
        conn.send(FrameKind::Data, 1, 2, 0, small.clone())
            .await
            .unwrap();
        let delivery = rx.await.unwrap().unwrap();
        assert!(!delivery.is_streamed());
        let mut got = vec![0u8; small.len()];
        delivery.copy_into(&mut got).await.unwrap();
        assert!(got == small[..]);
        // Large, arriving whole before anyone waits: buffered whole within the budget.
        let early = pattern(2 << 20, 3);
        conn.send(FrameKind::Data, 1, 2, 1, early.clone())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !table.is_ready(&data_key(1)) {
            assert!(Instant::now() < deadline, "early frame never buffered");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let delivery = table
            .take_delivery(data_key(1), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(!delivery.is_streamed());
        let mut got = vec![0u8; early.len()];
        delivery.copy_into(&mut got).await.unwrap();
        assert!(got == early[..]);
        a.close();
        b.close();
    }

    #[tokio::test]
    async fn a_streamed_frame_that_does_not_fit_is_a_length_error_and_the_next_arrives() {
        let (a, b, conn, table) = reading_pair(64 << 20).await;
        let rx = waiting_receiver(&table, data_key(0)).await;
        conn.send(FrameKind::Data, 1, 2, 0, pattern(1 << 20, 4))
            .await
            .unwrap();
        let delivery = rx.await.unwrap().unwrap();
        assert!(delivery.is_streamed());
        let mut short = vec![0u8; 512 << 10];
        match delivery.copy_into(&mut short).await {
            Err(TransportError::LengthMismatch { expected, actual }) => {
                assert_eq!((expected, actual), (512 << 10, 1 << 20));
            }
            other => panic!("expected a length mismatch, got {other:?}"),
        }
        // The connection carries on: the next frame, streamed too, arrives intact.
        let rx = waiting_receiver(&table, data_key(1)).await;
        let next = pattern(1 << 20, 5);
        conn.send(FrameKind::Data, 1, 2, 1, next.clone())
            .await
            .unwrap();
        let delivery = rx.await.unwrap().unwrap();
        let mut got = vec![0u8; next.len()];
        delivery.copy_into(&mut got).await.unwrap();
        assert!(got == next[..]);
        a.close();
        b.close();
    }

    #[tokio::test]
    async fn a_streamed_send_arrives_whole_and_a_short_producer_fails_it() {
        let (a, b, conn, table) = reading_pair(64 << 20).await;
        // Produced in pieces while sent: arrives as one frame.
        let sent = pattern(3 << 20, 6);
        let (tx, rx) = mpsc::unbounded_channel();
        for piece in sent.chunks(1 << 20) {
            tx.send(Bytes::copy_from_slice(piece)).unwrap();
        }
        drop(tx);
        conn.send_streamed(FrameKind::Data, 1, 2, 0, sent.len(), rx)
            .await
            .unwrap();
        let got = table
            .take(data_key(0), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(got.to_bytes() == sent, "streamed frame differs");
        // A producer that stops short: the send fails and the stream is reset, so the
        // receiver never gets a partial frame; the connection carries on.
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(pattern(1 << 20, 7)).unwrap();
        drop(tx);
        let short = conn
            .send_streamed(FrameKind::Data, 1, 2, 1, 2 << 20, rx)
            .await;
        assert!(
            matches!(short, Err(TransportError::Send { .. })),
            "{short:?}"
        );
        let next = pattern(4096, 8);
        conn.send(FrameKind::Data, 1, 2, 2, next.clone())
            .await
            .unwrap();
        let got = table
            .take(data_key(2), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(got.to_bytes() == next);
        never_arrives(&table, 1).await;
        // A producer that carries more than announced, the extra starting right at the
        // announced end (so no chunk crosses it): the send fails, and the frame, all of
        // whose announced bytes went out, is discarded at the reset.
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(pattern(4096, 9)).unwrap();
        tx.send(pattern(1, 10)).unwrap();
        drop(tx);
        let long = conn.send_streamed(FrameKind::Data, 1, 2, 3, 4096, rx).await;
        assert!(matches!(long, Err(TransportError::Send { .. })), "{long:?}");
        never_arrives(&table, 3).await;
        a.close();
        b.close();
    }

    /// Frames that every receiver refuses on their header (a marker or farewell with a
    /// payload, a lane-only kind over QUIC, a control frame over 1 MiB) are refused by the
    /// sender before any byte goes out: on the message stream, the receiver's refusal
    /// would have stopped the stream and lost the frames queued behind it, each of whose
    /// sends had returned `Ok`.
    #[tokio::test]
    async fn frames_every_receiver_refuses_are_never_sent() {
        let (a, b, conn, table) = reading_pair(64 << 20).await;
        for (kind, len) in [
            (FrameKind::Abandoned, 1),
            (FrameKind::Farewell, 1),
            (FrameKind::Announce, 0),
            (FrameKind::Clear, 0),
            (FrameKind::Credit, 0),
            (FrameKind::Control, (1 << 20) + 1),
            (FrameKind::Heartbeat, 1),
            (FrameKind::Heartbeat, (1 << 20) + 1),
        ] {
            let sent = conn.send(kind, 1, 2, 0, pattern(len, 1)).await;
            assert!(
                matches!(&sent, Err(TransportError::Send { reason, .. }) if reason.contains("refuses")),
                "{kind:?} of {len} bytes: {sent:?}"
            );
        }
        assert_eq!(
            conn.messages_opened.load(Ordering::Relaxed),
            0,
            "nothing sent"
        );
        // The same kinds within their rules go, and the message stream carries on.
        conn.send(FrameKind::Abandoned, 1, 2, 0, Bytes::new())
            .await
            .unwrap();
        let next = pattern(4096, 2);
        conn.send(FrameKind::Data, 1, 2, 1, next.clone())
            .await
            .unwrap();
        assert!(taken(&table, 1).await.unwrap() == next);
        assert_eq!(
            conn.messages_opened.load(Ordering::Relaxed),
            1,
            "one stream"
        );
        a.close();
        b.close();
    }

    /// Step `step`'s frame is not there to take, nor does it arrive within 200 ms.
    async fn never_arrives(table: &MailboxTable, step: u64) {
        assert!(matches!(
            table.take(data_key(step), Duration::from_millis(200)).await,
            Err(TransportError::Timeout(_))
        ));
    }

    /// Takes `step`'s payload (bounded) as bytes.
    async fn taken(table: &MailboxTable, step: u64) -> Result<Bytes, TransportError> {
        let got = table.take(data_key(step), Duration::from_secs(10)).await?;
        Ok(got.to_bytes())
    }

    /// A frame as a sender writes it: header, then payload.
    fn frame(step: u64, payload: &[u8]) -> Vec<u8> {
        let mut bytes =
            FrameHeader::new(FrameKind::Data, 1, 2, step, 0, payload.len() as u64).encode();
        bytes.extend_from_slice(payload);
        bytes
    }

    #[tokio::test]
    async fn small_frames_share_one_stream_and_large_ones_get_their_own() {
        let (a, b, conn, table) = reading_pair(64 << 20).await;
        let small: Vec<Bytes> = (0..64).map(|i| pattern(100 + 997 * i, i as u8)).collect();
        for (step, payload) in small.iter().enumerate() {
            conn.send(FrameKind::Data, 1, 2, step as u64, payload.clone())
                .await
                .unwrap();
        }
        for (step, payload) in small.iter().enumerate() {
            assert!(taken(&table, step as u64).await.unwrap() == payload);
        }
        // One stream for all 64: the receiver never had stream credit to give back. A
        // stream each would have drawn a MAX_STREAMS update for every few.
        assert_eq!(conn.quic().stats().frame_rx.max_streams_uni, 0);
        // Frames over the limit each take a stream of their own, and free it.
        for step in 64..80 {
            let big = pattern(MESSAGE_FRAME_BYTES + 1, step as u8);
            conn.send(FrameKind::Data, 1, 2, step, big.clone())
                .await
                .unwrap();
            assert!(taken(&table, step).await.unwrap() == big);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while conn.quic().stats().frame_rx.max_streams_uni == 0 {
            assert!(
                Instant::now() < deadline,
                "16 streams freed, no credit given back"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        a.close();
        b.close();
    }

    /// A reading pair whose sender's send window takes 65000 bytes, one datagram: a
    /// frame larger than what is in flight waits there for an acknowledgement, which the
    /// runtime cannot process during one poll.
    async fn narrow_window_pair() -> (Endpoint, Endpoint, Connection, Arc<MailboxTable>) {
        let sender = TransportConfig {
            send_window: 65_000,
            ..TransportConfig::default()
        };
        reading_pair_with(64 << 20, sender, mpsc::channel(16).0).await
    }

    /// A small send whose future is dropped part-way (here: the send window lets only
    /// 65000 bytes of a 64 KiB frame through before an acknowledgement, and the runtime
    /// cannot process one during a single poll) takes the message stream with it: the
    /// receiver discards the partial frame, and the next frame arrives on a new stream.
    #[tokio::test]
    async fn a_small_send_dropped_part_way_loses_only_its_own_frame() {
        let (a, b, conn, table) = narrow_window_pair().await;
        let first = pattern(10, 1);
        conn.send(FrameKind::Data, 1, 2, 0, first.clone())
            .await
            .unwrap();
        assert!(taken(&table, 0).await.unwrap() == first);
        let mut cut =
            Box::pin(conn.send(FrameKind::Data, 1, 2, 1, pattern(MESSAGE_FRAME_BYTES, 2)));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(std::future::Future::poll(cut.as_mut(), &mut cx).is_pending());
        drop(cut);
        let next = pattern(4096, 3);
        conn.send(FrameKind::Data, 1, 2, 2, next.clone())
            .await
            .unwrap();
        assert!(taken(&table, 2).await.unwrap() == next);
        never_arrives(&table, 1).await;
        a.close();
        b.close();
    }

    /// A small send dropped before any of its frame went out (the send window full: 65000
    /// bytes in flight, none acknowledged during one poll) gives the message stream back:
    /// the next frame goes on the same stream (it opened a new one, which can wait for a
    /// place while the peer holds all of this node's streams parked), and the dropped
    /// frame never arrives.
    #[tokio::test]
    async fn a_small_send_dropped_before_it_went_out_keeps_the_message_stream() {
        let (a, b, conn, table) = narrow_window_pair().await;
        // A first frame that fills the send window exactly: the stream's mark, its
        // header and its payload make 65000 bytes.
        let mut len = MESSAGE_FRAME_BYTES;
        while 2 + conn.header(FrameKind::Data, 1, 2, 0, len).unwrap().len() + len > 65_000 {
            len -= 1;
        }
        assert_eq!(
            2 + conn.header(FrameKind::Data, 1, 2, 0, len).unwrap().len() + len,
            65_000
        );
        let first = pattern(len, 1);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut send = Box::pin(conn.send(FrameKind::Data, 1, 2, 0, first.clone()));
        assert!(
            std::future::Future::poll(send.as_mut(), &mut cx).is_ready(),
            "the first frame fits"
        );
        let mut cut = Box::pin(conn.send(FrameKind::Data, 1, 2, 1, pattern(100, 2)));
        assert!(
            std::future::Future::poll(cut.as_mut(), &mut cx).is_pending(),
            "the window is full"
        );
        drop(cut);
        let next = pattern(4096, 3);
        conn.send(FrameKind::Data, 1, 2, 2, next.clone())
            .await
            .unwrap();
        assert!(taken(&table, 0).await.unwrap() == first);
        assert!(taken(&table, 2).await.unwrap() == next);
        assert_eq!(
            conn.messages_opened.load(Ordering::Relaxed),
            1,
            "one stream"
        );
        never_arrives(&table, 1).await;
        a.close();
        b.close();
    }

    /// A small send dropped before any of its frame went out, on a message stream it had
    /// just opened (the send window full of a large frame on a stream of its own), keeps
    /// that stream for the next frame, which writes its mark: dropped, the stream used to
    /// reach the peer empty, which it refuses as a bad header, and the next frame opened
    /// another.
    #[tokio::test]
    async fn a_message_stream_opened_for_a_dropped_send_serves_the_next() {
        let (a, b, conn, table) = narrow_window_pair().await;
        leave_a_fresh_message_stream(&conn, &table).await;
        the_next_frame_arrives(&conn, &table, 1).await;
        a.close();
        b.close();
    }

    /// Step 0: a large frame that fills `conn`'s send window (65000 bytes) on a stream of
    /// its own; step 1: a small send that opens the message stream and is dropped before
    /// any byte of it goes out. Returns once step 0 has arrived.
    async fn leave_a_fresh_message_stream(conn: &Connection, table: &MailboxTable) {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let large = pattern(1 << 20, 1);
        let mut filling = Box::pin(conn.send(FrameKind::Data, 1, 2, 0, large.clone()));
        assert!(
            std::future::Future::poll(filling.as_mut(), &mut cx).is_pending(),
            "the large frame fills the window"
        );
        let mut cut = Box::pin(conn.send(FrameKind::Data, 1, 2, 1, pattern(100, 2)));
        assert!(
            std::future::Future::poll(cut.as_mut(), &mut cx).is_pending(),
            "the window is full"
        );
        drop(cut);
        filling.await.unwrap();
        assert!(taken(table, 0).await.unwrap() == large);
    }

    /// Step 2, sent after [`leave_a_fresh_message_stream`], arrives; `streams` message
    /// streams were opened in all; step 1 never arrives.
    async fn the_next_frame_arrives(conn: &Connection, table: &MailboxTable, streams: usize) {
        let next = pattern(4096, 3);
        conn.send(FrameKind::Data, 1, 2, 2, next.clone())
            .await
            .unwrap();
        assert!(taken(table, 2).await.unwrap() == next);
        assert_eq!(conn.messages_opened.load(Ordering::Relaxed), streams);
        never_arrives(table, 1).await;
    }

    /// A message stream opened for a send dropped before any byte went out is kept only
    /// for half the header deadline: the peer's reader refuses a stream whose opening has
    /// not come by that deadline (counted from when it learns of the stream), and a frame
    /// written just as that refusal is on its way would be lost. Past it the next frame
    /// goes on a new stream, and the old one is reset.
    #[tokio::test]
    async fn an_unmarked_message_stream_past_half_the_header_deadline_is_replaced() {
        let sender = TransportConfig {
            send_window: 65_000,
            header_timeout: Duration::from_millis(200),
            ..TransportConfig::default()
        };
        let (a, b, conn, table) = reading_pair_with(64 << 20, sender, mpsc::channel(16).0).await;
        leave_a_fresh_message_stream(&conn, &table).await;
        // The subject here is the stream's age, not a wait for another task.
        tokio::time::sleep(Duration::from_millis(100)).await;
        the_next_frame_arrives(&conn, &table, 2).await;
        assert_eq!(
            conn.quic().stats().frame_tx.reset_stream,
            1,
            "the old one reset"
        );
        a.close();
        b.close();
    }

    /// A large frame whose send is dropped part-way resets its stream, so QUIC sends
    /// none of the rest (finishing it, as dropping a quinn stream does, sent what QUIC
    /// held of it for the receiver to discard); the receiver discards the frame, and the
    /// next arrives.
    #[tokio::test]
    async fn a_large_send_dropped_part_way_resets_its_stream() {
        let (a, b, conn, table) = narrow_window_pair().await;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut cut = Box::pin(conn.send(FrameKind::Data, 1, 2, 0, pattern(1 << 20, 1)));
        assert!(std::future::Future::poll(cut.as_mut(), &mut cx).is_pending());
        drop(cut);
        let next = pattern(256 << 10, 2);
        conn.send(FrameKind::Data, 1, 2, 1, next.clone())
            .await
            .unwrap();
        assert!(taken(&table, 1).await.unwrap() == next);
        assert_eq!(conn.quic().stats().frame_tx.reset_stream, 1, "one reset");
        never_arrives(&table, 0).await;
        a.close();
        b.close();
    }

    /// Small frames share one stream with the heartbeats: with the early-arrival budget
    /// used up, a small frame nobody waits for is read on without it instead of parking,
    /// so the heartbeat and the wanted frame behind it still arrive, and nothing is lost.
    #[tokio::test]
    async fn a_full_budget_holds_up_no_heartbeat_or_wanted_frame_behind_a_small_one() {
        let (control, mut heartbeats) = mpsc::channel(4);
        let budget = 4096;
        let (a, b, conn, table) =
            reading_pair_with(budget, TransportConfig::default(), control).await;
        // Unwanted, and it takes the whole budget.
        let filler = pattern(budget, 1);
        conn.send(FrameKind::Data, 1, 2, 0, filler.clone())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while table.budget_available() > 0 {
            assert!(
                Instant::now() < deadline,
                "the first frame never took the budget"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Unwanted too, with no budget left; then a heartbeat and a frame that is wanted.
        let early = pattern(1000, 2);
        conn.send(FrameKind::Data, 1, 2, 1, early.clone())
            .await
            .unwrap();
        conn.send(FrameKind::Heartbeat, 0, 0, 7, Bytes::new())
            .await
            .unwrap();
        let wanted = pattern(10, 3);
        conn.send(FrameKind::Data, 1, 2, 2, wanted.clone())
            .await
            .unwrap();
        assert!(taken(&table, 2).await.unwrap() == wanted);
        let beat = tokio::time::timeout(Duration::from_secs(10), heartbeats.recv())
            .await
            .expect("the heartbeat was held up")
            .unwrap();
        assert_eq!(beat.header.kind, FrameKind::Heartbeat);
        assert_eq!(beat.header.step, 7);
        // Both early frames were kept, and taking them gives the budget back.
        assert!(taken(&table, 1).await.unwrap() == early);
        assert!(taken(&table, 0).await.unwrap() == filler);
        assert_eq!(table.budget_available(), budget);
        a.close();
        b.close();
    }

    /// Control frames go to a bounded channel whose reader may be slow: each keeps a stream
    /// of its own, so a full channel holds up only that frame, never the data behind it.
    #[tokio::test]
    async fn a_full_control_channel_does_not_hold_up_small_data() {
        let (control, mut backlog) = mpsc::channel(1);
        let config = TransportConfig::default();
        let (a, b, conn, table) = reading_pair_with(64 << 20, config, control).await;
        for step in 0..3 {
            conn.send(FrameKind::Control, 1, 9, step, Bytes::from_static(b"rpc"))
                .await
                .unwrap();
        }
        let small = pattern(4096, 4);
        conn.send(FrameKind::Data, 1, 2, 0, small.clone())
            .await
            .unwrap();
        assert!(taken(&table, 0).await.unwrap() == small);
        // Nothing was lost: the channel's reader gets all three once it reads.
        for _ in 0..3 {
            let frame = tokio::time::timeout(Duration::from_secs(10), backlog.recv())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(frame.payload, &b"rpc"[..]);
        }
        a.close();
        b.close();
    }

    /// A confirmed frame has arrived when its send returns, and a connection closed as
    /// finished tells the peer so (a plain close does not).
    #[tokio::test]
    async fn a_confirmed_farewell_arrives_and_a_finished_close_is_told_apart() {
        let ca = ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let config = TransportConfig::default();
        let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), config.clone()).unwrap();
        let b = Endpoint::bind(localhost, &ca.issue(NodeId(1)).unwrap(), config).unwrap();
        let addr = b.local_addr().unwrap();
        for finished in [true, false] {
            let (dialled, accepted) = tokio::join!(a.connect(addr, NodeId(1)), b.accept());
            let (dialled, accepted) = (dialled.unwrap(), accepted.unwrap().unwrap());
            let (tx, mut rx) = mpsc::channel(16);
            accepted.spawn_reader(Inbound {
                table: Arc::new(MailboxTable::new(1 << 20)),
                control: tx,
                relay: mpsc::channel(16).0,
            });
            dialled
                .send_confirmed(FrameKind::Farewell, 0, 0, 0)
                .await
                .unwrap();
            // Closed at once: the frame was had before its send returned.
            if finished {
                dialled.close_finished();
            } else {
                dialled.close("done");
            }
            let frame = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(frame.header.kind, FrameKind::Farewell);
            // A close after the first does not change what the peer is told.
            dialled.close("again");
            let (_, graceful) = tokio::time::timeout(Duration::from_secs(10), accepted.closed())
                .await
                .unwrap();
            assert!(graceful);
            assert_eq!(accepted.peer_finished(), finished);
        }
        a.close();
        b.close();
    }

    /// Writes a frame header that does not decode on a message stream, and waits for its
    /// reader to stop the stream with `BadHeader`.
    async fn stopped_by_a_bad_header(stream: &mut quinn::SendStream) {
        stream
            .write_all(&[0, 5, 0xff, 0xff, 0xff, 0xff, 0xff])
            .await
            .unwrap();
        let code = tokio::time::timeout(Duration::from_secs(10), stream.stopped())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(code, Some(StreamRefusal::BadHeader.code()));
    }

    #[tokio::test]
    async fn a_message_stream_skips_unwanted_frames_and_is_stopped_by_a_bad_one() {
        let (a, b, conn, table) = reading_pair(64 << 20).await;
        let mut stream = conn.quic().open_uni().await.unwrap();
        let mut bytes = MESSAGE_STREAM_MARK.to_vec();
        bytes.extend(frame(0, b"first"));
        // A second frame for the same key: discarded, and the stream read on.
        bytes.extend(frame(0, b"again"));
        bytes.extend(frame(1, b"next"));
        stream.write_all(&bytes).await.unwrap();
        assert_eq!(taken(&table, 0).await.unwrap(), &b"first"[..]);
        assert_eq!(taken(&table, 1).await.unwrap(), &b"next"[..]);
        // A header that does not decode: the whole stream is stopped.
        stopped_by_a_bad_header(&mut stream).await;
        // The connection's own sends carry on.
        conn.send(FrameKind::Data, 1, 2, 2, Bytes::from_static(b"later"))
            .await
            .unwrap();
        assert_eq!(taken(&table, 2).await.unwrap(), &b"later"[..]);
        a.close();
        b.close();
    }

    /// The frame a sender writes after the receiver stopped its message stream goes out
    /// on a new one (it used to fail, and only the frame after it opened a new stream;
    /// one written while the stop is on its way still fails).
    #[tokio::test]
    async fn a_frame_after_a_stopped_message_stream_goes_on_a_new_one() {
        let (a, b, conn, table) = reading_pair(64 << 20).await;
        conn.send(FrameKind::Data, 1, 2, 0, Bytes::from_static(b"first"))
            .await
            .unwrap();
        assert_eq!(taken(&table, 0).await.unwrap(), &b"first"[..]);
        {
            // Break the connection's own message stream: its reader stops it.
            let mut slot = conn.messages.lock().await;
            let mut stream = slot.take().expect("the message stream");
            stopped_by_a_bad_header(&mut stream.stream).await;
            *slot = Some(stream);
        }
        conn.send(FrameKind::Data, 1, 2, 1, Bytes::from_static(b"next"))
            .await
            .expect("written on a new stream");
        assert_eq!(taken(&table, 1).await.unwrap(), &b"next"[..]);
        a.close();
        b.close();
    }

    /// Frames of the kinds only a trusted lane carries (announcements, their answers,
    /// credit) are refused over QUIC.
    #[tokio::test]
    async fn lane_only_frames_are_refused_over_quic() {
        let (a, b, conn, _table) = reading_pair(64 << 20).await;
        for kind in [FrameKind::Announce, FrameKind::Clear, FrameKind::Credit] {
            let mut stream = conn.quic().open_uni().await.unwrap();
            let header = FrameHeader::new(kind, 1, 2, 0, conn.local_node().0, 0).encode();
            stream.write_all(&header).await.unwrap();
            let code = tokio::time::timeout(Duration::from_secs(10), stream.stopped())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(code, Some(StreamRefusal::BadHeader.code()), "{kind:?}");
        }
        a.close();
        b.close();
    }

    /// A data frame over `MESSAGE_FRAME_BYTES` on the message stream (a sender puts only
    /// smaller ones there) stops the stream instead of being read whole past the
    /// early-arrival budget.
    #[tokio::test]
    async fn a_large_data_frame_on_the_message_stream_is_refused() {
        let (a, b, conn, table) = reading_pair(1024).await;
        let mut stream = conn.quic().open_uni().await.unwrap();
        let mut bytes = MESSAGE_STREAM_MARK.to_vec();
        bytes.extend(frame(0, &vec![7u8; MESSAGE_FRAME_BYTES + 1]));
        stream.write_all(&bytes).await.unwrap();
        let code = tokio::time::timeout(Duration::from_secs(10), stream.stopped())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(code, Some(StreamRefusal::FrameTooLarge.code()));
        assert!(!table.is_ready(&data_key(0)));
        assert_eq!(table.budget_available(), 1024);
        a.close();
        b.close();
    }

    /// A sender whose peer stops acknowledging (its runtime is not run) accepts no more
    /// than `send_window` bytes from the application, where the stream's flow-control
    /// credit alone (16 MiB) would let it buffer and send far more.
    #[test]
    fn a_sender_holds_at_most_the_send_window_unacknowledged() {
        let config = TransportConfig::default();
        let window = config.send_window as usize;
        let (accepted, _) = unacknowledged_bytes_taken(config, &[]);
        assert!(
            accepted <= window,
            "{accepted} bytes taken, window {window}"
        );
        assert!(
            accepted >= window / 2,
            "only {accepted} bytes taken, window {window}"
        );
    }

    /// A window small enough that the receive buffer of a host with Linux's default cap
    /// (208 KiB) holds one and a half of it.
    fn small_window() -> TransportConfig {
        TransportConfig {
            send_window: 128 << 10,
            ..TransportConfig::default()
        }
    }

    /// The same with the connection set to its node's sole peer: it takes more than one
    /// window and no more than the sole peer's.
    #[test]
    fn a_sole_peer_holds_at_most_its_larger_window_unacknowledged() {
        let config = small_window();
        let shared = config.send_window as usize;
        let (accepted, sole) = unacknowledged_bytes_taken(config, &[true]);
        assert!(accepted <= sole, "{accepted} bytes taken, window {sole}");
        // Only a host whose receive buffer is capped under 192 KiB has no more to give.
        if sole == shared + shared / 2 {
            assert!(
                accepted > shared,
                "{accepted} bytes taken, one window {shared}, the sole peer's {sole}"
            );
        }
    }

    /// Pieces are half the window on a connection with one window, also where the
    /// receive buffer leaves a sole peer no more than that; whole with a sole peer's larger
    /// window; never under 64 KiB, however small the window.
    #[test]
    fn writes_are_cut_in_halves_of_one_window_and_not_of_a_larger_one() {
        let shared = 2u64 << 20;
        let roomy = SendWindows::new(2 << 20, Some(8 << 20));
        assert_eq!(roomy.sole, 3 << 20);
        assert_eq!(write_segment(shared, &roomy), Some(1 << 20));
        assert_eq!(write_segment(roomy.sole, &roomy), None);
        let capped = SendWindows::new(2 << 20, Some(4 << 20));
        assert_eq!(capped.sole, shared);
        assert_eq!(write_segment(capped.sole, &capped), Some(1 << 20));
        let tiny = SendWindows::new(9000, Some(8 << 20));
        assert_eq!(write_segment(9000, &tiny), Some(MIN_WRITE_SEGMENT));
        assert_eq!(write_segment(13_500, &tiny), None);
    }

    /// A connection cuts a payload as [`write_segment`] says for its window: in halves
    /// (pieces that share the payload's memory and hold its bytes in order), whole once it
    /// is a sole peer with a larger window, in halves again once set back.
    #[tokio::test]
    async fn payloads_are_written_in_halves_of_a_shared_window() {
        let (_a, _b, conn, _table) = reading_pair(64 << 20).await;
        let shared = conn.send_window() as usize;
        let half = shared / 2;
        let payload: Bytes = (0..5 * half + 7).map(|i| (i % 251) as u8).collect();
        let other = Bytes::from_static(&[9; 100]);
        let header = Bytes::from_static(b"header");
        let pieces = |conn: &Connection| {
            let parts = Payload::from_parts(vec![payload.clone(), other.clone()]);
            conn.write_pieces(header.clone(), parts)
        };
        let halves = pieces(&conn);
        assert_eq!(halves[0], header);
        assert!(
            halves[1..].iter().all(|p| p.len() <= half),
            "{:?}",
            lens(&halves)
        );
        assert_eq!(halves.len(), 1 + 6 + 1, "{:?}", lens(&halves));
        assert_eq!(
            halves[1].as_ptr(),
            payload.as_ptr(),
            "pieces share the payload"
        );
        assert_eq!(halves[1..].concat(), [&payload[..], &other[..]].concat());
        conn.set_sole_peer(true);
        let sole = pieces(&conn);
        if conn.send_window() as usize > shared {
            assert_eq!(sole, vec![header.clone(), payload.clone(), other.clone()]);
        } else {
            // A receive buffer too small for more than one window: halves still.
            assert_eq!(sole, halves);
        }
        conn.set_sole_peer(false);
        assert_eq!(pieces(&conn), halves);
    }

    /// What `send_payload` and `send_streamed` hand to QUIC: a large payload in halves of
    /// a shared window, whole for a sole peer's larger one; and the receiver gets it
    /// whole either way.
    #[tokio::test]
    async fn sends_hand_quic_halves_of_a_shared_window() {
        let (_a, _b, conn, table) = reading_pair(64 << 20).await;
        let half = conn.send_window() as usize / 2;
        let len = 5 * half + 7;
        let payload = pattern(len, 3);
        let send_both = |first_step: u64| {
            let (conn, payload) = (&conn, payload.clone());
            async move {
                let whole = Payload::from_bytes(payload.clone());
                conn.send_payload(FrameKind::Data, 1, 2, first_step, whole)
                    .await?;
                let (tx, rx) = mpsc::unbounded_channel();
                tx.send(payload).expect("the channel is open");
                drop(tx);
                conn.send_streamed(FrameKind::Data, 1, 2, first_step + 1, len, rx)
                    .await
            }
        };
        send_both(0).await.expect("sends in a shared window");
        conn.set_sole_peer(true);
        let sole = conn.send_window() as usize > 2 * half;
        send_both(2).await.expect("sends as a sole peer");
        let halves = [vec![half; 5], vec![7]].concat();
        let written = conn.pieces_written.lock().expect("pieces").clone();
        assert_eq!(written[..2], [halves.clone(), halves.clone()]);
        if sole {
            assert_eq!(written[2..], [vec![len], vec![len]]);
        } else {
            // A receive buffer too small for more than one window: halves still.
            assert_eq!(written[2..], [halves.clone(), halves]);
        }
        for step in 0..4 {
            assert_eq!(taken(&table, step).await.expect("a frame"), payload);
        }
    }

    fn lens(pieces: &[Bytes]) -> Vec<usize> {
        pieces.iter().map(Bytes::len).collect()
    }

    /// Set back from the sole peer's window to one, the connection takes no more than one.
    #[test]
    fn a_peer_no_longer_sole_holds_at_most_one_window_unacknowledged() {
        let config = small_window();
        let shared = config.send_window as usize;
        let (accepted, _) = unacknowledged_bytes_taken(config, &[true, false]);
        assert!(
            accepted <= shared,
            "{accepted} bytes taken, window {shared}"
        );
        assert!(accepted >= shared / 2, "only {accepted} bytes taken");
    }

    #[test]
    fn a_sole_peer_gets_one_and_a_half_windows_as_far_as_the_buffer_holds_them() {
        let w = 2 << 20;
        let sole = |granted| SendWindows::new(w, granted).sole;
        // Reported sizes are twice the usable ones.
        assert_eq!(sole(Some(8 << 20)), 3 << 20);
        assert_eq!(sole(Some(64 << 20)), 3 << 20);
        assert_eq!(sole(Some(5 << 20)), 5 << 19);
        assert_eq!(sole(Some(4 << 20)), 2 << 20);
        assert_eq!(sole(Some(425_984)), 2 << 20, "never under one window");
        assert_eq!(sole(None), 2 << 20);
        assert_eq!(SendWindows::new(w, Some(8 << 20)).shared, 2 << 20);
    }

    /// Bytes the application could write unacknowledged to a peer that stopped reading,
    /// with `config`, after the connection was set to a sole peer or not as `sole` says,
    /// in turn; and the endpoint's sole peer's window.
    fn unacknowledged_bytes_taken(config: TransportConfig, sole: &[bool]) -> (usize, usize) {
        let ca = ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let shared = config.send_window as usize;
        assert!(shared * 4 <= config.stream_window as usize);
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stalled_tx, stalled_rx) = std::sync::mpsc::channel();
        let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
        let receiver = {
            let (identity, config) = (ca.issue(NodeId(1)).unwrap(), config.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let (b, conn) = rt.block_on(async {
                    let b = Endpoint::bind(localhost, &identity, config).unwrap();
                    addr_tx.send(b.local_addr().unwrap()).unwrap();
                    let conn = b.accept().await.unwrap().unwrap();
                    (b, conn)
                });
                // From here on nothing runs this runtime: no datagram is read, none is
                // acknowledged, until the test is done.
                stalled_tx.send(()).unwrap();
                let _ = resume_rx.recv_timeout(Duration::from_secs(60));
                rt.block_on(async {
                    conn.close("done");
                    b.close();
                });
            })
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (accepted, sole_window) = rt.block_on(async {
            let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), config).unwrap();
            let sole_window = a.sole_peer_send_window() as usize;
            let addr = addr_rx.recv_timeout(Duration::from_secs(20)).unwrap();
            let conn = a.connect(addr, NodeId(1)).await.unwrap();
            assert_eq!(conn.send_window() as usize, shared);
            let mut window = shared;
            for sole in sole {
                conn.set_sole_peer(*sole);
                window = if *sole { sole_window } else { shared };
                assert_eq!(conn.send_window() as usize, window);
            }
            stalled_rx.recv_timeout(Duration::from_secs(20)).unwrap();
            let mut stream = conn.quic().open_uni().await.unwrap();
            let chunk = vec![7u8; 64 << 10];
            let mut accepted = 0usize;
            // One poll of each write (a zero timeout polls its future once): quinn takes
            // the bytes at once while it has room, and a write it leaves pending is
            // blocked for good, as only an acknowledgement could free room.
            while let Ok(written) = tokio::time::timeout(Duration::ZERO, stream.write(&chunk)).await
            {
                accepted += written.unwrap();
                assert!(
                    accepted <= 4 * window,
                    "{accepted} bytes taken unacknowledged"
                );
            }
            conn.close("done");
            a.close();
            (accepted, sole_window)
        });
        resume_tx.send(()).unwrap();
        receiver.join().unwrap();
        (accepted, sole_window)
    }

    #[test]
    fn a_receive_buffer_under_two_send_windows_gets_advice() {
        let window = 2 << 20;
        // Linux's default cap (212992 bytes, reported doubled) is far too small.
        let advice = receive_buffer_advice(425_984, window).expect("advice");
        assert!(
            advice.contains("net.core.rmem_max") && advice.contains("4194304"),
            "{advice}"
        );
        // This machine's 4 MiB cap, reported as 8 MiB, holds two windows.
        assert_eq!(receive_buffer_advice(8 << 20, window), None);
        // A 2 MiB cap, reported as 4 MiB, holds one (the report was taken for the usable
        // size, so this went without advice).
        assert!(receive_buffer_advice(4 << 20, window).is_some());
        assert!(receive_buffer_advice((8 << 20) - 2, window).is_some());
    }

    #[tokio::test]
    async fn loopback_connections_reach_the_upper_mtu_with_one_probe() {
        let ca = ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let config = TransportConfig::default();
        let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), config.clone()).unwrap();
        let b = Endpoint::bind(localhost, &ca.issue(NodeId(1)).unwrap(), config.clone()).unwrap();
        let addr = b.local_addr().unwrap();
        let (dialled, accepted) = tokio::join!(a.connect(addr, NodeId(1)), b.accept());
        let (dialled, accepted) = (dialled.unwrap(), accepted.unwrap().unwrap());
        let upper = crate::config::loopback_udp_payload()
            .map_or(config.max_udp_payload, |lo| lo.min(config.max_udp_payload));
        // Each side discovers the MTU of its own sending direction, with a single probe
        // of the upper bound (quinn's binary search would send about a dozen).
        assert_eq!(probes_to_reach(&dialled, upper).await, 1);
        assert_eq!(probes_to_reach(&accepted, upper).await, 1);
        a.close();
        b.close();
    }
}
