//! The seed: issues identities, assigns ranks and hands out the peer list.
//!
//! A `SeedActor` owns the membership table and decides; one task per incoming handshake
//! does the I/O and asks the actor.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use nexar_transport::{bootstrap_server, fingerprint_hex, ClusterCa, NodeId, TransportConfig};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::proto::{
    encode_frame, max_boot_world, max_from_worker, read_msg, read_msg_max, send_last, session_ekm,
    write_frame_within, write_within, BootMsg, JoinString, Plan, Secret, BOOT_VERSION, MAX_HELLO,
};
use super::BootstrapError;

/// Node id under which the seed's own (bootstrap) certificate is issued.
const SEED_NODE: NodeId = NodeId(u64::MAX);

/// Seed settings. Every field has a documented default.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SeedOptions {
    /// The cluster secret (default: 32 fresh random bytes).
    pub secret: Option<Secret>,
    /// Address to put in the join string when the listen address is unspecified
    /// (`0.0.0.0`/`[::]`); default: the listen address, or 127.0.0.1 if unspecified.
    pub advertise: Option<SocketAddr>,
    /// Deadline for every worker to arrive and the mesh to form (default 60 s; zero is
    /// refused).
    pub formation_timeout: Duration,
    /// Deadline for one worker's hello after its connection opens (default 10 s; zero is
    /// refused).
    pub handshake_timeout: Duration,
    /// Clients held at once that have not yet proved they know the secret (default 256),
    /// and of those at most a quarter (at least 1) from any one IP address, so that one
    /// host cannot take them all; one past either is refused at once (a worker's join
    /// asks again, within its timeout). A worker that has proved it holds none.
    pub max_handshakes: usize,
    /// Smallest world a graceful departure may leave (default 1): a leave that would go
    /// below it is refused, and the node stays a member. Only the members that stay
    /// count, not the nodes that join at the same resize point: the leavers are gone by
    /// the time the joiners are in, and a joiner may still fail there.
    pub min_world: usize,
    /// Largest world (default: the formation world, so the size is fixed). When larger,
    /// nodes may join the running cluster: each waits in a queue until the members reach
    /// a resize point ([`Node::resize`](crate::Node::resize)) with room for it, for at most
    /// `formation_timeout`. It caps every node still in the job together, also after a
    /// split, when each group has resize points of its own.
    pub max_world: Option<usize>,
    /// The cluster CA (default: a fresh one). Your own lets other tools issue
    /// certificates under it; the members still take, for each node, only the certificate
    /// this seed issued it.
    pub ca: Option<Arc<ClusterCa>>,
}

impl Default for SeedOptions {
    fn default() -> Self {
        SeedOptions {
            secret: None,
            advertise: None,
            formation_timeout: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 256,
            min_world: 1,
            max_world: None,
            ca: None,
        }
    }
}

/// How a cluster run went, as seen by the seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedReport {
    /// Cluster size.
    pub world: usize,
    /// Every rank's mesh address.
    pub addrs: Vec<SocketAddr>,
    /// Ranks (node ids) whose job reported success.
    pub ok: Vec<usize>,
    /// Ranks (node ids) whose job reported failure or that left without reporting.
    pub failed: Vec<usize>,
    /// Nodes that joined the running cluster: node id and mesh address.
    pub joined: Vec<(usize, SocketAddr)>,
}

impl SeedReport {
    /// True when every node that took part (the formation world and every node that
    /// joined later) reported success.
    pub fn succeeded(&self) -> bool {
        self.failed.is_empty() && self.ok.len() == self.world + self.joined.len()
    }
}

/// A running seed. Dropping it stops serving.
pub struct Seed {
    join: JoinString,
    endpoint: quinn::Endpoint,
    actor: ActorRef<SeedMsg>,
    accept: JoinHandle<()>,
    formed: watch::Receiver<Option<Result<Vec<SocketAddr>, String>>>,
    finished: watch::Receiver<Option<SeedReport>>,
    admitted: watch::Receiver<Vec<usize>>,
    queued: watch::Receiver<usize>,
}

impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seed")
            .field("join", &self.join)
            .finish_non_exhaustive()
    }
}

impl Seed {
    /// Binds `listen`, creates the cluster CA and starts admitting `world` workers.
    pub async fn start(
        listen: SocketAddr,
        world: usize,
        opts: SeedOptions,
    ) -> Result<Seed, crate::NexarError> {
        if world == 0 {
            return Err(crate::NexarError::InvalidArgument(
                "a cluster needs at least one worker".into(),
            ));
        }
        for (name, t) in [
            ("formation_timeout", opts.formation_timeout),
            ("handshake_timeout", opts.handshake_timeout),
        ] {
            if t.is_zero() {
                return Err(crate::NexarError::InvalidArgument(format!(
                    "{name} must be greater than zero (every worker would be turned away)"
                )));
            }
        }
        let max_world = opts.max_world.unwrap_or(world);
        if opts.min_world == 0 || opts.min_world > world || max_world < world {
            return Err(crate::NexarError::InvalidArgument(format!(
                "world bounds must satisfy 1 <= min ({}) <= world ({world}) <= max ({max_world})",
                opts.min_world
            )));
        }
        // Every member's entry travels in one peer list or plan.
        let limit = crate::MAX_WORLD.min(max_boot_world());
        if max_world > limit {
            return Err(crate::NexarError::InvalidArgument(format!(
                "max world {max_world} is too large (at most {limit})"
            )));
        }
        let ca = match opts.ca.clone() {
            Some(ca) => ca,
            None => Arc::new(ClusterCa::generate()?),
        };
        let identity = ca.issue(SEED_NODE)?;
        let endpoint = bootstrap_server(listen, &identity, &TransportConfig::default())?;
        let bound = endpoint
            .local_addr()
            .map_err(nexar_transport::TransportError::from)?;
        let seed_addr = match opts.advertise {
            Some(a) => a,
            None if bound.ip().is_unspecified() => {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), bound.port())
            }
            None => bound,
        };
        let fp_hex = fingerprint_hex(identity.cert_der());
        let mut fingerprint = [0u8; 32];
        hex::decode_to_slice(&fp_hex, &mut fingerprint)
            .map_err(|e| crate::NexarError::Actor(e.to_string()))?;
        let secret = opts.secret.clone().unwrap_or_else(Secret::random);
        let join = JoinString {
            seed: seed_addr,
            secret: secret.clone(),
            fingerprint,
        };
        let (formed_tx, formed) = watch::channel(None);
        let (finished_tx, finished) = watch::channel(None);
        let (admitted_tx, admitted) = watch::channel(Vec::new());
        let (queued_tx, queued) = watch::channel(0);
        let args = SeedArgs {
            ca,
            world,
            formed: formed_tx,
            finished: finished_tx,
            admitted: admitted_tx,
            queued: queued_tx,
            timeout: opts.formation_timeout,
            min_world: opts.min_world,
            max_world,
        };
        let (actor, _) = Actor::spawn(None, SeedActor, args)
            .await
            .map_err(|e| crate::NexarError::Actor(e.to_string()))?;
        let accept = tokio::spawn(accept_loop(
            endpoint.clone(),
            actor.clone(),
            secret,
            opts.handshake_timeout,
            opts.max_handshakes,
            max_from_worker(max_world),
        ));
        info!(%seed_addr, world, "seed listening");
        Ok(Seed {
            join,
            endpoint,
            actor,
            accept,
            formed,
            finished,
            admitted,
            queued,
        })
    }

    /// The join string workers need.
    pub fn join_string(&self) -> &JoinString {
        &self.join
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// Ranks currently held by admitted workers, ascending.
    pub fn admitted(&self) -> Vec<usize> {
        self.admitted.borrow().clone()
    }

    /// Waits until `rank` is held by an admitted worker; fails once that can no longer
    /// happen (formation failed, or the cluster finished).
    pub async fn wait_admitted(&self, rank: usize) -> Result<(), BootstrapError> {
        let mut rx = self.admitted.clone();
        tokio::select! {
            biased;
            held = rx.wait_for(|held| held.contains(&rank)) => held
                .map(|_| ())
                .map_err(|_| BootstrapError::Formation("seed stopped".into())),
            e = self.ended() => Err(e),
        }
    }

    /// Resolves once no more nodes will be admitted or queued: formation failed (its
    /// error), or the cluster finished.
    async fn ended(&self) -> BootstrapError {
        let mut formed = self.formed.clone();
        let mut finished = self.finished.clone();
        let stopped = || BootstrapError::Formation("seed stopped".into());
        tokio::select! {
            failed = formed.wait_for(|f| matches!(f, Some(Err(_)))) => match failed {
                Ok(f) => match f.as_ref() {
                    Some(Err(e)) => BootstrapError::Formation(e.clone()),
                    _ => stopped(),
                },
                Err(_) => stopped(),
            },
            done = finished.wait_for(Option::is_some) => match done {
                Ok(_) => BootstrapError::Formation("the cluster finished".into()),
                Err(_) => stopped(),
            },
        }
    }

    /// Number of nodes waiting to join the running cluster at the next resize point.
    pub fn queued(&self) -> usize {
        *self.queued.borrow()
    }

    /// Waits until at least `n` nodes wait to join the running cluster; fails once that
    /// can no longer happen (formation failed, or the cluster finished).
    pub async fn wait_queued(&self, n: usize) -> Result<(), BootstrapError> {
        let mut rx = self.queued.clone();
        tokio::select! {
            biased;
            queued = rx.wait_for(|q| *q >= n) => queued
                .map(|_| ())
                .map_err(|_| BootstrapError::Formation("seed stopped".into())),
            e = self.ended() => Err(e),
        }
    }

    /// Waits until every worker is in and the peer list went out (or formation failed,
    /// naming the ranks that did not arrive).
    pub async fn wait_formed(&self) -> Result<Vec<SocketAddr>, BootstrapError> {
        let mut rx = self.formed.clone();
        let res = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| BootstrapError::Formation("seed stopped".into()))?;
        match res.as_ref() {
            Some(Ok(addrs)) => Ok(addrs.clone()),
            Some(Err(e)) => Err(BootstrapError::Formation(e.clone())),
            None => Err(BootstrapError::Formation("seed stopped".into())),
        }
    }

    /// Serves the cluster until every worker has reported its job done (or left).
    pub async fn wait_finished(&self) -> Result<SeedReport, BootstrapError> {
        self.wait_formed().await?;
        let mut rx = self.finished.clone();
        let res = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| BootstrapError::Formation("seed stopped".into()))?;
        res.clone()
            .ok_or_else(|| BootstrapError::Formation("seed stopped".into()))
    }
}

impl Seed {
    /// Stops the seed, first letting the answers it already gave reach their workers: it
    /// takes no more clients, then waits until its connections have closed, for at most
    /// 3 s (a refusal goes out within 2). Dropping the
    /// seed stops it at once, and may cut an answer short: a worker refused at a
    /// formation's deadline, or at the job's end, then sees only the seed go away.
    pub async fn close(self) {
        self.accept.abort();
        let grace = REFUSE_TIMEOUT + Duration::from_secs(1);
        if tokio::time::timeout(grace, self.endpoint.wait_idle())
            .await
            .is_err()
        {
            debug!(
                open = self.endpoint.open_connections(),
                "seed closing with connections still open"
            );
        }
    }
}

impl Drop for Seed {
    fn drop(&mut self) {
        self.accept.abort();
        self.actor.stop(None);
        self.endpoint.close(0u32.into(), b"seed stopped");
    }
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    actor: ActorRef<SeedMsg>,
    secret: Secret,
    handshake_timeout: Duration,
    max_handshakes: usize,
    max_msg: usize,
) {
    let admission = crate::admission::Admission::new(max_handshakes);
    let rejected = crate::admission::Rejections::default();
    while let Some(incoming) = endpoint.accept().await {
        // A client must first show it receives at its address (a QUIC retry, stateless
        // here), so forged source addresses hold no handshake.
        if !incoming.remote_address_validated() {
            let _ = incoming.retry();
            continue;
        }
        let remote = incoming.remote_address();
        let admitted = admission.admit_or_refuse(incoming, remote, "bootstrap", |c| c.refuse());
        let Some((incoming, slot)) = admitted else {
            continue;
        };
        let actor = actor.clone();
        let secret = secret.clone();
        let rejected = rejected.clone();
        // One task per handshake: a slow or silent client only ever holds its own task
        // (and one of the slots, until it has proved the secret or for at most the
        // handshake timeout).
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            if let Err(e) =
                handshake(incoming, actor, secret, handshake_timeout, slot, max_msg).await
            {
                rejected.report(remote, &e, "bootstrap");
            }
        });
    }
}

async fn handshake(
    incoming: quinn::Incoming,
    actor: ActorRef<SeedMsg>,
    secret: Secret,
    timeout: Duration,
    slot: crate::admission::HandshakeSlot,
    max_msg: usize,
) -> Result<(), BootstrapError> {
    let remote = incoming.remote_address();
    let opened = tokio::time::timeout(timeout, async {
        let conn = incoming
            .await
            .map_err(|e| BootstrapError::Protocol(format!("handshake: {e}")))?;
        let (send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|e| BootstrapError::Protocol(format!("no stream: {e}")))?;
        // Before the proof is checked, only a hello's size is read (a CSR and a proof).
        let hello = read_msg_max(&mut recv, MAX_HELLO).await?;
        Ok::<_, BootstrapError>((conn, send, recv, hello))
    })
    .await
    .map_err(|_| BootstrapError::Protocol(format!("no hello within {timeout:?}")))??;
    let (conn, mut send, mut recv, hello) = opened;
    let Some(BootMsg::Hello {
        version,
        proof,
        csr,
        rank,
    }) = hello
    else {
        refuse(&mut send, "expected a hello").await;
        return Err(BootstrapError::Protocol(
            "first message was not a hello".into(),
        ));
    };
    if version != BOOT_VERSION {
        refuse(
            &mut send,
            &format!("protocol version {version} unsupported (seed speaks {BOOT_VERSION})"),
        )
        .await;
        return Err(BootstrapError::Protocol(format!("version {version}")));
    }
    let ekm = session_ekm(&conn)?;
    if !secret.verify(&ekm, b"worker", &proof) {
        refuse(&mut send, "wrong cluster secret").await;
        return Err(BootstrapError::Refused("wrong cluster secret".into()));
    }
    // A worker holds no handshake slot for the rest of its job.
    drop(slot);
    // Admission: the actor decides the rank and signs the request.
    let (reply, mut admission) = oneshot::channel();
    actor
        .send_message(SeedMsg::Hello { rank, csr, reply })
        .map_err(|e| BootstrapError::Protocol(format!("seed actor: {e}")))?;
    let admitted = match tokio::time::timeout(ADMISSION_WAIT, &mut admission).await {
        Ok(Ok(admitted)) => admitted,
        Ok(Err(_)) => return Err(BootstrapError::Protocol("the seed actor stopped".into())),
        Err(_) => {
            // A seed this busy: give up, and give back a rank granted meanwhile. After the
            // close the actor's answer either came (and is taken here) or fails to send
            // (and the actor frees the rank itself), never neither.
            if let Some(rank) = granted_after_giving_up(&mut admission) {
                let _ = actor.send_message(SeedMsg::Gone { rank, why: None });
            }
            return Err(BootstrapError::Protocol(format!(
                "the seed did not admit this worker within {ADMISSION_WAIT:?}"
            )));
        }
    };
    let (rank, cert, ca, world) = match admitted {
        Ok(v) => v,
        Err(reason) => {
            refuse(&mut send, &reason).await;
            return Err(BootstrapError::Refused(reason));
        }
    };
    // From here on the slot is held; give it back if this worker goes away.
    let mut guard = SlotGuard {
        actor: actor.clone(),
        rank,
        armed: true,
        why: None,
    };
    // Each write to the worker has the handshake's deadline: one that grants no
    // flow-control credit would otherwise hold its task and its rank for ever (and keep a
    // finishing seed waiting on it).
    let welcome = BootMsg::Welcome {
        rank,
        world,
        cert,
        ca,
    };
    write_within(&mut send, &welcome, timeout).await?;
    let listening = tokio::time::timeout(timeout, read_msg(&mut recv))
        .await
        .map_err(|_| {
            BootstrapError::Protocol("worker did not report its listening port".into())
        })??;
    let (port, advertise) = match listening {
        Some(BootMsg::Listening { port, advertise }) => (port, advertise),
        // Admitted, the worker could not start its node (its mesh port taken, say).
        Some(BootMsg::Refused { reason }) => {
            let reason = bounded_reason(reason);
            warn!(
                rank,
                ?reason,
                "an admitted worker could not start its node; its rank is free again"
            );
            // Said here, not reported as a rejected handshake: the worker was admitted.
            guard.why = Some(reason);
            return Ok(());
        }
        _ => {
            return Err(BootstrapError::Protocol(
                "expected the listening port".into(),
            ))
        }
    };
    // The worker's mesh address: what it advertises, else the address the seed sees (an
    // IPv4 worker reaching a dual-stack seed shows as `::ffff:a.b.c.d`, which its peers'
    // IPv4 sockets could not dial: such an address is given out as the IPv4 one).
    let addr = advertise.unwrap_or(SocketAddr::new(remote.ip().to_canonical(), port));
    let (peers_tx, peers_rx) = oneshot::channel();
    actor
        .send_message(SeedMsg::Listening {
            rank,
            addr,
            peers: peers_tx,
        })
        .map_err(|e| BootstrapError::Protocol(e.to_string()))?;
    // A node waiting to join that goes away leaves the queue at once (the guard tells
    // the actor), rather than being admitted into a plan it cannot follow.
    let peers = tokio::select! {
        p = peers_rx => p.map_err(|_| BootstrapError::Formation("seed stopped".into()))?,
        e = conn.closed() => {
            return Err(BootstrapError::Protocol(format!("worker went away: {e}")));
        }
    };
    match peers {
        Ok(Entry::Formed(peers)) => write_frame_within(&mut send, peers, timeout).await?,
        Ok(Entry::Joined(plan)) => write_within(&mut send, &BootMsg::Plan(plan), timeout).await?,
        Err(reason) => {
            refuse(&mut send, &reason).await;
            return Err(BootstrapError::Formation(reason));
        }
    }
    // Serve: Ready, resize points (when this worker coordinates one), then Done (or the
    // connection dropping).
    let mut ok = None;
    loop {
        match read_msg_max(&mut recv, max_msg).await {
            Ok(Some(BootMsg::Ready)) => {
                let _ = actor.send_message(SeedMsg::Ready { rank });
            }
            Ok(Some(BootMsg::Resize { members, leaving })) => {
                let (tx, rx) = oneshot::channel();
                let _ = actor.send_message(SeedMsg::Resize {
                    from: rank,
                    members,
                    leaving,
                    reply: tx,
                });
                let reply = match rx.await {
                    Ok(Ok(plan)) => BootMsg::Plan(plan),
                    Ok(Err(reason)) => BootMsg::Refused { reason },
                    Err(_) => BootMsg::Refused {
                        reason: "seed stopped".into(),
                    },
                };
                write_within(&mut send, &reply, timeout).await?;
            }
            Ok(Some(BootMsg::Committed { epoch })) => {
                let _ = actor.send_message(SeedMsg::Committed { from: rank, epoch });
            }
            Ok(Some(BootMsg::Done { ok: o })) => {
                ok = Some(o);
                break;
            }
            Ok(Some(BootMsg::Refused { reason })) => {
                warn!(rank, %reason, "worker reported a failure");
                ok = Some(false);
                break;
            }
            Ok(Some(other)) => debug!(rank, ?other, "unexpected message ignored"),
            Ok(None) | Err(_) => break,
        }
    }
    let mut guard = guard;
    guard.armed = false;
    let _ = actor.send_message(SeedMsg::Done {
        rank,
        ok: ok.unwrap_or(false),
    });
    let _ = send.finish();
    conn.close(0u32.into(), b"bye");
    Ok(())
}

/// Why formation failed: which ranks did not arrive (the first [`NAMED_MISSING`] by
/// number, and how many in all).
fn missing_ranks(st: &SeedState) -> String {
    let mut missing = (0..st.world as u32).filter(|r| !matches!(st.taken.get(r), Some(Some(_))));
    let named: Vec<String> = missing
        .by_ref()
        .take(NAMED_MISSING)
        .map(|r| r.to_string())
        .collect();
    let more = missing.count();
    let all = named.len() + more;
    let list = named.join(", ");
    let mut reason = if more == 0 {
        format!("ranks {list} did not arrive before the formation deadline")
    } else {
        format!("{all} ranks ({list} and {more} more) did not arrive before the formation deadline")
    };
    if let (n, Some(last)) = &st.start_failures {
        let workers = if *n == 1 { "worker" } else { "workers" };
        // Quoted as a string (the worker's own words, which may hold any character).
        reason.push_str(&format!(
            "; {n} admitted {workers} could not start their node (the last said: {last:?})"
        ));
    }
    reason
}

/// The most of a worker's reason for not starting that the seed keeps.
const MAX_REASON_BYTES: usize = 512;

/// `reason`, cut to [`MAX_REASON_BYTES`] (at a character's boundary).
fn bounded_reason(mut reason: String) -> String {
    if reason.len() > MAX_REASON_BYTES {
        let mut at = MAX_REASON_BYTES;
        while !reason.is_char_boundary(at) {
            at -= 1;
        }
        reason.truncate(at);
        reason.push_str("...");
    }
    reason
}

/// How many missing ranks a formation failure names.
const NAMED_MISSING: usize = 16;

/// How long a worker's handshake waits for the seed's actor to admit it.
const ADMISSION_WAIT: Duration = Duration::from_secs(10);

/// How long a refusal may take to reach a client.
const REFUSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Tells a client why it is refused, and waits until it has the reason, for at most
/// [`REFUSE_TIMEOUT`] in all: a client that grants no flow-control credit would otherwise
/// hold the write, and with it the handshake slot of a client that has not proved the
/// secret, for ever.
async fn refuse(send: &mut quinn::SendStream, reason: &str) {
    let refused = BootMsg::Refused {
        reason: reason.to_string(),
    };
    send_last(send, &refused, REFUSE_TIMEOUT).await;
}

/// Frees a rank whose worker vanished between admission and formation.
struct SlotGuard {
    actor: ActorRef<SeedMsg>,
    rank: u32,
    armed: bool,
    /// Why its worker gave the rank back, where it said.
    why: Option<String>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if self.armed {
            let why = self.why.take();
            let _ = self.actor.send_message(SeedMsg::Gone {
                rank: self.rank,
                why,
            });
        }
    }
}

type Admission = Result<(u32, Vec<u8>, Vec<u8>, u32), String>;

/// Closes the wait for an admission that took too long, and returns the rank the actor
/// granted meanwhile, if it did: after the close, the actor's answer either is in the
/// channel (taken here, and the caller gives the rank back) or fails to send (and the
/// actor frees the rank itself), never neither.
fn granted_after_giving_up(admission: &mut oneshot::Receiver<Admission>) -> Option<u32> {
    admission.close();
    match admission.try_recv() {
        Ok(Ok((rank, ..))) => Some(rank),
        _ => None,
    }
}

/// Where a worker's handshake waits for how it enters (or why it cannot).
type Answer = oneshot::Sender<Result<Entry, String>>;

/// How an admitted worker enters: at formation (every rank's address) or into the running
/// cluster at a resize point.
#[derive(Debug)]
enum Entry {
    /// Every rank's mesh address and certificate fingerprint: the [`BootMsg::Peers`]
    /// message, encoded once and shared by every worker's handshake (a copy each would
    /// hold memory that grows with the square of the world while they are sent).
    Formed(bytes::Bytes),
    Joined(Plan),
}

/// At most this many nodes wait to join a running cluster.
const MAX_QUEUED: usize = 256;

/// Messages the [`SeedActor`] handles.
#[derive(Debug)]
enum SeedMsg {
    /// A worker with a valid proof asks for a rank (maybe a specific one).
    Hello {
        rank: Option<u32>,
        csr: Vec<u8>,
        reply: oneshot::Sender<Admission>,
    },
    /// An admitted worker's mesh endpoint listens at `addr`; `peers` gets the list (or why
    /// formation failed).
    Listening {
        rank: u32,
        addr: SocketAddr,
        peers: Answer,
    },
    /// A coordinator (node `from`) reached a resize point.
    Resize {
        from: u32,
        members: Vec<u64>,
        leaving: Vec<u64>,
        reply: oneshot::Sender<Result<Plan, String>>,
    },
    /// The members of `epoch` all have its communicator (says its coordinator, `from`).
    Committed { from: u32, epoch: u64 },
    /// A queued joiner's wait is over.
    QueueExpired { rank: u32 },
    /// A worker formed its mesh.
    Ready { rank: u32 },
    /// A worker finished its job.
    Done { rank: u32, ok: bool },
    /// An admitted worker left before formation (saying why, if it did).
    Gone { rank: u32, why: Option<String> },
    /// Formation deadline.
    Deadline,
}

struct SeedActor;

struct SeedArgs {
    ca: Arc<ClusterCa>,
    world: usize,
    formed: watch::Sender<Option<Result<Vec<SocketAddr>, String>>>,
    finished: watch::Sender<Option<SeedReport>>,
    admitted: watch::Sender<Vec<usize>>,
    queued: watch::Sender<usize>,
    timeout: Duration,
    min_world: usize,
    max_world: usize,
}

struct SeedState {
    ca: Arc<ClusterCa>,
    world: usize,
    min_world: usize,
    max_world: usize,
    timeout: Duration,
    /// Every admitted node (id = formation rank or, for later joiners, a fresh id) and its
    /// mesh address once known.
    taken: BTreeMap<u32, Option<SocketAddr>>,
    /// The certificate (SHA-256 of its DER) issued to each admitted node.
    certs: BTreeMap<u32, [u8; 32]>,
    /// The formation's workers that reported their mesh address, by rank, each with its
    /// answer's sender (a worker that goes before formation takes its entry with it:
    /// [`forget`]). Every rank of the world here: the cluster forms.
    waiting: BTreeMap<u32, Answer>,
    /// Nodes waiting to join the running cluster, oldest first, each with the timer that
    /// ends its wait: aborted when it
    /// leaves the queue another way (admitted, gone, the job finished), so timers of
    /// nodes long gone do not pile up for the seed's whole `--timeout`.
    queue: VecDeque<(u32, Answer, Option<crate::AbortOnDrop>)>,
    /// Last membership epoch handed out, and its members (which may have been committed
    /// without the seed hearing of it yet, or not at all: its agreement failed and the
    /// old members go on).
    epoch: u64,
    members: Vec<u32>,
    /// Nodes that entered the running cluster at a resize point (reported ready).
    entered: Vec<u32>,
    /// Joiners that plans handed out named, with the plan's epoch, until each reports
    /// ready or its plan is reported committed (then they move to `entered`), or it goes
    /// (a joiner turned away is never either).
    pending: Vec<(u32, u64)>,
    /// Joiners that went (reported done, or their connection closed) while still
    /// `pending`, with their plan's epoch and their address. Should that plan's commit
    /// report come after all, the members took them in: they are members lost, as one
    /// that went a moment later would be (joined, and recorded failed), whichever of the
    /// two messages came first.
    vanished: Vec<(u32, u64, Option<SocketAddr>)>,
    /// The coordinator each plan handed out went to, until it reports the plan committed
    /// (one small entry per resize point whose report never came).
    coordinators: BTreeMap<u64, u32>,
    /// Node id for the next node joining the running cluster (ids are never reused: an
    /// earlier holder still has its certificate).
    next_node: u32,
    addrs: Option<Vec<SocketAddr>>,
    /// How many workers admitted before formation could not start their node, and what
    /// the last of them said: quoted should formation fail.
    start_failures: (usize, Option<String>),
    done: BTreeMap<u32, bool>,
    formed: watch::Sender<Option<Result<Vec<SocketAddr>, String>>>,
    finished: watch::Sender<Option<SeedReport>>,
    admitted: watch::Sender<Vec<usize>>,
    queued: watch::Sender<usize>,
    timer: JoinHandle<()>,
}

impl SeedState {
    /// Why no worker can be admitted any more: formation failed at its deadline, and
    /// nobody would answer one.
    fn formation_failed(&self) -> Option<String> {
        match self.formed.borrow().as_ref() {
            Some(Err(reason)) => Some(format!("the cluster did not form: {reason}")),
            _ => None,
        }
    }

    /// The certificate fingerprints of `nodes`, in that order (zeros for one without:
    /// no certificate hashes to that, so such a node is refused everywhere).
    fn fingerprints(&self, nodes: impl Iterator<Item = u32>) -> Vec<[u8; 32]> {
        nodes
            .map(|n| self.certs.get(&n).copied().unwrap_or_default())
            .collect()
    }
}

/// Formation's worker `rank` waits for the others to arrive, its answer's sender kept
/// with theirs (the senders of workers that go away meanwhile are let go by [`forget`]).
fn wait_for_formation(st: &mut SeedState, rank: u32, peers: Answer) {
    st.waiting.insert(rank, peers);
}

/// Every worker arrived (each in `st.waiting`, with its address in `st.taken`): each is
/// sent the peer list, the one encoding of it shared by all, and the cluster is formed.
fn form(st: &mut SeedState) {
    let addrs: Vec<SocketAddr> = st.taken.values().flatten().copied().collect();
    let certs = st.fingerprints(st.taken.keys().copied());
    let peers = encode_frame(&BootMsg::Peers {
        addrs: addrs.clone(),
        certs,
    });
    let peers = match peers {
        Ok(peers) => peers,
        Err(e) => {
            // An encoding that fails fails for every worker: the formation with it.
            let why = format!("the peer list could not be encoded: {e}");
            warn!("{why}");
            for w in std::mem::take(&mut st.waiting).into_values() {
                let _ = w.send(Err(why.clone()));
            }
            st.timer.abort();
            st.formed.send_replace(Some(Err(why)));
            return;
        }
    };
    for w in std::mem::take(&mut st.waiting).into_values() {
        let _ = w.send(Ok(Entry::Formed(peers.clone())));
    }
    info!(world = st.world, "every worker arrived; peer list sent");
    st.members = st.taken.keys().copied().collect();
    st.addrs = Some(addrs.clone());
    st.timer.abort();
    st.formed.send_replace(Some(Ok(addrs)));
}

impl Actor for SeedActor {
    type Msg = SeedMsg;
    type State = SeedState;
    type Arguments = SeedArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SeedMsg>,
        args: SeedArgs,
    ) -> Result<SeedState, ActorProcessingErr> {
        let timeout = args.timeout;
        let timer = tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            let _ = myself.send_message(SeedMsg::Deadline);
        });
        Ok(SeedState {
            ca: args.ca,
            world: args.world,
            min_world: args.min_world,
            max_world: args.max_world,
            timeout,
            taken: BTreeMap::new(),
            certs: BTreeMap::new(),
            waiting: BTreeMap::new(),
            queue: VecDeque::new(),
            epoch: 0,
            members: Vec::new(),
            entered: Vec::new(),
            pending: Vec::new(),
            vanished: Vec::new(),
            coordinators: BTreeMap::new(),
            next_node: args.world as u32,
            addrs: None,
            start_failures: (0, None),
            done: BTreeMap::new(),
            formed: args.formed,
            finished: args.finished,
            admitted: args.admitted,
            queued: args.queued,
            timer,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SeedMsg>,
        msg: SeedMsg,
        st: &mut SeedState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SeedMsg::Hello { rank, csr, reply } => {
                let admitted = admit(st, rank, &csr);
                let granted = admitted.as_ref().ok().map(|(r, ..)| *r);
                if let (Err(_), Some(rank)) = (reply.send(admitted), granted) {
                    // Its handshake gave up waiting (a seed this busy): nobody holds the
                    // rank, and nobody would ever report it done.
                    forget(st, rank);
                }
                publish_admitted(st);
            }
            SeedMsg::Listening { rank, addr, peers } => {
                if let Some(why) = st.formation_failed() {
                    let _ = peers.send(Err(why));
                    return Ok(());
                }
                st.taken.insert(rank, Some(addr));
                if st.addrs.is_some() {
                    // Joining the running cluster: wait for a resize point with room.
                    if st.queue.len() >= MAX_QUEUED {
                        let _ = peers.send(Err(format!(
                            "{MAX_QUEUED} nodes are already waiting to join"
                        )));
                        return Ok(());
                    }
                    info!(
                        node = rank,
                        queued = st.queue.len() + 1,
                        "node waits to join at the next resize point"
                    );
                    let me = myself.clone();
                    let after = st.timeout;
                    let expiry = tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        let _ = me.send_message(SeedMsg::QueueExpired { rank });
                    });
                    st.queue
                        .push_back((rank, peers, Some(crate::AbortOnDrop(expiry))));
                    st.queued.send_replace(st.queue.len());
                    check_finished(st);
                    return Ok(());
                }
                wait_for_formation(st, rank, peers);
                if st.waiting.len() == st.world {
                    form(st);
                }
            }
            SeedMsg::Ready { rank } => {
                debug!(rank, "worker mesh ready");
                // A joiner reports ready once the members told it it is in: it is one of
                // the job's nodes from here on. (Its Ready and its later report share one
                // stream, so they arrive in order; the coordinator's Committed, on
                // another, may come later.)
                if let Some(pos) = st.pending.iter().position(|(r, _)| *r == rank) {
                    st.pending.swap_remove(pos);
                    st.entered.push(rank);
                }
            }
            SeedMsg::Done { rank, ok } => done(st, rank, ok),
            SeedMsg::Resize {
                from,
                members,
                leaving,
                reply,
            } => {
                let answer = check_resize(st, from, &members, &leaving)
                    .and_then(|()| plan_resize(st, &members, &leaving));
                if let Ok(plan) = &answer {
                    st.coordinators.insert(plan.epoch, from);
                }
                if let Err(reason) = &answer {
                    warn!(node = from, %reason, "resize request refused");
                }
                let _ = reply.send(answer);
                st.queued.send_replace(st.queue.len());
            }
            SeedMsg::Committed { from, epoch } => committed(st, from, epoch),
            SeedMsg::QueueExpired { rank } => {
                if let Some(pos) = st.queue.iter().position(|(r, ..)| *r == rank) {
                    if let Some((_, w, _)) = st.queue.remove(pos) {
                        let _ = w.send(Err(format!(
                            "no resize point with room for this node within {:?} (max world {})",
                            st.timeout, st.max_world
                        )));
                        // It never joined: it took no part in the job.
                        forget(st, rank);
                    }
                }
            }
            SeedMsg::Gone { rank, why } => {
                if let (Some(why), None) = (why, &st.addrs) {
                    st.start_failures.0 += 1;
                    st.start_failures.1 = Some(why);
                }
                forget(st, rank);
            }
            SeedMsg::Deadline => {
                if st.addrs.is_none() {
                    let reason = missing_ranks(st);
                    for w in std::mem::take(&mut st.waiting).into_values() {
                        let _ = w.send(Err(reason.clone()));
                    }
                    st.formed.send_replace(Some(Err(reason)));
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SeedMsg>,
        st: &mut SeedState,
    ) -> Result<(), ActorProcessingErr> {
        st.timer.abort();
        Ok(())
    }
}

/// A node reports its job done.
fn done(st: &mut SeedState, rank: u32, ok: bool) {
    if never_entered(st, rank) {
        // A joiner turned away at its resize point took no part in the job (unless its
        // plan's commit report comes later: `vanished`).
        debug!(rank, ok, "a node that never entered the cluster is done");
        forget(st, rank);
    } else {
        st.done.insert(rank, ok);
        check_finished(st);
    }
}

/// The coordinator of `epoch`'s plan reports it carried out.
fn committed(st: &mut SeedState, from: u32, epoch: u64) {
    // Only the coordinator the plan was handed to reports it.
    if st.coordinators.get(&epoch) != Some(&from) {
        warn!(
            node = from,
            epoch, "commit report from a node that did not coordinate that resize point; ignored"
        );
        return;
    }
    st.coordinators.remove(&epoch);
    info!(epoch, "membership change committed");
    // Its joiners entered (whichever of this and their own ready comes first; a later plan
    // may have overtaken this report).
    let (entered, rest): (Vec<_>, Vec<_>) = st.pending.iter().partition(|(_, e)| *e == epoch);
    st.entered.extend(entered.into_iter().map(|(r, _)| r));
    st.pending = rest;
    // Those of them that went before this report came were members lost.
    let (lost, rest): (Vec<_>, Vec<_>) = st.vanished.iter().partition(|(_, e, _)| *e == epoch);
    st.vanished = rest;
    for (rank, _, addr) in lost {
        warn!(
            node = rank,
            epoch, "a node taken in at a resize point went before its commit was reported"
        );
        st.taken.insert(rank, addr);
        st.entered.push(rank);
        st.done.insert(rank, false);
    }
    check_finished(st);
}

/// True for a node admitted after formation that never entered the running cluster
/// (it has not reported ready after a resize point took it in).
fn never_entered(st: &SeedState, rank: u32) -> bool {
    st.addrs.is_some() && rank >= st.world as u32 && !st.entered.contains(&rank)
}

/// A worker went away, or holds nothing any more: before formation its rank is free
/// again; a member is recorded as failed unless it reported; a node that never got in
/// is forgotten.
fn forget(st: &mut SeedState, rank: u32) {
    st.queue.retain(|(r, ..)| *r != rank);
    st.queued.send_replace(st.queue.len());
    if let Some(at) = st.pending.iter().position(|(r, _)| *r == rank) {
        // Its plan may still be reported committed.
        let (_, epoch) = st.pending.swap_remove(at);
        let addr = st.taken.get(&rank).copied().flatten();
        st.vanished.push((rank, epoch, addr));
    }
    if st.addrs.is_none() {
        info!(rank, "worker left before formation; its rank is free again");
        st.taken.remove(&rank);
        st.waiting.remove(&rank);
        publish_admitted(st);
    } else if !never_entered(st, rank) {
        // A member that went away before it reported.
        st.done.entry(rank).or_insert(false);
        check_finished(st);
    } else {
        // A node that never got in took no part in the job.
        st.taken.remove(&rank);
        st.certs.remove(&rank);
        publish_admitted(st);
        check_finished(st);
    }
}

/// Publishes the report once every node that took part has reported its job done (nodes
/// still queued to join are turned away then).
fn check_finished(st: &mut SeedState) {
    if st.finished.borrow().is_some() {
        return;
    }
    let Some(addrs) = &st.addrs else { return };
    let queued: Vec<u32> = st.queue.iter().map(|(r, ..)| *r).collect();
    let active = st.taken.keys().filter(|r| !queued.contains(r));
    if !active.clone().all(|r| st.done.contains_key(r)) {
        return;
    }
    let addrs = addrs.clone();
    for (node, w, _) in std::mem::take(&mut st.queue) {
        st.taken.remove(&node);
        let _ = w.send(Err("the cluster finished its job".into()));
    }
    st.queued.send_replace(0);
    let world = st.world as u32;
    let report = SeedReport {
        world: st.world,
        addrs,
        joined: st
            .taken
            .iter()
            .filter(|(r, _)| **r >= world && st.entered.contains(r))
            .filter_map(|(r, a)| a.map(|a| (*r as usize, a)))
            .collect(),
        ok: st
            .done
            .iter()
            .filter(|(_, ok)| **ok)
            .map(|(r, _)| *r as usize)
            .collect(),
        failed: st
            .done
            .iter()
            .filter(|(_, ok)| !**ok)
            .map(|(r, _)| *r as usize)
            .collect(),
    };
    st.finished.send_replace(Some(report));
}

/// Checks a resize request against what the seed knows: it must come from the
/// coordinator it names (the first member not leaving; the first member when all are),
/// and name only nodes still in the job: of the formed world, of the last membership
/// handed out, or joiners that entered, and none that reported its job done or went away
/// (a joiner turned away is none of those; a node that left at a resize point passes
/// until it reports).
fn check_resize(st: &SeedState, from: u32, members: &[u64], leaving: &[u64]) -> Result<(), String> {
    if st.addrs.is_none() {
        return Err("the cluster is not formed yet".into());
    }
    // Sets, not scans of one list per entry of the other: a request can name a quarter of
    // a million nodes, and the seed's actor answers everyone else meanwhile.
    let leaving: HashSet<u64> = leaving.iter().copied().collect();
    let coordinator = members
        .iter()
        .find(|m| !leaving.contains(m))
        .or(members.first());
    if coordinator != Some(&u64::from(from)) {
        return Err(format!(
            "node {from} is not the coordinator of the resize point it asked for"
        ));
    }
    // The nodes still in the job: the formed world and those that entered later (or were
    // named by the last plan, whose joiners may not have reported yet), less those that
    // reported their job done or went away. Not only the last plan's members: after a
    // split, each group adopts its own communicator and has resize points of its own.
    let known: HashSet<u32> = (0..st.world as u32)
        .chain(st.members.iter().copied())
        .chain(st.entered.iter().copied())
        .filter(|n| !st.done.contains_key(n))
        .collect();
    let known = |n: &u64| u32::try_from(*n).is_ok_and(|n| known.contains(&n));
    if let Some(stranger) = members.iter().find(|n| !known(n)) {
        return Err(format!("node {stranger} is not a member of this cluster"));
    }
    Ok(())
}

/// Decides the membership at a resize point: `members` (the coordinator's communicator,
/// in rank order) minus those `leaving`, unless that would go below the minimum world,
/// plus queued joiners while there is room under the maximum (which counts the nodes of
/// the job outside this communicator too).
fn plan_resize(st: &mut SeedState, members: &[u64], leaving: &[u64]) -> Result<Plan, String> {
    if st.addrs.is_none() {
        return Err("the cluster is not formed yet".into());
    }
    let addr_of = |n: u64| -> Result<(u32, SocketAddr), String> {
        let id = u32::try_from(n).map_err(|_| format!("unknown node {n}"))?;
        match st.taken.get(&id) {
            Some(Some(a)) => Ok((id, *a)),
            _ => Err(format!("node {n} is not a member of this cluster")),
        }
    };
    let mut current = Vec::with_capacity(members.len());
    let mut listed = HashSet::with_capacity(members.len());
    for &n in members {
        if !listed.insert(n) {
            return Err(format!("node {n} is listed twice"));
        }
        current.push(addr_of(n)?);
    }
    if leaving.iter().any(|n| !listed.contains(n)) {
        return Err("a leaving node is not a member".into());
    }
    let leaving: HashSet<u64> = leaving.iter().copied().collect();
    let mut keep: Vec<(u32, SocketAddr)> = current
        .iter()
        .filter(|(n, _)| !leaving.contains(&u64::from(*n)))
        .copied()
        .collect();
    let mut note = None;
    if !leaving.is_empty() && keep.len() < st.min_world {
        note = Some(format!(
            "leaving refused: the world would drop to {} nodes, below the minimum of {}",
            keep.len(),
            st.min_world
        ));
        keep = current;
    }
    // Room under the maximum counts every node still in the job, not only this
    // communicator's: after a split, each group has resize points of its own. (A node
    // that left and has not reported its job done yet still counts: the cap is kept.)
    let queued: HashSet<u32> = st.queue.iter().map(|(n, ..)| *n).collect();
    let elsewhere = st
        .taken
        .iter()
        .filter(|(n, a)| {
            a.is_some()
                && !st.done.contains_key(n)
                && !queued.contains(n)
                && !listed.contains(&u64::from(**n))
        })
        .count();
    let mut joining = Vec::new();
    while elsewhere + keep.len() + joining.len() < st.max_world {
        let Some((node, w, _)) = st.queue.pop_front() else {
            break;
        };
        match st.taken.get(&node) {
            Some(Some(a)) if !w.is_closed() => joining.push((node, *a, w)),
            _ => debug!(node, "queued joiner went away"),
        }
    }
    st.epoch += 1;
    let next: Vec<(u64, SocketAddr)> = keep
        .iter()
        .map(|(n, a)| (u64::from(*n), *a))
        .chain(joining.iter().map(|(n, a, _)| (u64::from(*n), *a)))
        .collect();
    let certs = st.fingerprints(next.iter().map(|(n, _)| *n as u32));
    let plan = Plan {
        epoch: st.epoch,
        comm: crate::comm::membership_comm_id(st.epoch),
        members: next,
        certs,
        note,
    };
    st.members = plan.members.iter().map(|(n, _)| *n as u32).collect();
    info!(
        epoch = plan.epoch,
        world = plan.members.len(),
        joining = joining.len(),
        leaving = members.len() + joining.len() - plan.members.len(),
        "resize point"
    );
    st.pending
        .extend(joining.iter().map(|(n, ..)| (*n, st.epoch)));
    for (_, _, w) in joining {
        let _ = w.send(Ok(Entry::Joined(plan.clone())));
    }
    Ok(plan)
}

fn publish_admitted(st: &SeedState) {
    st.admitted
        .send_replace(st.taken.keys().map(|r| *r as usize).collect());
}

fn admit(st: &mut SeedState, requested: Option<u32>, csr: &[u8]) -> Admission {
    if let Some(why) = st.formation_failed() {
        return Err(why);
    }
    if st.finished.borrow().is_some() {
        return Err("the cluster finished its job".into());
    }
    let rank = if st.addrs.is_some() {
        if st.max_world <= st.world {
            return Err(format!(
                "the cluster is already formed and its size is fixed at {} (a seed started \
                 with a larger max world lets nodes join a running cluster)",
                st.world
            ));
        }
        if requested.is_some() {
            return Err("a node joining a running cluster cannot ask for a rank: \
                 ranks are assigned at the resize point"
                .into());
        }
        // A fresh node id, never reused.
        let id = st.next_node;
        st.next_node = id
            .checked_add(1)
            .ok_or_else(|| "no node ids left".to_string())?;
        id
    } else {
        match requested {
            Some(r) if r as usize >= st.world => {
                return Err(format!(
                    "rank {r} is out of range for a world of {}",
                    st.world
                ))
            }
            Some(r) if st.taken.contains_key(&r) => {
                return Err(format!("rank {r} is already taken by another node"))
            }
            Some(r) => r,
            None => (0..st.world as u32)
                .find(|r| !st.taken.contains_key(r))
                .ok_or_else(|| format!("all {} ranks are taken", st.world))?,
        }
    };
    let cert = st
        .ca
        .sign_request(csr, NodeId(u64::from(rank)))
        .map_err(|e| format!("bad certificate request: {e}"))?;
    st.taken.insert(rank, None);
    // The certificate the members will take for this node: one issued earlier for the same
    // rank (to a worker that left before formation) is refused.
    st.certs
        .insert(rank, nexar_transport::cert_fingerprint(cert.as_ref()));
    info!(rank, "worker admitted");
    Ok((
        rank,
        cert.to_vec(),
        st.ca.cert_der().to_vec(),
        st.world as u32,
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::bootstrap::proto::write_msg;
    use crate::bootstrap::JoinOptions;
    use crate::Node;

    const LOOPBACK: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    const DEADLINE: Duration = Duration::from_secs(60);

    /// A client of `seed` that grants no flow-control credit on its streams, connected.
    async fn stalling_client(seed: &Seed) -> (quinn::Endpoint, quinn::Connection) {
        let (ep, conn) = stalling_client_from(seed, LOOPBACK).await;
        (ep, conn.expect("handshake with the seed"))
    }

    /// [`stalling_client`] from the local address `local`, the handshake's outcome as is.
    async fn stalling_client_from(
        seed: &Seed,
        local: SocketAddr,
    ) -> (
        quinn::Endpoint,
        Result<quinn::Connection, quinn::ConnectionError>,
    ) {
        let join = seed.join_string();
        let mut client =
            nexar_transport::bootstrap_client_config(join.fingerprint, &TransportConfig::default())
                .expect("client config");
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(0u32.into());
        t.keep_alive_interval(Some(Duration::from_millis(200)));
        client.transport_config(Arc::new(t));
        let ep = quinn::Endpoint::client(local).expect("client endpoint");
        let conn = tokio::time::timeout(DEADLINE, async {
            ep.connect_with(client, join.seed, "seed.nexar")
                .expect("connect")
                .await
        })
        .await
        .expect("no handshake within the deadline");
        (ep, conn)
    }

    /// Zero formation or handshake timeouts are refused when the seed starts, naming the
    /// setting (every worker would be turned away, with a reason that points elsewhere).
    #[tokio::test]
    async fn zero_timeouts_are_refused_at_start() {
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        for name in ["formation_timeout", "handshake_timeout"] {
            let mut so = SeedOptions::default();
            match name {
                "formation_timeout" => so.formation_timeout = Duration::ZERO,
                _ => so.handshake_timeout = Duration::ZERO,
            }
            match Seed::start(local, 1, so).await {
                Err(crate::NexarError::InvalidArgument(why)) => {
                    assert!(why.contains(name), "{why}")
                }
                other => panic!("{name} of zero: {:?}", other.err()),
            }
        }
    }

    /// A seed that holds all the handshakes it takes refuses a worker, which asks again
    /// within its timeout: with a short timeout it fails saying the seed was busy (it used
    /// to fail at once, told to check that the seed runs and UDP reaches it), and with a
    /// long one it joins once the silent client that held the place has gone. The place
    /// is held for two minutes unless the client goes, past the test's deadline, so how
    /// slowly the machine runs changes neither outcome.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_refused_by_a_busy_seed_asks_again_within_its_timeout() {
        let so = SeedOptions {
            max_handshakes: 1,
            handshake_timeout: 2 * DEADLINE,
            ..SeedOptions::default()
        };
        let seed = Seed::start(LOOPBACK, 1, so).await.expect("seed");
        let (ep, silent) = stalling_client(&seed).await;
        let mut opts = JoinOptions::new(seed.join_string().clone());
        opts.listen = LOOPBACK;
        opts.timeout = Duration::from_secs(2);
        match Node::join(opts).await {
            Err(crate::NexarError::Bootstrap(BootstrapError::SeedBusy { .. })) => {}
            other => panic!("expected the seed to be busy, got {other:?}"),
        }
        // A worker that asks while the place is held joins once the client goes.
        let joining = tokio::spawn({
            let join = seed.join_string().clone();
            async move {
                let mut opts = JoinOptions::new(join);
                opts.listen = LOOPBACK;
                opts.timeout = DEADLINE;
                Node::join(opts).await
            }
        });
        silent.close(0u32.into(), b"done");
        tokio::time::timeout(DEADLINE, ep.wait_idle())
            .await
            .expect("the client's close sent within the deadline");
        let node = tokio::time::timeout(DEADLINE, joining)
            .await
            .expect("no join within the deadline")
            .expect("join task")
            .expect("a worker joins once the place is free");
        tokio::time::timeout(DEADLINE, node.finish(true))
            .await
            .expect("finished within the deadline");
    }

    /// One IP address holds at most a quarter of the handshakes: four silent clients from
    /// 127.0.0.2 hold one of four, and a worker from 127.0.0.1 joins at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_address_holds_at_most_a_quarter_of_the_handshakes() {
        let so = SeedOptions {
            max_handshakes: 4,
            handshake_timeout: Duration::from_secs(120),
            ..SeedOptions::default()
        };
        let seed = Seed::start(LOOPBACK, 1, so).await.expect("seed");
        let other = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)), 0);
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(stalling_client_from(&seed, other).await);
        }
        let connected = held.iter().filter(|(_, c)| c.is_ok()).count();
        assert_eq!(connected, 1, "silent clients held from one address");
        let mut opts = JoinOptions::new(seed.join_string().clone());
        opts.listen = LOOPBACK;
        opts.timeout = Duration::from_secs(20);
        let node = Node::join(opts)
            .await
            .expect("a worker from another address joins");
        node.finish(true).await;
    }

    /// Joins one worker to `seed` and finishes it.
    async fn join_one(seed: &Seed) {
        let mut opts = JoinOptions::new(seed.join_string().clone());
        opts.listen = LOOPBACK;
        let node = tokio::time::timeout(DEADLINE, Node::join(opts))
            .await
            .expect("no join within the deadline")
            .expect("a worker joins once the slot is free");
        tokio::time::timeout(DEADLINE, node.finish(true))
            .await
            .expect("finished within the deadline");
    }

    /// Starts a one-rank seed with `so`, sends it `first` from a client that grants no
    /// flow-control credit, and checks that the seed drops that client (`what` says what
    /// it would still hold otherwise) and then admits a worker.
    async fn a_stalling_client_is_dropped(
        so: SeedOptions,
        first: impl FnOnce(&Seed, &quinn::Connection) -> BootMsg,
        what: &str,
    ) {
        let seed = Seed::start(LOOPBACK, 1, so).await.expect("seed");
        let (_ep, conn) = stalling_client(&seed).await;
        let (mut send, _recv) = conn.open_bi().await.expect("stream");
        write_msg(&mut send, &first(&seed, &conn))
            .await
            .expect("write");
        let closed = tokio::time::timeout(DEADLINE, conn.closed()).await;
        assert!(closed.is_ok(), "the seed still holds {what}");
        join_one(&seed).await;
    }

    /// A client that has not proved the secret and grants no flow-control credit cannot
    /// keep its handshake slot by leaving the seed's refusal unwritten: with room for one
    /// handshake, the seed drops it and a worker joins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_takes_no_refusal_gives_its_handshake_slot_back() {
        let so = SeedOptions {
            max_handshakes: 1,
            ..SeedOptions::default()
        };
        let not_a_hello = |_: &Seed, _: &quinn::Connection| BootMsg::Refused {
            reason: "not a hello".into(),
        };
        a_stalling_client_is_dropped(so, not_a_hello, "a client that takes no refusal").await;
    }

    /// A client that proved the secret (and so was given a rank) but takes no message
    /// cannot hold its rank by leaving its welcome unwritten: the seed drops it within the
    /// handshake timeout and gives the rank to a worker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admitted_client_that_takes_no_welcome_gives_its_rank_back() {
        let so = SeedOptions {
            // It also bounds the worker's handshake that follows: room for a slow machine.
            handshake_timeout: Duration::from_secs(3),
            ..SeedOptions::default()
        };
        let hello = |seed: &Seed, conn: &quinn::Connection| {
            let ekm = session_ekm(conn).expect("keying material");
            let (csr, _key) = nexar_transport::generate_csr().expect("certificate request");
            BootMsg::Hello {
                version: BOOT_VERSION,
                proof: seed.join_string().secret.prove(&ekm, b"worker"),
                csr,
                rank: None,
            }
        };
        a_stalling_client_is_dropped(so, hello, "an admitted client that takes no welcome").await;
    }

    /// A formation that fails names the first missing ranks and counts the others, so a
    /// large world's reason stays short.
    #[tokio::test]
    async fn a_formation_failure_names_the_first_missing_ranks_and_counts_the_rest() {
        let so = SeedOptions {
            formation_timeout: Duration::from_millis(100),
            ..SeedOptions::default()
        };
        let seed = Seed::start(LOOPBACK, 40, so).await.expect("seed");
        let formed = tokio::time::timeout(DEADLINE, seed.wait_formed())
            .await
            .expect("the seed did not give up within the deadline");
        let Err(BootstrapError::Formation(reason)) = formed else {
            panic!("expected a formation failure, got {formed:?}");
        };
        let named: Vec<String> = (0..16).map(|r| r.to_string()).collect();
        let expected = format!("40 ranks ({} and 24 more) did not arrive", named.join(", "));
        assert!(reason.contains(&expected), "{reason}");
    }

    /// The state of a seed whose nodes `0..world` formed the cluster, with the nodes
    /// `queued` waiting to join, in order, within the world bounds `min..=max`; with the
    /// receivers of the queued nodes' answers, kept so that they stay waiting.
    fn formed_state(
        world: u32,
        min: usize,
        max: usize,
        queued: std::ops::Range<u32>,
    ) -> (SeedState, Vec<oneshot::Receiver<Result<Entry, String>>>) {
        let (formed, _) = watch::channel(None);
        let (finished, _) = watch::channel(None);
        let (admitted, _) = watch::channel(Vec::new());
        let (queued_tx, _) = watch::channel(0);
        let addr = |n: u32| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 7000 + n as u16);
        let nodes = queued.end;
        let (queue, waiting): (VecDeque<_>, Vec<_>) = queued
            .map(|n| {
                let (tx, rx) = oneshot::channel();
                ((n, tx, None), rx)
            })
            .unzip();
        let st = SeedState {
            ca: Arc::new(ClusterCa::generate().expect("ca")),
            world: world as usize,
            min_world: min,
            max_world: max,
            timeout: DEADLINE,
            taken: (0..nodes).map(|n| (n, Some(addr(n)))).collect(),
            certs: BTreeMap::new(),
            waiting: BTreeMap::new(),
            queue,
            epoch: 0,
            members: Vec::new(),
            entered: Vec::new(),
            pending: Vec::new(),
            vanished: Vec::new(),
            coordinators: BTreeMap::new(),
            next_node: nodes,
            addrs: Some((0..world).map(addr).collect()),
            start_failures: (0, None),
            done: BTreeMap::new(),
            formed,
            finished,
            admitted,
            queued: queued_tx,
            timer: tokio::spawn(async {}),
        };
        (st, waiting)
    }

    /// The workers of a formation are all sent the one encoding of the peer list (a copy
    /// each held memory growing with the square of the world while they were sent), and
    /// it decodes to every rank's address and certificate, in rank order.
    #[tokio::test]
    async fn every_worker_is_sent_one_shared_peer_list() {
        let (mut st, _) = formed_state(4, 4, 4, 4..4);
        st.addrs = None;
        let addrs: Vec<SocketAddr> = st.taken.values().flatten().copied().collect();
        assert_eq!(addrs.len(), 4);
        let certs: Vec<[u8; 32]> = (0..4u8).map(|n| [n + 1; 32]).collect();
        for (n, c) in certs.iter().enumerate() {
            st.certs.insert(n as u32, *c);
        }
        let mut answers = Vec::new();
        for rank in 0..4 {
            let (tx, rx) = oneshot::channel();
            st.waiting.insert(rank, tx);
            answers.push(rx);
        }
        form(&mut st);
        let sent: Vec<bytes::Bytes> = answers
            .into_iter()
            .map(|mut rx| match rx.try_recv() {
                Ok(Ok(Entry::Formed(peers))) => peers,
                other => panic!("expected the peer list, got {other:?}"),
            })
            .collect();
        assert!(
            sent.iter().all(|b| b.as_ptr() == sent[0].as_ptr()),
            "one encoding shared by every worker"
        );
        let len = u32::from_be_bytes(sent[0][..4].try_into().unwrap()) as usize;
        assert_eq!(len, sent[0].len() - 4);
        match postcard::from_bytes::<BootMsg>(&sent[0][4..]).expect("a message") {
            BootMsg::Peers { addrs: a, certs: c } => {
                assert_eq!(a, addrs);
                assert_eq!(c, certs);
            }
            other => panic!("expected Peers, got {other:?}"),
        }
        assert_eq!(st.formed.borrow().clone(), Some(Ok(addrs)));
        assert!(st.waiting.is_empty());
    }

    /// A queued node that goes away takes its wait's timer with it: the timer is
    /// aborted, where it slept on for the seed's whole `--timeout`, one per node that
    /// came and went.
    #[tokio::test]
    async fn a_queued_nodes_timer_ends_when_it_leaves_the_queue() {
        let (mut st, _answers) = formed_state(2, 1, 3, 2..3);
        // A timer that holds a sender while it waits: aborted, it lets it go.
        let (held, gone) = oneshot::channel::<()>();
        let timer = tokio::spawn(async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        st.queue[0].2 = Some(crate::AbortOnDrop(timer));
        forget(&mut st, 2);
        assert!(st.queue.is_empty());
        let ended = tokio::time::timeout(DEADLINE, gone)
            .await
            .expect("the timer ended");
        assert!(ended.is_err(), "aborted, not finished");
    }

    /// Workers that went away while the formation waited leave no answer behind: the
    /// senders of their answers are let go as each goes, not kept to the formation's
    /// deadline.
    #[tokio::test]
    async fn answers_of_workers_gone_before_formation_are_let_go() {
        let (mut st, _) = formed_state(4, 4, 4, 4..4);
        st.addrs = None;
        let mut kept = Vec::new();
        for rank in 0..4 {
            let (tx, rx) = oneshot::channel();
            wait_for_formation(&mut st, rank, tx);
            kept.push(rx);
        }
        for rank in 0..3 {
            forget(&mut st, rank);
        }
        assert_eq!(st.waiting.keys().copied().collect::<Vec<_>>(), vec![3]);
        // The senders of the three that went are dropped: their answers are closed.
        for rx in &mut kept[..3] {
            assert!(matches!(
                rx.try_recv(),
                Err(oneshot::error::TryRecvError::Closed)
            ));
        }
    }

    fn plan_members(p: &Plan) -> Vec<u64> {
        p.members.iter().map(|(n, _)| *n).collect()
    }

    /// A joiner that goes between the new communicator's barrier and its coordinator's
    /// commit report is a member lost whichever message the seed gets first: its report
    /// fails the job either way. (With its own "done" first, the seed used to forget it as
    /// a node that never got in, and report success.)
    #[tokio::test]
    async fn a_joiner_gone_before_its_commit_report_is_a_member_lost_in_either_order() {
        for done_first in [true, false] {
            let (mut st, epoch) = joiner_pending();
            if done_first {
                done(&mut st, 2, false);
                committed(&mut st, 0, epoch);
            } else {
                committed(&mut st, 0, epoch);
                done(&mut st, 2, false);
            }
            let report = members_finish(&mut st);
            assert_eq!(report.failed, [2], "done first: {done_first}");
            let joined: Vec<usize> = report.joined.iter().map(|(n, _)| *n).collect();
            assert_eq!(joined, [2], "done first: {done_first}");
            assert!(!report.succeeded(), "done first: {done_first}");
        }
    }

    /// A joiner that goes while still pending, whose plan is never reported committed (it
    /// was turned away), took no part: the job succeeds without it.
    #[tokio::test]
    async fn a_joiner_gone_before_an_uncommitted_plan_took_no_part() {
        let (mut st, _) = joiner_pending();
        forget(&mut st, 2);
        let report = members_finish(&mut st);
        assert!(report.succeeded(), "{report:?}");
        assert!(report.joined.is_empty(), "{report:?}");
    }

    /// A seed whose nodes 0 and 1 formed the cluster and handed node 0 a plan that takes
    /// node 2 in; with that plan's epoch. (Node 2's answer is dropped: it was told.)
    fn joiner_pending() -> (SeedState, u64) {
        let (mut st, _waiting) = formed_state(2, 1, 3, 2..3);
        let plan = plan_resize(&mut st, &[0, 1], &[]).expect("a plan");
        assert_eq!(plan_members(&plan), [0, 1, 2], "node 2 joins");
        st.coordinators.insert(plan.epoch, 0);
        (st, plan.epoch)
    }

    /// Nodes 0 and 1 report their job done; the seed's report, which that completes.
    fn members_finish(st: &mut SeedState) -> SeedReport {
        let mut finished = st.finished.subscribe();
        done(st, 0, true);
        done(st, 1, true);
        let report = finished.borrow_and_update().clone();
        report.expect("every node reported: the job is finished")
    }

    /// A handshake that gives up waiting for its admission gives back a rank the actor
    /// granted meanwhile, and closes the wait so that an answer after that fails to send
    /// (the actor then frees the rank itself).
    #[test]
    fn an_admission_given_up_returns_the_rank_granted_meanwhile() {
        let (tx, mut rx) = oneshot::channel::<Admission>();
        tx.send(Ok((7, Vec::new(), Vec::new(), 4)))
            .expect("the wait is open");
        assert_eq!(granted_after_giving_up(&mut rx), Some(7));
        let (tx, mut rx) = oneshot::channel::<Admission>();
        assert_eq!(granted_after_giving_up(&mut rx), None);
        assert!(
            tx.send(Ok((8, Vec::new(), Vec::new(), 4))).is_err(),
            "a grant after the wait closed fails to send"
        );
    }

    /// A leave is judged by the members that stay: one that would leave fewer than the
    /// minimum is refused even while a joiner waits that the same point lets in (the
    /// leaver would be gone before the joiner is in, and the joiner may still fail
    /// there, leaving the world below the minimum). The joiner still comes in.
    #[tokio::test]
    async fn a_leave_below_the_minimum_is_refused_whatever_joins() {
        let (mut st, mut waiting) = formed_state(2, 2, 3, 2..3);
        let plan = plan_resize(&mut st, &[0, 1], &[1]).expect("a plan");
        assert_eq!(plan_members(&plan), [0, 1, 2], "node 1 stays, node 2 joins");
        let note = plan.note.as_deref().unwrap_or_default();
        assert!(note.contains("below the minimum of 2"), "{note}");
        assert!(matches!(waiting[0].try_recv(), Ok(Ok(Entry::Joined(_)))));
    }

    /// The largest world caps the whole job: after a split, each group's resize points
    /// admit joiners only while the nodes of both groups, and the joiners already let in,
    /// stay within it (each group used to fill up to it on its own).
    #[tokio::test]
    async fn the_largest_world_caps_split_groups_together() {
        let (mut st, _waiting) = formed_state(4, 1, 6, 4..8);
        let members = plan_members;
        let a = plan_resize(&mut st, &[0, 1], &[]).expect("a plan");
        assert_eq!(
            members(&a),
            [0, 1, 4, 5],
            "room for two beside the other group"
        );
        let b = plan_resize(&mut st, &[2, 3], &[]).expect("a plan");
        assert_eq!(members(&b), [2, 3], "no room left");
        // One of the first group done: room for one.
        st.done.insert(1, true);
        let b = plan_resize(&mut st, &[2, 3], &[]).expect("a plan");
        assert_eq!(members(&b), [2, 3, 6]);
    }

    /// `Node::from_env` checks the launcher's world size against the cluster's, as `nexar
    /// worker` does: a worker told of 2 ranks that joins a cluster of 1 fails with
    /// `Environment` naming the variable (it used to run as if nothing were wrong); told
    /// of 1, it joins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn joining_from_the_environment_checks_the_launchers_world_size() {
        for (said, ok) in [("2", false), ("1", true)] {
            let seed = Seed::start(LOOPBACK, 1, SeedOptions::default())
                .await
                .expect("seed");
            let join = seed.join_string().to_string();
            let get = |k: &str| match k {
                "NEXAR_JOIN" => Some(join.clone()),
                "WORLD_SIZE" => Some(said.to_string()),
                "NEXAR_LISTEN" => Some("127.0.0.1:0".to_string()),
                _ => None,
            };
            let joined = tokio::time::timeout(DEADLINE, Node::from_env_with(get))
                .await
                .expect("the join ends within the deadline");
            match joined {
                Ok(node) if ok => {
                    tokio::time::timeout(DEADLINE, node.finish(true))
                        .await
                        .expect("finished within the deadline");
                }
                Err(crate::NexarError::Bootstrap(BootstrapError::Environment(why))) if !ok => {
                    assert!(
                        why.contains("WORLD_SIZE") && why.contains("2 ranks"),
                        "{why}"
                    );
                }
                other => panic!("WORLD_SIZE={said}: {:?}", other.map(|n| n.rank())),
            }
        }
    }

    /// Waiting for a rank's admission or for queued joiners ends with the formation's
    /// error once formation failed (both used to wait for good).
    #[tokio::test]
    async fn waits_for_admission_or_a_queue_end_when_formation_fails() {
        let so = SeedOptions {
            formation_timeout: Duration::from_millis(100),
            max_world: Some(3),
            ..SeedOptions::default()
        };
        let seed = Seed::start(LOOPBACK, 2, so).await.expect("seed");
        let admitted = tokio::time::timeout(DEADLINE, seed.wait_admitted(0))
            .await
            .expect("the wait for an admission ended");
        assert!(
            matches!(&admitted, Err(BootstrapError::Formation(e)) if e.contains("did not arrive")),
            "{admitted:?}"
        );
        let queued = tokio::time::timeout(DEADLINE, seed.wait_queued(1))
            .await
            .expect("the wait for a queue ended");
        assert!(
            matches!(queued, Err(BootstrapError::Formation(_))),
            "{queued:?}"
        );
    }

    /// A world whose peer list would not fit a message from the seed is refused at start,
    /// instead of forming a seed whose workers cannot read it.
    #[tokio::test]
    async fn a_world_too_large_for_a_peer_list_is_refused() {
        let over = max_boot_world() + 1;
        for (world, max_world) in [(over, None), (2, Some(over))] {
            let so = SeedOptions {
                max_world,
                ..SeedOptions::default()
            };
            match Seed::start(LOOPBACK, world, so).await {
                Err(crate::NexarError::InvalidArgument(e)) => {
                    assert!(e.contains("too large"), "{e}")
                }
                other => panic!(
                    "world {world}, max {max_world:?}: expected a refusal, got {:?}",
                    other.map(|_| ())
                ),
            }
        }
        assert!(Seed::start(
            LOOPBACK,
            2,
            SeedOptions {
                max_world: Some(max_boot_world()),
                ..SeedOptions::default()
            }
        )
        .await
        .is_ok());
    }
}
