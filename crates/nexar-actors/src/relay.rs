//! Sending to any node: directly over a link when one exists, otherwise through neighbours
//! along the topology's routing table. A relayed frame carries an envelope that names its
//! origin and destination, the origin's certificate and the origin's signature over the
//! whole message, so the destination can check who sent it; relays only forward. A hop
//! limit bounds how far a frame can travel, whatever the routers' views of dead ranks. A
//! relay that cannot pass a frame on within `op_timeout` (its next hop takes no new
//! streams) drops it: the origin's send has succeeded by then, and its receiver's receive
//! times out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use nexar_transport::{
    ControlFrame, FrameHeader, FrameKind, MailboxKey, NodeId, Payload, RelayFrame, TransportError,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::node::NodeShared;
use crate::topology::Topology;

/// How many of the latest sequence numbers of an origin's relayed frames [`ReplayWindow`]
/// tells apart (a multiple of 64).
const REPLAY_WINDOW: u64 = 4096;

/// How many runs of numbers that left the window untaken [`ReplayWindow`] keeps.
const HOLE_RUNS: usize = 4096;

/// The sequence numbers of one origin's relayed frames already taken here. A relay
/// forwards a frame signed by its origin and could forward it again (a replay; or a
/// reroute, when a next hop failed after all while taking it), and the signature cannot
/// tell the copy from the original; so the origin numbers the frames it relays to each
/// destination, from 0 up, under its signature, and the destination takes each number
/// once. A copy would otherwise run an RPC request twice, or leave a data frame whose
/// original was taken in a mailbox nobody will take, for good.
///
/// The window holds the latest [`REPLAY_WINDOW`] numbers as bits (512 bytes). A number
/// that leaves it untaken (its frame overtaken by that many later ones: a large frame
/// behind many small ones, each on a stream of its own; or lost) is kept as a hole, in
/// runs, and taken once if its frame still comes; of the runs, the [`HOLE_RUNS`] highest
/// are kept (a frame overtaken by that many runs of others is refused).
#[derive(Debug)]
pub(crate) struct ReplayWindow {
    /// The highest number taken so far.
    top: Option<u64>,
    /// Bit `seq % REPLAY_WINDOW`: number `seq` was taken (for the window's numbers).
    seen: Box<[u64; (REPLAY_WINDOW / 64) as usize]>,
    /// Numbers below the window never taken, as runs: first mapped to last.
    holes: BTreeMap<u64, u64>,
}

impl Default for ReplayWindow {
    fn default() -> ReplayWindow {
        ReplayWindow {
            top: None,
            seen: Box::new([0; (REPLAY_WINDOW / 64) as usize]),
            holes: BTreeMap::new(),
        }
    }
}

impl ReplayWindow {
    /// Whether frame `seq` comes for the first time; it counts as taken from now on.
    /// `u64::MAX` never does: no origin numbers that many frames, and the window's
    /// arithmetic takes one past `seq`.
    pub(crate) fn first(&mut self, seq: u64) -> bool {
        if seq == u64::MAX {
            return false;
        }
        match self.top {
            Some(top) if seq <= top => {
                if top - seq >= REPLAY_WINDOW {
                    return self.take_hole(seq);
                }
            }
            top => {
                // The window moves up to end at `seq`: the numbers that leave it untaken
                // become holes, then those that enter it start untaken.
                let from = top.map_or(0, |t| t + 1);
                let old_low = top.map_or(0, |t| (t + 1).saturating_sub(REPLAY_WINDOW));
                let new_low = (seq + 1).saturating_sub(REPLAY_WINDOW);
                for n in old_low..new_low.min(from) {
                    if !self.is_set(n) {
                        self.add_holes(n, n);
                    }
                }
                if new_low > from {
                    self.add_holes(from, new_low - 1);
                }
                if seq - from >= REPLAY_WINDOW {
                    self.seen.fill(0);
                } else {
                    for n in from..=seq {
                        self.set(n, false);
                    }
                }
                self.top = Some(seq);
            }
        }
        !self.set(seq, true)
    }

    fn is_set(&self, seq: u64) -> bool {
        let bit = seq % REPLAY_WINDOW;
        self.seen[(bit / 64) as usize] & (1u64 << (bit % 64)) != 0
    }

    /// Sets bit `seq` to `on`, returning what it was.
    fn set(&mut self, seq: u64, on: bool) -> bool {
        let bit = seq % REPLAY_WINDOW;
        let word = &mut self.seen[(bit / 64) as usize];
        let mask = 1u64 << (bit % 64);
        let was = *word & mask != 0;
        if on {
            *word |= mask;
        } else {
            *word &= !mask;
        }
        was
    }

    /// Adds the holes `first..=last` (above every kept run), joined to the last run where
    /// they follow it; past [`HOLE_RUNS`] runs the lowest is forgotten.
    fn add_holes(&mut self, first: u64, last: u64) {
        if let Some(mut run) = self.holes.last_entry() {
            if run.get().checked_add(1) == Some(first) {
                *run.get_mut() = last;
                return;
            }
        }
        self.holes.insert(first, last);
        if self.holes.len() > HOLE_RUNS {
            self.holes.pop_first();
        }
    }

    /// Takes hole `seq` if it is one (its frame comes late), splitting its run; past
    /// [`HOLE_RUNS`] runs the lowest is forgotten, as in [`Self::add_holes`].
    fn take_hole(&mut self, seq: u64) -> bool {
        let Some((&first, &last)) = self.holes.range(..=seq).next_back() else {
            return false;
        };
        if seq > last {
            return false;
        }
        self.holes.remove(&first);
        if first < seq {
            self.holes.insert(first, seq - 1);
        }
        if seq < last {
            self.holes.insert(seq + 1, last);
        }
        if self.holes.len() > HOLE_RUNS {
            self.holes.pop_first();
        }
        true
    }
}

/// Envelope in front of a relayed payload: `[u32 length][postcard Envelope][payload]`.
#[derive(Debug, Serialize, Deserialize)]
struct Envelope {
    origin: u64,
    dest: u64,
    hops: u32,
    kind: FrameKind,
    comm: u64,
    tag: u64,
    step: u64,
    /// The origin's number for this frame among those it relays to `dest` (see
    /// [`ReplayWindow`]).
    seq: u64,
    cert: Vec<u8>,
    sig: Vec<u8>,
    /// Nodes the origin and the relays so far know to be lost: every router avoids them,
    /// so a router that has not yet noticed a death does not send the frame back into it.
    /// Not signed (it only steers routing).
    avoid: Vec<u64>,
}

const MAX_ENVELOPE: usize = 16 << 10;

/// What a relay frame adds to its payload at most (the envelope and its length): a
/// payload that may be relayed must leave this much room under `max_frame_bytes`.
pub(crate) const RELAY_ROOM: u64 = MAX_ENVELOPE as u64 + 4;

fn signed_message(e: &Envelope, payload: &[Bytes]) -> Vec<u8> {
    let mut m = b"nexar-relay/2".to_vec();
    for w in [e.origin, e.dest, e.comm, e.tag, e.step, e.seq] {
        m.extend_from_slice(&w.to_be_bytes());
    }
    m.push(match e.kind {
        FrameKind::Data => 0,
        FrameKind::Control => 1,
        FrameKind::Heartbeat => 2,
        FrameKind::Relay => 3,
        FrameKind::Abandoned => 4,
        FrameKind::Farewell => 5,
        FrameKind::Announce => 6,
        FrameKind::Clear => 7,
        FrameKind::Credit => 8,
    });
    let mut h = Sha256::new();
    for c in payload {
        h.update(c);
    }
    m.extend_from_slice(&h.finalize());
    m
}

/// What a relayed frame's replay window is kept under: the SHA-256 of its origin and
/// the public key of the certificate it came with. Not the certificate's bytes: a relay
/// could re-encode the CA's signature on it (ECDSA's `s` and `n - s` both verify) to make
/// a copy look new; nor the origin alone: a certificate the CA issued earlier for the
/// same id (to a worker that left before formation) is another process, with its own ids.
/// `key` is the certificate's public-key fingerprint, as
/// [`SignatureVerifier::verify_signer`](nexar_transport::SignatureVerifier::verify_signer)
/// gives it.
pub(crate) fn origin_key(origin: NodeId, key: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(origin.0.to_le_bytes());
    h.update(key);
    h.finalize().into()
}

/// The relay frame: the envelope in a buffer of its own, then the payload's chunks as they
/// are (a relay passes a payload on without copying it).
fn pack(e: &Envelope, payload: &[Bytes]) -> Result<Payload, TransportError> {
    let env =
        postcard::to_stdvec(e).map_err(|err| TransportError::Closed(format!("envelope: {err}")))?;
    let mut head = BytesMut::with_capacity(4 + env.len());
    head.put_u32(env.len() as u32);
    head.put_slice(&env);
    let mut chunks = Vec::with_capacity(1 + payload.len());
    chunks.push(head.freeze());
    chunks.extend_from_slice(payload);
    Ok(Payload::from_parts(chunks))
}

/// The first `n` bytes of `chunks`, copied (`None` when there are fewer), and the rest as
/// slices of the chunks.
fn split_at(chunks: &[Bytes], n: usize) -> Option<(Vec<u8>, Vec<Bytes>)> {
    let mut head = Vec::with_capacity(n);
    let mut rest = Vec::new();
    for c in chunks {
        let take = (n - head.len()).min(c.len());
        head.extend_from_slice(&c[..take]);
        if take < c.len() {
            rest.push(c.slice(take..));
        }
    }
    (head.len() == n).then_some((head, rest))
}

/// A relay frame's envelope and payload (its chunks, not copied).
fn unpack(frame: &Payload) -> Option<(Envelope, Vec<Bytes>)> {
    let (len, rest) = split_at(frame.chunks(), 4)?;
    let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
    if len > MAX_ENVELOPE {
        return None;
    }
    let (env, payload) = split_at(&rest, len)?;
    let e: Envelope = postcard::from_bytes(&env).ok()?;
    Some((e, payload))
}

/// Routes computed for a node: next hop by node, per (avoided set, world size), and how
/// many searches sets that relayed frames named have cost lately.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    by_set: std::collections::HashMap<(BTreeSet<usize>, usize), Vec<Option<usize>>>,
    /// Searches made for sets beyond this node's own losses since `since`.
    named_searches: usize,
    since: Option<Instant>,
}

/// How many avoided sets [`Routes`] keeps: the one of this node's own losses, and a few a
/// relayed frame's routers named. Past it the cache starts over.
pub(crate) const ROUTE_SETS: usize = 16;

/// The most searches that avoided sets named by relayed frames (beyond this node's own
/// losses) may cost per [`NAMED_SEARCH_PERIOD`]: the list a frame's routers name is not
/// signed, and a neighbour naming a new set in every frame would otherwise have this node
/// search the whole topology for each, under the lock every relay here takes. Past it,
/// frames are routed around this node's own losses only (the hop limit and rerouting
/// still bound where they go).
pub(crate) const NAMED_SEARCHES: usize = ROUTE_SETS;

/// See [`NAMED_SEARCHES`].
pub(crate) const NAMED_SEARCH_PERIOD: Duration = Duration::from_secs(1);

/// Avoided ranks a relayed frame may name that routing takes into account (its routers
/// name the losses they saw; more than this many is not a real route's doing).
const MAX_AVOID: usize = 64;

impl Routes {
    /// Whether a search for a set a frame named may run at `now`; counts it if so.
    fn named_search_allowed(&mut self, now: Instant) -> bool {
        if self
            .since
            .is_none_or(|t| now.saturating_duration_since(t) >= NAMED_SEARCH_PERIOD)
        {
            self.since = Some(now);
            self.named_searches = 0;
        }
        let allowed = self.named_searches < NAMED_SEARCHES;
        self.named_searches += usize::from(allowed);
        allowed
    }
}

impl NodeShared {
    /// The neighbour to reach `dest` through, avoiding ranks known to be lost here and the
    /// ranks in `avoid` (reported by the frame's earlier routers; the first
    /// [`MAX_AVOID`]). Routes are computed once per avoided set (a breadth-first search
    /// over the topology's links) and kept; sets beyond this node's own losses get at most
    /// [`NAMED_SEARCHES`] new searches per [`NAMED_SEARCH_PERIOD`].
    /// `failed`: next hops this node itself saw fail while passing this frame on, which
    /// count as its own losses (a reroute around them is never refused a search).
    fn next_hop(&self, dest: NodeId, avoid: &[u64], failed: &[u64]) -> Option<NodeId> {
        self.next_hop_at(dest, avoid, failed, Instant::now())
    }

    fn next_hop_at(
        &self,
        dest: NodeId,
        avoid: &[u64],
        failed: &[u64],
        now: Instant,
    ) -> Option<NodeId> {
        let world = self.world();
        let dest = usize::try_from(dest.0).ok().filter(|d| *d < world)?;
        let in_world = |a: &u64| usize::try_from(*a).ok().filter(|a| *a < world);
        let mut own = self.unreachable();
        own.extend(failed.iter().filter_map(in_world));
        let mut lost = own.clone();
        lost.extend(avoid.iter().take(MAX_AVOID).filter_map(in_world));
        let mut cache = self
            .routes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut key = (lost, world);
        if !cache.by_set.contains_key(&key) && key.0 != own && !cache.named_search_allowed(now) {
            debug!(named = ?key.0, "too many avoided sets named lately; routing around this node's own losses");
            key.0 = own;
        }
        if !cache.by_set.contains_key(&key) {
            if cache.by_set.len() >= ROUTE_SETS {
                cache.by_set.clear();
            }
            let me = usize::try_from(self.id.0).unwrap_or(usize::MAX);
            let hops = self.topology().next_hops(me, world, &key.0);
            cache.by_set.insert(key.clone(), hops);
        }
        cache
            .by_set
            .get(&key)?
            .get(dest)
            .copied()
            .flatten()
            .map(|n| NodeId(n as u64))
    }

    fn topology(&self) -> Topology {
        self.config.topology
    }
}

/// Sends one frame to `node`, directly or through relays. Small payloads use the control
/// lane, large ones the bulk lane; data frames use the pair's trusted-fabric lane where
/// there is one, except RPC replies, which stay on QUIC as the requests do.
pub(crate) async fn send_to(
    shared: &NodeShared,
    node: NodeId,
    kind: FrameKind,
    comm: u64,
    tag: u64,
    step: u64,
    payload: Payload,
) -> Result<(), TransportError> {
    if let Some(links) = shared.links.get(&node).map(|l| l.clone()) {
        if let (Some(lane), FrameKind::Data) = (&links.lane, kind) {
            if comm != crate::rpc::RPC_REPLY_CHANNEL {
                return lane.send(comm, tag, step, payload.to_bytes()).await;
            }
        }
        let lane = if payload.len() <= shared.config.small_message_bytes {
            links.control
        } else {
            links.bulk
        };
        return lane.send_payload(kind, comm, tag, step, payload).await;
    }
    if shared.config.topology == Topology::FullMesh {
        return Err(TransportError::ConnectionLost {
            peer: node,
            reason: "not connected".into(),
        });
    }
    let payload = payload.into_chunks();
    let mut env = seal(shared, node, kind, (comm, tag, step), &payload)?;
    forward(shared, &mut env, &payload, None).await
}

/// The signed envelope of a frame this node relays to `dest`, numbered as the next of
/// those it relays there.
fn seal(
    shared: &NodeShared,
    dest: NodeId,
    kind: FrameKind,
    (comm, tag, step): (u64, u64, u64),
    payload: &[Bytes],
) -> Result<Envelope, TransportError> {
    let seq = {
        let mut next = shared.relay_seq.entry(dest).or_insert(0);
        let seq = *next;
        *next += 1;
        seq
    };
    let mut env = Envelope {
        origin: shared.id.0,
        dest: dest.0,
        hops: 0,
        kind,
        comm,
        tag,
        step,
        seq,
        cert: shared.signer.cert_der().to_vec(),
        sig: Vec::new(),
        avoid: Vec::new(),
    };
    env.sig = shared.signer.sign(&signed_message(&env, payload))?;
    Ok(env)
}

/// Sends a relay frame on towards its destination. Its header's step carries the
/// envelope's hop count, which picks the relay budget it takes at the next hop (see
/// `MailboxTable::with_relay_budget`: one budget per hop count keeps relays that forward
/// to each other free of deadlock). A next hop whose connection fails while the frame is
/// handed to it (it died, or is closing, before this node took it for lost) is avoided
/// and the frame sent another way, up to [`MAX_REROUTES`] times: a frame that went nowhere
/// would be lost without word to its origin, and the receive waiting for it, and every
/// later one under its tag, would time out. (A hop that took the frame whole and failed
/// before passing it on still loses it: QUIC has it, not the hop's reader.)
///
/// A frame is passed back to the neighbour it came from (`came_from`; `None` for this
/// node's own) only when this node avoids a node the envelope did not name (one gone
/// here, or a next hop that failed here), which that neighbour may not know: see
/// [`onward_hop`].
async fn forward(
    shared: &NodeShared,
    env: &mut Envelope,
    payload: &[Bytes],
    came_from: Option<NodeId>,
) -> Result<(), TransportError> {
    let dest = NodeId(env.dest);
    let named = env.avoid.len();
    for n in shared.unreachable() {
        if !env.avoid.contains(&(n as u64)) {
            env.avoid.push(n as u64);
        }
    }
    let mut failed = Vec::new();
    loop {
        // Sent back with more to avoid, the neighbour routes it anew (the hop limit bounds
        // how often).
        let back = came_from.filter(|_| env.avoid.len() == named);
        let hop = onward_hop(shared, dest, &env.avoid, &failed, back).ok_or_else(|| {
            TransportError::ConnectionLost {
                peer: dest,
                reason: "no route".into(),
            }
        })?;
        let sent = match shared.links.get(&hop).map(|l| l.clone()) {
            None => Err(TransportError::ConnectionLost {
                peer: dest,
                reason: format!("next hop {hop} not connected"),
            }),
            Some(links) => {
                let frame = pack(env, payload)?;
                let lane = if frame.len() <= shared.config.small_message_bytes {
                    links.control
                } else {
                    links.bulk
                };
                lane.send_payload(FrameKind::Relay, 0, 0, u64::from(env.hops), frame)
                    .await
            }
        };
        match sent {
            Err(
                e @ (TransportError::ConnectionLost { .. }
                | TransportError::Send { .. }
                | TransportError::Closed(_)),
            ) if hop != dest && failed.len() < MAX_REROUTES => {
                debug!(%hop, dest = %dest, error = %e, "next hop failed; relaying another way");
                env.avoid.push(hop.0);
                failed.push(hop.0);
            }
            other => return other,
        }
    }
}

/// The next hop towards `dest` (avoiding `avoid` and `failed`, as
/// [`NodeShared::next_hop`]), which is never `came_from`, the neighbour the frame came
/// from, when given: with nothing more to avoid than that neighbour named, a route back
/// to it is a loop (it routed the frame here on the same knowledge), and a neighbour that
/// never takes such frames back would hold a task, and the frame, here for each until the
/// forward's deadline. So the route is taken again without it, and `None` if there is
/// none.
fn onward_hop(
    shared: &NodeShared,
    dest: NodeId,
    avoid: &[u64],
    failed: &[u64],
    came_from: Option<NodeId>,
) -> Option<NodeId> {
    let hop = shared.next_hop(dest, avoid, failed)?;
    match came_from {
        Some(back) if back == hop => {
            let mut without = failed.to_vec();
            without.push(back.0);
            shared.next_hop(dest, avoid, &without)
        }
        _ => Some(hop),
    }
}

/// How many times [`forward`] tries another next hop after one fails.
const MAX_REROUTES: usize = 2;

/// Handles relay frames as they arrive: each in its own task. How many are in hand at
/// once is bounded by the relay budget their payloads hold (see
/// `TransportConfig::relay_budget_bytes`; except frames read without it, when half a
/// neighbour's streams wait), released when `handle` is done with them.
pub(crate) fn spawn_dispatch(
    shared: Arc<NodeShared>,
    mut rx: mpsc::Receiver<RelayFrame>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(frame) = rx.recv().await {
            let shared = shared.clone();
            tokio::spawn(async move { handle(&shared, frame).await });
        }
    })
}

/// What a node does with a relay frame that reached it.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// It is for this node: check its signature and deliver it.
    Deliver,
    /// Pass it on, one hop further.
    Forward,
    /// Drop it, for this reason.
    Drop(&'static str),
}

/// The verdict on a relay frame with envelope `env`, whose header's step is `step`, from
/// neighbour `from`, at node `me` of a world of `world` nodes.
fn verdict(env: &Envelope, step: u64, from: NodeId, me: NodeId, world: usize) -> Verdict {
    // The relay budget this frame took here was picked by its header's hop count: one
    // that is not the envelope's could undo the budgets' ordering by hop count.
    if step != u64::from(env.hops) {
        return Verdict::Drop("its header and envelope disagree on its hop count");
    }
    if env.dest == me.0 {
        return Verdict::Deliver;
    }
    // Its sender is its destination, which would have kept it: passing it back only
    // bounces it (and a neighbour that sends such frames, and does not take them back,
    // would hold a task here for each).
    if env.dest == from.0 {
        return Verdict::Drop("it is for the neighbour it came from");
    }
    if env.hops as usize >= world {
        return Verdict::Drop("it is over the hop limit");
    }
    Verdict::Forward
}

async fn handle(shared: &Arc<NodeShared>, frame: RelayFrame) {
    let Some((mut env, payload)) = unpack(&frame.payload) else {
        warn!(from = %frame.from, "dropping a malformed relay frame");
        return;
    };
    match verdict(
        &env,
        frame.header.step,
        frame.from,
        shared.id,
        shared.world(),
    ) {
        Verdict::Deliver => {}
        Verdict::Drop(why) => {
            warn!(from = %frame.from, origin = env.origin, dest = env.dest, "dropping a relay frame: {why}");
            return;
        }
        Verdict::Forward => {
            env.hops += 1;
            // Within the operation timeout: a next hop that takes no new streams would
            // otherwise hold this task, and the relay budget its frame holds, for good.
            let within = shared.config.op_timeout;
            match tokio::time::timeout(
                within,
                forward(shared, &mut env, &payload, Some(frame.from)),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    debug!(origin = env.origin, dest = env.dest, error = %e, "relay frame not forwarded");
                }
                Err(_) => {
                    debug!(
                        origin = env.origin,
                        dest = env.dest,
                        ?within,
                        "relay frame not forwarded in time"
                    );
                }
            }
            return;
        }
    }
    // Nothing more from a lost node reaches the mailboxes, also by way of a relay that
    // held its frames (as nothing does over its own links): a receive from it fails
    // first anyway, so such a frame would only sit in the table for good. (Dropped
    // before its signature is checked: whoever sent it, it is not delivered.)
    if shared.lost.contains_key(&NodeId(env.origin)) {
        debug!(origin = env.origin, "relay frame from a lost node; dropped");
        return;
    }
    // For us: the origin must have signed exactly this message with a cluster certificate
    // that names it.
    let key = match shared.verifier.verify_signer(
        &env.cert,
        &signed_message(&env, &payload),
        &env.sig,
    ) {
        Ok((node, key)) if node.0 == env.origin => key,
        Ok((node, _)) => {
            warn!(claimed = env.origin, signer = %node, "relay frame signed by another node; dropped");
            return;
        }
        Err(e) => {
            warn!(from = %frame.from, error = %e, "relay frame failed authentication; dropped");
            return;
        }
    };
    let origin = NodeId(env.origin);
    if !shared.pinned_member(origin, &nexar_transport::cert_fingerprint(&env.cert)) {
        warn!(%origin, "relay frame signed with a certificate the membership does not name for its origin (or from a node it does not name); dropped");
        return;
    }
    // Each frame is taken once however often a relay forwards it: the signature cannot
    // tell a copy from the original. Kept per origin and key, not per certificate bytes,
    // which a relay can re-encode.
    if !shared
        .relayed_seen
        .entry(origin_key(origin, &key))
        .or_default()
        .first(env.seq)
    {
        warn!(%origin, seq = env.seq, kind = ?env.kind, "relay frame seen before, or overtaken by a window of later ones; dropped");
        return;
    }
    match env.kind {
        FrameKind::Data => {
            let key = MailboxKey {
                comm: env.comm,
                tag: env.tag,
                step: env.step,
                src: origin,
            };
            // Never waits (for budget or a receiver): `frame`, holding this frame's relay
            // budget, is dropped right after.
            match shared.table.deliver_relayed(key, payload).await {
                Ok(()) => {}
                // So far ahead that its receives could not be told: given up on.
                Err(nexar_transport::TransportError::ConnectionLost { reason, .. }) => {
                    warn!(%origin, "taking the origin of relayed frames for lost: it {reason}");
                    shared.record_loss(origin, &reason);
                }
                Err(e) => debug!(error = %e, "relayed frame not delivered"),
            }
        }
        FrameKind::Control => {
            // Requests sent directly are refused over `MAX_RPC_REQUEST` by the transport;
            // a relayed one is refused here, before it is joined, with a reply that says
            // why (the payload is not kept).
            let len: usize = payload.iter().map(Bytes::len).sum();
            let payload = if len > crate::rpc::MAX_RPC_REQUEST {
                warn!(%origin, request = env.tag, len, "relayed RPC request over the size limit; refused");
                Bytes::new()
            } else {
                Payload::from_parts(payload).to_bytes()
            };
            let header = FrameHeader::new(
                FrameKind::Control,
                env.comm,
                env.tag,
                env.step,
                env.origin,
                len as u64,
            );
            crate::rpc::dispatch(
                shared.clone(),
                ControlFrame {
                    from: origin,
                    header,
                    payload,
                    oversized: false,
                },
            );
        }
        FrameKind::Abandoned => shared.table.abandon(MailboxKey {
            comm: env.comm,
            tag: env.tag,
            step: env.step,
            src: origin,
        }),
        FrameKind::Farewell => shared.farewell_from(origin),
        kind => debug!(?kind, "relayed frame of an unexpected kind dropped"),
    }
}

#[cfg(test)]
mod tests {
    use super::{
        origin_key, pack, signed_message, unpack, verdict, Envelope, ReplayWindow, Verdict,
        REPLAY_WINDOW,
    };
    use bytes::Bytes;
    use nexar_transport::{FrameHeader, FrameKind, MailboxKey, NodeId, Payload, RelayFrame};

    /// A relay frame is delivered at its destination and passed on elsewhere; dropped
    /// when its header misstates its hop count, when it is past the hop limit, and when
    /// it came from its own destination (which would have kept it: passed back, it could
    /// only bounce, and a neighbour that never takes it back would hold a task here for
    /// each such frame until the forward's deadline).
    #[test]
    fn relay_frames_are_delivered_passed_on_or_dropped() {
        let env = |dest: u64, hops: u32| Envelope {
            origin: 7,
            dest,
            hops,
            kind: FrameKind::Data,
            comm: 0,
            tag: 1,
            step: 0,
            seq: 0,
            cert: Vec::new(),
            sig: Vec::new(),
            avoid: Vec::new(),
        };
        let (me, from) = (NodeId(2), NodeId(3));
        assert_eq!(verdict(&env(2, 1), 1, from, me, 8), Verdict::Deliver);
        // For this node: delivered past the hop limit, but not with a misstated header.
        assert_eq!(verdict(&env(2, 9), 9, from, me, 8), Verdict::Deliver);
        assert!(matches!(
            verdict(&env(2, 1), 2, from, me, 8),
            Verdict::Drop(_)
        ));
        assert_eq!(verdict(&env(5, 1), 1, from, me, 8), Verdict::Forward);
        assert!(matches!(
            verdict(&env(5, 1), 0, from, me, 8),
            Verdict::Drop(_)
        ));
        assert!(matches!(
            verdict(&env(5, 8), 8, from, me, 8),
            Verdict::Drop(_)
        ));
        assert!(matches!(
            verdict(&env(3, 1), 1, from, me, 8),
            Verdict::Drop(_)
        ));
    }

    /// A relayed request's replay window follows its origin and key: two certificates of
    /// one key (other bytes) share it, another origin or key does not.
    #[test]
    fn replay_windows_are_kept_by_origin_and_key_not_certificate_bytes() {
        let ca = nexar_transport::ClusterCa::generate().expect("ca");
        let (csr, _key) = nexar_transport::generate_csr().expect("csr");
        let a = ca.sign_request(&csr, NodeId(3)).expect("a");
        let b = ca.sign_request(&csr, NodeId(3)).expect("b");
        let other = ca.issue(NodeId(3)).expect("another key");
        let key = |n: u64, cert: &[u8]| {
            let fingerprint = nexar_transport::SignatureVerifier::public_key_fingerprint(cert)
                .expect("a certificate");
            origin_key(NodeId(n), &fingerprint)
        };
        assert_eq!(key(3, a.as_ref()), key(3, b.as_ref()));
        assert_ne!(key(3, a.as_ref()), key(4, a.as_ref()));
        assert_ne!(key(3, a.as_ref()), key(3, other.cert_der()));
    }

    /// Receives the next message from rank 0 under tag 7 on `comm` (within 60 s) and
    /// checks that it is `want`.
    async fn received(comm: &crate::Communicator, want: &[u8]) {
        let mut got = vec![0u8; want.len()];
        tokio::time::timeout(
            std::time::Duration::from_secs(60),
            comm.recv(&mut got, 0, 7),
        )
        .await
        .expect("the message came within the deadline")
        .expect("received");
        assert_eq!(got, want);
    }

    /// An in-process cluster of `world` ranks on a ring (`KRegular { k: 2 }`).
    async fn ring(world: usize) -> crate::Cluster {
        let config = crate::NodeConfig {
            topology: crate::Topology::KRegular { k: 2 },
            ..crate::NodeConfig::default()
        };
        crate::Cluster::local_with(world, config)
            .await
            .expect("a ring")
    }

    /// A relayed frame is taken only from an origin the membership names, signed with
    /// the certificate it names for it: one signed with a certificate the cluster CA
    /// issued to a node outside the membership (as a node queued to join holds) is
    /// dropped, where a member's, through the same path, is taken. Such frames used to
    /// be taken: the check let through every node the membership did not name.
    #[tokio::test]
    async fn a_relayed_frame_from_a_node_outside_the_membership_is_dropped() {
        let cluster = ring(4).await;
        let shared = cluster.nodes[0].shared.clone();
        let comm = cluster.communicators()[0].core.id;
        let outsider = cluster
            .ca()
            .issue(NodeId(99))
            .expect("a certificate for node 99");
        let member = cluster.identity(2).expect("rank 2");
        for (identity, taken) in [(member, true), (&outsider, false)] {
            let origin = identity.node();
            let signer = nexar_transport::Signer::new(identity).expect("signer");
            let payload = vec![Bytes::from_static(b"from afar")];
            let mut env = Envelope {
                origin: origin.0,
                dest: 0,
                hops: 1,
                kind: FrameKind::Data,
                comm,
                tag: 5,
                step: 0,
                seq: 0,
                cert: signer.cert_der().to_vec(),
                sig: Vec::new(),
                avoid: Vec::new(),
            };
            env.sig = signer
                .sign(&signed_message(&env, &payload))
                .expect("signed");
            let packed = pack(&env, &payload).expect("packed");
            let header = FrameHeader::new(FrameKind::Relay, comm, 5, 1, 1, packed.len() as u64);
            let frame = RelayFrame {
                from: NodeId(1),
                header,
                payload: packed,
            };
            super::handle(&shared, frame).await;
            let key = MailboxKey {
                comm,
                tag: 5,
                step: 0,
                src: origin,
            };
            assert_eq!(shared.table.is_ready(&key), taken, "origin {origin}");
        }
        cluster.shutdown().await;
    }

    /// A frame is not passed back to the neighbour it came from on the same knowledge:
    /// on a ring of 6, node 2's way to 0 is through 1, so a frame from 1 for 0 goes the
    /// other way round (1 avoided 0's link, say), and none is left when that way is
    /// avoided too. It used to go back to 1, which could hold it, and a task here, to the
    /// forward's deadline.
    #[tokio::test]
    async fn a_relayed_frame_is_never_passed_back_where_it_came_from() {
        let cluster = ring(6).await;
        let shared = cluster.nodes[2].shared.clone();
        let (dest, from) = (NodeId(0), NodeId(1));
        assert_eq!(super::onward_hop(&shared, dest, &[], &[], None), Some(from));
        assert_eq!(
            super::onward_hop(&shared, dest, &[], &[], Some(NodeId(3))),
            Some(from)
        );
        assert_eq!(
            super::onward_hop(&shared, dest, &[], &[], Some(from)),
            Some(NodeId(3))
        );
        assert_eq!(
            super::onward_hop(&shared, dest, &[3], &[], Some(from)),
            None
        );
        cluster.shutdown().await;
    }

    /// A relay that avoids a node the frame's sender did not know to avoid sends it back
    /// when that is the only way left, naming the node, and the sender routes it anew: on
    /// a ring of 7, 0 reaches 3 through 1 and 2; node 1 has 2 gone (a departed neighbour
    /// 0 never had a link to), so the frame goes back to 0 and round through 6, 5 and 4.
    /// Dropped at 1 (the first version of the rule that a frame never goes back), every
    /// such message was lost.
    #[tokio::test]
    async fn a_relay_that_knows_more_to_avoid_sends_a_frame_back() {
        let cluster = ring(7).await;
        let comms = cluster.communicators();
        cluster.nodes[1].shared.mark_gone(NodeId(2));
        let first = cluster.nodes[0].shared.next_hop(NodeId(3), &[], &[]);
        assert_eq!(first, Some(NodeId(1)), "ring of 7: 0 reaches 3 through 1");
        comms[0]
            .send(b"back and round", 3, 7)
            .await
            .expect("sent to the relay");
        received(&comms[3], b"back and round").await;
        cluster.shutdown().await;
    }

    /// A relayed message whose next hop's connection fails before this node took that hop
    /// for lost goes another way round (it used to be dropped: the send failed, or, at a
    /// relay, was only logged, and the receive, with every later one under its tag, timed
    /// out).
    #[tokio::test]
    async fn a_relayed_message_goes_another_way_when_its_next_hop_fails() {
        let cluster = ring(5).await;
        let comms = cluster.communicators();
        let shared = cluster.nodes[0].shared.clone();
        let dest = NodeId(2);
        let hop = shared.next_hop(dest, &[], &[]).expect("a route");
        assert!(hop == NodeId(1), "ring: 0 reaches 2 through 1, not {hop}");
        // The hop's connections fail; nothing has told this node yet (no await between).
        let links = shared.links.get(&hop).map(|l| l.clone()).expect("linked");
        links.control.close("test: hop fails");
        links.bulk.close("test: hop fails");
        let sent = super::send_to(
            &shared,
            dest,
            FrameKind::Data,
            comms[0].core.id,
            7,
            0,
            Payload::from_bytes(Bytes::from_static(b"around the other way")),
        )
        .await;
        assert!(sent.is_ok(), "{sent:?}");
        received(&comms[2], b"around the other way").await;
        cluster.shutdown().await;
    }

    /// Routes around the ranks a relayed frame's routers name are computed once per set
    /// named, not per frame (a full search over the topology each time, which on a large
    /// hypercube costs milliseconds), the cache keeps only a few sets, and sets named
    /// beyond this node's own losses cost at most `NAMED_SEARCHES` searches per period:
    /// past it a frame goes around this node's own losses only, until the period ends.
    #[tokio::test]
    async fn routes_around_named_ranks_are_kept_per_set_and_searched_for_within_a_budget() {
        use std::collections::BTreeSet;
        use std::time::Instant;
        let cluster = ring(6).await;
        let shared = cluster.nodes[0].shared.clone();
        let routes = || {
            shared
                .routes
                .lock()
                .map(|r| r.by_set.len())
                .unwrap_or(usize::MAX)
        };
        let now = Instant::now();
        assert_eq!(
            shared.next_hop_at(NodeId(2), &[], &[], now),
            Some(NodeId(1))
        );
        let before = routes();
        for _ in 0..100 {
            // Around rank 1, which only the frame's routers know to be lost.
            assert_eq!(
                shared.next_hop_at(NodeId(2), &[1], &[], now),
                Some(NodeId(5))
            );
        }
        assert_eq!(routes(), before + 1, "one set named, one more entry");
        // Ranks past the world and past `MAX_AVOID` entries change nothing.
        let mut long = vec![7u64; super::MAX_AVOID];
        long.push(1);
        assert_eq!(
            shared.next_hop_at(NodeId(2), &long, &[], now),
            Some(NodeId(1))
        );
        // 36 distinct sets of two ranks (ranks past the world are left out): the budget
        // runs out within them.
        for a in 0..36u64 {
            shared.next_hop_at(NodeId(3), &[a % 6, a / 6, 100 + a], &[], now);
        }
        assert!(routes() <= super::ROUTE_SETS, "{} sets kept", routes());
        let searched = |r: &super::Routes| r.named_searches;
        assert_eq!(
            shared.routes.lock().map(|r| searched(&r)).ok(),
            Some(super::NAMED_SEARCHES)
        );
        // A set not kept (rank 1's, put out of the cache here), named now, is not
        // searched for: the frame goes around this node's own losses (none), through 1.
        if let Ok(mut r) = shared.routes.lock() {
            r.by_set.retain(|(set, _), _| *set != BTreeSet::from([1]));
        }
        assert_eq!(
            shared.next_hop_at(NodeId(2), &[1], &[], now),
            Some(NodeId(1))
        );
        // A hop this node saw fail itself counts as its own loss: routed around, budget
        // or not (the fallback went straight back into it).
        assert_eq!(
            shared.next_hop_at(NodeId(2), &[1], &[1], now),
            Some(NodeId(5))
        );
        if let Ok(mut r) = shared.routes.lock() {
            r.by_set.retain(|(set, _), _| *set != BTreeSet::from([1]));
        }
        // A period later a named set is searched for again.
        let later = now + super::NAMED_SEARCH_PERIOD;
        assert_eq!(
            shared.next_hop_at(NodeId(2), &[1], &[], later),
            Some(NodeId(5))
        );
        cluster.shutdown().await;
    }

    /// A relayed RPC request over `MAX_RPC_REQUEST` (which `rpc` itself never sends, and
    /// the transport refuses on a direct connection) is answered with an error and its
    /// handler is not called; it used to be joined and served whatever its size.
    #[tokio::test]
    async fn a_relayed_rpc_request_over_the_limit_is_refused() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::time::Duration;
        let cluster = ring(5).await;
        let comms = cluster.communicators();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        comms[2].register_rpc(9, move |_caller, req: Bytes| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move { Ok(req.len().to_be_bytes().to_vec()) }
        });
        let shared = cluster.nodes[0].shared.clone();
        let dest = NodeId(2);
        assert!(
            shared.links.get(&dest).is_none(),
            "2 is reached through a relay"
        );
        let request = shared
            .next_request
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let big = Bytes::from(vec![1u8; crate::rpc::MAX_RPC_REQUEST + 1]);
        let sent = super::send_to(
            &shared,
            dest,
            FrameKind::Control,
            comms[0].core.id,
            request,
            9,
            Payload::from_bytes(big),
        )
        .await;
        assert!(sent.is_ok(), "{sent:?}");
        let key = nexar_transport::MailboxKey {
            comm: crate::rpc::RPC_REPLY_CHANNEL,
            tag: request,
            step: 0,
            src: dest,
        };
        let reply = shared
            .table
            .take(key, Duration::from_secs(60))
            .await
            .expect("a reply")
            .to_bytes();
        assert_eq!(
            reply.first(),
            Some(&(crate::rpc::Status::HandlerError as u8))
        );
        let msg = String::from_utf8_lossy(&reply[1..]);
        assert!(msg.contains("exceeds"), "{msg}");
        assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler was called");
        // A request within the limit, the same way, is served.
        let small = comms[0]
            .rpc_with_timeout(2, 9, b"small", Duration::from_secs(60))
            .await
            .expect("served");
        assert_eq!(small.as_ref(), 5usize.to_be_bytes());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        cluster.shutdown().await;
    }

    /// A relay frame's envelope comes back whatever the chunks it arrived in, and its
    /// payload as slices of those chunks, signed over the same bytes.
    #[test]
    fn a_relay_frame_unpacks_from_any_chunks_without_copying_its_payload() {
        let env = Envelope {
            origin: 3,
            dest: 5,
            hops: 2,
            kind: FrameKind::Data,
            comm: 1,
            tag: 9,
            step: 4,
            seq: 11,
            cert: vec![7; 300],
            sig: vec![8; 64],
            avoid: vec![1],
        };
        let payload = vec![Bytes::from(vec![1u8; 1000]), Bytes::from(vec![2u8; 500])];
        let frame = pack(&env, &payload).expect("packs");
        // As packed: the envelope's buffer, then the payload's chunks as they were.
        assert_eq!(frame.chunks().len(), 3);
        let (got, body) = unpack(&frame).expect("unpacks");
        assert_eq!(got.hops, 2);
        assert!(body[0].as_ptr() == payload[0].as_ptr() && body[1].as_ptr() == payload[1].as_ptr());
        let joined = frame.to_bytes();
        // Cut anywhere: inside the length, inside the envelope, at its end, in the payload.
        for cut in [1, 3, 4, 100, joined.len() - 1500, joined.len() - 700] {
            // With an empty chunk too, as a stream's reads may give.
            let chunks = vec![joined.slice(..cut), Bytes::new(), joined.slice(cut..)];
            let (got, body) = unpack(&Payload::from_parts(chunks)).expect("unpacks");
            assert_eq!((got.origin, got.dest, got.hops, got.step), (3, 5, 2, 4));
            assert_eq!(got.cert, env.cert);
            let body_bytes: Vec<u8> = body.iter().flat_map(|c| c.iter().copied()).collect();
            assert_eq!(body_bytes.len(), 1500);
            assert!(body_bytes[..1000].iter().all(|b| *b == 1));
            assert!(body_bytes[1000..].iter().all(|b| *b == 2));
            assert_eq!(signed_message(&got, &body), signed_message(&env, &payload));
            // Slices of the arrived buffer, not copies.
            let end = joined.as_ptr() as usize + joined.len();
            assert!(body.iter().all(|c| {
                let p = c.as_ptr() as usize;
                p >= joined.as_ptr() as usize && p + c.len() <= end
            }));
        }
        // Shorter than its envelope says, or an envelope over the limit: refused.
        assert!(unpack(&Payload::from_parts(vec![joined.slice(..50)])).is_none());
        let mut huge = (super::MAX_ENVELOPE as u32 + 1).to_be_bytes().to_vec();
        huge.extend_from_slice(&[0; 64]);
        assert!(unpack(&Payload::from_parts(vec![Bytes::from(huge)])).is_none());
    }

    /// Each number is taken once, in any order: within the window by its bits, below it
    /// as a hole it left untaken (a frame overtaken by a window's worth of later ones, as
    /// a large frame behind many small ones is); a number taken before never comes back,
    /// and a jump past the window keeps the numbers it skipped as one run of holes.
    #[test]
    fn each_relayed_frame_is_taken_once_even_out_of_order() {
        let mut w = ReplayWindow::default();
        assert!(w.first(0));
        assert!(!w.first(0), "a replay of the first frame");
        assert!(w.first(7));
        assert!(w.first(3), "overtaken by a later one");
        assert!(!w.first(3) && !w.first(7));
        assert!(w.first(1) && w.first(2) && !w.first(1));
        // A window's worth later: 0 to 7 leave the window; 4, 5 and 6, never taken, are
        // holes, taken once when their frames come; the others are refused.
        let top = 7 + REPLAY_WINDOW;
        assert!(w.first(top));
        assert!(!w.first(7) && !w.first(0), "taken before the window moved");
        assert!(w.first(5) && !w.first(5), "overtaken by a window's worth");
        assert!(w.first(8) && !w.first(8), "overtaken, within the window");
        assert!(w.first(top - 1) && !w.first(top));
        // The bits of numbers that enter the window are cleared, also where they wrap.
        for n in top + 1..top + REPLAY_WINDOW {
            assert!(w.first(n), "{n} is new");
        }
        assert!(!w.first(top + 5));
        // 9 to 7 + REPLAY_WINDOW - 2 left the window untaken: holes, once each.
        assert!(w.first(4) && w.first(6) && w.first(9) && w.first(top - 2));
        assert!(!w.first(4) && !w.first(9) && !w.first(top - 1));
        // A jump of many windows: the skipped numbers are holes, the old bits gone.
        let far = top + 10 * REPLAY_WINDOW;
        assert!(w.first(far) && !w.first(far) && !w.first(top + 5));
        assert!(w.first(far - 1) && w.first(far - REPLAY_WINDOW + 1));
        assert!(w.first(far - REPLAY_WINDOW) && !w.first(far - REPLAY_WINDOW));
        assert!(w.first(top + REPLAY_WINDOW + 3), "skipped by the jump");
    }

    /// The holes are kept as runs, at most `HOLE_RUNS` of them, the lowest forgotten
    /// first: every other number skipped makes a run each.
    #[test]
    fn a_windows_holes_are_bounded() {
        let mut w = ReplayWindow::default();
        let runs = super::HOLE_RUNS as u64 + 10;
        for i in 0..runs + REPLAY_WINDOW {
            w.first(2 * i + 1);
        }
        assert_eq!(w.holes.len(), super::HOLE_RUNS);
        assert!(!w.first(0), "the lowest hole was forgotten");
        let top = 2 * (runs + REPLAY_WINDOW - 1) + 1;
        assert!(w.first(top - REPLAY_WINDOW - 1), "the highest hole is kept");
        assert!(!w.first(top - REPLAY_WINDOW), "taken, not a hole");
    }

    /// Frames taken from the middle of a run of holes split it, and the runs stay within
    /// `HOLE_RUNS` (an origin could otherwise add a run with every other number of one
    /// long jump, for good); the highest are kept.
    #[test]
    fn holes_taken_one_by_one_keep_the_runs_bounded() {
        let mut w = ReplayWindow::default();
        let far = 10 * REPLAY_WINDOW + 4 * super::HOLE_RUNS as u64;
        assert!(w.first(far));
        assert_eq!(w.holes.len(), 1, "one run below the window");
        let taken = 2 * super::HOLE_RUNS as u64;
        for i in 0..taken {
            assert!(w.first(2 * i + 1), "{} is a hole", 2 * i + 1);
        }
        assert_eq!(w.holes.len(), super::HOLE_RUNS);
        assert!(!w.first(0), "the lowest run was forgotten");
        assert!(w.first(2 * taken + 1), "the highest run is kept");
    }

    /// The last sequence number is refused without disturbing the window: its
    /// arithmetic would overflow (a panic with overflow checks, a window stuck at the top
    /// without them).
    #[test]
    fn the_last_sequence_number_is_refused() {
        let mut w = ReplayWindow::default();
        assert!(w.first(5));
        assert!(!w.first(u64::MAX));
        assert!(w.first(6) && w.first(4) && !w.first(5));
        assert!(w.first(u64::MAX - 1) && !w.first(u64::MAX - 1));
        assert!(!w.first(u64::MAX));
    }

    /// A relay frame that reaches its destination twice (a relay forwards it again, or a
    /// reroute sends a copy) is taken once: the copy of a data frame whose original was
    /// received is dropped, not kept in a mailbox nobody will take; a replayed request is
    /// not served again.
    #[tokio::test]
    async fn a_relay_frame_that_arrives_twice_is_taken_once() {
        use nexar_transport::{FrameHeader, MailboxKey, RelayFrame};
        use std::time::Duration;
        let cluster = ring(5).await;
        let comms = cluster.communicators();
        let (origin, dest) = (
            cluster.nodes[0].shared.clone(),
            cluster.nodes[2].shared.clone(),
        );
        let relayed = |kind, (comm, tag, step): (u64, u64, u64), body: &'static [u8]| {
            let payload = vec![Bytes::from_static(body)];
            let mut env =
                super::seal(&origin, NodeId(2), kind, (comm, tag, step), &payload).expect("sealed");
            env.hops = 1;
            let frame = pack(&env, &payload).expect("packed");
            let header = FrameHeader::new(FrameKind::Relay, 0, 0, 1, 1, frame.len() as u64);
            move || RelayFrame {
                from: NodeId(1),
                header,
                payload: Payload::from_parts(frame.chunks().to_vec()),
            }
        };
        let comm = comms[0].core.id;
        let frame = relayed(FrameKind::Data, (comm, 7, 0), b"once");
        super::handle(&dest, frame()).await;
        received(&comms[2], b"once").await;
        // The same frame again, after its original was taken.
        super::handle(&dest, frame()).await;
        let key = MailboxKey {
            comm,
            tag: 7,
            step: 0,
            src: NodeId(0),
        };
        let again = dest.table.take(key, Duration::from_millis(200)).await;
        assert!(again.is_err(), "the copy was kept: {again:?}");
        // A later frame of the same origin still comes through.
        super::handle(&dest, relayed(FrameKind::Data, (comm, 7, 1), b"next")()).await;
        received(&comms[2], b"next").await;
        cluster.shutdown().await;
    }
}
