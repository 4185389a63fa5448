//! The trusted-fabric lane: a plain TCP connection between two nodes that have already
//! authenticated each other over QUIC, for bulk data on networks the user declares trusted.
//!
//! **Plaintext.** Frames on this lane are neither encrypted nor integrity-protected: anyone
//! who can read or inject packets on the fabric can read or corrupt the data. Enable it only
//! where the network itself is trusted (a private cluster fabric); the default path stays
//! QUIC with TLS.
//!
//! What it does guarantee: only the two nodes of an authenticated QUIC session can open a
//! lane between them. Both derive a one-time key from that session's TLS exporter
//! ([`lane_key`]); the lane's handshake is a challenge-response over fresh nonces with
//! HMAC-SHA256 under that key, in both directions, so a third party can neither open a lane
//! claiming to be a node nor replay an old handshake, and each side knows which node is at
//! the other end. Frames then use the QUIC lane's framing (a `u16` length, a postcard
//! [`FrameHeader`], the raw payload) followed by one trailer byte; a header that claims
//! another source, another protocol version, a frame over the size limit or any kind but
//! [`FrameKind::Data`] and the lane's own (below), or an unknown trailer, ends the lane
//! (and so loses the peer: over QUIC only that frame is refused; nodes whose
//! `max_frame_bytes` differ see this). A
//! frame for a key already buffered is discarded, as over QUIC, but its sender is not
//! told (its send has returned already).
//!
//! Two ways to send: [`TcpLane::send`] queues owned bytes for the lane's writer task, and
//! [`TcpLane::begin_frame`] hands the caller a [`DirectFrame`] that writes straight from
//! borrowed memory (the collective driver's zero-copy path). Both take the lane's write
//! lock for a whole frame, so frames never interleave. A direct frame dropped half
//! written is finished in the background with zero bytes and an *aborted* trailer, and the
//! receiver discards it: cancelling a send never corrupts the stream or delivers bytes the
//! sender did not mean.
//!
//! Early arrivals on this lane take budget when it is free but never wait for it: one TCP
//! stream carries every frame of the pair, and a frame parked for budget would block the
//! frames behind it, among them the one a receiver waits for. So a sender that must not
//! run ahead of its receiver asks first, in one of two ways (the point-to-point messages
//! of `nexar-actors` over 64 KiB do, as over QUIC, where smaller ones are kept past the
//! budget; a collective's frames in flight are bounded by the collective itself):
//! - on credit ([`TcpLane::take_credit`]): each lane lets its sender have
//!   [`LANE_CREDIT_BYTES`] of frames out (each taking at least [`CREDIT_MIN_CHARGE`])
//!   that the receiver has not given back yet; the frame's
//!   trailer says it was sent on credit, and the receiver gives the credit back
//!   ([`FrameKind::Credit`]) once such frames are taken or discarded, in batches (half
//!   the window; less while frames not taken hold most of it, and all that is owed when
//!   an announcement shows the sender ran short);
//! - announced ([`TcpLane::announce`]): the sender sends the frame's key and length
//!   ([`FrameKind::Announce`]) and writes the frame once the receiver answers
//!   ([`FrameKind::Clear`]), which it does when a receive waits for the frame or its
//!   early-arrival budget holds it, as over QUIC, where a large frame's stream waits
//!   unread. A sender has at most [`LANE_ANNOUNCEMENTS`] unanswered.
//!
//! A peer that sends past its credit, gives back more than this side spent, leaves more
//! announcements unanswered than that, or sends an announced frame of another length (or
//! on credit as well), loses the lane. These bounds hold for a peer that keeps to the
//! protocol: a data frame sent neither on credit nor announced is kept as before (a
//! collective's frames come so, bounded by the collective), and an authenticated peer
//! that sends its point-to-point messages so is not told apart from one.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use aws_lc_rs::hmac;
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Mutex, OwnedMutexGuard, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

use crate::endpoint::Inbound;
use crate::mailbox::{MailboxKey, MailboxTable, Park, Payload, Refused};
use crate::wire::{FrameHeader, FrameKind, MAX_HEADER_BYTES, PROTOCOL_VERSION};
use crate::{Connection, NodeId, TransportConfig, TransportError};

/// TLS exporter label of the lane key.
const KEY_LABEL: &[u8] = b"EXPORTER-nexar-trusted-lane";
/// First bytes of a lane handshake.
const MAGIC: &[u8; 4] = b"NXTL";
/// Lane handshake version (3: the listener answers the confirmation with
/// [`LANE_ACCEPTED`]; 4: frames of kinds [`FrameKind::Announce`] and [`FrameKind::Clear`]).
const LANE_VERSION: u16 = 4;
/// The listener's last handshake byte: it checked the dialer's confirmation and keeps the
/// lane. Without it a dialer whose confirmation came too late (or was refused) would take
/// the closed socket for a lane, and the peer for gone.
const LANE_ACCEPTED: u8 = 0xA5;
/// How long the listener waits for a dialer's hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the listener side of a lane handshake may take in all (see [`accept_lane`]).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Frames queued for the writer before `send` waits.
const WRITE_QUEUE: usize = 64;
/// The lane reader's buffer.
const READ_BUFFER: usize = 64 << 10;
/// How long a closing lane waits for the write lock to shut its socket down.
const CLOSE_WAIT: Duration = Duration::from_secs(5);
/// Trailer of a frame written whole.
const FRAME_COMPLETE: u8 = 0;
/// Trailer of a frame its sender abandoned midway (its payload is padding): discarded.
const FRAME_ABORTED: u8 = 1;
/// Trailer bit of a data frame sent on credit ([`TcpLane::take_credit`]), whole or
/// aborted: its receiver gives the credit back once it is done with the frame.
const FRAME_CREDITED: u8 = 2;
/// Bytes of data frames a sender may have sent on credit over one lane and not had back
/// yet ([`TcpLane::take_credit`]): the receiver gives credit back once frames are taken,
/// in batches (half the window, or less while frames not taken hold most of it), so up to
/// about half of it may be frames already taken. A peer that sends on more ends the lane.
/// A receiver so holds at most this much of a peer's credited frames, on top of its
/// early-arrival budget.
pub const LANE_CREDIT_BYTES: usize = 64 << 20;
/// The least credit a frame takes, however small: a receiver keeps at most
/// [`LANE_CREDIT_BYTES`] / 4 KiB (16,384) of a peer's small frames on credit, not 64 Mi of
/// empty ones, each with a slot of its own.
pub const CREDIT_MIN_CHARGE: usize = 4 << 10;

/// The credit a frame of `len` bytes takes.
fn credit_charge(len: usize) -> usize {
    len.max(CREDIT_MIN_CHARGE)
}

/// Credit a receiver gives back in one frame, at least ([`FrameKind::Credit`]), unless
/// frames it has not let go yet hold so much of the window that less is due (see
/// `Returns::is_due`); less waits for more (a sender short of credit announces its frames
/// instead). Half the window: each frame given back cost a 2-rank stream of 8 MiB
/// messages in one process a tenth of its time when it came after every message
/// (BENCHMARKS.md, session 40).
const CREDIT_RETURN_BYTES: u64 = (LANE_CREDIT_BYTES / 2) as u64;
/// Announcements ([`TcpLane::announce`]) a sender may have unanswered on one lane; a
/// peer with more ends the lane.
pub const LANE_ANNOUNCEMENTS: usize = 64;
/// The payload of an [`FrameKind::Announce`] frame: the announced frame's length.
const ANNOUNCE_BYTES: usize = 8;
/// The payload of a [`FrameKind::Credit`] frame: the bytes of credit given back.
const CREDIT_BYTES: usize = 8;

/// The one-time key of the lane between the two ends of `conn` (an authenticated QUIC
/// connection): exported from its TLS session, so only these two nodes can compute it, and
/// a new session gives a new key.
pub fn lane_key(conn: &Connection) -> Result<[u8; 32], TransportError> {
    let (a, b) = (conn.local_node().0, conn.peer().0);
    let mut context = Vec::with_capacity(16);
    context.extend_from_slice(&a.min(b).to_be_bytes());
    context.extend_from_slice(&a.max(b).to_be_bytes());
    let mut out = [0u8; 32];
    conn.quic()
        .export_keying_material(&mut out, KEY_LABEL, &context)
        .map_err(|_| TransportError::Closed("cannot export TLS keying material".into()))?;
    Ok(out)
}

/// What a handshake MAC covers: the role, both node ids and both nonces.
fn mac_message(role: &[u8], dialer: u64, listener: u64, nd: &[u8], nl: &[u8]) -> Vec<u8> {
    let mut msg = b"nexar-lane/1 ".to_vec();
    msg.extend_from_slice(role);
    msg.extend_from_slice(&dialer.to_be_bytes());
    msg.extend_from_slice(&listener.to_be_bytes());
    msg.extend_from_slice(nd);
    msg.extend_from_slice(nl);
    msg
}

fn mac(key: &[u8; 32], role: &[u8], dialer: u64, listener: u64, nd: &[u8], nl: &[u8]) -> hmac::Tag {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    hmac::sign(&key, &mac_message(role, dialer, listener, nd, nl))
}

/// Constant-time check of a tag made by [`mac`].
fn verify(key: &[u8; 32], role: &[u8], ids: (u64, u64), nd: &[u8], nl: &[u8], tag: &[u8]) -> bool {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    hmac::verify(&key, &mac_message(role, ids.0, ids.1, nd, nl), tag).is_ok()
}

fn nonce() -> Result<[u8; 32], TransportError> {
    let mut n = [0u8; 32];
    SystemRandom::new()
        .fill(&mut n)
        .map_err(|_| TransportError::Closed("no randomness for a lane nonce".into()))?;
    Ok(n)
}

fn lane_err(peer: Option<NodeId>, what: impl std::fmt::Display) -> TransportError {
    match peer {
        Some(p) => TransportError::Send {
            peer: p,
            reason: format!("trusted lane: {what}"),
        },
        None => TransportError::Closed(format!("trusted lane: {what}")),
    }
}

/// A handshaken lane, before its reader starts: the sending half and the socket's read
/// half.
#[derive(Debug)]
pub struct LaneParts {
    /// The sending half.
    pub lane: TcpLane,
    /// The read half, for [`TcpLane::spawn_reader`].
    pub read: OwnedReadHalf,
}

/// How long a lane may be silent before TCP probes its peer, and then between probes.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Probes unanswered before the lane counts as broken.
#[cfg(target_os = "linux")]
const KEEPALIVE_PROBES: u32 = 3;
/// How long a lane may go without hearing from its peer, with data written and not
/// acknowledged or with keepalive probes out, before it counts as broken (Linux). Where
/// it is set, Linux ends a connection on it alone and no longer counts keepalive probes
/// (tcp(7)), so it is the idle time and the probes together: an idle lane and a busy
/// one end alike. (At 60 s, as it was, an idle lane took 60 s, not the 25 its probes
/// promised.)
#[cfg(target_os = "linux")]
const USER_TIMEOUT: Duration = Duration::from_secs(25);

/// A lane socket's settings: no Nagle delay, and a path that stops carrying packets (a
/// peer host gone, a middlebox that dropped the flow) ends the lane within about 25 s,
/// idle (keepalive probes) or with data unacknowledged, instead of the kernel's 15
/// minutes of retransmissions while the QUIC connection beside it, and so the peer,
/// stays up. The congestion control becomes `congestion` where given and not
/// already in use (see [`TransportConfig::lane_congestion`]); a connection whose route
/// fixes its congestion control (`ip route ... congctl lock`) keeps the route's, with a
/// warning, since the lane works with any.
fn tune(s: &TcpStream, congestion: Option<&str>) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let sock = socket2::SockRef::from(s);
    #[cfg(target_os = "linux")]
    if let Some(name) = congestion {
        let current = sock.tcp_congestion().unwrap_or_default();
        if current.split(|b| *b == 0).next() != Some(name.as_bytes()) {
            if let Err(e) = set_congestion(&sock, Some(name)) {
                warn!(
                    error = %e,
                    current = %String::from_utf8_lossy(&current).trim_end_matches('\0'),
                    "a trusted lane keeps the congestion control its connection has"
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = congestion;
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL);
    #[cfg(target_os = "linux")]
    let keepalive = keepalive.with_retries(KEEPALIVE_PROBES);
    sock.set_tcp_keepalive(&keepalive)?;
    #[cfg(target_os = "linux")]
    sock.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
    Ok(())
}

/// Sets `sock`'s congestion control to `congestion`, where one is given (Linux), with an
/// error that names it and says why the kernel refused it.
fn set_congestion(sock: &socket2::SockRef<'_>, congestion: Option<&str>) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    if let Some(name) = congestion {
        sock.set_tcp_congestion(name.as_bytes()).map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound => {
                    "the kernel has no congestion control of that name (see \
                     net.ipv4.tcp_available_congestion_control)"
                }
                std::io::ErrorKind::PermissionDenied => {
                    "this process may not use it (see \
                     net.ipv4.tcp_allowed_congestion_control)"
                }
                _ => "the kernel refused it",
            };
            std::io::Error::new(
                e.kind(),
                format!("TCP congestion control {name:?} (lane_congestion): {why}: {e}"),
            )
        })?;
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (sock, congestion);
    Ok(())
}

/// Binds a listener for lanes on `ip`, at a port of the system's choosing, non-blocking
/// (for [`tokio::net::TcpListener::from_std`]). It takes `config`'s
/// [`lane_congestion`](TransportConfig::lane_congestion) at once, so that a name the
/// kernel does not offer fails here, when the node starts, and not at each lane's set-up.
pub fn bind_lane_listener(
    ip: IpAddr,
    config: &TransportConfig,
) -> Result<std::net::TcpListener, TransportError> {
    let listener = std::net::TcpListener::bind(SocketAddr::new(ip, 0))?;
    listener.set_nonblocking(true)?;
    set_congestion(
        &socket2::SockRef::from(&listener),
        config.lane_congestion.as_deref(),
    )?;
    Ok(listener)
}

/// Dials `addr` and opens the lane to `peer` under `key` (see [`lane_key`]), within
/// `timeout`. `from`: the address to dial from, when this node's QUIC endpoint is bound to
/// one (an unspecified one, or one of another family than `addr`'s, is ignored): the
/// listener takes lanes only from addresses its QUIC peers' connections come from.
/// `config` gives the largest frame taken and the congestion control
/// ([`TransportConfig::lane_congestion`]), set before the socket connects.
pub async fn dial_lane(
    addr: SocketAddr,
    from: Option<IpAddr>,
    local: NodeId,
    peer: NodeId,
    key: [u8; 32],
    config: &TransportConfig,
    timeout: Duration,
) -> Result<LaneParts, TransportError> {
    let p = Some(peer);
    let run = async {
        let mut s = connect_from(addr, from, config.lane_congestion.as_deref())
            .await
            .map_err(|e| lane_err(p, format!("connecting to {addr}: {e}")))?;
        tune(&s, config.lane_congestion.as_deref()).map_err(|e| lane_err(p, e))?;
        let nd = nonce()?;
        let mut hello = Vec::with_capacity(54);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&LANE_VERSION.to_be_bytes());
        hello.extend_from_slice(&local.0.to_be_bytes());
        hello.extend_from_slice(&peer.0.to_be_bytes());
        hello.extend_from_slice(&nd);
        s.write_all(&hello).await.map_err(|e| lane_err(p, e))?;
        let mut reply = [0u8; 64];
        s.read_exact(&mut reply)
            .await
            .map_err(|e| lane_err(p, format!("no handshake reply: {e}{REFUSAL_HINT}")))?;
        let (nl, tag) = reply.split_at(32);
        if !verify(&key, b"L", (local.0, peer.0), &nd, nl, tag) {
            return Err(lane_err(p, "the listener did not prove the session key"));
        }
        let confirm = mac(&key, b"D", local.0, peer.0, &nd, nl);
        s.write_all(confirm.as_ref())
            .await
            .map_err(|e| lane_err(p, e))?;
        let mut accepted = [0u8; 1];
        s.read_exact(&mut accepted)
            .await
            .map_err(|e| lane_err(p, format!("the listener did not take the lane: {e}")))?;
        if accepted[0] != LANE_ACCEPTED {
            return Err(lane_err(p, "the listener's last handshake byte is wrong"));
        }
        Ok(s)
    };
    let s = tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| lane_err(p, format!("handshake with {addr} timed out")))??;
    Ok(TcpLane::start(s, local, peer, config.max_frame_bytes))
}

/// What a dialer's error adds when the listener closed without a word.
const REFUSAL_HINT: &str = " (a listener takes a lane only from an address that one of \
    this node's QUIC connections to it comes from, and only from a node it has a session \
    with)";

/// Connects to `addr` from `from` (see [`dial_lane`]). The socket takes its congestion
/// control before it connects: one that connected under BBR keeps BBR's pacing of its
/// sends after a switch.
async fn connect_from(
    addr: SocketAddr,
    from: Option<IpAddr>,
    congestion: Option<&str>,
) -> std::io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    set_congestion(&socket2::SockRef::from(&socket), congestion)?;
    let from = from.filter(|ip| !ip.is_unspecified() && ip.is_ipv4() == addr.is_ipv4());
    if let Some(ip) = from {
        socket.bind(SocketAddr::new(ip, 0))?;
    }
    socket.connect(addr).await
}

/// Runs the listener side of a lane handshake on an accepted `stream`: `key_of` gives the
/// session key shared with the node the dialer claims to be (`None`: no such session).
/// The whole handshake has 5 s at most (or `timeout`, if shorter: a real dialer answers
/// at once), so a client that stalls holds a handshake slot only that long. `config`
/// gives the largest frame taken and the congestion control, which a socket accepted by
/// [`bind_lane_listener`] already has.
pub async fn accept_lane(
    mut s: TcpStream,
    local: NodeId,
    key_of: impl Fn(NodeId) -> Option<[u8; 32]>,
    config: &TransportConfig,
    timeout: Duration,
) -> Result<LaneParts, TransportError> {
    let run = async {
        tune(&s, config.lane_congestion.as_deref()).map_err(|e| lane_err(None, e))?;
        let mut hello = [0u8; 54];
        // A real dialer sends its hello at once: a silent client holds a handshake slot
        // only briefly.
        tokio::time::timeout(HELLO_TIMEOUT.min(timeout), s.read_exact(&mut hello))
            .await
            .map_err(|_| lane_err(None, "no hello"))?
            .map_err(|e| lane_err(None, format!("reading the hello: {e}")))?;
        if &hello[..4] != MAGIC {
            return Err(lane_err(None, "not a nexar lane handshake"));
        }
        let version = u16::from_be_bytes([hello[4], hello[5]]);
        if version != LANE_VERSION {
            return Err(lane_err(None, format!("handshake version {version}")));
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&hello[6..14]);
        let dialer = NodeId(u64::from_be_bytes(id));
        id.copy_from_slice(&hello[14..22]);
        if u64::from_be_bytes(id) != local.0 {
            return Err(lane_err(None, "the hello names another node"));
        }
        let nd = &hello[22..54];
        let key = key_of(dialer)
            .ok_or_else(|| lane_err(None, format!("no session with node {dialer}")))?;
        let nl = nonce()?;
        let tag = mac(&key, b"L", dialer.0, local.0, nd, &nl);
        let mut reply = Vec::with_capacity(64);
        reply.extend_from_slice(&nl);
        reply.extend_from_slice(tag.as_ref());
        s.write_all(&reply)
            .await
            .map_err(|e| lane_err(Some(dialer), e))?;
        let mut confirm = [0u8; 32];
        s.read_exact(&mut confirm)
            .await
            .map_err(|e| lane_err(Some(dialer), format!("no confirmation: {e}")))?;
        if !verify(&key, b"D", (dialer.0, local.0), nd, &nl, &confirm) {
            return Err(lane_err(
                Some(dialer),
                "the dialer did not prove the session key",
            ));
        }
        s.write_all(&[LANE_ACCEPTED])
            .await
            .map_err(|e| lane_err(Some(dialer), e))?;
        Ok((s, dialer))
    };
    let (s, dialer) = tokio::time::timeout(HANDSHAKE_TIMEOUT.min(timeout), run)
        .await
        .map_err(|_| lane_err(None, "handshake timed out"))??;
    Ok(TcpLane::start(s, local, dialer, config.max_frame_bytes))
}

/// A queued frame: its length prefix and header, its payload, and its trailer.
type Job = (Bytes, Bytes, u8);

/// The socket's sending half and whether it is still in step.
#[derive(Debug)]
struct Writer {
    half: OwnedWriteHalf,
    /// Set while a frame is being written and cleared once it is whole: found set by the
    /// next writer, a frame was cut short (a cancelled write, a padding task that never
    /// finished), so the stream is out of step and nothing more may be written on it.
    cut: bool,
}

impl Writer {
    /// Starts a frame: refuses (and ends the lane) if the last one was cut short.
    async fn begin(&mut self, side: &WriteSide, peer: NodeId) -> Result<(), TransportError> {
        if self.cut {
            side.closed.send_replace(true);
            let _ = self.half.shutdown().await;
            return Err(lane_err(Some(peer), "a frame was cut short; lane closed"));
        }
        self.cut = true;
        Ok(())
    }
}

/// The socket's sending side, shared by the writer task and direct frames.
#[derive(Debug)]
struct WriteSide {
    /// Held for a whole frame by whoever writes it.
    writer: Arc<Mutex<Writer>>,
    /// Set when the lane is closed: stops the writer, direct frames and their padding.
    closed: watch::Sender<bool>,
    /// The runtime the lane was opened on, where abandoned frames are padded.
    rt: Option<tokio::runtime::Handle>,
}

impl WriteSide {
    /// Resolves once the lane is closed.
    async fn closed(&self) {
        let mut rx = self.closed.subscribe();
        // An error means the sender is gone, which cannot happen while `self` lives.
        let _ = rx.wait_for(|c| *c).await;
    }
}

/// A frame's key on a lane: communicator, tag and step (its source is the lane's peer).
type LaneKey = (u64, u64, u64);

/// A sender's unanswered announcements: who waits for each answer (nobody once its
/// sender gave up), and the place it holds until the answer comes.
type Unanswered = HashMap<LaneKey, (oneshot::Sender<()>, OwnedSemaphorePermit)>;

/// A sender's announcements waiting for their answers ([`TcpLane::announce`]).
#[derive(Debug)]
struct Announced {
    /// One place per unanswered announcement ([`LANE_ANNOUNCEMENTS`]).
    places: Arc<Semaphore>,
    /// The unanswered announcements; `None` once the lane's reader stopped, so that no
    /// answer can come.
    waiting: std::sync::Mutex<Option<Unanswered>>,
}

impl Announced {
    fn new() -> Announced {
        Announced {
            places: Arc::new(Semaphore::new(LANE_ANNOUNCEMENTS)),
            waiting: std::sync::Mutex::new(Some(HashMap::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Unanswered>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The receiver answered the announcement of `key`: its sender (if it still waits)
    /// may write the frame. False for a key nobody announced.
    fn answer(&self, key: LaneKey) -> bool {
        let answered = self.lock().as_mut().and_then(|w| w.remove(&key));
        match answered {
            Some((tx, _place)) => {
                let _ = tx.send(());
                true
            }
            None => false,
        }
    }

    /// The reader stopped: every waiting sender learns that no answer will come.
    fn end(&self) {
        self.lock().take();
    }
}

/// An announced frame's wait for its receiver's answer ([`TcpLane::announce`]). Send the
/// frame with [`TcpLane::send_announced`], which consumes it. Dropped before that (its
/// sender gave up), it withdraws the announcement: a frame queued on the lane after the
/// announcement, so that the receiver cannot read it first, lets go of the budget the
/// receiver took or is waiting to take for the frame, and the receiver answers.
#[derive(Debug)]
pub struct Clearance {
    rx: oneshot::Receiver<()>,
    side: Arc<WriteSide>,
    peer: NodeId,
    cleared: bool,
    /// The announced frame's key and length.
    key: LaneKey,
    len: usize,
    /// The withdrawal to queue if this is dropped unsent; `None` once the frame is queued.
    withdrawal: Option<Withdrawal>,
}

/// An announcement's withdrawal ([`Clearance`]): the lane's writer queue, and the frame.
type Withdrawal = (mpsc::Sender<Job>, Job);

/// Queues `withdrawal` on the lane of `side`, without waiting: in a task of its own when
/// the queue is full. Nothing where the lane is closed (the receiver lets its grants go
/// itself then).
fn withdraw(side: &Arc<WriteSide>, (queue, job): Withdrawal) {
    if let Err(mpsc::error::TrySendError::Full(job)) = queue.try_send(job) {
        if let Some(rt) = &side.rt {
            let side = side.clone();
            rt.spawn(async move {
                tokio::select! {
                    _ = queue.send(job) => {}
                    () = side.closed() => {}
                }
            });
        }
    }
}

impl Drop for Clearance {
    fn drop(&mut self) {
        if let Some(w) = self.withdrawal.take() {
            withdraw(&self.side, w);
        }
    }
}

impl Clearance {
    /// Resolves once the receiver answered: the frame may be written then, with
    /// [`TcpLane::send_announced`] or [`TcpLane::begin_announced_frame`] (its receiver
    /// discards it if it had no use for it). Fails once the lane is closed or its reader
    /// stopped. Cancel-safe; resolves at once when called again after it succeeded.
    pub async fn cleared(&mut self) -> Result<(), TransportError> {
        if self.cleared {
            return Ok(());
        }
        tokio::select! {
            r = &mut self.rx => {
                r.map_err(|_| lane_err(Some(self.peer), "ended before the receiver answered"))?;
                self.cleared = true;
                Ok(())
            }
            () = self.side.closed() => Err(lane_err(Some(self.peer), "closed")),
        }
    }
}

/// A lane's credit on its sending side ([`TcpLane::take_credit`]).
#[derive(Debug)]
struct SendCredit {
    /// Credit not taken.
    free: Semaphore,
    /// Credit spent on frames that the receiver has not given back yet: what it may give
    /// back.
    spent: AtomicU64,
}

impl SendCredit {
    fn new() -> SendCredit {
        SendCredit {
            free: Semaphore::new(LANE_CREDIT_BYTES),
            spent: AtomicU64::new(0),
        }
    }

    /// The receiver gave back `n` bytes; `Err` with what was spent when that is less.
    fn give_back(&self, n: u64) -> Result<(), u64> {
        self.spent
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| s.checked_sub(n))?;
        // At most the window: it was spent.
        self.free.add_permits(n as usize);
        Ok(())
    }
}

/// Leave to send one data frame unasked ([`TcpLane::take_credit`]). Dropped unused, the
/// credit goes back to the lane.
#[derive(Debug)]
pub struct Credit {
    credit: Arc<SendCredit>,
    /// The frame's length.
    len: usize,
    /// What it takes of the credit ([`credit_charge`]).
    charge: usize,
    /// Counted as spent: the receiver may give it back.
    spent: bool,
}

impl Credit {
    /// The frame is going out on it (whole or aborted): its receiver gives the credit
    /// back. Before the frame's first byte is written, so that the receiver can never give
    /// it back before it counts as spent.
    fn spend(&mut self) {
        if !self.spent {
            self.credit
                .spent
                .fetch_add(self.charge as u64, Ordering::SeqCst);
            self.spent = true;
        }
    }

    /// Spent, but nothing of the frame was written after all: no longer spent.
    fn unspend(&mut self) {
        if self.spent {
            let n = self.charge as u64;
            let _ = self
                .credit
                .spent
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| {
                    Some(s.saturating_sub(n))
                });
            self.spent = false;
        }
    }
}

impl Drop for Credit {
    /// Not spent, the credit goes back to the lane.
    fn drop(&mut self) {
        if !self.spent {
            self.credit.free.add_permits(self.charge);
        }
    }
}

/// The sending half of a lane. Cheap to clone; frames from concurrent senders are written
/// whole, one after another.
#[derive(Clone, Debug)]
pub struct TcpLane {
    peer: NodeId,
    local: NodeId,
    max_frame: u64,
    queue: mpsc::Sender<Job>,
    side: Arc<WriteSide>,
    /// This side's announcements waiting for answers.
    announced: Arc<Announced>,
    /// Credit for data frames this side may send unasked ([`TcpLane::take_credit`]).
    credit: Arc<SendCredit>,
    /// Frames its reader has taken: whole ([`TcpLane::frames_received`]), abandoned
    /// by their sender midway ([`TcpLane::frames_abandoned`]), and announcements withdrawn
    /// ([`TcpLane::frames_withdrawn`]).
    received: Arc<[AtomicU64; 3]>,
    /// Bytes its reader has read ([`TcpLane::bytes_received`]).
    read_bytes: Arc<AtomicU64>,
}

impl TcpLane {
    fn start(stream: TcpStream, local: NodeId, peer: NodeId, max_frame: u64) -> LaneParts {
        let (read, write) = stream.into_split();
        let (queue, rx) = mpsc::channel(WRITE_QUEUE);
        let side = Arc::new(WriteSide {
            writer: Arc::new(Mutex::new(Writer {
                half: write,
                cut: false,
            })),
            closed: watch::Sender::new(false),
            rt: tokio::runtime::Handle::try_current().ok(),
        });
        tokio::spawn(write_loop(side.clone(), rx, peer));
        LaneParts {
            lane: TcpLane {
                peer,
                local,
                max_frame,
                queue,
                side,
                announced: Arc::new(Announced::new()),
                credit: Arc::new(SendCredit::new()),
                received: Arc::default(),
                read_bytes: Arc::default(),
            },
            read,
        }
    }

    /// Data frames read from the peer over this lane so far: each that came whole (not
    /// one its sender abandoned midway), whether delivered or found stale.
    pub fn frames_received(&self) -> u64 {
        self.received[0].load(Ordering::Relaxed)
    }

    /// Bytes read from the peer over this lane so far, counted as they arrive (within a
    /// frame too): a sign that the peer is alive and sending, which a node's loss
    /// detection takes as it takes data arriving over QUIC.
    pub fn bytes_received(&self) -> u64 {
        self.read_bytes.load(Ordering::Relaxed)
    }

    /// Frames read from the peer over this lane that its sender abandoned midway (a
    /// collective dropped while it sent), padded out and discarded.
    pub fn frames_abandoned(&self) -> u64 {
        self.received[1].load(Ordering::Relaxed)
    }

    /// Announcements the peer withdrew over this lane: frames it announced and then gave
    /// up on before writing any of them ([`Clearance`]).
    pub fn frames_withdrawn(&self) -> u64 {
        self.received[2].load(Ordering::Relaxed)
    }

    /// The node at the other end.
    pub fn peer(&self) -> NodeId {
        self.peer
    }

    /// The length prefix and header of a data frame of `len` payload bytes from this node.
    fn head(&self, comm: u64, tag: u64, step: u64, len: usize) -> Result<Bytes, TransportError> {
        FrameHeader::for_payload(
            FrameKind::Data,
            comm,
            tag,
            step,
            self.local.0,
            len,
            self.max_frame,
        )
    }

    /// Queues one data frame of owned bytes. Returns once the frame is queued whole for
    /// the writer task (cancel-safe: a frame is either queued entirely or not at all).
    pub async fn send(
        &self,
        comm: u64,
        tag: u64,
        step: u64,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        self.queue_frame(comm, tag, step, payload, None).await
    }

    /// Queues a data frame, on `credit` when given ([`send`](Self::send),
    /// [`send_credited`](Self::send_credited)).
    async fn queue_frame(
        &self,
        comm: u64,
        tag: u64,
        step: u64,
        payload: Bytes,
        mut credit: Option<Credit>,
    ) -> Result<(), TransportError> {
        if let Some(c) = &credit {
            self.check_credit(c, payload.len())?;
        }
        let header = self.head(comm, tag, step, payload.len())?;
        if *self.side.closed.borrow() {
            return Err(lane_err(Some(self.peer), "closed"));
        }
        let slot = self
            .queue
            .reserve()
            .await
            .map_err(|_| lane_err(Some(self.peer), "closed"))?;
        // Spent before the frame can be written (see `Credit::spend`).
        let trailer = match credit.as_mut() {
            Some(c) => {
                c.spend();
                FRAME_COMPLETE | FRAME_CREDITED
            }
            None => FRAME_COMPLETE,
        };
        slot.send((header, payload, trailer));
        Ok(())
    }

    /// Refuses `credit` for a frame of `len` bytes unless it was taken for that length.
    fn check_credit(&self, credit: &Credit, len: usize) -> Result<(), TransportError> {
        if credit.len != len {
            return Err(lane_err(
                Some(self.peer),
                format!("credit for {} bytes, a frame of {len}", credit.len),
            ));
        }
        Ok(())
    }

    /// Credit to send a data frame of `len` bytes unasked, if this lane has that much:
    /// each lane lets its sender have [`LANE_CREDIT_BYTES`] of such frames out that the
    /// receiver has not given back yet (it gives the credit back once it has taken them:
    /// received, discarded or consumed otherwise). A frame takes its length, at least
    /// [`CREDIT_MIN_CHARGE`]. Send the frame with [`send_credited`](Self::send_credited)
    /// or [`begin_credited_frame`](Self::begin_credited_frame); without credit,
    /// [`announce`](Self::announce) it.
    pub fn take_credit(&self, len: usize) -> Option<Credit> {
        let charge = credit_charge(len);
        if charge > LANE_CREDIT_BYTES {
            return None;
        }
        let n = u32::try_from(charge).ok()?;
        let permit = self.credit.free.try_acquire_many(n).ok()?;
        permit.forget();
        Some(Credit {
            credit: self.credit.clone(),
            len,
            charge,
            spent: false,
        })
    }

    /// [`send`](Self::send) of a frame on `credit` (taken for this frame's length).
    pub async fn send_credited(
        &self,
        comm: u64,
        tag: u64,
        step: u64,
        payload: Bytes,
        credit: Credit,
    ) -> Result<(), TransportError> {
        self.queue_frame(comm, tag, step, payload, Some(credit))
            .await
    }

    /// Asks the receiver for leave to send the data frame with this key, of `len` payload
    /// bytes, and returns the wait for its answer. The receiver answers once it can take
    /// the frame: at once when a receive waits for it or its early-arrival budget
    /// ([`TransportConfig::early_budget_bytes`]) holds it, else when either comes (the
    /// frame has the budget, or its receiver, from then on); it answers too when it will
    /// discard the frame (a retired tag, a frame its sender abandoned), so that a sender
    /// need not wait for its deadline. Send the frame with
    /// [`send_announced`](Self::send_announced). A sender that gives up on the frame drops
    /// the [`Clearance`], which withdraws the announcement on the lane, after it: the
    /// receiver lets go of the budget it holds for the frame, or stops waiting for it, and
    /// answers. (A receive waiting for the frame learns nothing from that: tell it apart,
    /// as `nexar-actors` does over QUIC.) The announcement holds one of this lane's
    /// [`LANE_ANNOUNCEMENTS`] places until its answer comes. Waits while all of them are
    /// held.
    ///
    /// So a frame announced holds the receiver's budget, as over QUIC, where a large
    /// frame's stream waits unread: the one TCP stream of a lane cannot hold back one frame
    /// without holding back all of them. (With credit in front, a sender running ahead
    /// makes its receiver hold at most [`LANE_CREDIT_BYTES`] plus that budget of such
    /// frames.) Cancel-safe: cancelled before it returns, nothing is announced.
    pub async fn announce(
        &self,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
    ) -> Result<Clearance, TransportError> {
        // The frame's own size check first.
        self.head(comm, tag, step, len)?;
        let head = FrameHeader::for_payload(
            FrameKind::Announce,
            comm,
            tag,
            step,
            self.local.0,
            ANNOUNCE_BYTES,
            self.max_frame,
        )?;
        // An empty data frame under the key, marked abandoned: a receiver of any version
        // discards it, and lets go of the key's grant.
        let withdrawal = (self.head(comm, tag, step, 0)?, Bytes::new(), FRAME_ABORTED);
        let closed = || lane_err(Some(self.peer), "closed");
        let place = tokio::select! {
            p = self.announced.places.clone().acquire_owned() => p.map_err(|_| closed())?,
            () = self.side.closed() => return Err(closed()),
        };
        let slot = tokio::select! {
            s = self.queue.reserve() => s.map_err(|_| closed())?,
            () = self.side.closed() => return Err(closed()),
        };
        let (tx, rx) = oneshot::channel();
        {
            let mut waiting = self.announced.lock();
            let Some(waiting) = waiting.as_mut() else {
                return Err(lane_err(Some(self.peer), "its reader stopped"));
            };
            if waiting.contains_key(&(comm, tag, step)) {
                return Err(lane_err(
                    Some(self.peer),
                    format!("frame ({comm}, {tag}, {step}) announced twice"),
                ));
            }
            waiting.insert((comm, tag, step), (tx, place));
        }
        slot.send((
            head,
            Bytes::copy_from_slice(&(len as u64).to_be_bytes()),
            FRAME_COMPLETE,
        ));
        Ok(Clearance {
            rx,
            side: self.side.clone(),
            peer: self.peer,
            cleared: false,
            key: (comm, tag, step),
            len,
            withdrawal: Some((self.queue.clone(), withdrawal)),
        })
    }

    /// Queues the frame `clearance` was given for, under the key it was announced with,
    /// once its receiver answered ([`send`](Self::send) after [`Clearance::cleared`]).
    /// Fails for a payload of another length than announced (nothing is queued, and the
    /// announcement is withdrawn). Cancel-safe: dropped before the frame is queued, the
    /// announcement is withdrawn.
    pub async fn send_announced(
        &self,
        mut clearance: Clearance,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        if payload.len() != clearance.len {
            return Err(lane_err(
                Some(self.peer),
                format!(
                    "a frame of {} bytes announced as {}",
                    payload.len(),
                    clearance.len
                ),
            ));
        }
        clearance.cleared().await?;
        let (comm, tag, step) = clearance.key;
        self.send(comm, tag, step, payload).await?;
        clearance.withdrawal = None;
        Ok(())
    }

    /// [`begin_frame`](Self::begin_frame) of the frame `clearance` was given for, once its
    /// receiver answered. The withdrawal passes to the frame: dropped before any byte of
    /// it is written, the frame withdraws the announcement (abandoned midway, its padding
    /// lets the receiver's grant go). Until the frame begins, `clearance` withdraws it
    /// when dropped. Cancel-safe.
    pub async fn begin_announced_frame(
        &self,
        clearance: &mut Clearance,
    ) -> Result<DirectFrame, TransportError> {
        clearance.cleared().await?;
        let (comm, tag, step) = clearance.key;
        let mut frame = self.begin(comm, tag, step, clearance.len, None).await?;
        frame.withdrawal = clearance.withdrawal.take();
        Ok(frame)
    }

    /// Takes the lane's write lock for one frame of `len` payload bytes, for the caller to
    /// write from its own memory with [`DirectFrame::advance`]. Waits while other frames
    /// are being written; fails if the lane is closed or `len` is over the frame limit.
    pub async fn begin_frame(
        &self,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
    ) -> Result<DirectFrame, TransportError> {
        self.begin(comm, tag, step, len, None).await
    }

    /// [`begin_frame`](Self::begin_frame) of a frame on `credit` (taken for `len`). The
    /// credit counts as spent from the first [`DirectFrame::advance`], before any byte is
    /// written (the receiver may give it back as soon as it has the frame), and goes back
    /// to the lane if the frame is dropped with nothing written.
    pub async fn begin_credited_frame(
        &self,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
        credit: Credit,
    ) -> Result<DirectFrame, TransportError> {
        self.check_credit(&credit, len)?;
        self.begin(comm, tag, step, len, Some(credit)).await
    }

    async fn begin(
        &self,
        comm: u64,
        tag: u64,
        step: u64,
        len: usize,
        credit: Option<Credit>,
    ) -> Result<DirectFrame, TransportError> {
        let head = self.head(comm, tag, step, len)?;
        let mut guard = tokio::select! {
            g = self.side.writer.clone().lock_owned() => g,
            () = self.side.closed() => return Err(lane_err(Some(self.peer), "closed")),
        };
        if *self.side.closed.borrow() {
            return Err(lane_err(Some(self.peer), "closed"));
        }
        guard.begin(&self.side, self.peer).await?;
        Ok(DirectFrame {
            guard: Some(guard),
            side: self.side.clone(),
            peer: self.peer,
            head,
            len,
            done: 0,
            credit,
            withdrawal: None,
        })
    }

    /// True once the lane is closed ([`close`](Self::close), or its writer failed): sends
    /// on it fail.
    pub fn is_closed(&self) -> bool {
        *self.side.closed.borrow()
    }

    /// Closes the lane: frames already queued are still written if the socket takes them
    /// at once (one stuck behind a peer that stopped reading is abandoned), direct frames
    /// fail, and the socket's sending side is shut down. A direct frame its caller holds
    /// without polling keeps the lock: the shutdown then waits for it a few seconds at
    /// most, and the socket closes when the last handle to the lane is dropped.
    pub fn close(&self) {
        self.side.closed.send_replace(true);
    }

    /// Reads frames from `read` into `inbound` until the lane ends; `on_end` gets the
    /// reason and whether the peer closed it cleanly (end of stream at a frame boundary).
    pub fn spawn_reader(
        &self,
        read: OwnedReadHalf,
        inbound: Inbound,
        on_end: impl FnOnce(String, bool) + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let peer = self.peer;
        let received = self.received.clone();
        let read = Counted {
            inner: read,
            count: self.read_bytes.clone(),
        };
        let answers = Answers {
            queue: self.queue.downgrade(),
            closed: self.side.closed.subscribe(),
            local: self.local,
            max_frame: self.max_frame,
            granted: Arc::default(),
            unanswered: AtomicUsize::new(0),
            ended: watch::Sender::new(false),
            announced: self.announced.clone(),
            returns: Arc::default(),
            credit: self.credit.clone(),
        };
        let answers = Arc::new(answers);
        tokio::spawn(answers.clone().return_credit());
        tokio::spawn(async move {
            let (reason, clean) = read_loop(read, inbound, peer, &answers, &received).await;
            debug!(%peer, %reason, "trusted lane reader stopped");
            // No more answers come to this side's announcements, and no more frames to
            // the announcements it answered.
            answers.announced.end();
            answers.ended.send_replace(true);
            answers.granted().clear();
            on_end(reason, clean);
        })
    }
}

async fn write_loop(side: Arc<WriteSide>, mut rx: mpsc::Receiver<Job>, peer: NodeId) {
    loop {
        let job = tokio::select! {
            biased;
            j = rx.recv() => j,
            () = side.closed() => None,
        };
        let Some((header, payload, trailer)) = job else {
            break;
        };
        if *side.closed.borrow() {
            // Closing: what is queued still drains, but nothing more is taken, so a busy
            // sender cannot keep a closed lane open.
            rx.close();
        }
        // `header` is the encoded header with its length prefix.
        let trailer = [trailer];
        let mut frame = Buf::chain(Buf::chain(header, payload), &trailer[..]);
        let write = async {
            let mut w = side.writer.lock().await;
            w.begin(&side, peer).await?;
            w.half
                .write_all_buf(&mut frame)
                .await
                .map_err(|e| lane_err(Some(peer), e))?;
            // Whole: the stream is in step again. (Cancelled or failed midway, `cut`
            // stays set and the next writer ends the lane.)
            w.cut = false;
            Ok::<(), TransportError>(())
        };
        let cut_short = tokio::select! {
            biased;
            r = write => {
                if let Err(e) = r {
                    warn!(%peer, error = %e, "trusted lane write failed");
                    side.closed.send_replace(true);
                    return;
                }
                false
            }
            // Closed while a frame was stuck (a peer that stopped reading): the lane is
            // dead, a cut frame no longer matters.
            () = side.closed() => true,
        };
        if cut_short {
            break;
        }
    }
    // Direct frames stop on close too, so the lock comes free (unless a caller keeps one
    // without polling it: then the socket closes when the lane is dropped).
    if let Ok(mut w) = tokio::time::timeout(CLOSE_WAIT, side.writer.lock()).await {
        let _ = w.half.shutdown().await;
    }
}

/// One frame being written by its sender straight from the sender's memory, holding the
/// lane's write lock (see [`TcpLane::begin_frame`]). Call [`DirectFrame::advance`] with the
/// payload until it returns `true`, waiting on [`DirectFrame::writable`] in between.
/// Dropped half written, it is finished in the background with zero bytes and an aborted
/// trailer, which the receiver discards.
#[derive(Debug)]
pub struct DirectFrame {
    guard: Option<OwnedMutexGuard<Writer>>,
    side: Arc<WriteSide>,
    peer: NodeId,
    /// The length prefix and header.
    head: Bytes,
    len: usize,
    /// Bytes of head, payload and trailer written so far.
    done: usize,
    /// The credit it is sent on, if any, until spent.
    credit: Option<Credit>,
    /// An announced frame's withdrawal ([`TcpLane::begin_announced_frame`]), queued if it
    /// is dropped before any byte is written.
    withdrawal: Option<Withdrawal>,
}

impl DirectFrame {
    fn total(&self) -> usize {
        self.head.len() + self.len + 1
    }

    /// Writes as much of the frame as the socket takes without waiting. `payload` must be
    /// the frame's payload, the same bytes at every call. Returns `true` once the whole
    /// frame is written (and the write lock released).
    pub fn advance(&mut self, payload: &[u8]) -> Result<bool, TransportError> {
        if payload.len() != self.len {
            return Err(lane_err(
                Some(self.peer),
                format!(
                    "payload of {} bytes for a frame of {}",
                    payload.len(),
                    self.len
                ),
            ));
        }
        let total = self.total();
        let Some(w) = self.guard.as_ref() else {
            return if self.done == total {
                Ok(true)
            } else {
                Err(lane_err(Some(self.peer), "the lane failed"))
            };
        };
        let trailer = [self.trailer(FRAME_COMPLETE)];
        if let Some(credit) = self.credit.as_mut() {
            credit.spend();
        }
        while self.done < total {
            let parts = frame_parts(&self.head, payload, &trailer, self.done);
            let slices = parts.map(std::io::IoSlice::new);
            match w.half.try_write_vectored(&slices) {
                Ok(0) => {
                    self.broken();
                    return Err(lane_err(Some(self.peer), "the socket took no bytes"));
                }
                Ok(n) => self.done += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.broken();
                    return Err(lane_err(Some(self.peer), format!("write failed: {e}")));
                }
            }
        }
        if let Some(mut w) = self.guard.take() {
            w.cut = false;
        }
        Ok(true)
    }

    /// `trailer`, marked credited for a frame sent on credit.
    fn trailer(&self, trailer: u8) -> u8 {
        match self.credit {
            Some(_) => trailer | FRAME_CREDITED,
            None => trailer,
        }
    }

    /// Writes the rest of the frame, waiting for room in the socket as needed
    /// ([`advance`](Self::advance) and [`writable`](Self::writable) in turn). Dropped
    /// part-way, the frame stays where it got to, to be finished by another call.
    pub async fn write_all(&mut self, payload: &[u8]) -> Result<(), TransportError> {
        while !self.advance(payload)? {
            self.writable().await?;
        }
        Ok(())
    }

    /// Resolves when the socket may take more bytes; fails if the lane was closed or the
    /// frame failed.
    pub async fn writable(&self) -> Result<(), TransportError> {
        let Some(w) = self.guard.as_ref() else {
            return if self.done == self.total() {
                Ok(())
            } else {
                Err(lane_err(Some(self.peer), "the lane failed"))
            };
        };
        tokio::select! {
            r = w.half.writable() => r.map_err(|e| lane_err(Some(self.peer), e)),
            () = self.side.closed() => Err(lane_err(Some(self.peer), "closed")),
        }
    }

    /// The socket failed: nothing more can be written, so there is nothing to pad (`cut`
    /// stays set, so the lane stays refused).
    fn broken(&mut self) {
        self.side.closed.send_replace(true);
        self.guard = None;
    }
}

/// What is left to write of a frame after `done` bytes: the rest of the head, of the
/// payload and of the trailer.
fn frame_parts<'a>(
    head: &'a [u8],
    payload: &'a [u8],
    trailer: &'a [u8],
    done: usize,
) -> [&'a [u8]; 3] {
    let h = done.min(head.len());
    let p = (done - h).min(payload.len());
    let t = (done - h - p).min(trailer.len());
    [&head[h..], &payload[p..], &trailer[t..]]
}

impl Drop for DirectFrame {
    fn drop(&mut self) {
        let Some(mut w) = self.guard.take() else {
            return;
        };
        let (done, total) = (self.done, self.total());
        if done == 0 {
            // Nothing of it reached the socket: the stream is in step (and its credit, if
            // any, goes back; its announcement, if any, is withdrawn, behind the lock).
            w.cut = false;
            if let Some(credit) = self.credit.as_mut() {
                credit.unspend();
            }
            drop(w);
            if let Some(withdrawal) = self.withdrawal.take() {
                withdraw(&self.side, withdrawal);
            }
            return;
        }
        // The receiver gives the credit back on reading the aborted frame.
        let aborted = self.trailer(FRAME_ABORTED);
        // Half written: keep the lock and finish the frame as padding the receiver
        // discards, so the stream stays in step.
        let (head, len, side, peer) = (self.head.clone(), self.len, self.side.clone(), self.peer);
        let pad = async move {
            let zeros = vec![0u8; len.min(64 << 10)];
            let mut at = done;
            while at < total {
                let h = at.min(head.len());
                let chunk: &[u8] = if h < head.len() {
                    &head[h..]
                } else if at - head.len() < len {
                    let left = len - (at - head.len());
                    &zeros[..left.min(zeros.len())]
                } else {
                    std::slice::from_ref(&aborted)
                };
                // Cut short here (closed, or the runtime dropping this task), `cut` stays
                // set and the next writer ends the lane.
                let n = tokio::select! {
                    r = w.half.write(chunk) => r,
                    () = side.closed() => return,
                };
                match n {
                    Ok(0) | Err(_) => {
                        side.closed.send_replace(true);
                        warn!(%peer, "trusted lane: padding an abandoned frame failed");
                        return;
                    }
                    Ok(n) => at += n,
                }
            }
            w.cut = false;
            debug!(%peer, "trusted lane: abandoned frame padded and marked aborted");
        };
        match &self.side.rt {
            Some(rt) => {
                rt.spawn(pad);
            }
            // No runtime to finish it on: the stream cannot stay in step (`cut` stays
            // set), so end the lane.
            None => {
                self.side.closed.send_replace(true);
            }
        }
    }
}

/// Frames larger than this are read in pieces of this size, into reused buffers.
const PIECE_BYTES: usize = 1 << 20;

/// Pieces kept for reuse, for all the lanes of a process together (64 MiB): reading each
/// large frame into fresh memory cost a page fault per 4 KiB (16,384 for a 64 MiB
/// message, about 2 us each here).
const POOLED_PIECES: usize = 64;

/// Buffers for the pieces of large frames, returned when the last reference to a piece
/// is dropped (the receiver has copied it out).
#[derive(Default)]
struct PiecePool {
    free: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// The process's pool of pieces, shared by its lanes (so the memory it keeps is bounded
/// per process, not per peer).
fn piece_pool() -> Arc<PiecePool> {
    static POOL: std::sync::OnceLock<Arc<PiecePool>> = std::sync::OnceLock::new();
    POOL.get_or_init(Arc::default).clone()
}

impl PiecePool {
    fn take(&self) -> Vec<u8> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.pop()
            .unwrap_or_else(|| Vec::with_capacity(PIECE_BYTES))
    }

    fn put(&self, mut buf: Vec<u8>) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < POOLED_PIECES && buf.capacity() >= PIECE_BYTES {
            buf.clear();
            free.push(buf);
        }
    }
}

/// A piece of a received frame; its buffer goes back to the pool when dropped.
struct Piece {
    buf: Vec<u8>,
    pool: Arc<PiecePool>,
}

impl AsRef<[u8]> for Piece {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.buf));
    }
}

/// Reads a frame's `len` payload bytes from `body` in pieces of pooled buffers.
async fn read_pieces<R: tokio::io::AsyncRead + Unpin>(
    body: &mut R,
    len: usize,
    pool: &Arc<PiecePool>,
) -> Result<Vec<Bytes>, String> {
    // Sized from the header's length, which only `max_frame_bytes` bounds (and a user may
    // lift that bound): at most a GiB's worth of pieces up front, more as they come.
    let mut chunks = Vec::with_capacity(len.div_ceil(PIECE_BYTES).min(1024));
    let mut got = 0;
    while got < len {
        let want = (len - got).min(PIECE_BYTES);
        let mut buf = pool.take();
        fill(&mut (&mut *body).take(want as u64), &mut buf, want, len).await?;
        got += want;
        chunks.push(Bytes::from_owner(Piece {
            buf,
            pool: pool.clone(),
        }));
    }
    Ok(chunks)
}

/// Reads `want` bytes from `body` into `buf`, part of a frame of `len` bytes (for the
/// error).
async fn fill<R: tokio::io::AsyncRead + Unpin, B: bytes::BufMut>(
    body: &mut R,
    buf: &mut B,
    want: usize,
    len: usize,
) -> Result<(), String> {
    let mut got = 0;
    while got < want {
        match body.read_buf(buf).await {
            Ok(0) => return Err(format!("ended inside a frame of {len} bytes")),
            Ok(n) => got += n,
            Err(e) => return Err(format!("read failed: {e}")),
        }
    }
    Ok(())
}

/// A reader that counts the bytes it reads into `count`.
struct Counted<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if read > 0 {
            self.count.fetch_add(read as u64, Ordering::Relaxed);
        }
        polled
    }
}

/// The credit a lane's receiving side holds for frames sent on it
/// ([`TcpLane::take_credit`]), and what it owes back.
#[derive(Debug, Default)]
struct Returns {
    /// Bytes of credited frames read and not yet let go.
    held: AtomicU64,
    /// Bytes let go and not yet given back.
    owed: AtomicU64,
    /// Woken when enough is owed for a [`FrameKind::Credit`] frame, or an announcement
    /// came.
    due: tokio::sync::Notify,
    /// Set when an announcement came: the sender ran short of credit, so whatever is owed
    /// goes back at once.
    flush: std::sync::atomic::AtomicBool,
}

impl Returns {
    /// Takes credit for a frame of `len` bytes that its sender sent on it; `None` when
    /// that would be more than the sender was given.
    fn hold(self: &Arc<Self>, len: usize) -> Option<HeldCredit> {
        let len = len as u64;
        let before = self.held.fetch_add(len, Ordering::SeqCst);
        if before + len > LANE_CREDIT_BYTES as u64 {
            return None;
        }
        // Holding more may make what is owed due.
        self.wake_if_due();
        Some(HeldCredit {
            returns: self.clone(),
            len,
        })
    }

    /// Lets go of `len` bytes of credit: owed back to the sender from now on.
    fn release(&self, len: u64) {
        // Before the sender can learn of it: the frames it sends on it come later.
        self.held.fetch_sub(len, Ordering::SeqCst);
        self.owed.fetch_add(len, Ordering::SeqCst);
        self.wake_if_due();
    }

    /// True when what is owed should go back now: [`CREDIT_RETURN_BYTES`], or half the
    /// credit that frames not yet let go do not hold (with more of the window held, less
    /// is ever owed at once, and the sender would wait for it for good).
    fn is_due(&self, owed: u64) -> bool {
        let held = self.held.load(Ordering::SeqCst);
        let free = (LANE_CREDIT_BYTES as u64).saturating_sub(held);
        owed > 0 && (owed >= CREDIT_RETURN_BYTES || 2 * owed >= free)
    }

    /// Wakes the return task when what is owed is due, or when an announcement asked for
    /// it and nothing was owed then.
    fn wake_if_due(&self) {
        let owed = self.owed.load(Ordering::SeqCst);
        if self.is_due(owed) || (owed > 0 && self.flush.load(Ordering::SeqCst)) {
            self.due.notify_one();
        }
    }
}

/// Credit a received frame holds until it is dropped (taken by its receive, or
/// discarded): then it is owed back to the sender.
#[derive(Debug)]
pub(crate) struct HeldCredit {
    returns: Arc<Returns>,
    len: u64,
}

impl Drop for HeldCredit {
    fn drop(&mut self) {
        self.returns.release(self.len);
    }
}

/// A peer's announced frame, from its announcement until its data comes or it is
/// withdrawn (an aborted frame under its key, [`Clearance`]): removing it from
/// [`Answers::granted`] lets it go either way.
#[derive(Debug)]
enum Grant {
    /// Its answer is being decided (the table's `admit`); dropped, the wait ends.
    Deciding { _withdraws: oneshot::Sender<()> },
    /// Let in and answered: where its data goes, and its announced length.
    Granted(oneshot::Sender<Vec<Bytes>>, usize),
}

/// What a lane's reader shares with the tasks that answer the peer's announcements
/// ([`TcpLane::announce`]).
struct Answers {
    /// The lane's writer queue, where answers go (not holding the lane open).
    queue: mpsc::WeakSender<Job>,
    /// The lane's closed flag ([`WriteSide::closed`]); its sender gone counts as closed.
    closed: watch::Receiver<bool>,
    local: NodeId,
    max_frame: u64,
    /// Announced frames let in and answered, waiting for their data: where to hand it,
    /// and the length announced.
    granted: Arc<std::sync::Mutex<HashMap<MailboxKey, Grant>>>,
    /// Announcements read and not answered yet.
    unanswered: AtomicUsize,
    /// Set once the reader stopped.
    ended: watch::Sender<bool>,
    /// This side's own announcements, which the peer's answers ([`FrameKind::Clear`])
    /// clear.
    announced: Arc<Announced>,
    /// Credit held for the peer's frames, and owed back to it.
    returns: Arc<Returns>,
    /// This side's own credit, which the peer's [`FrameKind::Credit`] frames give back.
    credit: Arc<SendCredit>,
}

impl Answers {
    fn granted(&self) -> std::sync::MutexGuard<'_, HashMap<MailboxKey, Grant>> {
        self.granted.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Resolves once the lane is closed or its reader stopped.
    async fn gone(&self) {
        let mut ended = self.ended.subscribe();
        let mut closed = self.closed.clone();
        tokio::select! {
            _ = closed.wait_for(|c| *c) => {}
            _ = ended.wait_for(|e| *e) => {}
        }
    }

    /// Answers the announcement of `key`, a frame of `len` bytes: once the table lets it
    /// in (its receiver waits for it, or its early-arrival budget is taken for it), or
    /// refuses it. A frame let in waits here for its data (with that budget), and is
    /// forgotten if its sender abandons it meanwhile or the lane goes.
    /// `withdrawn` resolves once the sender withdraws the announcement (the reader takes
    /// its `Grant::Deciding` out).
    async fn grant(
        self: Arc<Self>,
        table: Arc<MailboxTable>,
        key: MailboxKey,
        len: usize,
        mut withdrawn: oneshot::Receiver<()>,
    ) {
        let given_up = async {
            tokio::select! {
                () = self.gone() => {}
                _ = &mut withdrawn => {}
            }
        };
        let admitted = table.admit(key, len, Park::UntilBudget, given_up).await;
        let let_in = match admitted {
            Ok(a) => {
                // Before the answer: the frame may follow it at once.
                let (tx, rx) = oneshot::channel();
                let mut granted = self.granted();
                match granted.get_mut(&key) {
                    Some(g @ Grant::Deciding { .. }) => {
                        *g = Grant::Granted(tx, len);
                        drop(granted);
                        Some((a, rx))
                    }
                    // Withdrawn just as it was let in.
                    _ => {
                        drop(granted);
                        debug!(peer = %key.src, ?key, "announced frame withdrawn by its sender");
                        table.forget_incoming(key, &a.wanted);
                        None
                    }
                }
            }
            Err(why) => {
                let mut granted = self.granted();
                if matches!(granted.get(&key), Some(Grant::Deciding { .. })) {
                    granted.remove(&key);
                }
                drop(granted);
                // The frame, if it comes, is discarded as any other for that key.
                debug!(peer = %key.src, ?key, ?why, "announced frame refused; answering anyway");
                None
            }
        };
        let clear = FrameHeader::for_payload(
            FrameKind::Clear,
            key.comm,
            key.tag,
            key.step,
            self.local.0,
            0,
            self.max_frame,
        );
        if let (Ok(head), Some(queue)) = (clear, self.queue.upgrade()) {
            let _ = queue.send((head, Bytes::new(), FRAME_COMPLETE)).await;
        }
        // Answered once the answer is queued, not before: this side's writer may be stuck
        // (a peer that does not read its lane), and announcements answered only in tasks
        // waiting for the queue must still count against the limit, or their tasks pile up
        // without one. (An honest sender counts each until it reads the answer, so it
        // never has fewer unanswered than this side.)
        self.unanswered.fetch_sub(1, Ordering::SeqCst);
        let Some((admitted, mut data)) = let_in else {
            return;
        };
        loop {
            tokio::select! {
                // Data that came is delivered, whatever else happened meanwhile.
                biased;
                got = &mut data => {
                    match got {
                        Ok(chunks) => {
                            let payload = Payload::from_chunks(chunks, admitted.permit);
                            table.finish_incoming(key, &admitted.wanted, payload);
                        }
                        // Its sender abandoned it midway, or the reader stopped.
                        Err(_) => table.forget_incoming(key, &admitted.wanted),
                    }
                    return;
                }
                () = admitted.wanted.notified() => {
                    // Abandoned by its sender (a marker took the slot), or retired.
                    if !table.still_incoming(&key, &admitted.wanted) {
                        self.granted().remove(&key);
                        return;
                    }
                }
                () = self.gone() => {
                    if self.granted().remove(&key).is_none() {
                        // The reader took the grant: its data is on its way, or the frame
                        // was cut short (the sender dropped, no data).
                        if let Ok(chunks) = data.await {
                            let payload = Payload::from_chunks(chunks, admitted.permit);
                            table.finish_incoming(key, &admitted.wanted, payload);
                            return;
                        }
                    }
                    table.forget_incoming(key, &admitted.wanted);
                    return;
                }
            }
        }
    }
}

impl Answers {
    /// Gives credit back to the peer as frames sent on it are let go, in
    /// [`FrameKind::Credit`] frames, once what is owed is due (`Returns::is_due`) or an
    /// announcement came, until the lane goes.
    async fn return_credit(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.returns.due.notified() => {}
                () = self.gone() => return,
            }
            let owed = self.returns.owed.load(Ordering::SeqCst);
            if owed == 0 {
                // An announcement's flush, if any, waits for the next credit let go.
                continue;
            }
            let flush = self.returns.flush.swap(false, Ordering::SeqCst);
            if !(flush || self.returns.is_due(owed)) {
                continue;
            }
            self.returns.owed.fetch_sub(owed, Ordering::SeqCst);
            let head = FrameHeader::for_payload(
                FrameKind::Credit,
                0,
                0,
                0,
                self.local.0,
                CREDIT_BYTES,
                self.max_frame,
            );
            let (Ok(head), Some(queue)) = (head, self.queue.upgrade()) else {
                return;
            };
            let n = Bytes::copy_from_slice(&owed.to_be_bytes());
            if queue.send((head, n, FRAME_COMPLETE)).await.is_err() {
                return;
            }
        }
    }
}

/// The 8 payload bytes of an announcement or credit frame (checked for that length).
fn fixed_payload(chunks: &[Bytes]) -> [u8; 8] {
    let mut out = [0u8; 8];
    let mut at = 0;
    for c in chunks {
        let n = c.len().min(8 - at);
        out[at..at + n].copy_from_slice(&c[..n]);
        at += n;
    }
    out
}

/// Reads frames until the lane ends: (reason, clean end).
async fn read_loop<R: tokio::io::AsyncRead + Unpin>(
    read: R,
    inbound: Inbound,
    peer: NodeId,
    answers: &Arc<Answers>,
    received: &[AtomicU64; 3],
) -> (String, bool) {
    let max_frame = answers.max_frame;
    // Small frames' prefixes, headers, payloads and trailers come out of one buffered read
    // instead of a syscall each; a large payload bypasses the buffer (it is read straight
    // into its own allocation once the buffered bytes are used).
    let mut read = tokio::io::BufReader::with_capacity(READ_BUFFER, read);
    let pieces = piece_pool();
    let table = &inbound.table;
    let mut head = [0u8; MAX_HEADER_BYTES];
    loop {
        // Only an end before a frame's first byte is a clean one: within its length
        // prefix, as anywhere later in the frame, the peer stopped midway.
        let first = match read.read_u8().await {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return ("closed by the peer".into(), true)
            }
            Err(e) => return (format!("read failed: {e}"), false),
        };
        let second = match read.read_u8().await {
            Ok(b) => b,
            Err(e) => return (format!("read failed within a frame's length: {e}"), false),
        };
        let n = u16::from_be_bytes([first, second]) as usize;
        if n == 0 || n > MAX_HEADER_BYTES {
            return (format!("bad header length {n}"), false);
        }
        if let Err(e) = read.read_exact(&mut head[..n]).await {
            return (format!("read failed: {e}"), false);
        }
        let header = match FrameHeader::decode(&head[..n]) {
            Ok(h) => h,
            Err(e) => return (format!("undecodable header: {e}"), false),
        };
        if header.version != PROTOCOL_VERSION {
            return (format!("protocol version {}", header.version), false);
        }
        if header.src != peer.0 {
            return (format!("a frame claims node {}", header.src), false);
        }
        let kind = header.kind;
        let fixed = match kind {
            FrameKind::Data => None,
            FrameKind::Announce => Some(ANNOUNCE_BYTES),
            FrameKind::Clear => Some(0),
            FrameKind::Credit => Some(CREDIT_BYTES),
            other => return (format!("{other:?} frame on the data lane"), false),
        };
        if fixed.is_some_and(|n| header.len != n as u64) {
            return (format!("a {kind:?} frame of {} bytes", header.len), false);
        }
        if header.len > max_frame {
            return (format!("frame of {} bytes", header.len), false);
        }
        let len = header.len as usize;
        // Never past this frame: `take` bounds every read to what is left of it.
        let mut body = (&mut read).take(header.len);
        let chunks = if len > PIECE_BYTES {
            match read_pieces(&mut body, len, &pieces).await {
                Ok(c) => c,
                Err(reason) => return (reason, false),
            }
        } else {
            let mut buf = BytesMut::with_capacity(len);
            if let Err(reason) = fill(&mut body, &mut buf, len, len).await {
                return (reason, false);
            }
            vec![buf.freeze()]
        };
        let mut trailer = [0u8; 1];
        if let Err(e) = read.read_exact(&mut trailer).await {
            return (format!("ended before a frame's trailer: {e}"), false);
        }
        let key = MailboxKey {
            comm: header.comm,
            tag: header.tag,
            step: header.step,
            src: peer,
        };
        let trailer = trailer[0];
        // Only data frames are sent on credit, or written from their sender's memory (the
        // ones that can be cut short).
        if trailer > (FRAME_ABORTED | FRAME_CREDITED)
            || (trailer != FRAME_COMPLETE && kind != FrameKind::Data)
        {
            return (format!("bad frame trailer {trailer}"), false);
        }
        let credit = if trailer & FRAME_CREDITED != 0 {
            match answers.returns.hold(credit_charge(len)) {
                Some(c) => Some(c),
                None => return ("frames sent past their credit".into(), false),
            }
        } else {
            None
        };
        if trailer & FRAME_ABORTED != 0 {
            // An empty one, sent on no credit, is how a sender withdraws an announcement
            // (`Clearance`); any other was abandoned midway and padded out.
            let withdrawn = len == 0 && credit.is_none();
            debug!(%peer, ?key, withdrawn, "discarding a frame its sender gave up on");
            received[if withdrawn { 2 } else { 1 }].fetch_add(1, Ordering::Relaxed);
            // Its announcement, if any, is let go: the wait for its answer ends, or the
            // budget it was let in with goes back (and its credit is given back).
            answers.granted().remove(&key);
            continue;
        }
        match kind {
            FrameKind::Credit => {
                let n = u64::from_be_bytes(fixed_payload(&chunks));
                if let Err(spent) = answers.credit.give_back(n) {
                    return (
                        format!("{n} bytes of credit given back, {spent} spent"),
                        false,
                    );
                }
                continue;
            }
            FrameKind::Clear => {
                if !answers.announced.answer((key.comm, key.tag, key.step)) {
                    debug!(%peer, ?key, "an answer to no announcement");
                }
                continue;
            }
            FrameKind::Announce => {
                let len = u64::from_be_bytes(fixed_payload(&chunks));
                if len > max_frame {
                    return (format!("announced a frame of {len} bytes"), false);
                }
                if answers.unanswered.fetch_add(1, Ordering::SeqCst) >= LANE_ANNOUNCEMENTS {
                    return (
                        format!("over {LANE_ANNOUNCEMENTS} announcements unanswered"),
                        false,
                    );
                }
                // Its sender ran short of credit: what is owed goes back now.
                answers.returns.flush.store(true, Ordering::SeqCst);
                answers.returns.due.notify_one();
                // Answered in a task of its own: the frames behind it are read meanwhile.
                // (Before the task runs: a withdrawal read next finds it.)
                let (deciding, withdrawn) = oneshot::channel();
                answers.granted().insert(
                    key,
                    Grant::Deciding {
                        _withdraws: deciding,
                    },
                );
                tokio::spawn(
                    answers
                        .clone()
                        .grant(table.clone(), key, len as usize, withdrawn),
                );
                continue;
            }
            _ => {}
        }
        received[0].fetch_add(1, Ordering::Relaxed);
        let granted = answers.granted().remove(&key);
        if matches!(granted, Some(Grant::Deciding { .. })) {
            return ("an announced frame sent before its answer".into(), false);
        }
        if credit.is_some() {
            if granted.is_some() {
                return ("a frame both announced and sent on credit".into(), false);
            }
            match table.deliver_whole_holding(key, chunks, credit).await {
                Ok(()) => {}
                Err(Refused::Closed) => return ("node shut down".into(), true),
                Err(why) => debug!(%peer, ?key, ?why, "discarding a frame sent on credit"),
            }
            continue;
        }
        // An announced frame goes to the task that let it in, with the budget it took.
        let chunks = match granted {
            Some(Grant::Granted(_, announced)) if announced != len => {
                return (
                    format!("a frame of {len} bytes announced as {announced}"),
                    false,
                );
            }
            Some(Grant::Granted(tx, _)) => match tx.send(chunks) {
                Ok(()) => continue,
                // Let go meanwhile (abandoned, or its tag retired): delivered as any frame.
                Err(chunks) => chunks,
            },
            // (`Deciding` ended the lane above.)
            Some(Grant::Deciding { .. }) | None => chunks,
        };
        // Never parked: the frames behind it on this connection would wait too.
        match table.deliver_whole(key, chunks).await {
            Ok(()) => {}
            Err(Refused::Duplicate) => {
                warn!(%peer, ?key, "discarding a frame for a key already buffered");
            }
            Err(Refused::Retired) => {
                debug!(%peer, ?key, "discarding frame for a retired collective");
            }
            Err(Refused::Abandoned) => {
                debug!(%peer, ?key, "discarding a frame its sender abandoned");
            }
            // Not for a lane's frames, which are never refused for budget (`Park::Never`;
            // kept without budget, they take their sender's overdraft where it is free).
            Err(Refused::OverBudget { .. }) => {}
            Err(Refused::Closed) => return ("node shut down".into(), true),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use tokio::sync::oneshot;

    use super::*;
    use crate::MailboxTable;

    #[tokio::test]
    async fn large_frames_are_read_into_pieces_that_are_reused() {
        let pool = Arc::new(PiecePool::default());
        let len = 2 * PIECE_BYTES + PIECE_BYTES / 2;
        let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        // The reader stops at the frame's end, whatever follows it.
        let mut wire = data.clone();
        wire.extend_from_slice(b"next frame");
        let mut src = &wire[..];
        let chunks = read_pieces(&mut src, len, &pool).await.unwrap();
        assert_eq!(src, b"next frame");
        let lens: Vec<usize> = chunks.iter().map(Bytes::len).collect();
        assert_eq!(lens, [PIECE_BYTES, PIECE_BYTES, PIECE_BYTES / 2]);
        assert!(chunks.concat() == data);
        let addresses: Vec<*const u8> = chunks.iter().map(|c| c.as_ptr()).collect();
        drop(chunks);
        // All three buffers came back, and the next frame is read into them.
        assert_eq!(pool.free.lock().unwrap().len(), 3);
        let mut src = &data[..];
        let again = read_pieces(&mut src, len, &pool).await.unwrap();
        assert!(again.iter().all(|c| addresses.contains(&c.as_ptr())));
        assert!(pool.free.lock().unwrap().is_empty());
        // A frame cut short is an error.
        let mut short = &data[..PIECE_BYTES + 10];
        assert!(read_pieces(&mut short, len, &pool).await.is_err());
        // So is a header claiming far more than memory holds (it used to reserve room
        // for every piece first, and abort the process).
        let mut nothing = &b""[..];
        assert!(read_pieces(&mut nothing, 1 << 62, &pool).await.is_err());
    }

    async fn pair(
        listen_key: [u8; 32],
        dial_key: [u8; 32],
    ) -> (
        Result<LaneParts, TransportError>,
        Result<LaneParts, TransportError>,
    ) {
        pair_with(listen_key, dial_key, &config(1 << 20)).await
    }

    /// The defaults, with frames of up to `max_frame` bytes.
    fn config(max_frame: u64) -> TransportConfig {
        TransportConfig {
            max_frame_bytes: max_frame,
            ..TransportConfig::default()
        }
    }

    async fn pair_with(
        listen_key: [u8; 32],
        dial_key: [u8; 32],
        config: &TransportConfig,
    ) -> (
        Result<LaneParts, TransportError>,
        Result<LaneParts, TransportError>,
    ) {
        // The listener a node binds, as in production.
        let listener = bind_lane_listener(std::net::Ipv4Addr::LOCALHOST.into(), config).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let addr = listener.local_addr().unwrap();
        let t = Duration::from_secs(10);
        let accept = async {
            let (s, _) = listener.accept().await.unwrap();
            accept_lane(
                s,
                NodeId(0),
                |n| (n == NodeId(1)).then_some(listen_key),
                config,
                t,
            )
            .await
        };
        let dial = dial_lane(addr, None, NodeId(1), NodeId(0), dial_key, config, t);
        tokio::join!(accept, dial)
    }

    /// A lane whose peer closes between frames ends cleanly; one that closes within a
    /// frame's length prefix does not (the peer stopped midway: lost, not departed).
    #[tokio::test]
    async fn only_a_close_between_frames_ends_a_lane_cleanly() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        for (sent, clean) in [(&b""[..], true), (&[0u8][..], false)] {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (server, _) = listener.accept().await.unwrap();
            client.write_all(sent).await.unwrap();
            client.shutdown().await.unwrap();
            let (read, _write) = server.into_split();
            let received = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
            let (answers, _closed) = answers(1 << 20);
            let ended = read_loop(read, inbound(), NodeId(1), &answers, &received);
            let (reason, got) = tokio::time::timeout(Duration::from_secs(10), ended)
                .await
                .expect("the lane ended in time");
            assert_eq!(got, clean, "{} byte(s) sent: {reason}", sent.len());
        }
    }

    /// The bytes a lane's reader reads are counted as they arrive, before the frame they
    /// belong to is whole (the sign of life a node's loss detection reads).
    #[tokio::test]
    async fn a_lane_counts_the_bytes_it_reads_within_a_frame() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (read, _write) = server.into_split();
        let count = Arc::new(AtomicU64::new(0));
        let read = Counted {
            inner: read,
            count: count.clone(),
        };
        let reader = tokio::spawn(async move {
            let received = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
            let (answers, _closed) = answers(1 << 20);
            read_loop(read, inbound(), NodeId(1), &answers, &received).await
        });
        // A header length of 20, then 7 of those 20 bytes: the reader waits for the rest.
        let sent = [0u8, 20, 1, 2, 3, 4, 5, 6, 7];
        client.write_all(&sent).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while count.load(Ordering::Relaxed) < sent.len() as u64 {
            assert!(std::time::Instant::now() < deadline, "bytes never counted");
            tokio::task::yield_now().await;
        }
        assert_eq!(count.load(Ordering::Relaxed), sent.len() as u64);
        assert!(
            !reader.is_finished(),
            "the reader still waits within the frame"
        );
        reader.abort();
    }

    /// What a reader without a lane to answer on shares: frames of up to `max_frame`
    /// bytes; the lane counts as closed once the returned sender is dropped.
    fn answers(max_frame: u64) -> (Arc<Answers>, watch::Sender<bool>) {
        let (queue, _) = mpsc::channel(1);
        answers_queued(max_frame, &queue)
    }

    /// [`answers`] whose answers go to `queue` (while it is held).
    fn answers_queued(
        max_frame: u64,
        queue: &mpsc::Sender<Job>,
    ) -> (Arc<Answers>, watch::Sender<bool>) {
        let (closed, rx) = watch::channel(false);
        let answers = Answers {
            queue: queue.downgrade(),
            closed: rx,
            local: NodeId(0),
            max_frame,
            granted: Arc::default(),
            unanswered: AtomicUsize::new(0),
            ended: watch::Sender::new(false),
            announced: Arc::new(Announced::new()),
            returns: Arc::default(),
            credit: Arc::new(SendCredit::new()),
        };
        (Arc::new(answers), closed)
    }

    fn inbound() -> Inbound {
        let (control, _) = mpsc::channel(4);
        let (relay, _) = mpsc::channel(4);
        Inbound {
            table: Arc::new(MailboxTable::new(1 << 20)),
            control,
            relay,
        }
    }

    /// Both ends of a lane probe an idle peer and give up on unacknowledged data, so a
    /// path that stops carrying packets ends the lane in under a minute (with the kernel's
    /// defaults only after about 15 minutes of retransmissions).
    #[tokio::test]
    async fn both_ends_of_a_lane_notice_a_dead_path() {
        let (a, b) = pair([9; 32], [9; 32]).await;
        for parts in [a.unwrap(), b.unwrap()] {
            let sock = socket2::SockRef::from(parts.read.as_ref());
            assert!(sock.keepalive().unwrap());
            assert_eq!(sock.keepalive_time().unwrap(), KEEPALIVE_IDLE);
            assert_eq!(sock.keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
            #[cfg(target_os = "linux")]
            {
                assert_eq!(sock.keepalive_retries().unwrap(), KEEPALIVE_PROBES);
                assert_eq!(sock.tcp_user_timeout().unwrap(), Some(USER_TIMEOUT));
            }
        }
        // Linux ends a connection with a user timeout on that alone, probes or not: it
        // must be the idle time and the probes together, or an idle lane would end later
        // than its probes promise (README: about 25 s).
        #[cfg(target_os = "linux")]
        assert_eq!(
            USER_TIMEOUT,
            KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_PROBES
        );
    }

    #[tokio::test]
    async fn frames_cross_a_lane_both_ways_in_order() {
        let (a, b) = pair([9; 32], [9; 32]).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!((a.lane.peer(), b.lane.peer()), (NodeId(1), NodeId(0)));
        let (ia, ib) = (inbound(), inbound());
        let _ra = a.lane.spawn_reader(a.read, ia.clone(), |_, _| {});
        let _rb = b.lane.spawn_reader(b.read, ib.clone(), |_, _| {});
        for step in 0..50u64 {
            let len = (step as usize * 7919) % 70_000;
            b.lane
                .send(5, 1, step, Bytes::from(vec![step as u8; len]))
                .await
                .unwrap();
            a.lane
                .send(5, 2, step, Bytes::from(vec![!(step as u8); len]))
                .await
                .unwrap();
        }
        for step in 0..50u64 {
            let len = (step as usize * 7919) % 70_000;
            let t = Duration::from_secs(10);
            let got = ia
                .table
                .take(
                    MailboxKey {
                        comm: 5,
                        tag: 1,
                        step,
                        src: NodeId(1),
                    },
                    t,
                )
                .await
                .unwrap();
            let mut v = vec![0u8; got.len()];
            got.copy_to(&mut v).unwrap();
            assert_eq!(v, vec![step as u8; len]);
            let got = ib
                .table
                .take(
                    MailboxKey {
                        comm: 5,
                        tag: 2,
                        step,
                        src: NodeId(0),
                    },
                    t,
                )
                .await
                .unwrap();
            assert_eq!(got.len(), len);
        }
        assert!(matches!(
            b.lane
                .send(5, 1, 99, Bytes::from(vec![0u8; (1 << 20) + 1]))
                .await,
            Err(TransportError::FrameTooLarge { .. })
        ));
    }

    fn key(tag: u64, step: u64, src: u64) -> MailboxKey {
        MailboxKey {
            comm: 5,
            tag,
            step,
            src: NodeId(src),
        }
    }

    /// Drives a direct frame to the end.
    async fn write_direct(lane: &TcpLane, tag: u64, step: u64, payload: &[u8]) {
        let mut f = lane.begin_frame(5, tag, step, payload.len()).await.unwrap();
        while !f.advance(payload).unwrap() {
            f.writable().await.unwrap();
        }
    }

    #[tokio::test]
    async fn direct_frames_and_queued_frames_interleave_whole() {
        let (a, b) = pair([4; 32], [4; 32]).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let ia = inbound();
        let _ra = a.lane.spawn_reader(a.read, ia.clone(), |_, _| {});
        let _rb = b.lane.spawn_reader(b.read, inbound(), |_, _| {});
        let big: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
        for step in 0..6u64 {
            // Owned frames queued for the writer task race the direct ones for the lock.
            let queued = b
                .lane
                .send(5, 1, step, Bytes::from(vec![step as u8; 90_000]));
            let direct = write_direct(&b.lane, 2, step, &big[..big.len() - step as usize]);
            let (q, ()) = tokio::join!(queued, direct);
            q.unwrap();
        }
        write_direct(&b.lane, 3, 0, &[]).await;
        let t = Duration::from_secs(10);
        for step in 0..6u64 {
            let got = ia.table.take(key(1, step, 1), t).await.unwrap();
            let mut v = vec![0u8; got.len()];
            got.copy_to(&mut v).unwrap();
            assert_eq!(v, vec![step as u8; 90_000]);
            let got = ia.table.take(key(2, step, 1), t).await.unwrap();
            let mut v = vec![0u8; got.len()];
            got.copy_to(&mut v).unwrap();
            assert_eq!(v, &big[..big.len() - step as usize]);
        }
        assert_eq!(ia.table.take(key(3, 0, 1), t).await.unwrap().len(), 0);
        // A direct frame is held to the frame limit and to its length.
        assert!(matches!(
            b.lane.begin_frame(5, 4, 0, (1 << 20) + 1).await,
            Err(TransportError::FrameTooLarge { .. })
        ));
        let mut f = b.lane.begin_frame(5, 4, 0, 10).await.unwrap();
        assert!(f.advance(&[0u8; 11]).is_err());
    }

    /// A lane whose dialing end (`b`) holds a direct frame of 32 MiB cut partway, and the
    /// listening end's inbound table; `ended` gets the listening reader's end.
    struct Cut {
        ia: Inbound,
        b: TcpLane,
        frame: DirectFrame,
        ended: oneshot::Receiver<(String, bool)>,
    }

    async fn cut_frame(key: u8) -> Cut {
        let (a, b) = pair_with([key; 32], [key; 32], &config(64 << 20)).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let ia = inbound();
        let (end_tx, ended) = oneshot::channel();
        let _ra = a
            .lane
            .spawn_reader(a.read, ia.clone(), move |reason, clean| {
                let _ = end_tx.send((reason, clean));
            });
        let _rb = b.lane.spawn_reader(b.read, inbound(), |_, _| {});
        // On this single-threaded runtime the reader cannot run during `advance`, so a
        // 32 MiB frame stops partway, when the socket buffers are full.
        let payload = vec![7u8; 32 << 20];
        let mut frame = b.lane.begin_frame(5, 1, 0, payload.len()).await.unwrap();
        assert!(
            !frame.advance(&payload).unwrap(),
            "the whole frame fit the socket"
        );
        Cut {
            ia,
            b: b.lane,
            frame,
            ended,
        }
    }

    /// Frames arrive in stream order, so after a later frame (or the lane's end) these
    /// were read and dropped if they were ever going to be.
    async fn assert_not_delivered(ia: &Inbound, steps: &[u64]) {
        for &step in steps {
            assert!(
                ia.table
                    .take(key(1, step, 1), Duration::ZERO)
                    .await
                    .is_err(),
                "frame {step} was delivered"
            );
        }
    }

    /// A dialer takes the lane only once the listener says it took the dialer's
    /// confirmation: one that closes instead (past its deadline, say) fails the dial, which
    /// is retried, where the dialer used to start a lane on a closed socket.
    #[tokio::test]
    async fn a_dial_fails_unless_the_listener_takes_its_confirmation() {
        let key = [6u8; 32];
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = async {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut hello = [0u8; 54];
            s.read_exact(&mut hello).await.unwrap();
            let nl = [3u8; 32];
            let tag = mac(&key, b"L", 1, 0, &hello[22..54], &nl);
            s.write_all(&nl).await.unwrap();
            s.write_all(tag.as_ref()).await.unwrap();
            let mut confirm = [0u8; 32];
            s.read_exact(&mut confirm).await.unwrap();
            assert!(verify(&key, b"D", (1, 0), &hello[22..54], &nl, &confirm));
            // Closes without the last byte.
        };
        let t = Duration::from_secs(10);
        let config = config(1 << 20);
        let (_, dialled) = tokio::join!(
            fake,
            dial_lane(addr, None, NodeId(1), NodeId(0), key, &config, t)
        );
        match dialled {
            Err(e) => assert!(e.to_string().contains("did not take the lane"), "{e}"),
            Ok(_) => panic!("a lane on a socket the listener closed"),
        }
    }

    /// A second frame for a key already buffered is discarded, as over QUIC, and the lane
    /// goes on (it used to end, and with it the peer).
    #[tokio::test]
    async fn a_duplicate_frame_is_discarded_and_the_lane_goes_on() {
        let (a, b) = pair([8; 32], [8; 32]).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let ia = inbound();
        let (end_tx, mut ended) = oneshot::channel();
        let _ra = a
            .lane
            .spawn_reader(a.read, ia.clone(), move |reason, clean| {
                let _ = end_tx.send((reason, clean));
            });
        b.lane
            .send(5, 1, 0, Bytes::from_static(b"first"))
            .await
            .unwrap();
        b.lane
            .send(5, 1, 0, Bytes::from_static(b"again"))
            .await
            .unwrap();
        b.lane
            .send(5, 1, 1, Bytes::from_static(b"next"))
            .await
            .unwrap();
        let t = Duration::from_secs(20);
        let got = ia.table.take(key(1, 1, 1), t).await.unwrap();
        assert_eq!(got.to_bytes().as_ref(), b"next");
        let got = ia.table.take(key(1, 0, 1), t).await.unwrap();
        assert_eq!(got.to_bytes().as_ref(), b"first");
        assert!(ia.table.is_empty());
        assert!(ended.try_recv().is_err(), "the lane ended");
    }

    #[tokio::test]
    async fn an_abandoned_direct_frame_is_discarded_and_the_lane_stays_in_step() {
        let Cut {
            ia,
            b,
            frame,
            mut ended,
        } = cut_frame(6).await;
        drop(frame);
        // A frame never started puts nothing on the wire.
        drop(b.begin_frame(5, 1, 1, 100).await.unwrap());
        write_direct(&b, 1, 2, &[9u8; 1000]).await;
        b.send(5, 1, 3, Bytes::from_static(b"after")).await.unwrap();
        let t = Duration::from_secs(20);
        let got = ia.table.take(key(1, 2, 1), t).await.unwrap();
        assert_eq!(got.len(), 1000);
        let got = ia.table.take(key(1, 3, 1), t).await.unwrap();
        assert_eq!(got.len(), 5);
        assert_not_delivered(&ia, &[0, 1]).await;
        assert!(ended.try_recv().is_err(), "the lane ended");
    }

    /// A frame cut short (its padding stopped by `close`) must not be followed by anything:
    /// the next queued frame is refused and the lane ends, so the receiver neither gets
    /// the cut frame nor reads the next frame's bytes as its rest.
    #[tokio::test]
    async fn a_frame_cut_short_by_close_ends_the_lane_and_delivers_nothing() {
        let Cut {
            ia,
            b,
            frame,
            ended,
        } = cut_frame(8).await;
        // A frame queued behind the cut one: the writer task waits for the lock.
        b.send(5, 1, 1, Bytes::from(vec![0u8; 1000])).await.unwrap();
        // Closed before the padding task runs: it stops at once, leaving the frame cut.
        b.close();
        drop(frame);
        assert!(
            b.send(5, 1, 2, Bytes::from_static(b"late")).await.is_err(),
            "a closed lane took a frame"
        );
        let (reason, clean) = tokio::time::timeout(Duration::from_secs(20), ended)
            .await
            .expect("the lane ended in time")
            .unwrap();
        assert!(!clean, "ended cleanly: {reason}");
        assert_not_delivered(&ia, &[0, 1, 2]).await;
        assert!(b.begin_frame(5, 1, 3, 10).await.is_err());
    }

    #[tokio::test]
    async fn different_session_keys_open_no_lane() {
        let (a, b) = pair([1; 32], [2; 32]).await;
        assert!(a.is_err(), "the listener accepted a dialer without its key");
        assert!(b.is_err(), "the dialer accepted a listener without its key");
    }

    /// The congestion control `sock` uses.
    #[cfg(target_os = "linux")]
    fn congestion_of<'a>(sock: impl Into<socket2::SockRef<'a>>) -> String {
        let name = sock.into().tcp_congestion().unwrap();
        String::from_utf8(name)
            .unwrap()
            .trim_end_matches('\0')
            .to_owned()
    }

    /// The system's default congestion control, and another one this process may set
    /// (Reno, else CUBIC, else any the kernel has), so that a test sees the setting take.
    #[cfg(target_os = "linux")]
    fn system_and_other_congestion() -> (String, String) {
        let read = |f: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/{f}")).unwrap();
        let system = read("tcp_congestion_control").trim().to_owned();
        let available = read("tcp_available_congestion_control");
        let probe =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let other = ["reno", "cubic"]
            .into_iter()
            .chain(available.split_whitespace())
            .find(|name| *name != system && probe.set_tcp_congestion(name.as_bytes()).is_ok())
            .unwrap_or_else(|| {
                panic!(
                    "this process may set no congestion control but the default {system} \
                     (available: {available}), so no test can see a setting take"
                )
            });
        (system, other.to_owned())
    }

    /// Both ends of a lane use the configured congestion control, or the system's default
    /// where none is configured.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn both_ends_of_a_lane_use_the_configured_congestion_control() {
        let (system, other) = system_and_other_congestion();
        for (set, has) in [(Some(other.clone()), other), (None, system)] {
            let config = TransportConfig {
                lane_congestion: set,
                ..config(1 << 20)
            };
            let (a, b) = pair_with([4; 32], [4; 32], &config).await;
            let (a, b) = (a.unwrap(), b.unwrap());
            assert_eq!(congestion_of(a.read.as_ref()), has);
            assert_eq!(congestion_of(b.read.as_ref()), has);
        }
        // Reno by default.
        assert_eq!(
            TransportConfig::default().lane_congestion.as_deref(),
            Some("reno")
        );
    }

    /// A connection accepted by a node's lane listener has the configured congestion
    /// control from its start, before the handshake sets anything.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_lane_listener_passes_its_congestion_control_to_what_it_accepts() {
        let (system, other) = system_and_other_congestion();
        let config = TransportConfig {
            lane_congestion: Some(other.clone()),
            ..TransportConfig::default()
        };
        let listener = bind_lane_listener(std::net::Ipv4Addr::LOCALHOST.into(), &config).unwrap();
        let addr = listener.local_addr().unwrap();
        let dialer = std::net::TcpStream::connect(addr).unwrap();
        let accepted = tokio::net::TcpListener::from_std(listener)
            .unwrap()
            .accept()
            .await
            .unwrap()
            .0;
        assert_eq!(congestion_of(&accepted), other);
        assert_eq!(congestion_of(&dialer), system);
    }

    /// A congestion control the kernel does not have fails a node's lane listener and a
    /// dial, each with an error that names it and says why.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_congestion_control_the_kernel_lacks_fails_by_name() {
        let config = TransportConfig {
            lane_congestion: Some("no-such-cc".into()),
            ..config(1 << 20)
        };
        let says = |e: &dyn std::fmt::Display| {
            let e = e.to_string();
            assert!(e.contains("\"no-such-cc\""), "{e}");
            assert!(e.contains("no congestion control of that name"), "{e}");
        };
        match bind_lane_listener(std::net::Ipv4Addr::LOCALHOST.into(), &config) {
            Err(e) => says(&e),
            Ok(_) => panic!("a lane listener with a congestion control the kernel lacks"),
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let t = Duration::from_secs(10);
        match dial_lane(addr, None, NodeId(1), NodeId(0), [5; 32], &config, t).await {
            Err(e) => says(&e),
            Ok(_) => panic!("a lane dialled with a congestion control the kernel lacks"),
        }
    }

    /// A lane accepted from a listener that is not a node's (so without the setting)
    /// takes the configured congestion control in its handshake; one whose connection
    /// cannot take it (as where a route locks it) opens all the same, with the one it has.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn an_accepted_lane_takes_the_congestion_control_or_keeps_its_own() {
        let (system, other) = system_and_other_congestion();
        let plain = TransportConfig {
            lane_congestion: None,
            ..config(1 << 20)
        };
        for (wanted, has) in [(other.clone(), other), ("no-such-cc".into(), system)] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let t = Duration::from_secs(10);
            let config = TransportConfig {
                lane_congestion: Some(wanted.clone()),
                ..config(1 << 20)
            };
            let accept = async {
                let (s, _) = listener.accept().await.unwrap();
                accept_lane(s, NodeId(0), |_| Some([6; 32]), &config, t).await
            };
            let dial = dial_lane(addr, None, NodeId(1), NodeId(0), [6; 32], &plain, t);
            let (accepted, dialled) = tokio::join!(accept, dial);
            let accepted = accepted.unwrap_or_else(|e| panic!("{wanted}: {e}"));
            dialled.unwrap_or_else(|e| panic!("{wanted}: {e}"));
            assert_eq!(congestion_of(accepted.read.as_ref()), has, "{wanted}");
        }
    }

    /// A lane pair whose listener side (frames from the dialer arrive there, as from
    /// node 1) keeps at most `budget` bytes of early arrivals; both readers running.
    async fn announcing_pair(budget: usize) -> (TcpLane, TcpLane, Inbound) {
        let (a, b) = pair([6; 32], [6; 32]).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let mut ia = inbound();
        ia.table = Arc::new(MailboxTable::new(budget));
        let (la, lb) = (a.lane.clone(), b.lane.clone());
        a.lane.spawn_reader(a.read, ia.clone(), |_, _| {});
        b.lane.spawn_reader(b.read, inbound(), |_, _| {});
        (la, lb, ia)
    }

    /// Takes frame `step` (tag 1, from node 1) and checks its bytes.
    async fn take_frame(table: &MailboxTable, step: u64, len: usize) {
        let got = table
            .take(key(1, step, 1), Duration::from_secs(10))
            .await
            .unwrap();
        let mut v = vec![0u8; got.len()];
        got.copy_to(&mut v).unwrap();
        assert!(v == vec![step as u8 + 1; len], "frame {step}");
    }

    /// Sends frame `step` of `len` bytes on tag `tag` (communicator 5) on credit, which
    /// must be there.
    async fn send_on_credit(lane: &TcpLane, tag: u64, step: u64, len: usize) {
        let credit = lane.take_credit(len).expect("credit");
        lane.send_credited(5, tag, step, frame(step, len), credit)
            .await
            .unwrap();
    }

    /// Every frame was taken: the table holds nothing, and all of its `budget` is free.
    fn all_taken(table: &MailboxTable, budget: usize) {
        assert_eq!(table.budget_available(), budget);
        assert!(table.is_empty(), "{table:?}");
    }

    fn frame(step: u64, len: usize) -> Bytes {
        Bytes::from(vec![step as u8 + 1; len])
    }

    /// Waits (10 s at most) until `cond` holds.
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Waits (10 s at most) for the answer to an announcement.
    async fn answered(clearance: &mut Clearance, what: &str) {
        tokio::time::timeout(Duration::from_secs(10), clearance.cleared())
            .await
            .unwrap_or_else(|_| panic!("not {what}"))
            .unwrap();
    }

    /// Checks that no answer comes for 200 ms (one that must not come at all).
    async fn unanswered(clearance: &mut Clearance, what: &str) {
        let waited = tokio::time::timeout(Duration::from_millis(200), clearance.cleared());
        assert!(waited.await.is_err(), "{what}");
    }

    /// An announced frame is answered once its receiver can take it: at once while the
    /// early-arrival budget holds it, once an earlier frame is taken when it does not,
    /// and, larger than the whole budget, only once a receive waits for it. Each arrives
    /// whole, and taking them gives all the budget back.
    #[tokio::test]
    async fn an_announced_frame_is_answered_once_its_receiver_can_take_it() {
        let (_a, b, ia) = announcing_pair(768 << 10).await;
        let mut first = b.announce(5, 1, 0, 512 << 10).await.unwrap();
        answered(&mut first, "answered while the budget holds it").await;
        b.send_announced(first, frame(0, 512 << 10)).await.unwrap();
        until("frame 0 arrives", || ia.table.is_ready(&key(1, 0, 1))).await;
        assert_eq!(ia.table.budget_available(), 256 << 10);
        let mut second = b.announce(5, 1, 1, 512 << 10).await.unwrap();
        unanswered(&mut second, "answered past the budget").await;
        take_frame(&ia.table, 0, 512 << 10).await;
        answered(&mut second, "answered once frame 0 gave its budget back").await;
        b.send_announced(second, frame(1, 512 << 10)).await.unwrap();
        // Larger than the whole budget: only a receive lets it in.
        let mut third = b.announce(5, 1, 2, 1 << 20).await.unwrap();
        unanswered(
            &mut third,
            "a frame larger than the budget answered with nobody waiting for it",
        )
        .await;
        let table = ia.table.clone();
        let waiting = tokio::spawn(async move { take_frame(&table, 2, 1 << 20).await });
        answered(&mut third, "answered once a receive waits").await;
        b.send_announced(third, frame(2, 1 << 20)).await.unwrap();
        waiting.await.unwrap();
        take_frame(&ia.table, 1, 512 << 10).await;
        all_taken(&ia.table, 768 << 10);
    }

    /// A frame its sender gives up on (told over QUIC, here straight to the table) is
    /// answered if it was waiting, and lets go of the budget it took if it had been let
    /// in; its receive then fails as abandoned.
    #[tokio::test]
    async fn an_abandoned_announcement_is_answered_and_lets_its_budget_go() {
        let t = Duration::from_secs(10);
        let (_a, b, ia) = announcing_pair(768 << 10).await;
        // Waiting (larger than the budget): answered once abandoned.
        let mut waiting = b.announce(5, 1, 0, 1 << 20).await.unwrap();
        unanswered(&mut waiting, "answered with nobody waiting and no budget").await;
        ia.table.abandon(key(1, 0, 1));
        answered(&mut waiting, "answered once abandoned").await;
        // Let in with budget, then abandoned before its data came.
        let mut let_in = b.announce(5, 1, 1, 512 << 10).await.unwrap();
        answered(&mut let_in, "answered").await;
        until("the budget is taken", || {
            ia.table.budget_available() == 256 << 10
        })
        .await;
        ia.table.abandon(key(1, 1, 1));
        until("the budget comes back", || {
            ia.table.budget_available() == 768 << 10
        })
        .await;
        for step in [0, 1] {
            let got = ia.table.take(key(1, step, 1), t).await;
            assert!(
                matches!(got, Err(TransportError::Abandoned { .. })),
                "frame {step}: {got:?}"
            );
        }
        // Both answered: their places are free again.
        assert_eq!(b.announced.places.available_permits(), LANE_ANNOUNCEMENTS);
        // The lane goes on, in step.
        b.send(5, 1, 2, frame(2, 100)).await.unwrap();
        take_frame(&ia.table, 2, 100).await;
        all_taken(&ia.table, 768 << 10);
    }

    /// A sender that gives up on an announced frame withdraws the announcement on the lane,
    /// behind it: the receiver lets go of the budget it took for the frame, or stops
    /// waiting for budget, and answers, even when the receive was told over QUIC (here
    /// straight to the table) and failed before the announcement was read. (The
    /// announcement then made a fresh slot that held its budget, or its sender's place,
    /// until the lane ended.)
    #[tokio::test]
    async fn a_withdrawn_announcement_read_after_its_receive_failed_lets_everything_go() {
        let t = Duration::from_secs(10);
        let (a, b, ia) = announcing_pair(768 << 10).await;
        // Step 0 fits the budget; step 1 is larger than all of it.
        for (step, len) in [(0, 512 << 10), (1, 1 << 20)] {
            // The lane's writer is held, so the announcement waits in its queue.
            let held = b.begin_frame(5, 9, step, 8).await.unwrap();
            let clearance = b.announce(5, 1, step, len).await.unwrap();
            ia.table.abandon(key(1, step, 1));
            let got = ia.table.take(key(1, step, 1), t).await;
            assert!(
                matches!(got, Err(TransportError::Abandoned { .. })),
                "step {step}: {got:?}"
            );
            drop(clearance);
            drop(held);
            until("the receiver answers", || {
                b.announced.places.available_permits() == LANE_ANNOUNCEMENTS
            })
            .await;
            until("the budget comes back and no slot is left", || {
                ia.table.budget_available() == 768 << 10 && ia.table.is_empty()
            })
            .await;
        }
        // The lane goes on, in step.
        let mut next = b.announce(5, 1, 2, 100).await.unwrap();
        answered(&mut next, "answered").await;
        b.send_announced(next, frame(2, 100)).await.unwrap();
        take_frame(&ia.table, 2, 100).await;
        all_taken(&ia.table, 768 << 10);
        assert_eq!(a.frames_withdrawn(), 2);
    }

    /// An announced frame begun and dropped before any byte of it was written withdraws
    /// the announcement: the budget its receiver took for it comes back.
    #[tokio::test]
    async fn an_announced_frame_dropped_before_its_first_byte_withdraws_it() {
        let (a, b, ia) = announcing_pair(768 << 10).await;
        let mut clearance = b.announce(5, 1, 0, 512 << 10).await.unwrap();
        answered(&mut clearance, "answered").await;
        until("the budget is taken", || {
            ia.table.budget_available() == 256 << 10
        })
        .await;
        let frame = b.begin_announced_frame(&mut clearance).await.unwrap();
        // The withdrawal went to the frame.
        drop(clearance);
        drop(frame);
        until("the budget comes back", || {
            ia.table.budget_available() == 768 << 10 && ia.table.is_empty()
        })
        .await;
        assert_eq!((a.frames_withdrawn(), a.frames_abandoned()), (1, 0));
    }

    /// A frame sent with its clearance withdraws nothing, and one of another length than
    /// announced is refused before anything is queued.
    #[tokio::test]
    async fn an_announced_frame_is_sent_with_its_clearance() {
        let (a, b, ia) = announcing_pair(768 << 10).await;
        let clearance = b.announce(5, 1, 0, 100).await.unwrap();
        let wrong = b.send_announced(clearance, frame(0, 99)).await;
        assert!(
            matches!(&wrong, Err(e) if e.to_string().contains("announced as 100")),
            "{wrong:?}"
        );
        let mut clearance = b.announce(5, 1, 1, 100).await.unwrap();
        answered(&mut clearance, "answered").await;
        b.send_announced(clearance, frame(1, 100)).await.unwrap();
        take_frame(&ia.table, 1, 100).await;
        assert_eq!(ia.table.budget_available(), 768 << 10);
        let mut last = b.announce(5, 1, 2, 100).await.unwrap();
        answered(&mut last, "answered").await;
        b.send_announced(last, frame(2, 100)).await.unwrap();
        take_frame(&ia.table, 2, 100).await;
        // Nothing was withdrawn but the first one, which the refused send withdrew.
        assert_eq!(a.frames_withdrawn(), 1);
        assert_eq!(a.frames_abandoned(), 0);
    }

    /// A sender has at most `LANE_ANNOUNCEMENTS` announcements unanswered: the next one
    /// waits until an answer comes.
    #[tokio::test]
    async fn a_sender_waits_while_its_announcements_are_all_unanswered() {
        let t = Duration::from_secs(10);
        let (_a, b, ia) = announcing_pair(512 << 10).await;
        let mut held = Vec::new();
        for step in 0..LANE_ANNOUNCEMENTS as u64 {
            held.push(b.announce(5, 1, step, 600 << 10).await.unwrap());
        }
        let next = b.announce(5, 1, LANE_ANNOUNCEMENTS as u64, 100);
        tokio::pin!(next);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), &mut next)
                .await
                .is_err(),
            "announced past the limit"
        );
        let table = ia.table.clone();
        let receive = tokio::spawn(async move { take_frame(&table, 0, 600 << 10).await });
        answered(&mut held[0], "answered").await;
        let mut last = tokio::time::timeout(t, next)
            .await
            .expect("announced once an answer came")
            .unwrap();
        b.send_announced(held.remove(0), frame(0, 600 << 10))
            .await
            .unwrap();
        receive.await.unwrap();
        answered(&mut last, "answered").await;
    }

    /// A lane pair for frames of up to `LANE_CREDIT_BYTES`, both readers running: the
    /// dialer's sending half (frames from node 1), what the listener side receives, and
    /// the listener's sending half (keep it: credit goes back through it).
    async fn credit_pair(key: u8) -> (TcpLane, Inbound, TcpLane) {
        let config = config(LANE_CREDIT_BYTES as u64);
        let (a, b) = pair_with([key; 32], [key; 32], &config).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let ia = inbound();
        let lane = b.lane.clone();
        a.lane.spawn_reader(a.read, ia.clone(), |_, _| {});
        b.lane.spawn_reader(b.read, inbound(), |_, _| {});
        (lane, ia, a.lane)
    }

    /// Frames sent on credit go unasked, up to `LANE_CREDIT_BYTES` not yet taken by the
    /// receiver; credit not used goes back at once, and the receiver gives back what its
    /// frames held once they are taken, or discarded as aborted.
    #[tokio::test]
    async fn frames_sent_on_credit_go_unasked_and_their_credit_comes_back() {
        // Each frame's credit is given back on its own.
        const LEN: usize = CREDIT_RETURN_BYTES as usize;
        let (lane, ia, _back) = credit_pair(7).await;
        assert!(lane.take_credit(LANE_CREDIT_BYTES + 1).is_none());
        let all = lane.take_credit(LANE_CREDIT_BYTES).expect("all the credit");
        assert!(lane.take_credit(1).is_none(), "credit past the window");
        drop(all);
        // A frame on all of it cut short (on this single-threaded runtime the reader
        // cannot run during `advance`, so it stops when the socket buffers are full):
        // discarded, and its credit given back.
        let credit = lane.take_credit(LANE_CREDIT_BYTES).expect("all the credit");
        let payload = frame(9, LANE_CREDIT_BYTES);
        let mut cut = lane
            .begin_credited_frame(5, 1, 9, LANE_CREDIT_BYTES, credit)
            .await
            .unwrap();
        assert!(!cut.advance(&payload).unwrap(), "written whole at once");
        assert!(
            lane.take_credit(1).is_none(),
            "the cut frame's credit is out"
        );
        drop(cut);
        until("the cut frame's credit comes back", || {
            lane.credit.free.available_permits() == LANE_CREDIT_BYTES
        })
        .await;
        let frames = LANE_CREDIT_BYTES / LEN;
        for step in 0..frames as u64 {
            let credit = lane.take_credit(LEN).expect("credit");
            if step % 2 == 0 {
                lane.send_credited(5, 1, step, frame(step, LEN), credit)
                    .await
                    .unwrap();
            } else {
                let payload = frame(step, LEN);
                let mut f = lane
                    .begin_credited_frame(5, 1, step, LEN, credit)
                    .await
                    .unwrap();
                f.write_all(&payload).await.unwrap();
            }
        }
        assert!(lane.take_credit(LEN).is_none(), "credit all out");
        // Frames past the early-arrival budget (1 MiB) are kept all the same.
        until("all the frames arrive", || {
            (0..frames as u64).all(|s| ia.table.is_ready(&key(1, s, 1)))
        })
        .await;
        take_frame(&ia.table, 0, LEN).await;
        until("frame 0's credit comes back", || {
            lane.credit.free.available_permits() == LEN
        })
        .await;
        for step in 1..frames as u64 {
            take_frame(&ia.table, step, LEN).await;
        }
        until("all the credit comes back", || {
            lane.credit.free.available_permits() == LANE_CREDIT_BYTES
        })
        .await;
        assert!(ia.table.is_empty(), "{:?}", ia.table);
        assert!(
            !ia.table.is_ready(&key(1, 9, 1)),
            "the cut frame was discarded"
        );
    }

    /// A frame as a peer (node 1) would write it on a lane, trailer included.
    fn raw_frame(kind: FrameKind, step: u64, payload: &[u8], trailer: u8) -> Vec<u8> {
        let mut f = FrameHeader::new(kind, 5, 1, step, 1, payload.len() as u64).encode();
        f.extend_from_slice(payload);
        f.push(trailer);
        f
    }

    /// When a test's raw peer may write the rest.
    type Ready = dyn Fn(&Answers) -> bool;

    /// Runs a lane reader on a socket whose peer writes `sent`, then (when `then` is
    /// given) its bytes once its condition holds, and returns why the lane ended, which
    /// must not be cleanly.
    async fn lane_ended_by(
        sent: Vec<u8>,
        then: Option<(Vec<u8>, &Ready)>,
        answers: Arc<Answers>,
    ) -> String {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (read, _write) = server.into_split();
        let received = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
        let ended = read_loop(read, inbound(), NodeId(1), &answers, &received);
        let write = async {
            // The reader may end before it has read all of it.
            let _ = client.write_all(&sent).await;
            if let Some((more, ready)) = then {
                until("ready for the rest", || ready(&answers)).await;
                let _ = client.write_all(&more).await;
            }
        };
        let ((reason, clean), ()) = tokio::time::timeout(Duration::from_secs(20), async {
            tokio::join!(ended, write)
        })
        .await
        .expect("the lane ended in time");
        assert!(!clean, "{reason}");
        reason
    }

    /// A peer's announcement and answer frames are checked like its data frames: an
    /// announcement whose payload is not a length, one of a frame over the limit, an
    /// answer with a payload, and more than `LANE_ANNOUNCEMENTS` unanswered announcements
    /// each end the lane; so does an announced frame of another length than announced,
    /// or one also sent on credit.
    #[tokio::test]
    async fn malformed_announcements_and_answers_end_the_lane() {
        let announce = |step, len: u64| {
            raw_frame(
                FrameKind::Announce,
                step,
                &len.to_be_bytes(),
                FRAME_COMPLETE,
            )
        };
        // Frames of up to 4 MiB, 1 MiB of budget: the flood's frames all wait.
        let flood: Vec<u8> = (0..=LANE_ANNOUNCEMENTS as u64)
            .flat_map(|s| announce(s, 2 << 20))
            .collect();
        let cases = [
            (
                raw_frame(FrameKind::Announce, 0, &[0; 4], FRAME_COMPLETE),
                "Announce frame of 4 bytes",
            ),
            (announce(0, (4 << 20) + 1), "announced a frame of"),
            (
                raw_frame(FrameKind::Clear, 0, &[1], FRAME_COMPLETE),
                "Clear frame of 1 bytes",
            ),
            (flood, "announcements unanswered"),
        ];
        for (sent, why) in cases {
            let (answers, _closed) = answers(4 << 20);
            let reason = lane_ended_by(sent, None, answers).await;
            assert!(reason.contains(why), "{why}: {reason}");
        }
        // Let in (the budget holds 100 bytes), then a frame of 50 bytes, or one of 100 on
        // credit.
        let let_in: &Ready =
            &|a| matches!(a.granted().get(&key(1, 0, 1)), Some(Grant::Granted(..)));
        for (trailer, len, why) in [
            (FRAME_COMPLETE, 50, "a frame of 50 bytes announced as 100"),
            (
                FRAME_COMPLETE | FRAME_CREDITED,
                100,
                "both announced and sent on credit",
            ),
        ] {
            let data = raw_frame(FrameKind::Data, 0, &vec![1; len], trailer);
            // Kept open: a closed lane would let the frame go at once.
            let (answers, _closed) = answers(4 << 20);
            let reason = lane_ended_by(announce(0, 100), Some((data, let_in)), answers).await;
            assert!(reason.contains(why), "{why}: {reason}");
        }
    }

    /// Announcements whose answers wait for this side's writer (a peer that reads nothing
    /// of its lane stalls it) still count as unanswered: past `LANE_ANNOUNCEMENTS` the
    /// lane ends. (They used to count as answered before their answers were queued, so
    /// a peer could make this side hold a task per announcement without bound.)
    #[tokio::test]
    async fn announcements_whose_answers_wait_for_the_writer_count_against_the_limit() {
        // A writer queue that nobody reads, with room for one answer.
        let (queue, _unread) = mpsc::channel(1);
        let (answers, _closed) = answers_queued(4 << 20, &queue);
        // Small frames, each let in at once (the budget holds them all), in two runs
        // under the limit: the second once the first's answers all wait for the queue.
        let run = |from: u64| -> Vec<u8> {
            (from..from + LANE_ANNOUNCEMENTS as u64 - 1)
                .flat_map(|s| {
                    raw_frame(
                        FrameKind::Announce,
                        s,
                        &100u64.to_be_bytes(),
                        FRAME_COMPLETE,
                    )
                })
                .collect()
        };
        let decided: &Ready = &|a| a.granted().len() == LANE_ANNOUNCEMENTS - 1;
        let second = run(LANE_ANNOUNCEMENTS as u64);
        let reason = lane_ended_by(run(0), Some((second, decided)), answers).await;
        assert!(reason.contains("announcements unanswered"), "{reason}");
    }

    /// A peer that sends on more credit than it has, or gives back more than this side
    /// spent (credit taken and not yet spent does not count), ends the lane; so does a
    /// trailer that marks anything but a data frame.
    #[tokio::test]
    async fn credit_overdrawn_or_overpaid_ends_the_lane() {
        const LEN: usize = 16 << 20;
        let zeros = vec![0u8; LEN];
        let overdrawn: Vec<u8> = (0..=(LANE_CREDIT_BYTES / LEN) as u64)
            .flat_map(|s| raw_frame(FrameKind::Data, s, &zeros, FRAME_COMPLETE | FRAME_CREDITED))
            .collect();
        let cases = [
            (overdrawn, "frames sent past their credit"),
            (
                raw_frame(FrameKind::Credit, 0, &1u64.to_be_bytes(), FRAME_COMPLETE),
                "1 bytes of credit given back, 0 spent",
            ),
            (
                raw_frame(FrameKind::Announce, 0, &8u64.to_be_bytes(), FRAME_CREDITED),
                "bad frame trailer 2",
            ),
            (
                raw_frame(FrameKind::Data, 0, b"x", 4),
                "bad frame trailer 4",
            ),
        ];
        for (sent, why) in cases {
            let (answers, _closed) = answers(LEN as u64);
            // Taken, not spent: nothing the peer may give back.
            answers
                .credit
                .free
                .try_acquire_many(8 << 20)
                .unwrap()
                .forget();
            let reason = lane_ended_by(sent, None, answers).await;
            assert!(reason.contains(why), "{why}: {reason}");
        }
    }

    /// Credit comes back even while frames not taken yet hold most of the window: a
    /// 40 MiB frame nobody takes, then 8 MiB frames taken one by one, never leave the
    /// sender without credit for the next (it used to wait for 32 MiB to be owed, which
    /// the 24 MiB not held could never make).
    #[tokio::test]
    async fn credit_comes_back_while_frames_not_taken_hold_most_of_the_window() {
        const LEN: usize = 8 << 20;
        let (lane, ia, _back) = credit_pair(8).await;
        let big = 40 << 20;
        send_on_credit(&lane, 2, 0, big).await;
        for step in 0..10u64 {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let credit = loop {
                if let Some(c) = lane.take_credit(LEN) {
                    break c;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "no credit for frame {step}"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            lane.send_credited(5, 1, step, frame(step, LEN), credit)
                .await
                .unwrap();
            take_frame(&ia.table, step, LEN).await;
        }
    }

    /// An announcement tells the receiver its sender ran short of credit: what it owes
    /// goes back at once, below the amount it would otherwise wait for (20 MiB owed of a
    /// free window: it waits for 32 MiB).
    #[tokio::test]
    async fn an_announcement_brings_back_what_is_owed() {
        let (lane, ia, _back) = credit_pair(9).await;
        let first = 20 << 20;
        send_on_credit(&lane, 1, 0, first).await;
        take_frame(&ia.table, 0, first).await;
        let left = LANE_CREDIT_BYTES - first;
        assert_eq!(
            lane.credit.free.available_permits(),
            left,
            "nothing back yet"
        );
        let second = left + 1;
        assert!(lane.take_credit(second).is_none());
        let mut clearance = lane.announce(5, 1, 1, second).await.unwrap();
        until("what was owed comes back", || {
            lane.credit.free.available_permits() == LANE_CREDIT_BYTES
        })
        .await;
        // The announcement is answered once a receive waits (the frame is larger than the
        // budget), and the frame arrives.
        let table = ia.table.clone();
        let receive = tokio::spawn(async move { take_frame(&table, 1, second).await });
        answered(&mut clearance, "answered").await;
        lane.send_announced(clearance, frame(1, second))
            .await
            .unwrap();
        receive.await.unwrap();
    }

    /// An announcement made when nothing is owed yet is not forgotten: the next credit
    /// the receiver lets go comes back at once, however little (2 MiB, where with 48 MiB
    /// held it would wait for 8).
    #[tokio::test]
    async fn an_announcement_with_nothing_owed_brings_back_the_next_credit() {
        let (lane, ia, _back) = credit_pair(10).await;
        let (small, big) = (2 << 20, 48 << 20);
        for (step, len) in [(0, small), (1, big)] {
            send_on_credit(&lane, 1, step, len).await;
        }
        let left = LANE_CREDIT_BYTES - small - big;
        let _clearance = lane.announce(5, 1, 2, left + 1).await.unwrap();
        until("both frames arrive", || {
            ia.table.is_ready(&key(1, 0, 1)) && ia.table.is_ready(&key(1, 1, 1))
        })
        .await;
        assert_eq!(
            lane.credit.free.available_permits(),
            left,
            "nothing owed yet"
        );
        take_frame(&ia.table, 0, small).await;
        until("the small frame's credit comes back", || {
            lane.credit.free.available_permits() == left + small
        })
        .await;
    }
}
