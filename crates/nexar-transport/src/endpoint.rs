//! QUIC endpoints and authenticated connections.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::config::PathKind;
use crate::mailbox::{MailboxKey, MailboxTable, Payload, Refused};
use crate::wire::{FrameHeader, FrameKind, StreamRefusal, MAX_HEADER_BYTES, PROTOCOL_VERSION};
use crate::{node_id_from_cert, tls, NodeId, NodeIdentity, TransportConfig, TransportError};

/// A bound QUIC endpoint for one node: it dials peers and accepts their connections.
#[derive(Debug, Clone)]
pub struct Endpoint {
    inner: quinn::Endpoint,
    node: NodeId,
    config: TransportConfig,
    paths: PathConfigs,
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
        if let Some(advice) = socket
            .recv_buffer_size()
            .ok()
            .and_then(|granted| receive_buffer_advice(granted, config.send_window))
        {
            warn!("{advice}");
        }
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
        let conn = tokio::time::timeout(self.config.handshake_timeout, connecting)
            .await
            .map_err(|_| TransportError::Connect {
                addr,
                reason: "handshake timed out".into(),
            })?
            .map_err(|e| TransportError::Connect {
                addr,
                reason: e.to_string(),
            })?;
        let peer = peer_node(&conn)?;
        if peer != expected {
            conn.close(quinn::VarInt::from_u32(1), b"unexpected node");
            return Err(TransportError::UnexpectedPeer {
                expected,
                actual: peer,
            });
        }
        Ok(Connection::new(conn, peer, self.node, &self.config))
    }

    /// Accepts the next incoming connection and authenticates it. `None` once the endpoint
    /// is closed. A failed handshake is returned as an error; keep accepting after it.
    pub async fn accept(&self) -> Option<Result<Connection, TransportError>> {
        let incoming = self.inner.accept().await?;
        let remote = incoming.remote_address();
        let res = async {
            let connecting = match PathKind::of(remote) {
                PathKind::Loopback => incoming.accept_with(self.paths.loopback_server.clone()),
                PathKind::Network => incoming.accept(),
            }
            .map_err(|e| TransportError::Connect {
                addr: remote,
                reason: e.to_string(),
            })?;
            let conn = tokio::time::timeout(self.config.handshake_timeout, connecting)
                .await
                .map_err(|_| TransportError::Connect {
                    addr: remote,
                    reason: "handshake timed out".into(),
                })?
                .map_err(|e| TransportError::Connect {
                    addr: remote,
                    reason: e.to_string(),
                })?;
            let peer = peer_node(&conn)?;
            Ok(Connection::new(conn, peer, self.node, &self.config))
        }
        .await;
        Some(res)
    }

    /// Closes every connection and stops accepting.
    pub fn close(&self) {
        self.inner.close(quinn::VarInt::from_u32(0), b"shutdown");
    }

    /// Waits until every connection's close has been sent (bounded by the idle timeout).
    pub async fn wait_idle(&self) {
        self.inner.wait_idle().await;
    }
}

fn peer_node(conn: &quinn::Connection) -> Result<NodeId, TransportError> {
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
    node_id_from_cert(leaf)
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
    pub control: mpsc::Sender<ControlFrame>,
    /// Relay frames go here (bounded: a full channel stops this stream's reader, and QUIC
    /// flow control pushes back on the sender).
    pub relay: mpsc::Sender<RelayFrame>,
}

/// An authenticated connection to one peer node.
#[derive(Debug, Clone)]
pub struct Connection {
    conn: quinn::Connection,
    peer: NodeId,
    local: NodeId,
    max_frame: u64,
    header_timeout: std::time::Duration,
}

impl Connection {
    fn new(
        conn: quinn::Connection,
        peer: NodeId,
        local: NodeId,
        cfg: &TransportConfig,
    ) -> Connection {
        Connection {
            conn,
            peer,
            local,
            max_frame: cfg.max_frame_bytes,
            header_timeout: cfg.header_timeout,
        }
    }

    /// The peer's node id, from its verified certificate.
    pub fn peer(&self) -> NodeId {
        self.peer
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

    /// Sends one frame on a fresh unidirectional stream. Returns once the bytes are queued
    /// in QUIC's send buffer (not when the peer has read them).
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
        let (mut stream, header) = self
            .open_frame(kind, comm, tag, step, payload.len())
            .await?;
        let mut chunks = Vec::with_capacity(1 + payload.chunks().len());
        chunks.push(header);
        chunks.extend(payload.into_chunks());
        stream
            .write_all_chunks(&mut chunks)
            .await
            .map_err(|e| self.send_err(&e))?;
        stream.finish().map_err(|e| self.send_err(&e))?;
        Ok(())
    }

    /// [`Connection::send`] for a payload of `len` bytes produced while it is sent: its
    /// chunks are taken from `chunks` in order and written as they come (each waits for
    /// room in QUIC's send window), so the sender need not hold the whole payload at once.
    /// Should `chunks` close before `len` bytes, or carry more, the stream is reset (the
    /// receiver discards the partial frame) and the send fails.
    pub async fn send_streamed(
        &self,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
        mut chunks: mpsc::UnboundedReceiver<Bytes>,
    ) -> Result<(), TransportError> {
        let (mut stream, header) = self.open_frame(kind, comm, tag, step, len).await?;
        stream
            .write_chunk(header)
            .await
            .map_err(|e| self.send_err(&e))?;
        let mut sent = 0usize;
        while sent < len {
            let Some(chunk) = chunks.recv().await else {
                break;
            };
            sent += chunk.len();
            if sent > len {
                break;
            }
            stream
                .write_chunk(chunk)
                .await
                .map_err(|e| self.send_err(&e))?;
        }
        if sent != len {
            let _ = stream.reset(StreamRefusal::LengthMismatch.code());
            return Err(self.send_err(&format!(
                "the payload's producer gave {sent} of the {len} bytes announced"
            )));
        }
        stream.finish().map_err(|e| self.send_err(&e))?;
        Ok(())
    }

    /// Opens a stream for a frame of `len` bytes and encodes its header.
    async fn open_frame(
        &self,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
    ) -> Result<(quinn::SendStream, Bytes), TransportError> {
        let header =
            FrameHeader::for_payload(kind, comm, tag, step, self.local.0, len, self.max_frame)?;
        let stream = self.conn.open_uni().await.map_err(|e| self.send_err(&e))?;
        Ok((stream, header))
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

    /// Resolves when the connection is closed, with the reason and whether the peer (or
    /// this side) closed it deliberately with code 0, as a clean shutdown does.
    pub async fn closed(&self) -> (String, bool) {
        let e = self.conn.closed().await;
        let graceful = matches!(
            &e,
            quinn::ConnectionError::ApplicationClosed(c) if c.error_code == quinn::VarInt::from_u32(0)
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
                            Box::pin(async move { this.read_frame(stream, inbound).await });
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
        warn!(peer = %self.peer, reason = ?why, detail, "refusing inbound frame");
        let _ = stream.stop(why.code());
    }

    async fn read_frame(&self, mut stream: quinn::RecvStream, inbound: Inbound) {
        let header = match tokio::time::timeout(self.header_timeout, read_header(&mut stream)).await
        {
            Ok(Ok(h)) => h,
            Ok(Err((why, detail))) => return self.refuse(&mut stream, why, &detail),
            Err(_) => {
                return self.refuse(&mut stream, StreamRefusal::BadHeader, "header timed out")
            }
        };
        if header.version != PROTOCOL_VERSION {
            return self.refuse(
                &mut stream,
                StreamRefusal::BadVersion,
                &format!("version {}", header.version),
            );
        }
        if header.src != self.peer.0 {
            return self.refuse(
                &mut stream,
                StreamRefusal::SourceMismatch,
                &format!("claims node {}", header.src),
            );
        }
        if header.len > self.max_frame {
            return self.refuse(
                &mut stream,
                StreamRefusal::FrameTooLarge,
                &format!("{} bytes", header.len),
            );
        }
        if header.kind == FrameKind::Relay {
            let payload = match read_payload(&mut stream, header.len as usize).await {
                Ok(p) => p,
                Err((why, detail)) => return self.refuse(&mut stream, why, &detail),
            };
            let frame = RelayFrame {
                from: self.peer,
                header,
                payload: Payload::from_chunks(payload, None),
            };
            let _ = inbound.relay.send(frame).await;
            return;
        }
        if header.kind != FrameKind::Data {
            // Control frames are small by contract.
            if header.len > 1 << 20 {
                return self.refuse(
                    &mut stream,
                    StreamRefusal::FrameTooLarge,
                    "control frame over 1 MiB",
                );
            }
            let payload = match read_payload(&mut stream, header.len as usize).await {
                Ok(p) => p,
                Err((why, detail)) => return self.refuse(&mut stream, why, &detail),
            };
            let mut buf = bytes::BytesMut::with_capacity(payload.len());
            for c in payload {
                buf.extend_from_slice(&c);
            }
            let frame = ControlFrame {
                from: self.peer,
                header,
                payload: buf.freeze(),
            };
            if header.kind == FrameKind::Heartbeat {
                let _ = inbound.control.try_send(frame);
            } else {
                let _ = inbound.control.send(frame).await;
            }
            return;
        }
        let key = MailboxKey {
            comm: header.comm,
            tag: header.tag,
            step: header.step,
            src: self.peer,
        };
        let table = &inbound.table;
        let ticket = match table.begin_incoming(key) {
            Ok(t) => t,
            Err(Refused::Duplicate) => {
                return self.refuse(&mut stream, StreamRefusal::Duplicate, "duplicate key")
            }
            Err(Refused::Retired) => {
                debug!(peer = %self.peer, ?key, "discarding frame for a retired collective");
                let _ = stream.stop(StreamRefusal::Retired.code());
                return;
            }
            Err(Refused::Closed) => {
                let _ = stream.stop(StreamRefusal::Shutdown.code());
                return;
            }
        };
        let len = header.len as usize;
        let mut permit = None;
        let mut waited_for = ticket.has_waiter;
        if !ticket.has_waiter && len > 0 {
            let (budget, total) = table.budget();
            // Park until either budget frees up or a receiver asks for this very frame.
            loop {
                if table.has_waiter(&key) {
                    waited_for = true;
                    break;
                }
                let acquire = async {
                    if len <= total {
                        budget.clone().acquire_many_owned(len as u32).await.ok()
                    } else {
                        std::future::pending().await
                    }
                };
                tokio::select! {
                    p = acquire => {
                        match p {
                            Some(p) => { permit = Some(p); break; }
                            None => { table.abort_incoming(key); let _ = stream.stop(StreamRefusal::Shutdown.code()); return; }
                        }
                    }
                    _ = ticket.wanted.notified() => {}
                }
            }
        }
        // A large frame its receiver already waits for goes to that receiver as a stream
        // (if it takes deliveries), to be copied into its buffer as it arrives.
        if waited_for {
            match table.hand_over(key, stream, len) {
                Ok(()) => return,
                Err(back) => stream = back,
            }
        }
        match read_payload(&mut stream, len).await {
            Ok(chunks) => table.finish_incoming(key, Payload::from_chunks(chunks, permit)),
            Err((why, detail)) => {
                table.abort_incoming(key);
                self.refuse(&mut stream, why, &detail);
            }
        }
    }
}

pub(crate) type ReadFail = (StreamRefusal, String);

async fn read_header(stream: &mut quinn::RecvStream) -> Result<FrameHeader, ReadFail> {
    let mut prefix = [0u8; 2];
    stream.read_exact(&mut prefix).await.map_err(|e| {
        (
            StreamRefusal::BadHeader,
            format!("reading header length: {e}"),
        )
    })?;
    let n = u16::from_be_bytes(prefix) as usize;
    if n == 0 || n > MAX_HEADER_BYTES {
        return Err((StreamRefusal::BadHeader, format!("header length {n}")));
    }
    let mut buf = [0u8; MAX_HEADER_BYTES];
    stream
        .read_exact(&mut buf[..n])
        .await
        .map_err(|e| (StreamRefusal::BadHeader, format!("reading header: {e}")))?;
    FrameHeader::decode(&buf[..n])
        .map_err(|e| (StreamRefusal::BadHeader, format!("decoding header: {e}")))
}

/// A warning when the UDP receive buffer the kernel granted (as Linux reports it: twice
/// the usable size, the other half being its bookkeeping) cannot hold two send windows:
/// what one peer may have in flight toward this node, and room for a second. Datagrams
/// that overflow it are lost, and each loss costs a retransmission and a stall.
fn receive_buffer_advice(granted: usize, send_window: u32) -> Option<String> {
    let needed = 2 * send_window as usize;
    (granted < needed).then(|| {
        format!(
            "the UDP receive buffer is {granted} bytes, under twice the {send_window}-byte send \
             window: a busy node may drop datagrams (raise net.core.rmem_max to at least \
             {needed}, or lower TransportConfig::send_window)"
        )
    })
}

/// Reads exactly `len` payload bytes and then expects the end of the stream.
async fn read_payload(stream: &mut quinn::RecvStream, len: usize) -> Result<Vec<Bytes>, ReadFail> {
    let mut chunks = Vec::new();
    read_body(stream, len, |_, c| chunks.push(c)).await?;
    Ok(chunks)
}

/// Reads exactly `len` payload bytes, passing each chunk to `each` with its offset as it
/// arrives, and then expects the end of the stream.
pub(crate) async fn read_body(
    stream: &mut quinn::RecvStream,
    len: usize,
    mut each: impl FnMut(usize, Bytes),
) -> Result<(), ReadFail> {
    let mut got = 0usize;
    while got < len {
        match stream.read_chunk(len - got, true).await {
            Ok(Some(c)) => {
                let n = c.bytes.len();
                each(got, c.bytes);
                got += n;
            }
            Ok(None) => {
                return Err((
                    StreamRefusal::LengthMismatch,
                    format!("stream ended after {got} of {len} bytes"),
                ));
            }
            Err(e) => {
                return Err((
                    StreamRefusal::LengthMismatch,
                    format!("read failed after {got} of {len} bytes: {e}"),
                ))
            }
        }
    }
    match stream.read_chunk(1, true).await {
        Ok(None) => Ok(()),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::net::Ipv4Addr;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::mailbox::STREAM_HANDOVER_BYTES;
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
        let ca = ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let config = TransportConfig::default();
        let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), config.clone()).unwrap();
        let b = Endpoint::bind(localhost, &ca.issue(NodeId(1)).unwrap(), config).unwrap();
        let addr = b.local_addr().unwrap();
        let (dialled, accepted) = tokio::join!(a.connect(addr, NodeId(1)), b.accept());
        let table = Arc::new(MailboxTable::new(budget));
        let inbound = Inbound {
            table: table.clone(),
            control: mpsc::channel(16).0,
            relay: mpsc::channel(16).0,
        };
        accepted.unwrap().unwrap().spawn_reader(inbound);
        (a, b, dialled.unwrap(), table)
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
        // Large, arriving before anyone waits: buffered whole within the budget.
        let early = pattern(2 << 20, 3);
        conn.send(FrameKind::Data, 1, 2, 1, early.clone())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while table.budget_available() == budget {
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
        assert!(matches!(
            table.take(data_key(1), Duration::from_millis(200)).await,
            Err(TransportError::Timeout(_))
        ));
        a.close();
        b.close();
    }

    /// A sender whose peer stops acknowledging (its runtime is not run) accepts no more
    /// than `send_window` bytes from the application, where the stream's flow-control
    /// credit alone (16 MiB) would let it buffer and send far more.
    #[test]
    fn a_sender_holds_at_most_the_send_window_unacknowledged() {
        let ca = ClusterCa::generate().unwrap();
        let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let config = TransportConfig::default();
        let window = config.send_window as usize;
        assert!(window * 4 <= config.stream_window as usize);
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
        let accepted = rt.block_on(async {
            let a = Endpoint::bind(localhost, &ca.issue(NodeId(0)).unwrap(), config).unwrap();
            let addr = addr_rx.recv_timeout(Duration::from_secs(20)).unwrap();
            let conn = a.connect(addr, NodeId(1)).await.unwrap();
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
            accepted
        });
        resume_tx.send(()).unwrap();
        receiver.join().unwrap();
        assert!(
            accepted <= window,
            "{accepted} bytes taken, window {window}"
        );
        assert!(
            accepted >= window / 2,
            "only {accepted} bytes taken, window {window}"
        );
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
        assert_eq!(receive_buffer_advice(4 << 20, window), None);
        assert!(receive_buffer_advice((4 << 20) - 1, window).is_some());
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
