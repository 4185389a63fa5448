//! Elastic membership: resize points at which nodes join and leave a running cluster.
//!
//! A resize point is a collective over the node's current communicator. Every member calls
//! [`Node::resize`] (or [`Node::leave`], to depart) at the same point of its program:
//!
//! 1. The members all-gather who wants to leave; this is also the agreed point.
//! 2. The lowest-ranked member that stays (the coordinator) asks the seed, over its
//!    authenticated bootstrap stream, for the new membership. The seed drops the leavers
//!    (unless that would go below the minimum world), and admits nodes waiting in its join
//!    queue while there is room under the maximum world. It sends the plan to the
//!    coordinator and to each admitted joiner.
//! 3. The coordinator broadcasts the plan, so every member acts on the same bytes.
//! 4. Every member records the leavers as departed (their disconnection is then not a
//!    failure) and the members agree, by an all-reduce of the old communicator, that all
//!    of them are ready (connected to the joiners); if one is not, nothing changes. After
//!    it each staying member sends every leaver a farewell frame, and a leaver goes once
//!    it has one from every stayer (so nothing either sent is lost in flight).
//! 5. The members that stay connect to the joiners (who dial them too, with the
//!    certificates the seed issued at admission), build the new communicator (an id
//!    derived from the epoch, members in plan order) and pass its barrier together with
//!    the joiners. The joiners count as departing until the stayers agree (over a
//!    communicator of their own) that the barrier passed everywhere: then the first
//!    member tells each joiner it is in; if not (a joiner died or hung), the joiners are
//!    turned away and the stayers go on without them: a joiner failing before the stayers
//!    agree does not fail the running job (one failing after it, having entered, is a
//!    member lost like any other). The coordinator tells the seed the epoch is committed;
//!    the seed counts a joiner as one of the job's nodes once the joiner reports ready
//!    (after it was told it is in).
//!
//! Nodes that ask to join between resize points wait in the seed's queue; a join never
//! interrupts a running collective.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use nexar_transport::NodeId;
use tracing::{debug, info, warn};

use super::proto::{write_msg, write_within, BootMsg, Plan, MAX_FROM_SEED};
use super::worker::Node;
use super::BootstrapError;
use crate::comm::{send_frame, CommCore, Communicator};
use crate::node::NodeHandle;
use crate::{NexarError, Topology};

fn check_topology(handle: &NodeHandle) -> Result<(), NexarError> {
    if handle.shared.config.topology != Topology::FullMesh {
        return Err(NexarError::InvalidArgument(
            "elastic membership needs the full-mesh topology".into(),
        ));
    }
    Ok(())
}

/// The communicator of `plan` for this node; pins the members' certificates first.
fn communicator_of(handle: &NodeHandle, plan: &Plan) -> Result<Communicator, NexarError> {
    let me = handle.shared.id;
    let members: Arc<[NodeId]> = plan.members.iter().map(|(n, _)| NodeId(*n)).collect();
    let rank = members.iter().position(|n| *n == me).ok_or_else(|| {
        BootstrapError::Resize(format!("node {me} is not in the membership it was sent"))
    })?;
    if members.iter().collect::<HashSet<_>>().len() != members.len() {
        return Err(
            BootstrapError::Resize("a node is listed twice in the membership".into()).into(),
        );
    }
    if plan.certs.len() != members.len() {
        return Err(BootstrapError::Resize(format!(
            "a membership of {} nodes with {} certificates",
            members.len(),
            plan.certs.len()
        ))
        .into());
    }
    // Each member is taken only with the certificate the seed issued it (before this node
    // connects to any joiner).
    handle
        .shared
        .pin(members.iter().copied().zip(plan.certs.iter().copied()));
    Ok(Communicator::new(CommCore::new(
        handle.shared.clone(),
        plan.comm,
        rank,
        members,
    )))
}

/// A node admitted into a running cluster, first step: connects to every member; returns
/// the new communicator, to [`enter`] next.
pub(super) async fn connect(handle: &NodeHandle, plan: &Plan) -> Result<Communicator, NexarError> {
    check_topology(handle)?;
    let comm = communicator_of(handle, plan)?;
    let peers: Vec<(NodeId, SocketAddr)> =
        plan.members.iter().map(|(n, a)| (NodeId(*n), *a)).collect();
    handle.form(peers).await?;
    Ok(comm)
}

/// A node admitted into a running cluster, connected: passes the new communicator's first
/// barrier with the members, and waits for them to take it in.
pub(super) async fn enter(
    handle: &NodeHandle,
    plan: &Plan,
    comm: Communicator,
) -> Result<Communicator, NexarError> {
    comm.barrier().await?;
    // In only once the members agree that every joiner passed the barrier (else they go
    // on without the joiners and close their connections to them, which fails this wait).
    comm.core
        .take_delivery(
            0,
            commit_channel(plan),
            COMMIT_TAG,
            0,
            crate::deadline_in(handle.shared.config.op_timeout),
        )
        .await?;
    info!(
        epoch = plan.epoch,
        rank = comm.rank(),
        world = comm.world_size(),
        "joined the running cluster"
    );
    Ok(comm)
}

impl Node {
    /// A resize point: collective over [`communicator`](Node::communicator), which every
    /// member must call at the same point of its program (those departing call
    /// [`leave`](Node::leave) instead). Nodes waiting at the seed to join are admitted
    /// (up to the seed's maximum world) and departing nodes dropped; every member,
    /// joiners included, gets the same new communicator, which becomes this node's
    /// [`communicator`](Node::communicator) and is returned. With nobody joining or leaving
    /// the new communicator has the same members (and a fresh id).
    ///
    /// Errors (a member lost, the seed unreachable, a joiner that does not connect within
    /// the connect deadline) before the members agree to change are returned on every
    /// member, and the communicator is left as it was. A joiner that fails after that
    /// (during the new communicator's barrier) is turned away: the resize point still
    /// succeeds, with the members that stayed (and the leavers gone). A staying member
    /// lost after the agreement fails the point on the members that see the loss in time
    /// (they keep the old communicator, and turn the joiners away), while others may
    /// already hold the new one: a loss during a resize point is not recovered from by
    /// shrinking (the survivors may hold different communicators); under
    /// [`RecoveryPolicy::Abort`](crate::RecoveryPolicy) every call fails, as after any
    /// loss.
    ///
    /// Dropping the future part-way (a timeout of the caller's around it) fails the point
    /// on the other members, as an error of this node's would. Dropped before the members
    /// agreed, this node keeps its communicator and its link to the seed stays usable for
    /// the next point (an answer the seed still owes is skipped). A request or report cut
    /// short mid-message (its write outlasting half the op timeout, or dropped part-way)
    /// drops the link for good, and the seed then counts this node as gone, failed: the
    /// node and its communicator still run collectives, but every later resize point that
    /// lists it is refused (as [`BootstrapError::Resize`], on every member alike), and the
    /// job's report lists it failed. The point takes the sequence numbers of its four
    /// collectives on the old communicator as it starts, so however far it got on each
    /// member (dropped, or failed), the communicator's next call lines up on all of them.
    /// Dropped after, the others may already hold the new communicator while this node
    /// holds the old one: treat the node as lost and drop it.
    pub async fn resize(&mut self) -> Result<Communicator, NexarError> {
        self.resize_point(false).await?;
        Ok(self.comm.clone())
    }

    /// Leaves the cluster gracefully at a resize point (the other members call
    /// [`resize`](Node::resize) at the same point and get the smaller communicator,
    /// without any error). On success this node is no longer a member: call
    /// [`finish`](Node::finish) next. When the seed refuses (the world would drop below
    /// its minimum) the resize point still passes, this node stays a member of the new
    /// communicator, and the error is [`BootstrapError::LeaveRefused`], saying why; any
    /// other error is the resize point's own, as [`resize`](Node::resize) returns it on
    /// the other members.
    pub async fn leave(&mut self) -> Result<(), NexarError> {
        match self.resize_point(true).await? {
            Outcome::Left => Ok(()),
            Outcome::Stayed { note } => Err(BootstrapError::LeaveRefused(
                note.unwrap_or_else(|| "the seed kept this node a member".into()),
            )
            .into()),
        }
    }

    /// Makes `comm` this node's communicator, the one resize points run over: after an
    /// automatic recovery ([`Communicator::recoveries`]) or a
    /// [`shrink`](Communicator::shrink), adopt the survivors' communicator so that later
    /// resize points (and nodes joining) build on it. It must be a communicator of this
    /// node whose members are all members of its current one (as a shrink's or a split's
    /// are); [`mesh_addrs`](Node::mesh_addrs) then follows its ranks.
    pub fn adopt(&mut self, comm: Communicator) -> Result<(), NexarError> {
        if !Arc::ptr_eq(&comm.core.shared, &self.handle.shared) {
            return Err(NexarError::InvalidArgument(
                "the communicator belongs to another node".into(),
            ));
        }
        // mesh_addrs follows the adopted communicator's ranks.
        let known: std::collections::HashMap<NodeId, SocketAddr> = self
            .comm
            .members()
            .iter()
            .copied()
            .zip(self.addrs.iter().copied())
            .collect();
        let addrs = comm
            .members()
            .iter()
            .map(|m| known.get(m).copied())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                NexarError::InvalidArgument(
                    "the communicator has members outside this node's communicator".into(),
                )
            })?;
        self.addrs = addrs;
        self.comm = comm;
        Ok(())
    }

    async fn resize_point(&mut self, leave: bool) -> Result<Outcome, NexarError> {
        if self.left {
            return Err(NexarError::InvalidArgument(
                "this node already left the cluster".into(),
            ));
        }
        check_topology(&self.handle)?;
        let comm = self.comm.clone();
        let n = comm.world_size();
        // The point's four collectives on the old communicator take their numbers now,
        // together: a member that leaves the point early (an error, or its future dropped
        // part-way by a caller's timeout) lets the numbers it did not use go, instead of
        // keeping them for its next call, so every member has used the same four
        // whichever step it stopped at, and the communicator's next call lines up on all
        // of them. Its peers are told where their parts would otherwise wait for it (a
        // drop, an error of its own), or of the loss that ended it ([`Claims`]).
        let mut claims = Claims(std::iter::repeat_with(|| comm.claim()).take(4).collect());
        let mut flags = vec![0u64; n];
        comm.all_gather_claimed(claims.next(), &[u64::from(leave)], &mut flags)
            .await
            .map_err(|e| claims.fail(e))?;
        let members: Vec<u64> = comm.members().iter().map(|m| m.0).collect();
        let leaving: Vec<u64> = (0..n)
            .filter(|r| flags[*r] != 0)
            .map(|r| members[r])
            .collect();
        let coordinator = (0..n).find(|r| flags[*r] == 0).unwrap_or(0);
        // The coordinator asks the seed; every member acts on the answer it broadcasts.
        let mut body = Vec::new();
        if comm.rank() == coordinator {
            let answer = self.ask_seed(members.clone(), leaving).await;
            body = postcard::to_stdvec(&answer).map_err(|e| {
                claims.fail(BootstrapError::Protocol(format!("encoding the plan: {e}")).into())
            })?;
        }
        let mut len = [body.len() as u64];
        comm.broadcast_claimed(claims.next(), &mut len, coordinator)
            .await
            .map_err(|e| claims.fail(e))?;
        let len = usize::try_from(len[0]).unwrap_or(usize::MAX);
        if len > MAX_FROM_SEED {
            // The length came by the broadcast: every member that reached here has it.
            return Err(claims
                .fail_alike(BootstrapError::Protocol(format!("a plan of {len} bytes")).into()));
        }
        body.resize(len, 0);
        comm.broadcast_claimed(claims.next(), &mut body, coordinator)
            .await
            .map_err(|e| claims.fail(e))?;
        // From here every member holds the same bytes: what they make of them fails alike
        // everywhere, and the claim left goes without a word.
        let answer: Result<Plan, String> = postcard::from_bytes(&body).map_err(|e| {
            claims.fail_alike(BootstrapError::Protocol(format!("undecodable plan: {e}")).into())
        })?;
        let plan = answer.map_err(|why| claims.fail_alike(BootstrapError::Resize(why).into()))?;
        let shared = self.handle.shared.clone();
        let me = shared.id;
        let staying: HashSet<u64> = plan.members.iter().map(|(m, _)| *m).collect();
        let old: HashSet<u64> = members.iter().copied().collect();
        let leavers: Vec<NodeId> = members
            .iter()
            .filter(|m| !staying.contains(m))
            .map(|m| NodeId(*m))
            .collect();
        let joiners: Vec<(NodeId, SocketAddr)> = plan
            .members
            .iter()
            .filter(|(m, _)| !old.contains(m))
            .map(|(m, a)| (NodeId(*m), *a))
            .collect();
        let stays = staying.contains(&me.0);
        let next = communicator_of(&self.handle, &plan);
        // Until every member has confirmed, leavers are departing and joiners provisional:
        // neither one's disconnection is a failure of this cluster (no Abort, no recovery).
        let marks = Provisional::mark(&shared, &leavers, &joiners);
        // A staying member is ready once it holds the new communicator and is connected to
        // every joiner; a leaver has nothing to prepare.
        let connected: Result<(), NexarError> = match &next {
            _ if !stays => Ok(()),
            Err(e) => Err(BootstrapError::Resize(e.to_string()).into()),
            Ok(_) if joiners.is_empty() => Ok(()),
            Ok(_) => self.handle.form(joiners.clone()).await,
        };
        // Every old member reports whether it is ready; the change happens only if all are.
        let mut ready = [u64::from(connected.is_ok())];
        let agreed = comm
            .all_reduce_claimed(claims.next(), &mut ready, nexar_device::ReduceOp::Min)
            .await;
        if agreed.is_err() || ready[0] == 0 {
            // Nothing changes: the leavers stay members, the joiners are turned away.
            drop(marks);
            agreed?;
            return Err(BootstrapError::Resize(match connected {
                Err(e) => format!("epoch {}: {e}", plan.epoch),
                Ok(()) => format!(
                    "epoch {}: a member could not connect to a joining node",
                    plan.epoch
                ),
            })
            .into());
        }
        marks.keep();
        // A leaver may close only once the stayers have everything it sent, and it has
        // everything they sent (closing discards data still in flight): each stayer,
        // past the all-reduce, sends every leaver a last frame, and the leaver goes once
        // it has one from every stayer.
        let bye_deadline = crate::deadline_in(shared.config.connect_timeout);
        // Looked up once per stayer or leaver: a map, not a scan of the members for each
        // (worlds run to hundreds of thousands).
        let ranks: std::collections::HashMap<u64, usize> =
            members.iter().enumerate().map(|(r, m)| (*m, r)).collect();
        let rank_of = |node: u64| ranks.get(&node).copied();
        if !stays {
            for peer in members.iter().map(|m| NodeId(*m)).filter(|p| *p != me) {
                shared.mark_departed(peer);
            }
            for stayer in plan.members.iter().filter_map(|(m, _)| rank_of(*m)) {
                if let Err(e) = comm
                    .core
                    .take_delivery(stayer, plan.comm, BYE_TAG, 0, bye_deadline)
                    .await
                {
                    debug!(stayer, error = %e, "no farewell from a staying member");
                }
            }
            self.left = true;
            info!(epoch = plan.epoch, "left the cluster");
            return Ok(Outcome::Left);
        }
        for leaver in leavers.iter().filter_map(|l| rank_of(l.0)) {
            let bye = send_frame(
                &comm.core,
                leaver,
                plan.comm,
                BYE_TAG,
                0,
                nexar_transport::Payload::default(),
                bye_deadline,
            );
            if let Err(e) = bye.await {
                debug!(leaver, error = %e, "farewell to a leaving member not sent");
            }
        }
        let next = next?;
        let passed = next.barrier().await;
        let coordinates = comm.rank() == coordinator;
        let next = if joiners.is_empty() {
            passed?;
            if coordinates {
                self.report_committed(plan.epoch).await;
            }
            next
        } else {
            self.take_in_joiners(&plan, &old, next, passed, &joiners, coordinates)
                .await?
        };
        info!(
            epoch = plan.epoch,
            rank = next.rank(),
            world = next.world_size(),
            "resize point passed"
        );
        let world: HashSet<NodeId> = next.members().iter().copied().collect();
        self.addrs = plan
            .members
            .iter()
            .filter(|(m, _)| world.contains(&NodeId(*m)))
            .map(|(_, a)| *a)
            .collect();
        self.comm = next;
        Ok(Outcome::Stayed { note: plan.note })
    }

    /// Tells the seed (as the coordinator) that `epoch`'s plan was carried out, within
    /// half the op timeout (as [`ask_seed`](Self::ask_seed)); a report not written whole
    /// drops the seed link (the stream may be mid-message).
    async fn report_committed(&mut self, epoch: u64) {
        let timeout = self.handle.shared.config.op_timeout / 2;
        let Some(link) = self.seed.as_mut() else {
            return;
        };
        if link.cut {
            debug!(
                epoch,
                "commit not reported: the link to the seed was cut mid-message"
            );
            self.seed = None;
            return;
        }
        let report = BootMsg::Committed { epoch };
        link.cut = true;
        if let Err(e) = write_within(&mut link.send, &report, timeout).await {
            debug!(epoch, error = %e, "commit not reported to the seed");
            self.seed = None;
            return;
        }
        link.cut = false;
    }

    /// A staying member's last step at a resize point with joiners. The joiners count as
    /// departing until here, so one that failed during the new communicator's barrier is
    /// not a failure of the cluster (no Abort, no recovery): the stayers agree, over a
    /// communicator of their own, whether the barrier passed everywhere. If it did, the
    /// coordinator reports the plan committed to the seed, the new communicator's rank 0
    /// tells each joiner it is in (usually the coordinator, after its report; where old
    /// rank 0's leave was refused the two differ and race, which the seed takes in either
    /// order: a joiner's own ready report counts it in as the commit does), and `next` is
    /// the new communicator; if not, the joiners are turned away and the stayers go on
    /// without them (the seed, never told of a commit, counts them as never having
    /// entered).
    async fn take_in_joiners(
        &mut self,
        plan: &Plan,
        old: &HashSet<u64>,
        next: Communicator,
        passed: Result<(), NexarError>,
        joiners: &[(NodeId, SocketAddr)],
        coordinates: bool,
    ) -> Result<Communicator, NexarError> {
        let shared = self.handle.shared.clone();
        let stayers: Arc<[NodeId]> = plan
            .members
            .iter()
            .filter(|(m, _)| old.contains(m))
            .map(|(m, _)| NodeId(*m))
            .collect();
        let rank = stayers
            .iter()
            .position(|n| *n == shared.id)
            .ok_or_else(|| BootstrapError::Resize("this node is not a staying member".into()))?;
        let own = Communicator::new(CommCore::new(
            shared.clone(),
            stayers_channel(plan),
            rank,
            stayers,
        ));
        let mut all = [u64::from(passed.is_ok())];
        if let Err(e) = own.all_reduce(&mut all, nexar_device::ReduceOp::Min).await {
            turn_away(&shared, joiners);
            return Err(e);
        }
        if all[0] == 0 {
            let why = match &passed {
                Err(e) => format!("epoch {}: {e}", plan.epoch),
                Ok(()) => format!("epoch {}: a joining node failed", plan.epoch),
            };
            warn!(%why, "joining nodes turned away; the staying members go on without them");
            turn_away(&shared, joiners);
            return Ok(own);
        }
        // Members from here on: losing one now is a failure like any other's. (Before the
        // commit frames: a joiner told it is in may finish, and say farewell, at once.)
        for (j, _) in joiners {
            shared.undo_departed(*j);
        }
        if coordinates {
            // Before this node tells any joiner it is in (when it is also the new rank 0):
            // a joiner's own reports to the seed come later.
            self.report_committed(plan.epoch).await;
        }
        if next.rank() == 0 {
            let deadline = crate::deadline_in(shared.config.connect_timeout);
            for (j, _) in joiners {
                let Some(rank) = next.members().iter().position(|m| m == j) else {
                    continue;
                };
                let commit = send_frame(
                    &next.core,
                    rank,
                    commit_channel(plan),
                    COMMIT_TAG,
                    0,
                    nexar_transport::Payload::default(),
                    deadline,
                );
                if let Err(e) = commit.await {
                    debug!(joiner = %j, error = %e, "commit to a joining node not sent");
                }
            }
        }
        Ok(next)
    }

    /// Asks the seed for the membership at a resize point. An exchange that gives up
    /// waiting after its request went out keeps the link (its answer is skipped by the next
    /// exchange); one that fails otherwise (the stream broken, or cut mid-request) drops
    /// it; a refusal, a whole answer, keeps it. The link's state is kept as the exchange
    /// goes, so a caller that drops the resize point part-way leaves it as a timeout would:
    /// a request written counts an answer to skip, one cut short drops the link at its
    /// next use.
    async fn ask_seed(&mut self, members: Vec<u64>, leaving: Vec<u64>) -> Result<Plan, String> {
        // Half the members' deadline: a slow seed still leaves time to broadcast its
        // answer (or the failure) before the others' broadcast gives up.
        let timeout = self.handle.shared.config.op_timeout / 2;
        let Some(link) = self.seed.as_mut() else {
            return Err("this node has no connection to the seed".into());
        };
        if link.cut {
            self.seed = None;
            return Err("the link to the seed was cut mid-message".into());
        }
        let closed = || "the seed closed the stream".to_string();
        let exchange = tokio::time::timeout(timeout, async {
            while link.stale > 0 {
                link.answers.recv().await.ok_or_else(closed)?;
                link.stale -= 1;
            }
            link.cut = true;
            write_msg(&mut link.send, &BootMsg::Resize { members, leaving })
                .await
                .map_err(|e| e.to_string())?;
            link.cut = false;
            // Owed from here until it is read (the next exchange skips it otherwise).
            link.stale += 1;
            let answer = link.answers.recv().await.ok_or_else(closed)?;
            link.stale -= 1;
            match answer {
                BootMsg::Plan(plan) => Ok(Ok(plan)),
                BootMsg::Refused { reason } => Ok(Err(reason)),
                other => Err(format!("unexpected answer from the seed: {other:?}")),
            }
        })
        .await;
        let late = || format!("the seed did not answer within {timeout:?}");
        match exchange {
            Ok(Ok(answer)) => answer,
            // Cut mid-request: the stream is out of step.
            Err(_) if link.cut => {
                self.seed = None;
                Err(late())
            }
            // Nothing of the request went out, or its answer comes later and the next
            // exchange skips it.
            Err(_) => Err(late()),
            Ok(Err(e)) => {
                self.seed = None;
                Err(e)
            }
        }
    }
}

/// A resize point's leavers and joiners, marked departing (their disconnection no failure)
/// until the members agree on the change. Dropped before [`keep`](Self::keep), at a
/// failed agreement or with the resize point's future, it undoes that: the leavers stay
/// members, the joiners are turned away. (Dropped later, the members agreed: the leavers
/// go, and the joiners are taken in or turned away with the others.)
struct Provisional<'a> {
    shared: &'a crate::node::NodeShared,
    leavers: &'a [NodeId],
    joiners: &'a [(NodeId, SocketAddr)],
}

impl<'a> Provisional<'a> {
    fn mark(
        shared: &'a crate::node::NodeShared,
        leavers: &'a [NodeId],
        joiners: &'a [(NodeId, SocketAddr)],
    ) -> Self {
        for p in leavers
            .iter()
            .chain(joiners.iter().map(|(j, _)| j))
            .filter(|p| **p != shared.id)
        {
            shared.mark_departed(*p);
        }
        Provisional {
            shared,
            leavers,
            joiners,
        }
    }

    /// The members agreed: the marks stay.
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Provisional<'_> {
    fn drop(&mut self) {
        for l in self.leavers.iter().filter(|l| **l != self.shared.id) {
            self.shared.undo_departed(*l);
        }
        turn_away(self.shared, self.joiners);
    }
}

/// Closes this node's connections to the joiners of a resize point that did not take
/// them in (their joins then fail).
fn turn_away(shared: &crate::node::NodeShared, joiners: &[(NodeId, SocketAddr)]) {
    for (j, _) in joiners {
        shared.drop_peer(*j, "the resize point failed");
    }
}

/// Id of the communicator the staying members of `plan` agree over whether its joiners
/// are in (see `take_in_joiners`). Derived from a root of its own, as the membership's
/// is: one derived from `plan.comm` would be the id of a later split of the new
/// communicator, whose frames this one's retirement would then discard.
fn stayers_channel(plan: &Plan) -> u64 {
    crate::comm::derive_comm_id(0x5354_4159_4552_5300, plan.epoch, 0)
}

/// Channel (communicator id) of the frame that tells a joiner it is in: one that no
/// communicator uses, so the frame meets no other traffic.
fn commit_channel(plan: &Plan) -> u64 {
    crate::comm::derive_comm_id(0x434f_4d4d_4954_5300, plan.epoch, 0)
}

/// Tag of that frame.
const COMMIT_TAG: u64 = 0;

/// Tag of the farewell frame a staying member sends each leaving one (on the new
/// communicator's id, which the leaver is not part of, so it meets no other traffic).
const BYE_TAG: u64 = u64::MAX - 7;

/// What a resize point did to this node.
enum Outcome {
    Left,
    Stayed { note: Option<String> },
}

/// The sequence numbers a resize point's collectives on the old communicator claimed
/// together as it started, taken in turn. Dropped with some unused (the point's future
/// dropped part-way), each tells the other members this node gave up on it; let go by
/// [`fail`](Self::fail) or [`fail_alike`](Self::fail_alike) as the point ends early,
/// each goes as the error that ended it says ([`Ticket::release_after`]).
struct Claims(std::collections::VecDeque<crate::collective::Ticket>);

impl Claims {
    /// The next collective's claim.
    fn next(&mut self) -> crate::collective::Ticket {
        // Four are claimed, and the point runs at most four collectives on them.
        match self.0.pop_front() {
            Some(t) => t,
            None => unreachable!("a resize point runs four collectives on the old communicator"),
        }
    }

    /// Lets the claims left go after `e` ended the point on this member; returns `e`.
    fn fail(&mut self, e: NexarError) -> NexarError {
        self.release(e, false)
    }

    /// [`fail`](Self::fail) for an error every member meets alike at that point.
    fn fail_alike(&mut self, e: NexarError) -> NexarError {
        self.release(e, true)
    }

    fn release(&mut self, e: NexarError, same_everywhere: bool) -> NexarError {
        for t in self.0.drain(..) {
            t.release_after(&e, same_everywhere);
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};
    use std::time::Duration;

    use nexar_device::ReduceOp;
    use nexar_transport::NodeId;
    use tokio::task::JoinHandle;

    use futures::FutureExt;

    use super::{write_msg, BootMsg, Plan, Provisional};
    use crate::{
        BootstrapError, JoinOptions, NexarError, Node, NodeConfig, RecoveryPolicy, Seed,
        SeedOptions,
    };

    const DEADLINE: Duration = Duration::from_secs(60);

    async fn ask(node: &mut Node, members: Vec<u64>, leaving: Vec<u64>) -> Result<Plan, String> {
        tokio::time::timeout(DEADLINE, node.ask_seed(members, leaving))
            .await
            .expect("the seed answers")
    }

    /// An exchange with the seed that gave up after its request went out leaves the link in
    /// step: the next exchange skips the late answer and gets its own (it used to read the
    /// late answer as its own, so the link was dropped at the first timeout instead).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_answer_from_the_seed_is_skipped_by_the_next_exchange() {
        let seed = seed(2, 1, 3).await;
        let mut nodes = form(&seed, 2, &NodeConfig::default()).await;
        let members: Vec<u64> = nodes[0].comm.members().iter().map(|m| m.0).collect();
        // As an exchange that wrote its request and gave up waiting leaves it.
        let link = nodes[0].seed.as_mut().expect("a seed link");
        let request = BootMsg::Resize {
            members: members.clone(),
            leaving: Vec::new(),
        };
        write_msg(&mut link.send, &request).await.expect("request");
        link.stale = 1;
        next_exchange_gets_its_own_answer(nodes, members).await;
    }

    /// Node 0 of `nodes`, with one answer owed on its seed link (the first plan's), asks
    /// again: it gets the second plan, and owes nothing after. Then every node finishes.
    async fn next_exchange_gets_its_own_answer(mut nodes: Vec<Node>, members: Vec<u64>) {
        let plan = ask(&mut nodes[0], members, Vec::new())
            .await
            .expect("a plan");
        assert_eq!(
            plan.epoch, 2,
            "the answer to its own request, not the earlier one"
        );
        assert!(nodes[0].seed.as_ref().is_some_and(|l| l.stale == 0));
        futures::future::join_all(nodes.into_iter().map(|n| n.finish(true))).await;
    }

    /// An exchange with the seed dropped while it waits for the answer (a caller's own
    /// timeout around `resize`) leaves the link in step: the next exchange skips that
    /// answer. (The exchange counted the answer owed only when its own timeout fired, so a
    /// dropped one left every later resize point acting on the previous point's plan.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exchange_dropped_while_it_waits_leaves_the_link_in_step() {
        let seed = seed(2, 1, 3).await;
        let mut nodes = form(&seed, 2, &NodeConfig::default()).await;
        let members: Vec<u64> = nodes[0].comm.members().iter().map(|m| m.0).collect();
        {
            let exchange = nodes[0].ask_seed(members.clone(), Vec::new());
            futures::pin_mut!(exchange);
            // One poll writes the request (a few bytes, well within the stream's window)
            // and finds no answer yet: the seed is a round trip away.
            assert!(
                exchange.as_mut().now_or_never().is_none(),
                "answered without a round trip"
            );
        }
        assert!(
            nodes[0]
                .seed
                .as_ref()
                .is_some_and(|l| l.stale == 1 && !l.cut),
            "the request went out whole and its answer is owed"
        );
        next_exchange_gets_its_own_answer(nodes, members).await;
    }

    /// A resize point dropped part-way on one member (a caller's timeout around it, here
    /// while the coordinator waits for the seed) fails it on the others, and leaves every
    /// member's numbering of the old communicator's calls in step: the next all-reduce
    /// works on all of them at the first try. (The dropped member used to have taken one
    /// number where the others had taken two, so its next call met parts the others had
    /// given up on.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resize_point_dropped_part_way_leaves_the_numbering_in_step() {
        let seed = seed(3, 1, 3).await;
        let config = NodeConfig {
            op_timeout: Duration::from_secs(20),
            ..NodeConfig::default()
        };
        let mut nodes = form(&seed, 3, &config).await;
        // An answer owed that never comes: node 0, the coordinator, waits for it (up to
        // half its op timeout) after the point's first collective.
        nodes[0].seed.as_mut().expect("a seed link").stale = 1;
        let mut rest = nodes.split_off(1);
        let others: Vec<_> = rest
            .drain(..)
            .map(|mut n| {
                tokio::spawn(async move {
                    let r = n.resize().await.map(|_| ());
                    (n, r)
                })
            })
            .collect();
        let mut first = nodes.pop().expect("node 0");
        // Dropped while it waits for the seed (up to 10 s): 5 s leaves the point's first
        // collective, before that wait, time to pass even on a loaded machine.
        let dropped = tokio::time::timeout(Duration::from_secs(5), first.resize()).await;
        assert!(
            dropped.is_err(),
            "the point passed without the seed's answer"
        );
        let mut all = vec![first];
        for t in others {
            let (n, r) = tokio::time::timeout(DEADLINE, t)
                .await
                .expect("the others' point did not end within the deadline")
                .expect("task");
            assert!(
                r.is_err(),
                "the point passed on a member without its coordinator"
            );
            all.push(n);
        }
        let sums: Vec<_> = all
            .iter()
            .map(|n| {
                let comm = n.communicator();
                tokio::spawn(async move {
                    let mut v = vec![comm.rank() as u64 + 1; 8];
                    comm.all_reduce(&mut v, ReduceOp::Sum).await.map(|_| v[0])
                })
            })
            .collect();
        for t in sums {
            let sum = tokio::time::timeout(DEADLINE, t)
                .await
                .expect("the all-reduce did not end within the deadline")
                .expect("task");
            assert_eq!(sum.expect("the all-reduce after the dropped point"), 6);
        }
        futures::future::join_all(all.into_iter().map(|n| n.finish(true))).await;
    }

    /// A resize point that fails alike on every member (the coordinator has no link to
    /// the seed, so every member gets the same refusal) lets its unused claim go without a
    /// word: each member lets its own go. It used to tell every other member it gave up
    /// on it, a notice per member and claim left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_point_that_fails_alike_everywhere_sends_no_notices() {
        use std::sync::atomic::Ordering;
        let seed = seed(2, 1, 3).await;
        let mut nodes = form(&seed, 2, &NodeConfig::default()).await;
        nodes[0].seed = None;
        let points: Vec<_> = nodes
            .into_iter()
            .map(|mut n| {
                tokio::spawn(async move {
                    let r = n.resize().await.map(|_| ());
                    (n, r)
                })
            })
            .collect();
        let mut nodes = Vec::new();
        for t in points {
            let (n, r) = tokio::time::timeout(DEADLINE, t)
                .await
                .expect("the point did not end within the deadline")
                .expect("task");
            match r {
                Err(NexarError::Bootstrap(BootstrapError::Resize(why))) => {
                    assert!(why.contains("no connection to the seed"), "{why}")
                }
                other => panic!("expected the seed's refusal, got {other:?}"),
            }
            nodes.push(n);
        }
        let told: usize = nodes
            .iter()
            .map(|n| n.comm.core.gave_up_told.load(Ordering::Relaxed))
            .sum();
        assert_eq!(
            told, 0,
            "notices sent for a point that failed alike everywhere"
        );
        futures::future::join_all(nodes.into_iter().map(|n| n.finish(true))).await;
    }

    /// A resize point's departure marks, dropped before the members agreed (its future
    /// dropped part-way), are undone: the leaver counts as a member again, the joiner is
    /// turned away.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn marks_dropped_before_the_agreement_are_undone() {
        let seed = seed(2, 1, 3).await;
        let nodes = form(&seed, 2, &NodeConfig::default()).await;
        let shared = nodes[0].handle.shared.clone();
        let leaver = NodeId(1);
        let joiner = (NodeId(9), SocketAddr::from((Ipv4Addr::LOCALHOST, 9)));
        let leavers = [leaver];
        let joiners = [joiner];
        let marks = Provisional::mark(&shared, &leavers, &joiners);
        assert!(shared.has_departed(leaver));
        assert!(shared.has_departed(joiner.0));
        drop(marks);
        assert!(!shared.has_departed(leaver), "the leaver is a member again");
        assert!(
            shared.has_departed(joiner.0),
            "the joiner is turned away (dropped as departed)"
        );
        assert!(shared.lost.is_empty(), "nothing is recorded lost");
        // Kept, the marks stay.
        Provisional::mark(&shared, &leavers, &[]).keep();
        assert!(shared.has_departed(leaver));
        drop(nodes);
    }

    /// The seed plans a resize point only for the coordinator of the membership it names
    /// (the first member not leaving), and only over nodes of the cluster's membership: a
    /// member asking for another's resize point, or naming a node that is not a member,
    /// is refused (it would hand queued joiners a plan nobody carries out).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_seed_plans_only_for_the_coordinator_and_known_members() {
        let o = SeedOptions {
            max_world: Some(3),
            ..SeedOptions::default()
        };
        let seed = Seed::start(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), 2, o)
            .await
            .expect("seed");
        let mut nodes = form(&seed, 2, &NodeConfig::default()).await;
        let members: Vec<u64> = nodes[0].comm.members().iter().map(|m| m.0).collect();
        // Rank 1 is not the coordinator of a point where nobody leaves.
        let refused = ask(&mut nodes[1], members.clone(), Vec::new()).await;
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.contains("not the coordinator")),
            "{refused:?}"
        );
        // A node the cluster never admitted.
        let mut forged = members.clone();
        forged.push(4242);
        let refused = ask(&mut nodes[0], forged, Vec::new()).await;
        assert!(
            refused.as_ref().is_err_and(|e| e.contains("not a member")),
            "{refused:?}"
        );
        // The coordinator of a point where rank 0 leaves is rank 1.
        let refused = ask(&mut nodes[0], members.clone(), vec![members[0]]).await;
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.contains("not the coordinator")),
            "{refused:?}"
        );
        // The real coordinator is answered with a plan over the same members.
        let plan = ask(&mut nodes[0], members.clone(), Vec::new())
            .await
            .expect("a plan");
        let planned: Vec<u64> = plan.members.iter().map(|(m, _)| *m).collect();
        assert_eq!(planned, members);
        futures::future::join_all(nodes.into_iter().map(|n| n.finish(true))).await;
    }

    async fn seed(world: usize, min: usize, max: usize) -> Seed {
        let o = SeedOptions {
            min_world: min,
            max_world: Some(max),
            ..SeedOptions::default()
        };
        Seed::start(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), world, o)
            .await
            .expect("seed")
    }

    fn opts(seed: &Seed, config: &NodeConfig) -> JoinOptions {
        let mut o = JoinOptions::new(seed.join_string().clone());
        o.listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        o.config = config.clone();
        o
    }

    async fn form(seed: &Seed, n: usize, config: &NodeConfig) -> Vec<Node> {
        let tasks: Vec<_> = (0..n)
            .map(|_| tokio::spawn(Node::join(opts(seed, config))))
            .collect();
        let mut nodes = Vec::new();
        for t in tasks {
            let node = tokio::time::timeout(DEADLINE, t)
                .await
                .expect("join deadline")
                .expect("join task")
                .expect("join");
            nodes.push(node);
        }
        nodes.sort_by_key(Node::rank);
        nodes
    }

    /// Starts a node that asks to join the running cluster; returns once the seed queued it.
    async fn queue_joiner(seed: &Seed, o: JoinOptions) -> JoinHandle<Result<Node, NexarError>> {
        let before = seed.queued();
        let t = tokio::spawn(Node::join(o));
        tokio::time::timeout(DEADLINE, seed.wait_queued(before + 1))
            .await
            .expect("queued within the deadline")
            .expect("seed running");
        t
    }

    async fn bounded<T>(what: &str, t: JoinHandle<T>) -> T {
        tokio::time::timeout(DEADLINE, t)
            .await
            .unwrap_or_else(|_| panic!("{what}: deadline"))
            .unwrap_or_else(|e| panic!("{what}: task failed: {e}"))
    }

    /// Each node all-reduces 1 over its communicator; returns the sums.
    async fn sums(nodes: &[Node]) -> Vec<Result<u64, NexarError>> {
        futures::future::join_all(nodes.iter().map(|n| {
            let c = n.communicator();
            async move {
                let mut v = [1u64; 8];
                tokio::time::timeout(DEADLINE, c.all_reduce(&mut v, ReduceOp::Sum))
                    .await
                    .expect("all-reduce deadline")
                    .map(|()| v[0])
            }
        }))
        .await
    }

    fn abort_on_loss() -> NodeConfig {
        NodeConfig {
            recovery: RecoveryPolicy::Abort,
            ..NodeConfig::default()
        }
    }

    /// A node leaving at the resize point that admits a joiner never connects to the
    /// joiner, and must not take it for lost (it did, once the point passed: under Abort
    /// that closed its mailboxes before the stayers' farewells came, and it could close
    /// with their last frames in flight).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_leaving_and_one_joining_at_a_point_records_no_loss_and_later_splits_work() {
        let config = abort_on_loss();
        let seed = seed(3, 2, 4).await;
        let nodes = form(&seed, 3, &config).await;
        let joiner = queue_joiner(&seed, opts(&seed, &config)).await;
        let tasks: Vec<_> = nodes
            .into_iter()
            .map(|mut n| {
                tokio::spawn(async move {
                    let res = if n.rank() == 2 {
                        n.leave().await.map(|()| 0)
                    } else {
                        n.resize().await.map(|c| c.world_size())
                    };
                    (n, res)
                })
            })
            .collect();
        let mut stayed = Vec::new();
        let mut left = Vec::new();
        for t in tasks {
            let (n, res) = bounded("resize point", t).await;
            let lost: Vec<NodeId> = n.handle.shared.lost.iter().map(|e| *e.key()).collect();
            assert!(
                lost.is_empty(),
                "node {}: lost {lost:?}",
                n.handle.shared.id
            );
            match res.expect("resize point") {
                0 => left.push(n),
                world => {
                    assert_eq!(world, 3);
                    stayed.push(n);
                }
            }
        }
        // Only the joiner knows it joined a running cluster (`Node::from_env` then does
        // not hold it to the launcher's world size).
        assert!(stayed.iter().all(|n| !n.joined_running));
        let joined = bounded("join", joiner).await.expect("joined");
        assert!(joined.joined_running);
        stayed.push(joined);
        for sum in sums(&stayed).await {
            assert_eq!(sum.expect("all-reduce"), 3);
        }
        // Splits of the new communicator work on stayers and joiner alike (the stayers'
        // own communicator of the point, retired since, once had the id of the second).
        let split = futures::future::join_all(stayed.iter().map(|n| {
            let c = n.communicator();
            async move {
                let first = c.split(0, 0).await?;
                let second = c.split(0, 0).await?;
                let mut v = [1u64; 8];
                tokio::time::timeout(DEADLINE, second.all_reduce(&mut v, ReduceOp::Sum))
                    .await
                    .expect("all-reduce on the split")?;
                drop(first);
                Ok::<_, NexarError>(v[0])
            }
        }))
        .await;
        for sum in split {
            assert_eq!(sum.expect("split and all-reduce"), 3);
        }
        futures::future::join_all(stayed.into_iter().chain(left).map(|n| n.finish(true))).await;
        let report = tokio::time::timeout(DEADLINE, seed.wait_finished())
            .await
            .expect("report deadline")
            .expect("report");
        assert!(report.succeeded(), "{report:?}");
        assert_eq!(report.joined.len(), 1, "{report:?}");
    }

    /// A resize point's task per member (each gives its node back, with the new world
    /// size or the error), once every member has reached every one of `joiners`.
    async fn resizing_until_they_reach(
        nodes: Vec<Node>,
        joiners: &[NodeId],
    ) -> Vec<JoinHandle<(Node, Result<usize, NexarError>)>> {
        let shared: Vec<_> = nodes.iter().map(|n| n.handle.shared.clone()).collect();
        let tasks = nodes
            .into_iter()
            .map(|mut n| {
                tokio::spawn(async move {
                    let res = n.resize().await.map(|c| c.world_size());
                    (n, res)
                })
            })
            .collect();
        let reached = || {
            shared
                .iter()
                .all(|s| joiners.iter().all(|j| s.links.contains_key(j)))
        };
        let until = tokio::time::Instant::now() + DEADLINE;
        while !reached() {
            assert!(
                tokio::time::Instant::now() < until,
                "members never reached the joiners"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tasks
    }

    /// A joiner that dies during the resize point admitting it (here: once every member is
    /// connected to it, before it enters the new communicator's barrier) is turned away,
    /// not taken for a lost member: under Abort the members used to abort, every later
    /// call failing. Now they go on, in the world they had.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_joiner_dying_at_the_resize_point_is_turned_away_and_the_members_go_on() {
        let config = abort_on_loss();
        let seed = seed(2, 1, 3).await;
        let nodes = form(&seed, 2, &config).await;
        let mut o = opts(&seed, &config);
        o.stall_before_entering = true;
        let joiner = queue_joiner(&seed, o).await;
        let tasks = resizing_until_they_reach(nodes, &[NodeId(2)]).await;
        // The joiner's process dies: its join is dropped, which stops its node.
        joiner.abort();
        let mut nodes = Vec::new();
        for t in tasks {
            let (n, res) = bounded("resize point", t).await;
            // Either the point failed before the members agreed (nothing changed) or they
            // agreed and went on without the joiner: the world stays 2 either way.
            if let Ok(world) = res {
                assert_eq!(world, 2);
            }
            let lost: Vec<NodeId> = n.handle.shared.lost.iter().map(|e| *e.key()).collect();
            assert!(lost.is_empty(), "lost {lost:?}");
            nodes.push(n);
        }
        nodes.sort_by_key(Node::rank);
        for sum in sums(&nodes).await {
            assert_eq!(sum.expect("all-reduce after the point"), 2);
        }
        futures::future::join_all(nodes.into_iter().map(|n| n.finish(true))).await;
        // The joiner never entered: it is neither a failure of the job nor one of its nodes.
        let report = tokio::time::timeout(DEADLINE, seed.wait_finished())
            .await
            .expect("report deadline")
            .expect("report");
        assert!(report.succeeded(), "{report:?}");
        assert!(report.joined.is_empty(), "{report:?}");
    }

    /// A joiner the members turn away (another joiner of its point died there) fails its
    /// join with `BootstrapError::Resize`, as one the seed turns away does, not with the
    /// closed connection's error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_joiner_the_members_turn_away_fails_with_a_resize_error() {
        let config = abort_on_loss();
        let seed = seed(2, 1, 4).await;
        let nodes = form(&seed, 2, &config).await;
        let mut stalls = opts(&seed, &config);
        stalls.stall_before_entering = true;
        let dies = queue_joiner(&seed, stalls).await;
        let turned_away = queue_joiner(&seed, opts(&seed, &config)).await;
        let tasks = resizing_until_they_reach(nodes, &[NodeId(2), NodeId(3)]).await;
        dies.abort();
        let res = bounded("the second joiner", turned_away).await;
        assert!(
            matches!(
                res,
                Err(NexarError::Bootstrap(BootstrapError::Resize(ref why))) if why.contains("epoch")
            ),
            "{res:?}"
        );
        let mut nodes = Vec::new();
        for t in tasks {
            let (n, res) = bounded("resize point", t).await;
            if let Ok(world) = res {
                assert_eq!(world, 2);
            }
            nodes.push(n);
        }
        futures::future::join_all(nodes.into_iter().map(|n| n.finish(true))).await;
    }
}
