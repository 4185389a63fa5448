//! Shrinking a communicator to its survivors: the agreement on the lost ranks.
//!
//! The survivors exchange their sets of lost ranks in rounds (every survivor sends its set
//! to every rank it believes alive and merges what it receives; a rank that does not answer
//! in time joins the set). A rank decides in the first round in which every report it got
//! equals its own set. That alone is not enough when a rank dies *during* a round: it may
//! have reported to some survivors and not to others, so some decide in that round and the
//! rest go on to the next one, where the deciders no longer answer: the rest would count
//! them lost and agree on another set (or lose the quorum), and the survivors would build
//! different communicators. So a rank that decides sends its decision to every other rank
//! under a key of its own (the step [`DECISION`]), and every rank, before each round and
//! after it, looks for a decision from any rank, one it counts lost included, adopts it
//! and passes it on (its sender may have died before it reached every rank). All
//! deciders of a round decided the same set (each one's set is the report every other one
//! received from it).
//!
//! With deadlines alone no agreement can be certain: a rank that is slow rather than
//! dead, whose decision comes after the others finished, can still be left out. Each
//! side's quorum check keeps such a split from going on as two clusters.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nexar_transport::{NodeId, Payload, TransportError};
use tracing::{debug, warn};

use crate::comm::{mix, send_frame, CommCore, COLLECTIVE_CHANNEL};
use crate::{Communicator, NexarError, Result};

/// Mixed into the ids of the agreement's channel and of the communicators it builds
/// (ASCII "SHRINK").
const SHRINK: u64 = 0x5348_5249_4e4b;

/// The step a decided set is sent under: one key per agreement and rank, apart from the
/// rounds' (which count from 0), so that a decision is found whatever round its reader is
/// in.
const DECISION: u64 = u64::MAX;

/// Word that opens an announced decision (a report is otherwise a list of ranks, all
/// under [`MAX_WORLD`](crate::MAX_WORLD)).
const DECIDED: u32 = u32::MAX;

/// A survivor's report in one round of the agreement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Report {
    /// The ranks it counts lost so far.
    Open(BTreeSet<usize>),
    /// The set it decided on (or adopted) in an earlier round.
    Decided(BTreeSet<usize>),
}

impl Report {
    fn encode(&self) -> Bytes {
        let (set, mark) = match self {
            Report::Open(s) => (s, None),
            Report::Decided(s) => (s, Some(DECIDED)),
        };
        let words = mark.into_iter().chain(set.iter().map(|r| *r as u32));
        Bytes::from(words.flat_map(u32::to_le_bytes).collect::<Vec<u8>>())
    }

    /// Reads a report of a communicator of `world` ranks; `None` when malformed (a length
    /// that is not whole words, more words than a decided set of every rank, or a rank
    /// out of range).
    fn decode(bytes: &[u8], world: usize) -> Option<Report> {
        if bytes.len() % 4 != 0 || bytes.len() > Report::max_len(world) {
            return None;
        }
        let mut words = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .peekable();
        let decided = words.next_if_eq(&DECIDED).is_some();
        let set = words
            .map(|w| usize::try_from(w).ok().filter(|r| *r < world))
            .collect::<Option<BTreeSet<usize>>>()?;
        Some(if decided {
            Report::Decided(set)
        } else {
            Report::Open(set)
        })
    }

    /// The longest well-formed report: a decided set naming every rank.
    fn max_len(world: usize) -> usize {
        4 * (world + 1)
    }
}

/// What one round's exchange with the ranks believed alive brought.
#[derive(Debug, Default)]
struct Round {
    /// Ranks that could not be sent to, or did not answer in time.
    silent: Vec<usize>,
    /// Each answering rank's report.
    reports: Vec<(usize, Report)>,
}

/// The outcome of a round for a rank whose set going in was `lost`: the decided set, or
/// the set to go on with. A decision announced by any rank (`announced`, or a decided
/// report among the round's) wins.
fn judge(
    lost: &BTreeSet<usize>,
    round: &Round,
    announced: Option<&BTreeSet<usize>>,
) -> Result<std::result::Result<BTreeSet<usize>, BTreeSet<usize>>> {
    let decided = round.reports.iter().filter_map(|(_, r)| match r {
        Report::Decided(set) => Some(set),
        Report::Open(_) => None,
    });
    if let Some(set) = agreed(announced.into_iter().chain(decided))? {
        return Ok(Ok(set.clone()));
    }
    let unanimous = round.silent.is_empty()
        && round
            .reports
            .iter()
            .all(|(_, r)| matches!(r, Report::Open(s) if s == lost));
    if unanimous {
        return Ok(Ok(lost.clone()));
    }
    let mut merged = lost.clone();
    merged.extend(round.silent.iter().copied());
    for (_, report) in &round.reports {
        if let Report::Open(s) = report {
            merged.extend(s.iter().copied());
        }
    }
    Ok(Err(merged))
}

/// The one set that `decisions` name, if any; two different ones are an error (the
/// agreement guarantees they cannot be, so it would be a fault of the peers).
fn agreed<'a>(
    decisions: impl Iterator<Item = &'a BTreeSet<usize>>,
) -> Result<Option<&'a BTreeSet<usize>>> {
    let mut found: Option<&BTreeSet<usize>> = None;
    for set in decisions {
        match found {
            Some(earlier) if earlier != set => {
                return Err(NexarError::Actor(format!(
                    "shrink agreement: ranks announced different lost sets, {earlier:?} and \
                     {set:?}"
                )));
            }
            _ => found = Some(set),
        }
    }
    Ok(found)
}

/// Whether `survivors` (ranks of a communicator of `world`) may go on without the others:
/// a strict majority, or exactly half when it holds rank 0. Two sides of a partition (or a
/// slow rank that was declared lost and comes back) can never both qualify, so at most one
/// of them rebuilds a communicator.
fn has_quorum(survivors: &[usize], world: usize) -> bool {
    2 * survivors.len() > world || (2 * survivors.len() == world && survivors.contains(&0))
}

/// The last shrink of a communicator that succeeded ([`Communicator::shrink`]).
#[derive(Debug)]
pub(crate) struct LastShrink {
    /// The ranks it left out.
    left_out: Vec<usize>,
    /// The communicator it built, while someone holds it.
    comm: std::sync::Weak<crate::comm::CommCore>,
    /// Run by the recoveries ([`Communicator::shrink_after_loss`]), and not yet taken by
    /// a call of the application's.
    after_loss: bool,
    /// Run for a call of the application's whose future was dropped before it ended
    /// (at its caller's own deadline, say), and not yet taken by another.
    dropped: bool,
    /// The communicator, held while nobody took it (`dropped`, or the recoveries' whose
    /// stream was dropped meanwhile): the call that takes it in their place needs it.
    unclaimed: Option<Arc<CommCore>>,
}

impl Communicator {
    /// Agrees with the other survivors on the set of lost ranks and returns a communicator
    /// of the survivors (in the old rank order, with a fresh id and tag sequence).
    /// Collective over the survivors: each must call it. The agreement runs in rounds:
    /// every survivor sends its lost set to every rank it believes alive and merges what
    /// it receives; a rank that does not answer within twice the heartbeat timeout is
    /// added to the set. A rank decides in the first round in which every survivor it
    /// heard from reported its own set, and sends its decision to every other rank; a
    /// rank that finds a decision, before or after any round, adopts it and passes it on.
    /// So all survivors build the same communicator even when a rank dies while the
    /// agreement runs, having reported to some survivors and not to others. (With
    /// deadlines alone no agreement is certain: a rank so slow that the others decide
    /// without it, and whose own decision comes too late, can be left out; the quorum
    /// check below keeps such a rank from going on as a cluster of its own.)
    ///
    /// Only a side holding a quorum (a strict majority of the ranks, or exactly half
    /// including rank 0) gets a communicator; the other side of a partition, or a slow
    /// rank that the others declared lost and that comes back, gets
    /// [`NexarError::QuorumLost`] instead of carrying on as a cluster of its own.
    ///
    /// The lost sets merge, so one broken link (two ranks that no longer reach each
    /// other, both reaching the rest) leaves out both of its ends: in a world of 3 or 4
    /// that leaves no side a quorum, and every rank gets `QuorumLost`. (Leaving out one
    /// end only would take a rule that is not monotone in what each rank knows, which
    /// this agreement cannot make safe without a further commit round: two ranks that
    /// decide in different rounds could keep different quorums.)
    ///
    /// A call made while another call's agreement on this communicator runs waits for
    /// it and, when it succeeds, returns the same communicator: under
    /// [`RecoveryPolicy::Automatic`](crate::RecoveryPolicy::Automatic), a rank that calls
    /// it on a failed call while its recoveries run it for the same loss would otherwise
    /// run a second agreement that no other rank joins. For the same reason a call made
    /// after the recoveries' shrink finished takes its communicator (while anyone holds
    /// it, as the recoveries do until they move on): the others moved on to it. (Only the
    /// first such call: that call stands for the one whose agreement built it on the
    /// ranks where the application's call came first, so the next call agrees anew, as
    /// it does there.) A rank
    /// lost since is a member of it, so a call on it deals with that loss. (The
    /// recoveries, in turn, take what a call of the application's already agreed on for
    /// the losses they see.) Otherwise every call runs an agreement of its own, as every
    /// survivor's call does.
    ///
    /// A call whose future is dropped (at a deadline of the caller's, say) does not stop
    /// its agreement, which the others count on: it runs on in the background, and the
    /// next call takes its communicator. (Not where the future is dropped in the instant
    /// between the agreement's end and the future's next poll, as a `select!` whose other
    /// branch fires then may: that communicator is lost, and the next call agrees anew.)
    /// Needs a tokio runtime.
    pub async fn shrink(&self) -> Result<Communicator> {
        self.shrink_once(false).await
    }

    /// [`shrink`](Self::shrink) for the recoveries, after this rank saw a loss: a shrink
    /// of this communicator that succeeded and left out a rank this one counts lost (the
    /// application's own call for that loss, made when another rank's notice failed its
    /// call) is taken as it is, with no agreement that no other rank would join: the
    /// others moved on to it. A loss it did not cover (a rank lost since) is a member of
    /// it too, so the recoveries' next watch, on it, sees that one. (Taking it only when
    /// it left out every rank counted lost ran an agreement of this rank's own on the
    /// old communicator when a second rank was lost meanwhile: `QuorumLost`, and this
    /// rank's recoveries stayed behind.)
    pub(crate) async fn shrink_after_loss(&self) -> Result<Communicator> {
        self.shrink_once(true).await
    }

    /// One shrink: the last one's communicator where it serves (see [`shrink`] and
    /// [`shrink_after_loss`]), else an agreement. `after_loss` for the recoveries'.
    ///
    /// [`shrink`]: Self::shrink
    /// [`shrink_after_loss`]: Self::shrink_after_loss
    ///
    /// The agreement runs in a task of its own, to its end even when the caller's future
    /// is dropped: every rank's agreements are numbered in the order they run, so one cut
    /// short would leave this rank's next one under another number than the others',
    /// and the others' communicator with this rank in it, unused. Its communicator is then
    /// kept for the next call, which takes it in the dropped call's place.
    async fn shrink_once(&self, after_loss: bool) -> Result<Communicator> {
        let done = self.core.shrinks_done.load(Ordering::Acquire);
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| NexarError::InvalidArgument("shrink needs a tokio runtime".into()))?;
        let (answer, answered) = tokio::sync::oneshot::channel();
        let me = self.clone();
        runtime.spawn(async move { me.shrink_in_task(done, after_loss, answer).await });
        answered
            .await
            .map_err(|_| NexarError::Actor("the shrink's task ended without an answer".into()))?
    }

    /// [`shrink_once`](Self::shrink_once)'s work, in its task: the answer goes to
    /// `answer`, whose receiver is gone when the call's future was dropped.
    async fn shrink_in_task(
        &self,
        done: u64,
        after_loss: bool,
        answer: tokio::sync::oneshot::Sender<Result<Communicator>>,
    ) {
        let mut last = self.core.shrunk.lock().await;
        if let Some(l) = last.as_mut() {
            let joined = self.core.shrinks_done.load(Ordering::Acquire) != done;
            // The application's call takes the recoveries' shrink whatever this rank
            // counts lost: the same on every rank, where its own view of the losses may
            // lag behind the others' (a loss since is one of its members, for the
            // recoveries on it and the next call there).
            // A dropped call's shrink is taken by the next call of its kind.
            let covers = if after_loss {
                self.failed_ranks().iter().any(|r| l.left_out.contains(r))
            } else {
                l.after_loss || l.dropped
            };
            if let Some(core) = l.comm.upgrade().filter(|_| joined || covers) {
                // A call dropped before this answer took nothing: the record stays as it
                // was, for the next call.
                if answer.send(Ok(Communicator { core })).is_ok() {
                    if !after_loss {
                        // Taken by the application: its next call agrees anew, as it does
                        // on the ranks where the application's call ran this agreement.
                        l.after_loss = false;
                        l.dropped = false;
                        l.unclaimed = None;
                    } else if !l.dropped {
                        // The recoveries hold it now, as they hold what they deliver.
                        l.unclaimed = None;
                    }
                }
                return;
            }
        }
        let comm = match self.agree().await {
            Ok(comm) => comm,
            Err(e) => {
                let _ = answer.send(Err(e));
                return;
            }
        };
        let kept: BTreeSet<NodeId> = comm.core.members.iter().copied().collect();
        let left_out = (0..self.world_size())
            .filter(|r| !kept.contains(&self.core.members[*r]))
            .collect();
        let mut record = LastShrink {
            left_out,
            comm: Arc::downgrade(&comm.core),
            after_loss,
            dropped: false,
            unclaimed: None,
        };
        self.core.shrinks_done.fetch_add(1, Ordering::AcqRel);
        if let Err(Ok(comm)) = answer.send(Ok(comm)) {
            debug!(
                after_loss,
                "a shrink's call was dropped before its agreement ended: the next call takes its communicator"
            );
            record.dropped = !after_loss;
            record.unclaimed = Some(comm.core);
        }
        *last = Some(record);
    }

    /// The agreement of [`shrink`](Self::shrink), and the communicator it decides.
    async fn agree(&self) -> Result<Communicator> {
        let world = self.world_size();
        let agreement = Agreement::next(&self.core);
        let epoch = agreement.epoch;
        let mut lost: BTreeSet<usize> = self.failed_ranks().into_iter().collect();
        // Every round but the last adds a rank to the set or decides, so a rank decides by
        // round `world`; one more lets a rank that decided in the last round be heard.
        let rounds = world as u64 + 2;
        for round in 0..rounds {
            if let Some(decided) = agreement.announced().await? {
                debug!(epoch, round, lost = ?decided, "shrink decision adopted");
                // Passed on, in case its sender died before it reached every rank.
                self.announce_if_quorate(&agreement, &decided);
                return self.rebuild(epoch, &decided);
            }
            let exchanged = agreement.exchange(round, &lost).await;
            let announced = agreement.announced().await?;
            match judge(&lost, &exchanged, announced.as_ref())? {
                Ok(decided) => {
                    debug!(epoch, round, lost = ?decided, "shrink decided");
                    self.announce_if_quorate(&agreement, &decided);
                    return self.rebuild(epoch, &decided);
                }
                Err(merged) => lost = merged,
            }
        }
        Err(NexarError::Timeout {
            what: "shrink agreement".into(),
            after: agreement
                .wait
                .saturating_mul(u32::try_from(rounds).unwrap_or(u32::MAX)),
        })
    }

    /// Sends `decided` to the other ranks only if its survivors hold a quorum: a decision
    /// that would leave nobody a communicator (a rank cut off from the others, which
    /// suspects them all) must not be adopted by ranks that could still agree among
    /// themselves without it.
    fn announce_if_quorate(&self, agreement: &Agreement, decided: &BTreeSet<usize>) {
        let world = self.world_size();
        let survivors: Vec<usize> = (0..world).filter(|r| !decided.contains(r)).collect();
        if has_quorum(&survivors, world) {
            agreement.announce(decided);
        } else {
            debug!(lost = ?decided, "shrink decision without a quorum kept to this rank");
        }
    }

    /// The communicator of the ranks not in `lost`, as every survivor builds it.
    fn rebuild(&self, epoch: u64, lost: &BTreeSet<usize>) -> Result<Communicator> {
        let world = self.world_size();
        let me = self.rank();
        if lost.contains(&me) {
            // The others went on without this rank: as documented, it learns so as the
            // minority side of a partition does (it used to get InvalidArgument, which
            // reads as a caller's mistake).
            return Err(NexarError::QuorumLost {
                survivors: 1,
                world,
            });
        }
        let survivors: Vec<usize> = (0..world).filter(|r| !lost.contains(r)).collect();
        if !has_quorum(&survivors, world) {
            return Err(NexarError::QuorumLost {
                survivors: survivors.len(),
                world,
            });
        }
        let members: Arc<[NodeId]> = survivors.iter().map(|r| self.core.members[*r]).collect();
        let rank = survivors.iter().position(|r| *r == me).unwrap_or(0);
        let mut words = vec![self.core.id, SHRINK, epoch];
        words.extend(lost.iter().map(|r| *r as u64));
        let id = crate::comm::comm_id(mix(&words));
        Ok(Communicator::new(CommCore::new(
            self.core.shared.clone(),
            id,
            rank,
            members,
        )))
    }
}

/// The channel of communicator `comm`'s shrink agreements.
pub(crate) fn channel(comm: u64) -> u64 {
    (mix(&[comm, SHRINK]) & !COLLECTIVE_CHANNEL) | 1
}

/// One run of the shrink agreement on one rank: its frames go under `(channel, epoch)`,
/// one step per round.
struct Agreement {
    core: Arc<CommCore>,
    channel: u64,
    epoch: u64,
    /// How long a round waits for each report.
    wait: Duration,
}

impl Agreement {
    /// The next agreement of `core`'s communicator.
    fn next(core: &Arc<CommCore>) -> Agreement {
        Agreement {
            core: core.clone(),
            channel: channel(core.id),
            epoch: core.shrink_seq.fetch_add(1, Ordering::Relaxed),
            wait: core.shared.config.heartbeat_timeout.saturating_mul(2),
        }
    }

    /// Sends `lost` as this rank's report for `round` to every rank not in it (but this
    /// one) and takes theirs.
    async fn exchange(&self, round: u64, lost: &BTreeSet<usize>) -> Round {
        let me = self.core.rank;
        let world = self.core.members.len();
        let alive: Vec<usize> = (0..world)
            .filter(|r| *r != me && !lost.contains(r))
            .collect();
        let deadline = crate::deadline_in(self.wait);
        let bytes = Report::Open(lost.clone()).encode();
        let sends = alive.iter().map(|&p| {
            let payload = Payload::from_bytes(bytes.clone());
            let core = &*self.core;
            async move {
                let sent =
                    send_frame(core, p, self.channel, self.epoch, round, payload, deadline).await;
                (p, sent)
            }
        });
        let recvs = alive
            .iter()
            .map(|&p| async move { (p, self.take(p, round, deadline).await) });
        let (sent, got) = tokio::join!(
            futures::future::join_all(sends),
            futures::future::join_all(recvs)
        );
        let mut out = Round::default();
        for (p, r) in sent {
            if r.is_err() {
                out.silent.push(p);
            }
        }
        for (p, r) in got {
            match r {
                Ok(report) => out.reports.push((p, report)),
                // A malformed report counts as none: one faulty peer does not end this
                // rank's agreement.
                Err(e) => {
                    if matches!(e, NexarError::InvalidArgument(_)) {
                        warn!(rank = p, %e, "shrink report refused");
                    }
                    out.silent.push(p);
                }
            }
        }
        out.silent.sort_unstable();
        out.silent.dedup();
        out.reports.retain(|(p, _)| !out.silent.contains(p));
        out
    }

    /// A decision some other rank sent and that is here now, if any (see [`DECISION`]).
    async fn announced(&self) -> Result<Option<BTreeSet<usize>>> {
        let core = &*self.core;
        let mut found = Vec::new();
        for p in (0..core.members.len()).filter(|p| *p != core.rank) {
            let key = nexar_transport::MailboxKey {
                comm: self.channel,
                tag: self.epoch,
                step: DECISION,
                src: core.members[p],
            };
            if !core.shared.table.is_ready(&key) {
                continue;
            }
            match self.take(p, DECISION, crate::deadline_in(self.wait)).await {
                Ok(Report::Decided(set)) => found.push(set),
                Ok(Report::Open(_)) => warn!(rank = p, "an open report sent as a decision"),
                Err(e) => warn!(rank = p, %e, "shrink decision refused"),
            }
        }
        Ok(agreed(found.iter())?.cloned())
    }

    /// Rank `p`'s report for `round`.
    async fn take(&self, p: usize, round: u64, deadline: Instant) -> Result<Report> {
        let core = &*self.core;
        let world = core.members.len();
        let delivery = core
            .take_delivery(p, self.channel, self.epoch, round, deadline)
            .await?;
        // Refused before room is made for it: a report longer than any well-formed one.
        if delivery.len() > Report::max_len(world) {
            delivery.discard();
            return Err(malformed(p));
        }
        let mut bytes = vec![0u8; delivery.len()];
        match tokio::time::timeout_at(deadline.into(), delivery.copy_into(&mut bytes)).await {
            Ok(res) => res.map_err(|e| core.recv_error(e, p, self.epoch, round))?,
            Err(_) => {
                let e = TransportError::Timeout(self.wait);
                return Err(core.recv_error(e, p, self.epoch, round));
            }
        }
        Report::decode(&bytes, world).ok_or_else(|| malformed(p))
    }

    /// Sends the decided set to every other rank under [`DECISION`] (in the background:
    /// no answer is awaited), the ranks in the set among them (a slow one learns that it
    /// was left out).
    fn announce(&self, decided: &BTreeSet<usize>) {
        let me = self.core.rank;
        let world = self.core.members.len();
        let bytes = Report::Decided(decided.clone()).encode();
        let deadline = crate::deadline_in(self.wait);
        for p in (0..world).filter(|r| *r != me) {
            let core = self.core.clone();
            let (channel, epoch) = (self.channel, self.epoch);
            let payload = Payload::from_bytes(bytes.clone());
            tokio::spawn(async move {
                let sent = send_frame(&core, p, channel, epoch, DECISION, payload, deadline);
                if let Err(e) = sent.await {
                    debug!(rank = p, %e, "shrink decision not sent");
                }
            });
        }
    }
}

/// Once the agreement is over on this rank (decided, failed, or its future dropped), its
/// frames are unwanted here: reports and decisions that peers still send are discarded on
/// arrival, and those already buffered are dropped.
impl Drop for Agreement {
    fn drop(&mut self) {
        self.core.shared.table.retire(self.channel, self.epoch);
    }
}

fn malformed(p: usize) -> NexarError {
    NexarError::InvalidArgument(format!("malformed shrink report from rank {p}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ranks: &[usize]) -> BTreeSet<usize> {
        ranks.iter().copied().collect()
    }

    /// A local cluster whose heartbeats declare a silent peer lost after 3 s (so an
    /// agreement round waits 6 s for a report that does not come). The tests keep every
    /// rank alive and assert that none is lost: shorter, a healthy rank that a loaded
    /// machine starves for a moment would be (1 s was used before).
    async fn cluster(world: usize) -> crate::Cluster {
        let config = crate::NodeConfig {
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(3),
            ..crate::NodeConfig::default()
        };
        crate::Cluster::local_with(world, config)
            .await
            .expect("cluster")
    }

    /// A dropped communicator's shrink channel is retired with its other channels, so
    /// reports and decisions of an agreement this rank never ran are not kept for the
    /// node's lifetime.
    #[tokio::test]
    async fn a_dropped_communicator_retires_its_shrink_channel() {
        let cluster = cluster(2).await;
        // A communicator of this test's own (the cluster keeps its world communicators).
        let comms = cluster.communicators();
        let (a, b) = tokio::join!(comms[0].split(0, 0), comms[1].split(0, 0));
        let (comm, _other) = (a.expect("split"), b.expect("split"));
        let (shared, id) = (comm.core.shared.clone(), comm.core.id);
        assert!(!shared.table.is_retired(channel(id), 0));
        drop(comm);
        assert!(shared.table.is_retired(channel(id), 0));
        assert!(shared.table.is_retired(channel(id), u64::MAX));
    }

    /// The communicator a shrink call (number `call`) built, of `world` ranks.
    fn shrunk_to(
        res: std::result::Result<Result<Communicator>, tokio::time::error::Elapsed>,
        world: usize,
        call: usize,
    ) -> Communicator {
        let comm = res.expect("shrink within its deadline");
        let comm = comm.unwrap_or_else(|e| panic!("call {call}: {e}"));
        assert_eq!(comm.world_size(), world, "call {call}");
        comm
    }

    /// Waits (10 s at most) until the frame for `key` has arrived at `core`'s node.
    async fn arrived(core: &CommCore, key: &nexar_transport::MailboxKey, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !core.shared.table.is_ready(key) {
            assert!(Instant::now() < deadline, "{what} never arrived");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Rank 3 reports to rank 0 only, then falls silent (as if it died mid-round): rank 0
    /// hears every report it waits for and decides that no rank is lost, while ranks 1 and
    /// 2 wait for rank 3 in vain and go on to another round. There they must adopt rank
    /// 0's decision, not count rank 0 lost too (which would leave them without a quorum
    /// and rank 0 in a communicator of its own).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn survivors_adopt_a_decision_that_a_rank_dying_mid_round_split() {
        let cluster = cluster(4).await;
        let comms = cluster.communicators();
        let dying = Agreement::next(&comms[3].core);
        let deadline = Instant::now() + Duration::from_secs(10);
        let report = Payload::from_bytes(Report::Open(set(&[])).encode());
        send_frame(
            &dying.core,
            0,
            dying.channel,
            dying.epoch,
            0,
            report,
            deadline,
        )
        .await
        .expect("rank 3's report");
        let key = nexar_transport::MailboxKey {
            comm: dying.channel,
            tag: dying.epoch,
            step: 0,
            src: comms[3].core.members[3],
        };
        arrived(&comms[0].core, &key, "rank 3's report").await;
        let shrinks = comms[..3].iter().map(|c| async move {
            tokio::time::timeout(Duration::from_secs(60), c.shrink()).await
        });
        let ids: Vec<u64> = futures::future::join_all(shrinks)
            .await
            .into_iter()
            .enumerate()
            .map(|(r, res)| {
                let comm = shrunk_to(res, 4, r);
                assert_eq!(comm.rank(), r);
                comm.core.id
            })
            .collect();
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "one communicator: {ids:?}"
        );
    }

    /// A rank that joins the agreement only after the others decided without it finds
    /// their decision and learns that it was left out (`QuorumLost`, as the docs say, not
    /// `InvalidArgument`), instead of deciding on the round-0
    /// reports still buffered for it (every one of them "no rank lost") and building a
    /// communicator of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_late_to_the_agreement_learns_it_was_left_out() {
        let cluster = cluster(3).await;
        let comms = cluster.communicators();
        let shrinks = comms[..2].iter().map(|c| async move {
            tokio::time::timeout(Duration::from_secs(60), c.shrink()).await
        });
        for (r, res) in futures::future::join_all(shrinks)
            .await
            .into_iter()
            .enumerate()
        {
            let comm = res.expect("shrink within its deadline");
            let comm = comm.unwrap_or_else(|e| panic!("rank {r}: {e}"));
            assert_eq!(comm.world_size(), 2, "rank {r}: rank 2 left out");
        }
        // Both deciders' decisions have reached rank 2 (a bounded wait).
        let late = &comms[2];
        let channel = (mix(&[late.core.id, SHRINK]) & !COLLECTIVE_CHANNEL) | 1;
        for p in 0..2 {
            let key = nexar_transport::MailboxKey {
                comm: channel,
                tag: 0,
                step: DECISION,
                src: late.core.members[p],
            };
            arrived(&late.core, &key, "a decision").await;
        }
        let res = tokio::time::timeout(Duration::from_secs(60), late.shrink()).await;
        let res = res.expect("shrink within its deadline");
        assert!(
            matches!(
                &res,
                Err(NexarError::QuorumLost {
                    survivors: 1,
                    world: 3
                })
            ),
            "{:?}",
            res.map(|c| c.world_size())
        );
    }

    /// A cluster of 3 whose rank 2 was killed, once ranks 0 and 1 count it lost (60 s at
    /// most), and its communicators.
    async fn three_with_rank_2_lost() -> (crate::Cluster, Vec<Communicator>) {
        let cluster = cluster(3).await;
        let comms = cluster.communicators();
        cluster.kill_rank(2).expect("kill");
        let deadline = Instant::now() + Duration::from_secs(60);
        while comms[0].failed_ranks() != [2] || comms[1].failed_ranks() != [2] {
            assert!(Instant::now() < deadline, "rank 2 never declared lost");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (cluster, comms)
    }

    /// Two shrinks of one communicator on one rank at once (the application's own, and
    /// its recoveries' under `Automatic`, for the same loss) run one agreement and
    /// return the same communicator, which the other rank, calling it once, builds too;
    /// the recoveries, after it, take that communicator for the loss it left out. (Each
    /// call used to run an agreement of its own, the second one joined by no other
    /// rank.) A later call of the application's agrees anew, on every rank: its own view
    /// may lag behind a loss that only the others saw.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shrinks_of_one_communicator_at_once_run_one_agreement() {
        let (_cluster, comms) = three_with_rank_2_lost().await;
        let within = Duration::from_secs(60);
        let (a, b, c) = tokio::join!(
            tokio::time::timeout(within, comms[0].shrink()),
            tokio::time::timeout(within, comms[0].shrink()),
            tokio::time::timeout(within, comms[1].shrink()),
        );
        // Held: the recoveries take only a communicator the application still holds.
        let shrunk: Vec<Communicator> = [a, b, c]
            .into_iter()
            .enumerate()
            .map(|(i, res)| shrunk_to(res, 2, i))
            .collect();
        let ids: Vec<u64> = shrunk.iter().map(|c| c.core.id).collect();
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "one communicator: {ids:?}"
        );
        assert_eq!(comms[0].core.shrink_seq.load(Ordering::Relaxed), 1);
        let recovered = tokio::time::timeout(within, comms[0].shrink_after_loss()).await;
        assert_eq!(shrunk_to(recovered, 2, 3).core.id, ids[0]);
        assert_eq!(comms[0].core.shrink_seq.load(Ordering::Relaxed), 1);
        let (d, e) = tokio::join!(
            tokio::time::timeout(within, comms[0].shrink()),
            tokio::time::timeout(within, comms[1].shrink()),
        );
        let (d, e) = (shrunk_to(d, 2, 4), shrunk_to(e, 2, 5));
        assert_eq!(d.core.id, e.core.id);
        assert_ne!(d.core.id, ids[0], "a second agreement, of its own epoch");
        assert_eq!(comms[0].core.shrink_seq.load(Ordering::Relaxed), 2);
        drop(shrunk);
    }

    /// A shrink whose future is dropped before its agreement ends (at its caller's own
    /// deadline) leaves the rank in step: the agreement runs on, with the others, and the
    /// next call takes its communicator. (The dropped call used to give up the
    /// agreement's number: the next one ran under the following number, which no other
    /// rank ran, and found no quorum, while the others built a communicator with this
    /// rank in it.) The call after that agrees anew on every rank alike.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shrink_dropped_midway_leaves_the_rank_in_step() {
        let (_cluster, comms) = three_with_rank_2_lost().await;
        let within = Duration::from_secs(60);
        let cut = tokio::time::timeout(Duration::from_millis(1), comms[0].shrink()).await;
        assert!(cut.is_err(), "no agreement ends before rank 1 takes part");
        let (a, b) = tokio::join!(
            tokio::time::timeout(within, comms[0].shrink()),
            tokio::time::timeout(within, comms[1].shrink()),
        );
        let (a, b) = (shrunk_to(a, 2, 0), shrunk_to(b, 2, 1));
        assert_eq!(a.core.id, b.core.id);
        assert_eq!(
            comms[0].core.shrink_seq.load(Ordering::Relaxed),
            1,
            "one agreement"
        );
        let (c, d) = tokio::join!(
            tokio::time::timeout(within, comms[0].shrink()),
            tokio::time::timeout(within, comms[1].shrink()),
        );
        let (c, d) = (shrunk_to(c, 2, 2), shrunk_to(d, 2, 3));
        assert_eq!(c.core.id, d.core.id);
        assert_ne!(c.core.id, a.core.id, "an agreement of its own");
        assert_eq!(comms[0].core.shrink_seq.load(Ordering::Relaxed), 2);
    }

    /// The application's shrink, called after its recoveries' shrink for the same loss
    /// finished (its call failed only later), takes the recoveries' communicator, which
    /// the other rank's application call built with them: an agreement of its own would
    /// be joined by no other rank (`QuorumLost`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shrink_after_the_recoveries_finished_takes_their_communicator() {
        let (_cluster, comms) = three_with_rank_2_lost().await;
        let within = Duration::from_secs(60);
        let (recovered, called) = tokio::join!(
            tokio::time::timeout(within, comms[0].shrink_after_loss()),
            tokio::time::timeout(within, comms[1].shrink()),
        );
        // Held, as the recoveries hold the communicator they delivered.
        let recovered = shrunk_to(recovered, 2, 0);
        let called = shrunk_to(called, 2, 1);
        assert_eq!(recovered.core.id, called.core.id);
        let late = tokio::time::timeout(within, comms[0].shrink()).await;
        assert_eq!(shrunk_to(late, 2, 2).core.id, recovered.core.id);
        assert_eq!(
            comms[0].core.shrink_seq.load(Ordering::Relaxed),
            1,
            "no second agreement"
        );
        // The application's call on rank 0 took the recoveries' shrink where rank 1's ran
        // its agreement: a second call of the application's agrees anew on both ranks
        // alike. (Rank 0 returned the first shrink's communicator again, while rank 1
        // agreed on its own and found no quorum.)
        let (again0, again1) = tokio::join!(
            tokio::time::timeout(within, comms[0].shrink()),
            tokio::time::timeout(within, comms[1].shrink()),
        );
        let (again0, again1) = (shrunk_to(again0, 2, 3), shrunk_to(again1, 2, 4));
        assert_eq!(again0.core.id, again1.core.id);
        assert_ne!(again0.core.id, recovered.core.id, "an agreement of its own");
        assert_eq!(comms[0].core.shrink_seq.load(Ordering::Relaxed), 2);
    }

    /// The recoveries, waking for a loss that the application's own shrink already left
    /// out, take that shrink's communicator even when another rank was lost since: the
    /// others are on it, and the new loss is one of its members. (They ran an agreement
    /// of their own on the old communicator, which no other rank joined: `QuorumLost`.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_recoveries_take_a_shrink_that_covers_one_of_two_losses() {
        let cluster = cluster(4).await;
        let comms = cluster.communicators();
        let within = Duration::from_secs(60);
        let lost_seen = |ranks: &'static [usize], on: &'static [usize]| {
            let comms = &comms;
            async move {
                let deadline = Instant::now() + within;
                while on.iter().any(|&r| comms[r].failed_ranks() != ranks) {
                    assert!(Instant::now() < deadline, "{ranks:?} never declared lost");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        cluster.kill_rank(3).expect("kill");
        lost_seen(&[3], &[0, 1, 2]).await;
        let shrinks = comms[..3]
            .iter()
            .map(|c| async move { tokio::time::timeout(within, c.shrink()).await });
        // Held: the recoveries take only a communicator the application still holds.
        let shrunk: Vec<Communicator> = futures::future::join_all(shrinks)
            .await
            .into_iter()
            .enumerate()
            .map(|(r, res)| shrunk_to(res, 3, r))
            .collect();
        cluster.kill_rank(2).expect("kill");
        lost_seen(&[2, 3], &[0]).await;
        let recovered = tokio::time::timeout(within, comms[0].shrink_after_loss()).await;
        assert_eq!(shrunk_to(recovered, 3, 3).core.id, shrunk[0].core.id);
        assert_eq!(
            comms[0].core.shrink_seq.load(Ordering::Relaxed),
            1,
            "no agreement"
        );
    }

    #[test]
    fn reports_round_trip_and_malformed_ones_are_refused() {
        for report in [
            Report::Open(set(&[])),
            Report::Open(set(&[0, 3])),
            Report::Decided(set(&[])),
            Report::Decided(set(&[0, 1, 2, 3])),
        ] {
            assert_eq!(Report::decode(&report.encode(), 4), Some(report));
        }
        assert_eq!(Report::decode(&[1, 0, 0], 4), None, "not whole words");
        assert_eq!(
            Report::decode(&4u32.to_le_bytes(), 4),
            None,
            "rank out of range"
        );
        let long: Vec<u8> = (0..6u32).flat_map(|_| 0u32.to_le_bytes()).collect();
        assert_eq!(Report::decode(&long, 4), None, "longer than any report");
        let twice: Vec<u8> = [DECIDED, DECIDED]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        assert_eq!(
            Report::decode(&twice, 4),
            None,
            "the mark only opens a report"
        );
    }

    #[test]
    fn a_round_decides_on_agreement_or_an_announcement_and_merges_otherwise() {
        let lost = set(&[3]);
        let open = |r: &[usize]| Report::Open(set(r));
        let all_agree = Round {
            silent: vec![],
            reports: vec![(0, open(&[3])), (1, open(&[3]))],
        };
        assert_eq!(judge(&lost, &all_agree, None).ok(), Some(Ok(set(&[3]))));
        let one_silent = Round {
            silent: vec![1],
            reports: vec![(0, open(&[3]))],
        };
        assert_eq!(
            judge(&lost, &one_silent, None).ok(),
            Some(Err(set(&[1, 3])))
        );
        let one_differs = Round {
            silent: vec![],
            reports: vec![(0, open(&[3])), (1, open(&[2, 3]))],
        };
        assert_eq!(
            judge(&lost, &one_differs, None).ok(),
            Some(Err(set(&[2, 3])))
        );
        // An announced decision wins over this rank's own view, a silent rank included.
        let announced = Round {
            silent: vec![2],
            reports: vec![(0, Report::Decided(set(&[]))), (1, open(&[2, 3]))],
        };
        assert_eq!(judge(&lost, &announced, None).ok(), Some(Ok(set(&[]))));
        let conflicting = Round {
            silent: vec![],
            reports: vec![
                (0, Report::Decided(set(&[]))),
                (1, Report::Decided(set(&[3]))),
            ],
        };
        assert!(judge(&lost, &conflicting, None).is_err());
        // A decision found under its own key, from a rank this one counts lost, wins over
        // a round that would have decided otherwise.
        assert_eq!(
            judge(&lost, &all_agree, Some(&set(&[]))).ok(),
            Some(Ok(set(&[])))
        );
        assert!(judge(&lost, &announced, Some(&set(&[3]))).is_err());
    }

    #[test]
    fn only_one_side_of_any_split_has_a_quorum() {
        for world in 1..=9usize {
            // Every split of 0..world into two sides: at most one side qualifies.
            for mask in 0u32..(1 << world) {
                let a: Vec<usize> = (0..world).filter(|r| mask & (1 << r) != 0).collect();
                let b: Vec<usize> = (0..world).filter(|r| mask & (1 << r) == 0).collect();
                assert!(
                    !(has_quorum(&a, world) && has_quorum(&b, world)),
                    "world {world}: {a:?} and {b:?}"
                );
                // And one always does, when the whole world is split in two.
                assert!(has_quorum(&a, world) || has_quorum(&b, world));
            }
        }
        assert!(has_quorum(&[0, 1, 2, 3], 5));
        assert!(!has_quorum(&[4], 5));
        assert!(has_quorum(&[0], 2) && !has_quorum(&[1], 2));
    }
}
