//! A worker node: joins through the seed, then talks to its peers directly.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use nexar_transport::{bootstrap_client, NodeId, NodeIdentity};
use rustls_pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use tracing::{debug, info};

use super::proto::{
    read_msg_max, send_last, session_ekm, write_msg, BootMsg, JoinString, BOOT_VERSION,
    MAX_FROM_SEED,
};
use super::BootstrapError;
use crate::comm::{CommCore, Communicator};
use crate::node::NodeHandle;
use crate::{NexarError, NodeConfig};

/// How a worker joins. Every field but `join` has a documented default.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct JoinOptions {
    /// The seed's join string.
    pub join: JoinString,
    /// Where the mesh endpoint listens (default all interfaces, port 0: `0.0.0.0:0`). An
    /// unspecified IPv4 address becomes `[::]` (IPv6 and IPv4 on Linux) when the seed's
    /// address is IPv6, since the seed then sees, and hands out, this node's IPv6 address.
    pub listen: SocketAddr,
    /// The address peers should dial (default: the listen address when its IP is a
    /// specific one, else this host's address as the seed sees it, with the listen port).
    pub advertise: Option<SocketAddr>,
    /// Ask for a specific rank (default: the seed picks the lowest free one).
    pub rank: Option<usize>,
    /// Runtime settings for the node.
    pub config: NodeConfig,
    /// Deadline for reaching the seed and being admitted (default 20 s); formation then has
    /// the seed's deadline.
    pub timeout: Duration,
    /// Test hook: a node admitted into a running cluster stops once connected to the
    /// members, before the new communicator's barrier, as if its process hung there.
    #[cfg(test)]
    pub(crate) stall_before_entering: bool,
}

impl JoinOptions {
    /// The address the mesh endpoint binds: `listen`, with an unspecified IPv4 address
    /// widened to `[::]` when the seed is reached over IPv6.
    pub fn mesh_listen(&self) -> SocketAddr {
        mesh_listen(self.listen, self.join.seed)
    }

    /// Defaults for joining through `join`.
    pub fn new(join: JoinString) -> JoinOptions {
        JoinOptions {
            join,
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            advertise: None,
            rank: None,
            config: NodeConfig::default(),
            timeout: Duration::from_secs(20),
            #[cfg(test)]
            stall_before_entering: false,
        }
    }
}

/// A node that joined a cluster through a seed.
pub struct Node {
    pub(super) handle: NodeHandle,
    pub(super) comm: Communicator,
    pub(super) addrs: Vec<SocketAddr>,
    pub(super) seed: Option<SeedLink>,
    pub(super) bootstrap: quinn::Endpoint,
    /// Set once this node left the cluster by agreement.
    pub(super) left: bool,
    /// It joined a running cluster at a resize point (not at formation).
    pub(super) joined_running: bool,
}

/// How long a node's last report (its job done, or its failure to join) may take to
/// reach the seed.
const REPORT_WAIT: Duration = Duration::from_secs(2);

/// The bootstrap stream to the seed, kept for resize points and the final report.
pub(super) struct SeedLink {
    pub(super) conn: quinn::Connection,
    pub(super) send: quinn::SendStream,
    /// The seed's messages, each read whole by a task of its own: an exchange that gives
    /// up waiting leaves the stream in step, its answer coming here later.
    pub(super) answers: tokio::sync::mpsc::Receiver<BootMsg>,
    /// Answers still to come to requests whose exchange gave up waiting for them: the next
    /// exchange skips that many first (the seed answers every request once, in order).
    /// Counted in the exchange itself, so that a caller that drops a resize point part-way
    /// (a timeout of its own around [`Node::resize`]) leaves it right.
    pub(super) stale: usize,
    /// A message to the seed was begun and not written whole (its writer was dropped
    /// part-way): the stream is out of step, and the next use drops the link instead.
    pub(super) cut: bool,
    /// The reader holds the stream, and with it the connection, until it is aborted.
    _reader: crate::AbortOnDrop,
}

impl SeedLink {
    fn new(conn: quinn::Connection, send: quinn::SendStream, mut recv: quinn::RecvStream) -> Self {
        let (tx, answers) = tokio::sync::mpsc::channel(4);
        let reader = tokio::spawn(async move {
            while let Ok(Some(msg)) = read_msg_max(&mut recv, MAX_FROM_SEED).await {
                if tx.send(msg).await.is_err() {
                    break;
                }
            }
        });
        SeedLink {
            conn,
            send,
            answers,
            stale: 0,
            cut: false,
            _reader: crate::AbortOnDrop(reader),
        }
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world_size())
            .finish_non_exhaustive()
    }
}

fn unreachable(addr: SocketAddr, e: impl std::fmt::Display) -> BootstrapError {
    let text = e.to_string();
    if text.contains("fingerprint mismatch") {
        BootstrapError::FingerprintMismatch(addr)
    } else {
        BootstrapError::SeedUnreachable { addr, reason: text }
    }
}

/// Connects to the seed at `addr`. A seed that refuses the connection (it holds as many
/// clients as it takes that have not proved the secret yet, from this address or in all)
/// is asked again after a backoff (20 ms, doubling up to 500 ms), for as long as the
/// caller's deadline allows; `refused` says whether the last try was refused.
async fn connect_seed(
    bootstrap: &quinn::Endpoint,
    addr: SocketAddr,
    refused: &std::sync::atomic::AtomicBool,
) -> Result<quinn::Connection, BootstrapError> {
    let mut backoff = crate::node::Backoff::default();
    loop {
        let connecting = bootstrap
            .connect(addr, "seed.nexar")
            .map_err(|e| unreachable(addr, e))?;
        match connecting.await {
            Ok(conn) => {
                // Whatever keeps the join from finishing now, it is not a busy seed.
                refused.store(false, std::sync::atomic::Ordering::Relaxed);
                return Ok(conn);
            }
            Err(quinn::ConnectionError::ConnectionClosed(close))
                if close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED =>
            {
                refused.store(true, std::sync::atomic::Ordering::Relaxed);
                debug!(%addr, pause = ?backoff.next(), "the seed is busy (connection refused); asking again");
                backoff.wait().await;
            }
            Err(e) => return Err(unreachable(addr, e)),
        }
    }
}

/// The mesh endpoint's address: `listen`, with an unspecified IPv4 address widened to
/// `[::]` when the seed is reached over IPv6 (the seed hands peers the IPv6 address it sees
/// this node at, which an IPv4 socket would not answer).
fn mesh_listen(listen: SocketAddr, seed: SocketAddr) -> SocketAddr {
    if seed.is_ipv6() && listen.ip() == IpAddr::V4(Ipv4Addr::UNSPECIFIED) {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), listen.port())
    } else {
        listen
    }
}

impl Node {
    /// Joins the cluster: verifies the seed against the pinned fingerprint, proves the
    /// secret, obtains a certificate for a fresh key pair, and forms the mesh.
    pub async fn join(opts: JoinOptions) -> Result<Node, NexarError> {
        // Settings this node cannot start with are refused before the seed admits it and
        // holds a rank for it.
        opts.config.check()?;
        let rank = opts
            .rank
            .map(|r| {
                u32::try_from(r)
                    .ok()
                    .filter(|_| r < crate::MAX_WORLD)
                    .ok_or_else(|| {
                        NexarError::InvalidArgument(format!(
                            "rank {r} is out of range (ranks go up to {})",
                            crate::MAX_WORLD - 1
                        ))
                    })
            })
            .transpose()?;
        let seed_addr = opts.join.seed;
        let local = if seed_addr.is_ipv6() {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
        } else {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
        };
        // The transport as the mesh's endpoint will take it (its timeouts raised to the
        // node's own), so the bootstrap refuses no more than the endpoint would.
        let transport = crate::node::endpoint_transport(&opts.config);
        let bootstrap = bootstrap_client(local, opts.join.fingerprint, &transport)?;
        let refused = std::sync::atomic::AtomicBool::new(false);
        let admitted = tokio::time::timeout(opts.timeout, async {
            let conn = connect_seed(&bootstrap, seed_addr, &refused).await?;
            let (mut send, mut recv) = conn
                .open_bi()
                .await
                .map_err(|e| unreachable(seed_addr, e))?;
            let ekm = session_ekm(&conn)?;
            let (csr, key) = nexar_transport::generate_csr()
                .map_err(|e| BootstrapError::Protocol(e.to_string()))?;
            let hello = BootMsg::Hello {
                version: BOOT_VERSION,
                proof: opts.join.secret.prove(&ekm, b"worker"),
                csr,
                rank,
            };
            write_msg(&mut send, &hello).await?;
            match read_msg_max(&mut recv, MAX_FROM_SEED).await? {
                Some(BootMsg::Welcome {
                    rank,
                    world,
                    cert,
                    ca,
                }) => Ok((conn, send, recv, key, rank, world, cert, ca)),
                Some(BootMsg::Refused { reason }) => Err(BootstrapError::Refused(reason)),
                Some(other) => Err(BootstrapError::Protocol(format!("unexpected {other:?}"))),
                None => Err(BootstrapError::Protocol(
                    "the seed closed the stream".into(),
                )),
            }
        })
        .await
        .map_err(|_| {
            if refused.load(std::sync::atomic::Ordering::Relaxed) {
                BootstrapError::SeedBusy {
                    addr: seed_addr,
                    waited: opts.timeout,
                }
            } else {
                BootstrapError::SeedUnreachable {
                    addr: seed_addr,
                    reason: format!("no admission within {:?}", opts.timeout),
                }
            }
        })??;
        let (conn, mut send, mut recv, key, rank, world, cert, ca): (
            _,
            _,
            _,
            PrivatePkcs8KeyDer<'static>,
            _,
            _,
            _,
            _,
        ) = admitted;
        let started = async {
            let identity = NodeIdentity::from_parts(
                CertificateDer::from(cert),
                key,
                CertificateDer::from(ca),
            )?;
            if identity.node() != NodeId(u64::from(rank)) {
                return Err(BootstrapError::Protocol(format!(
                    "certificate names node {} but the seed assigned rank {rank}",
                    identity.node()
                ))
                .into());
            }
            info!(rank, world, "admitted by the seed");
            let listen = mesh_listen(opts.listen, seed_addr);
            let handle = NodeHandle::start(&identity, listen, opts.config.clone()).await?;
            Ok::<_, NexarError>((identity, handle))
        }
        .await;
        // A node that cannot start (its mesh port taken, say) tells the seed why, which
        // gives its rank back and names the reason should formation fail for the want of
        // it, rather than the seed seeing only the connection go.
        let (identity, mut handle) = match started {
            Ok(started) => started,
            Err(e) => {
                let reason = e.to_string();
                send_last(&mut send, &BootMsg::Refused { reason }, REPORT_WAIT).await;
                return Err(e);
            }
        };
        // A join cancelled from here on (dropped, say by a caller's timeout) stops the node
        // it started instead of leaving it running, connected and unreachable.
        let mut started = StopUnlessKept(Some((handle.shared.clone(), handle.actor.clone())));
        let bound = handle.shared.endpoint.local_addr()?;
        // Bound to one address, the endpoint is reachable only there, whichever address
        // the seed sees this host at.
        let advertise = opts
            .advertise
            .or_else(|| (!bound.ip().is_unspecified()).then_some(bound));
        let formed = async {
            write_msg(
                &mut send,
                &BootMsg::Listening {
                    port: bound.port(),
                    advertise,
                },
            )
            .await?;
            match read_msg_max(&mut recv, MAX_FROM_SEED).await? {
                Some(BootMsg::Peers { addrs, certs }) => {
                    if addrs.len() != world as usize || certs.len() != world as usize {
                        return Err(BootstrapError::Protocol(format!(
                            "peer list of {} addresses and {} certificates for a world of \
                             {world}",
                            addrs.len(),
                            certs.len()
                        ))
                        .into());
                    }
                    let mine = nexar_transport::cert_fingerprint(identity.cert_der());
                    if certs.get(rank as usize) != Some(&mine) {
                        return Err(BootstrapError::Protocol(
                            "the peer list names another certificate for this node".into(),
                        )
                        .into());
                    }
                    // Each peer is taken only with the certificate the seed issued it.
                    handle.shared.pin(
                        certs
                            .iter()
                            .enumerate()
                            .map(|(r, c)| (NodeId(r as u64), *c)),
                    );
                    let peers: Vec<(NodeId, SocketAddr)> = addrs
                        .iter()
                        .enumerate()
                        .map(|(r, a)| (NodeId(r as u64), *a))
                        .collect();
                    handle.form(peers).await?;
                    let members: Arc<[NodeId]> = (0..world).map(|r| NodeId(u64::from(r))).collect();
                    let comm = Communicator::new(CommCore::new(
                        handle.shared.clone(),
                        0,
                        rank as usize,
                        members,
                    ));
                    write_msg(&mut send, &BootMsg::Ready).await?;
                    Ok::<_, NexarError>((comm, addrs, false))
                }
                Some(BootMsg::Plan(plan)) => {
                    // Joining a running cluster: the members reached a resize point that
                    // admits this node.
                    let entered = async {
                        let comm = super::elastic::connect(&handle, &plan).await?;
                        #[cfg(test)]
                        if opts.stall_before_entering {
                            std::future::pending::<()>().await;
                        }
                        super::elastic::enter(&handle, &plan, comm).await
                    };
                    // The members turned this node away (or it could not reach them):
                    // a failed resize point for it, whatever the connection said.
                    let comm = entered.await.map_err(|e| match e {
                        NexarError::Bootstrap(e) => NexarError::Bootstrap(e),
                        e => BootstrapError::Resize(format!(
                            "epoch {}: not taken in at the resize point: {e}",
                            plan.epoch
                        ))
                        .into(),
                    })?;
                    write_msg(&mut send, &BootMsg::Ready).await?;
                    Ok((comm, plan.members.iter().map(|(_, a)| *a).collect(), true))
                }
                // A node joining the running cluster (its id past the formation world) was
                // turned away from the queue; any other, formation failed.
                Some(BootMsg::Refused { reason }) if rank >= world => {
                    Err(BootstrapError::Resize(reason).into())
                }
                Some(BootMsg::Refused { reason }) => Err(BootstrapError::Formation(reason).into()),
                other => Err(BootstrapError::Protocol(format!(
                    "expected the peer list, got {other:?}"
                ))
                .into()),
            }
        }
        .await;
        let (comm, addrs, joined_running) = match formed {
            Ok(v) => v,
            Err(e) => {
                let reason = e.to_string();
                send_last(&mut send, &BootMsg::Refused { reason }, REPORT_WAIT).await;
                handle.shutdown().await;
                return Err(e);
            }
        };
        started.0 = None;
        Ok(Node {
            handle,
            comm,
            addrs,
            seed: Some(SeedLink::new(conn, send, recv)),
            bootstrap,
            left: false,
            joined_running,
        })
    }

    /// Joins using launcher environment variables (see [`from_env_vars`](super::from_env_vars)).
    /// A world size the launcher announced that is not the cluster's formed with this node
    /// is an error ([`BootstrapError::Environment`], once the node has said farewell,
    /// which waits up to `finish_timeout` for the others to finish too): a job started
    /// with the wrong count of workers, or the seed with the wrong `--world`. Not checked
    /// for a node admitted to a running (elastic) cluster, whose size it does not choose.
    pub async fn from_env() -> Result<Node, NexarError> {
        Node::from_env_with(|k| std::env::var(k).ok()).await
    }

    /// [`from_env`](Node::from_env) with the variables read through `get`.
    pub(crate) async fn from_env_with(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Node, NexarError> {
        let env = super::from_env_vars(get)?;
        let node = Node::join(env.options.clone()).await?;
        let world = node.communicator().world_size();
        if let Some(mismatch) = env.world_mismatch(world).filter(|_| !node.joined_running) {
            node.finish(false).await;
            return Err(BootstrapError::Environment(mismatch).into());
        }
        Ok(node)
    }

    /// The communicator spanning the whole cluster (the latest one, after resize points).
    pub fn communicator(&self) -> Communicator {
        self.comm.clone()
    }

    /// This node's rank in [`communicator`](Node::communicator).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Every rank's mesh address as the seed recorded it (index = rank); this node's own
    /// entry is the address its peers dial.
    pub fn mesh_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The mesh endpoint's local address.
    pub fn local_addr(&self) -> Result<SocketAddr, NexarError> {
        Ok(self.handle.shared.endpoint.local_addr()?)
    }

    /// Tells the seed this node's job is finished (`ok` says how: the seed's report) and
    /// leaves the cluster, like `MPI_Finalize`: it says farewell to the other members of
    /// its [`communicator`](Self::communicator) and closes once each has said the same
    /// (when it calls `finish`), is lost, or [`NodeConfig::finish_timeout`](crate::NodeConfig)
    /// has passed, so that nothing sent is lost in flight when the connections close. The
    /// nodes still running see it depart, not fail; calls of theirs that still need it
    /// fail once it has closed. To leave as a failure instead (the others see it lost),
    /// drop the `Node`: it closes at once.
    pub async fn finish(mut self, ok: bool) {
        if let Some(SeedLink {
            conn,
            mut send,
            cut,
            ..
        }) = self.seed.take()
        {
            // Bounded, as every exchange with the seed: a seed that stopped reading does
            // not hold the finish (it then counts this node as gone without a report).
            // After a message cut short the seed could not read this one: it counts the
            // node as gone when the connection closes.
            if !cut {
                send_last(&mut send, &BootMsg::Done { ok }, REPORT_WAIT).await;
            }
            conn.close(0u32.into(), b"done");
        }
        let members = self.comm.members().to_vec();
        let within = self.handle.shared.config.finish_timeout;
        self.handle.farewell(&members, within).await;
        self.handle.shutdown_finished().await;
        self.bootstrap.close(0u32.into(), b"done");
    }
}

/// Stops a node on drop, unless taken out (see [`Node::join`]).
struct StopUnlessKept(
    Option<(
        Arc<crate::node::NodeShared>,
        ractor::ActorRef<crate::node::NodeMsg>,
    )>,
);

impl Drop for StopUnlessKept {
    fn drop(&mut self) {
        if let Some((shared, actor)) = self.0.take() {
            shared.close();
            actor.stop(Some("join cancelled".into()));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.handle.stop("node dropped");
        self.bootstrap.close(0u32.into(), b"dropped");
    }
}
