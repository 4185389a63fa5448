//! The seed: issues identities, assigns ranks and hands out the peer list.
//!
//! A `SeedActor` owns the membership table and decides; one task per incoming handshake
//! does the I/O and asks the actor.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use nexar_transport::{bootstrap_server, fingerprint_hex, ClusterCa, NodeId, TransportConfig};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::proto::{read_msg, session_ekm, write_msg, BootMsg, JoinString, Secret, BOOT_VERSION};
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
    /// Deadline for every worker to arrive and the mesh to form (default 60 s).
    pub formation_timeout: Duration,
    /// Deadline for one worker's hello after its connection opens (default 10 s).
    pub handshake_timeout: Duration,
}

impl Default for SeedOptions {
    fn default() -> Self {
        SeedOptions {
            secret: None,
            advertise: None,
            formation_timeout: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(10),
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
    /// Ranks whose job reported success.
    pub ok: Vec<usize>,
    /// Ranks whose job reported failure or that left without reporting.
    pub failed: Vec<usize>,
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
        let ca = ClusterCa::generate()?;
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
        let args = SeedArgs {
            ca,
            world,
            formed: formed_tx,
            finished: finished_tx,
            admitted: admitted_tx,
            timeout: opts.formation_timeout,
        };
        let (actor, _) = Actor::spawn(None, SeedActor, args)
            .await
            .map_err(|e| crate::NexarError::Actor(e.to_string()))?;
        let accept = tokio::spawn(accept_loop(
            endpoint.clone(),
            actor.clone(),
            secret,
            opts.handshake_timeout,
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

    /// Waits until `rank` is held by an admitted worker.
    pub async fn wait_admitted(&self, rank: usize) -> Result<(), BootstrapError> {
        let mut rx = self.admitted.clone();
        rx.wait_for(|held| held.contains(&rank))
            .await
            .map(|_| ())
            .map_err(|_| BootstrapError::Formation("seed stopped".into()))
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
) {
    while let Some(incoming) = endpoint.accept().await {
        let actor = actor.clone();
        let secret = secret.clone();
        // One task per handshake: a slow or silent client only ever holds its own task.
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            if let Err(e) = handshake(incoming, actor, secret, handshake_timeout).await {
                warn!(%remote, error = %e, "bootstrap handshake rejected");
            }
        });
    }
}

async fn handshake(
    incoming: quinn::Incoming,
    actor: ActorRef<SeedMsg>,
    secret: Secret,
    timeout: Duration,
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
        let hello = read_msg(&mut recv).await?;
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
    // Admission: the actor decides the rank and signs the request.
    let admitted = actor
        .call(
            |reply| SeedMsg::Hello { rank, csr, reply },
            Some(Duration::from_secs(10)),
        )
        .await
        .map_err(|e| BootstrapError::Protocol(e.to_string()))?;
    let (rank, cert, ca, world) = match admitted {
        ractor::rpc::CallResult::Success(Ok(v)) => v,
        ractor::rpc::CallResult::Success(Err(reason)) => {
            refuse(&mut send, &reason).await;
            return Err(BootstrapError::Refused(reason));
        }
        other => return Err(BootstrapError::Protocol(format!("seed actor: {other:?}"))),
    };
    // From here on the slot is held; give it back if this worker goes away.
    let guard = SlotGuard {
        actor: actor.clone(),
        rank,
        armed: true,
    };
    write_msg(
        &mut send,
        &BootMsg::Welcome {
            rank,
            world,
            cert,
            ca,
        },
    )
    .await?;
    let listening = tokio::time::timeout(timeout, read_msg(&mut recv))
        .await
        .map_err(|_| {
            BootstrapError::Protocol("worker did not report its listening port".into())
        })??;
    let Some(BootMsg::Listening { port, advertise }) = listening else {
        return Err(BootstrapError::Protocol(
            "expected the listening port".into(),
        ));
    };
    // The worker's mesh address: what it advertises, else the address the seed sees.
    let addr = advertise.unwrap_or(SocketAddr::new(remote.ip(), port));
    let (peers_tx, peers_rx) = oneshot::channel();
    actor
        .send_message(SeedMsg::Listening {
            rank,
            addr,
            peers: peers_tx,
        })
        .map_err(|e| BootstrapError::Protocol(e.to_string()))?;
    let peers = peers_rx
        .await
        .map_err(|_| BootstrapError::Formation("seed stopped".into()))?;
    match peers {
        Ok(addrs) => write_msg(&mut send, &BootMsg::Peers { addrs }).await?,
        Err(reason) => {
            refuse(&mut send, &reason).await;
            return Err(BootstrapError::Formation(reason));
        }
    }
    // Serve: wait for Ready and then Done (or the connection dropping).
    let mut ok = None;
    loop {
        match read_msg(&mut recv).await {
            Ok(Some(BootMsg::Ready)) => {
                let _ = actor.send_message(SeedMsg::Ready { rank });
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

/// Sends a refusal and waits (bounded) until the worker has it, so closing the connection
/// afterwards cannot swallow the reason.
async fn refuse(send: &mut quinn::SendStream, reason: &str) {
    let _ = write_msg(
        send,
        &BootMsg::Refused {
            reason: reason.to_string(),
        },
    )
    .await;
    let _ = send.finish();
    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
}

/// Frees a rank whose worker vanished between admission and formation.
struct SlotGuard {
    actor: ActorRef<SeedMsg>,
    rank: u32,
    armed: bool,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.actor.send_message(SeedMsg::Gone { rank: self.rank });
        }
    }
}

type Admission = Result<(u32, Vec<u8>, Vec<u8>, u32), String>;

/// Messages the [`SeedActor`] handles.
#[derive(Debug)]
enum SeedMsg {
    /// A worker with a valid proof asks for a rank (maybe a specific one).
    Hello {
        rank: Option<u32>,
        csr: Vec<u8>,
        reply: RpcReplyPort<Admission>,
    },
    /// An admitted worker's mesh endpoint listens at `addr`; `peers` gets the list (or why
    /// formation failed).
    Listening {
        rank: u32,
        addr: SocketAddr,
        peers: oneshot::Sender<Result<Vec<SocketAddr>, String>>,
    },
    /// A worker formed its mesh.
    Ready { rank: u32 },
    /// A worker finished its job.
    Done { rank: u32, ok: bool },
    /// An admitted worker left before formation.
    Gone { rank: u32 },
    /// Formation deadline.
    Deadline,
}

struct SeedActor;

struct SeedArgs {
    ca: ClusterCa,
    world: usize,
    formed: watch::Sender<Option<Result<Vec<SocketAddr>, String>>>,
    finished: watch::Sender<Option<SeedReport>>,
    admitted: watch::Sender<Vec<usize>>,
    timeout: Duration,
}

struct SeedState {
    ca: Arc<ClusterCa>,
    world: usize,
    taken: BTreeMap<u32, Option<SocketAddr>>,
    waiting: Vec<oneshot::Sender<Result<Vec<SocketAddr>, String>>>,
    addrs: Option<Vec<SocketAddr>>,
    done: BTreeMap<u32, bool>,
    formed: watch::Sender<Option<Result<Vec<SocketAddr>, String>>>,
    finished: watch::Sender<Option<SeedReport>>,
    admitted: watch::Sender<Vec<usize>>,
    timer: JoinHandle<()>,
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
            ca: Arc::new(args.ca),
            world: args.world,
            taken: BTreeMap::new(),
            waiting: Vec::new(),
            addrs: None,
            done: BTreeMap::new(),
            formed: args.formed,
            finished: args.finished,
            admitted: args.admitted,
            timer,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SeedMsg>,
        msg: SeedMsg,
        st: &mut SeedState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SeedMsg::Hello { rank, csr, reply } => {
                let _ = reply.send(admit(st, rank, &csr));
                publish_admitted(st);
            }
            SeedMsg::Listening { rank, addr, peers } => {
                st.taken.insert(rank, Some(addr));
                st.waiting.push(peers);
                if st.taken.len() == st.world && st.taken.values().all(Option::is_some) {
                    let addrs: Vec<SocketAddr> = st.taken.values().flatten().copied().collect();
                    for w in st.waiting.drain(..) {
                        let _ = w.send(Ok(addrs.clone()));
                    }
                    info!(world = st.world, "every worker arrived; peer list sent");
                    st.addrs = Some(addrs.clone());
                    st.timer.abort();
                    st.formed.send_replace(Some(Ok(addrs)));
                }
            }
            SeedMsg::Ready { rank } => debug!(rank, "worker mesh ready"),
            SeedMsg::Done { rank, ok } => {
                st.done.insert(rank, ok);
                if st.addrs.is_some() && st.done.len() == st.world {
                    let report = SeedReport {
                        world: st.world,
                        addrs: st.addrs.clone().unwrap_or_default(),
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
            }
            SeedMsg::Gone { rank } => {
                if st.addrs.is_none() {
                    info!(rank, "worker left before formation; its rank is free again");
                    st.taken.remove(&rank);
                    publish_admitted(st);
                }
            }
            SeedMsg::Deadline => {
                if st.addrs.is_none() {
                    let missing: Vec<String> = (0..st.world as u32)
                        .filter(|r| !matches!(st.taken.get(r), Some(Some(_))))
                        .map(|r| r.to_string())
                        .collect();
                    let reason = format!(
                        "ranks {} did not arrive before the formation deadline",
                        missing.join(", ")
                    );
                    for w in st.waiting.drain(..) {
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

fn publish_admitted(st: &SeedState) {
    st.admitted
        .send_replace(st.taken.keys().map(|r| *r as usize).collect());
}

fn admit(st: &mut SeedState, requested: Option<u32>, csr: &[u8]) -> Admission {
    if st.addrs.is_some() {
        return Err("the cluster is already formed".into());
    }
    let rank = match requested {
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
    };
    let cert = st
        .ca
        .sign_request(csr, NodeId(u64::from(rank)))
        .map_err(|e| format!("bad certificate request: {e}"))?;
    st.taken.insert(rank, None);
    info!(rank, "worker admitted");
    Ok((
        rank,
        cert.to_vec(),
        st.ca.cert_der().to_vec(),
        st.world as u32,
    ))
}
