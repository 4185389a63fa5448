//! Sparse topologies: fewer connections per rank, relays for the rest, every collective
//! still correct, forged relayed frames refused, dead relays routed around.

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use nexar_actors::{Cluster, NexarError, NodeConfig, Topology};
use nexar_tests::{check_all, on_all_ranks, within};
use nexar_transport::FrameKind;
use sha2::Digest;

const DEADLINE: Duration = Duration::from_secs(240);

fn config(topology: Topology) -> NodeConfig {
    let mut c = NodeConfig::default();
    c.topology = topology;
    c
}

async fn every_collective(topology: Topology, world: usize) {
    let cluster = Cluster::local_with(world, config(topology))
        .await
        .expect("cluster");
    let links = cluster.links_per_rank();
    for (rank, n) in links.iter().enumerate() {
        assert_eq!(
            *n,
            topology.neighbors(rank, world).len(),
            "{topology:?} world {world} rank {rank}"
        );
    }
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        for (count, block) in [(0, 0), (1, 1), (1001, 7), (70_000, 5000)] {
            check_all::<f32>(&comm, count, block).await?;
            check_all::<i32>(&comm, count, block).await?;
        }
        // Point-to-point to the farthest rank (a relay path on sparse topologies) and RPC.
        let world = comm.world_size();
        let far = (comm.rank() + world / 2) % world;
        let from = (comm.rank() + world - world / 2) % world;
        let msg = vec![comm.rank() as u32; 3000];
        let mut got = vec![0u32; 3000];
        let (s, r) = tokio::join!(comm.send(&msg, far, 4), comm.recv(&mut got, from, 4));
        s.map_err(|e| e.to_string())?;
        r.map_err(|e| e.to_string())?;
        if got != vec![from as u32; 3000] {
            return Err(format!("p2p from {from} corrupted"));
        }
        let reply = comm.rpc(far, 1, b"ping").await.map_err(|e| e.to_string())?;
        if reply.as_ref() != [far as u8] {
            return Err(format!("rpc to {far} answered by {reply:?}"));
        }
        Ok::<_, String>(())
    });
    for comm in cluster.communicators() {
        let me = comm.rank() as u8;
        comm.register_rpc(1, move |_, _| async move { Ok(vec![me]) });
    }
    let res = res.await;
    nexar_tests::all_ok(&format!("{topology:?} world {world}"), res);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_on_k_regular_worlds_5_8_16() {
    for world in [5, 8, 16] {
        every_collective(Topology::KRegular { k: 3 }, world).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_on_hypercube_worlds_5_8_16() {
    for world in [5, 8, 16] {
        every_collective(Topology::Hypercube, world).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_per_rank_follow_the_topology() {
    let full = Cluster::local(8).await.expect("cluster");
    assert_eq!(full.links_per_rank(), vec![7; 8]);
    let ring = Cluster::local_with(16, config(Topology::KRegular { k: 2 }))
        .await
        .expect("cluster");
    assert_eq!(ring.links_per_rank(), vec![2; 16]);
    let cube = Cluster::local_with(16, config(Topology::Hypercube))
        .await
        .expect("cluster");
    assert_eq!(cube.links_per_rank(), vec![4; 16]);
}

/// Relayed messages well past both the relay and the early-arrival budgets all arrive,
/// also when the receiver first asks for one sent after them: relay frames wait for relay
/// budget only while they are passed on, never for their receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_messages_past_the_budgets_arrive_when_asked_for_out_of_order() {
    const MESSAGES: u32 = 12;
    const LEN: usize = 64 << 10; // u32s: 256 KiB a message, 3 MiB in all
    let mut c = config(Topology::Hypercube);
    c.transport.early_budget_bytes = 1 << 20;
    c.transport.relay_budget_bytes = 1 << 20;
    assert!(!Topology::Hypercube.neighbors(0, 4).contains(&3));
    let cluster = Cluster::local_with(4, c).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let e = |e: NexarError| e.to_string();
        match comm.rank() {
            0 => {
                for i in 0..MESSAGES {
                    comm.send(&vec![i; LEN], 3, 9).await.map_err(e)?;
                }
                comm.send(&[MESSAGES], 3, 10).await.map_err(e)?;
            }
            3 => {
                let mut last = [0u32];
                comm.recv(&mut last, 0, 10).await.map_err(e)?;
                if last != [MESSAGES] {
                    return Err(format!("the last message is {last:?}"));
                }
                for i in 0..MESSAGES {
                    let mut got = vec![u32::MAX; LEN];
                    comm.recv(&mut got, 0, 9).await.map_err(e)?;
                    if got.iter().any(|v| *v != i) {
                        return Err(format!("message {i} corrupted"));
                    }
                }
            }
            _ => {}
        }
        Ok::<_, String>(())
    });
    nexar_tests::all_ok("relayed past the budgets", res.await);
    cluster.shutdown().await;
}

/// On a sparse topology a message must leave room for a relay's envelope under
/// `max_frame_bytes`: one that does not is refused before it takes its place in the
/// pair's sequence (it used to take it and then fail, when the envelope was added, and
/// the receiver waited for it), and the next message arrives as the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_with_no_room_for_a_relay_envelope_takes_no_place_in_the_sequence() {
    let mut c = config(Topology::Hypercube);
    c.transport.max_frame_bytes = 1 << 20;
    c.collectives.max_message_bytes = 1 << 19;
    c.op_timeout = Duration::from_secs(10);
    assert!(!Topology::Hypercube.neighbors(0, 4).contains(&3));
    let cluster = Cluster::local_with(4, c).await.expect("cluster");
    let comms = cluster.communicators();
    let sent = within(
        "the send with no room for an envelope",
        comms[0].send(&vec![1u8; (1 << 20) - 100], 3, 5),
    )
    .await;
    assert!(
        matches!(
            sent,
            Err(NexarError::Transport(
                nexar_transport::TransportError::FrameTooLarge { .. }
            ))
        ),
        "{sent:?}"
    );
    within("the next send", comms[0].send(&[4u8, 5, 6], 3, 5))
        .await
        .expect("next send");
    let mut next = [0u8; 3];
    within("the next message", comms[3].recv(&mut next, 0, 5))
        .await
        .expect("the next message");
    assert_eq!(next, [4, 5, 6]);
    cluster.shutdown().await;
}

/// Two relays that forward large messages to each other at once (on an 8-rank hypercube,
/// 0 -> 7 goes through 1 then 3, and 7 -> 0 through 3 then 1), each message larger than
/// the relay budget and than a QUIC stream's window: each relay holds its budget while it
/// forwards and the other must read for the forward to finish. With one budget for all
/// hop counts both waited for good; with one per hop count both messages arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_forwarding_to_each_other_do_not_deadlock() {
    const LEN: usize = 6 << 20; // u32s: 24 MiB, over the 16 MiB stream window
    let mut c = config(Topology::Hypercube);
    c.transport.relay_budget_bytes = 1 << 20;
    let cluster = Cluster::local_with(8, c).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        let me = comm.rank();
        if me != 0 && me != 7 {
            return Ok(());
        }
        let other = 7 - me;
        let msg = vec![me as u32; LEN];
        let mut got = vec![u32::MAX; LEN];
        let (s, r) = within(
            &format!("rank {me}: the exchange with rank {other}"),
            async { tokio::join!(comm.send(&msg, other, 3), comm.recv(&mut got, other, 3)) },
        )
        .await;
        s.map_err(|e| format!("send: {e}"))?;
        r.map_err(|e| format!("recv: {e}"))?;
        if got.iter().any(|v| *v != other as u32) {
            return Err(format!("the message from {other} is corrupted"));
        }
        Ok::<_, String>(())
    });
    nexar_tests::all_ok("relays forwarding to each other", res.await);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_relay_is_routed_around() {
    // Default heartbeats: `kill_rank` closes the rank's connections, so its neighbours see
    // the loss at once; a short heartbeat timeout could declare a healthy rank lost too.
    let cluster = Cluster::local_with(6, config(Topology::KRegular { k: 2 }))
        .await
        .expect("cluster");
    let comms = cluster.communicators();
    // 0 -> 2 goes through 1 on the ring; kill 1 and wait until 0 and 2 have noticed.
    let mut watches = [(0, comms[0].failures()), (2, comms[2].failures())];
    cluster.kill_rank(1).expect("kill");
    for (rank, w) in &mut watches {
        within(&format!("rank {rank} noticing the loss of rank 1"), async {
            while !w.changed().await.expect("failure watch").contains(&1) {}
        })
        .await;
    }
    // Now 0 -> 2 goes the long way round: 0 -> 5 -> 4 -> 3 -> 2.
    let mut got = [0u32; 4];
    let (s, r) = within("the message around the dead relay", async {
        tokio::join!(
            comms[0].send(&[1u32, 2, 3, 4], 2, 8),
            comms[2].recv(&mut got, 0, 8)
        )
    })
    .await;
    s.expect("send around the dead relay");
    r.expect("recv around the dead relay");
    assert_eq!(got, [1, 2, 3, 4]);
}

/// A 6-rank ring lattice (receives time out after 2 s) and a raw client speaking as node
/// 1 to rank 0 with node 1's own identity.
async fn ring_with_node_1_impostor() -> (
    Cluster,
    nexar_transport::Endpoint,
    nexar_transport::Connection,
    nexar_transport::NodeIdentity,
) {
    let mut c = config(Topology::KRegular { k: 2 });
    c.op_timeout = Duration::from_secs(2);
    let cluster = Cluster::local_with(6, c).await.expect("cluster");
    let (ep, conn, identity) = nexar_tests::impostor(&cluster, 1, 0).await;
    (cluster, ep, conn, identity)
}

/// A relay frame for node 0 as the runtime encodes it (postcard envelope, then the
/// payload): from `origin`, p2p `tag`, message step 0, `hops` relays passed, with
/// `identity`'s certificate and its signature over the message the runtime checks.
fn relay_frame(
    identity: &nexar_transport::NodeIdentity,
    origin: u64,
    tag: u64,
    hops: u32,
    payload: &[u8],
) -> bytes::Bytes {
    #[derive(serde::Serialize)]
    struct Envelope {
        origin: u64,
        dest: u64,
        hops: u32,
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        seq: u64,
        cert: Vec<u8>,
        sig: Vec<u8>,
        avoid: Vec<u64>,
    }
    let signer = nexar_transport::Signer::new(identity).expect("signer");
    // Numbered by tag: each frame of a test has a tag of its own.
    let seq = tag;
    let mut msg = b"nexar-relay/2".to_vec();
    for w in [origin, 0, 0, tag, 0, seq] {
        msg.extend_from_slice(&w.to_be_bytes());
    }
    msg.push(0);
    msg.extend_from_slice(&sha2::Sha256::digest(payload));
    let env = Envelope {
        origin,
        dest: 0,
        hops,
        kind: FrameKind::Data,
        comm: 0,
        tag,
        step: 0,
        seq,
        cert: identity.cert_der().to_vec(),
        sig: signer.sign(&msg).expect("sign"),
        avoid: Vec::new(),
    };
    let env = postcard::to_stdvec(&env).expect("encode");
    let mut frame = BytesMut::new();
    frame.put_u32(env.len() as u32);
    frame.put_slice(&env);
    frame.put_slice(payload);
    frame.freeze()
}

/// A node that holds a genuine cluster certificate (node 1) sends a relay frame claiming to
/// come from node 3: the destination must drop it, so a receive for node 3's message
/// times out instead of returning forged bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cannot_forge_the_origin() {
    let (cluster, ep, conn, identity) = ring_with_node_1_impostor().await;
    // Node 1 signs exactly the message the runtime would check, but claims origin 3. The
    // header's step carries the hop count, as it must (see the next test).
    let frame = relay_frame(&identity, 3, 5, 1, &[9u8; 4]);
    within(
        "the forged relay frame",
        conn.send(FrameKind::Relay, 0, 0, 1, frame),
    )
    .await
    .expect("send relay frame");
    let mut buf = [0u8; 4];
    let comm0 = cluster.communicators()[0].clone();
    let got = within(
        "a receive of the forged message",
        comm0.recv(&mut buf, 3, 5),
    )
    .await;
    assert!(matches!(got, Err(NexarError::Timeout { .. })), "{got:?}");
    ep.close();
}

/// A relayed frame signed with a certificate the CA issued for its origin, but not the
/// one the membership names for it (an earlier holder's, say), is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_frame_signed_with_a_second_certificate_for_its_origin_is_dropped() {
    let (cluster, ep, conn, _identity) = ring_with_node_1_impostor().await;
    let again = cluster
        .ca()
        .issue(nexar_transport::NodeId(3))
        .expect("identity");
    let frame = relay_frame(&again, 3, 8, 1, &[8u8; 4]);
    within(
        "the relay frame with a second certificate",
        conn.send(FrameKind::Relay, 0, 0, 1, frame),
    )
    .await
    .expect("send relay frame");
    let comm0 = cluster.communicators()[0].clone();
    let mut buf = [0u8; 4];
    let got = within("a receive of the message", comm0.recv(&mut buf, 3, 8)).await;
    assert!(matches!(got, Err(NexarError::Timeout { .. })), "{got:?}");
    ep.close();
}

/// A relay frame takes relay budget by the hop count its header's step carries, so one
/// whose header disagrees with its envelope is dropped; the same frame with the
/// right step is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_frame_whose_header_misstates_its_hop_count_is_dropped() {
    let (cluster, ep, conn, identity) = ring_with_node_1_impostor().await;
    let comm0 = cluster.communicators()[0].clone();
    let mut buf = [0u8; 4];
    let misstated = relay_frame(&identity, 1, 6, 1, &[6u8; 4]);
    within(
        "the frame whose header misstates its hops",
        conn.send(FrameKind::Relay, 0, 0, 0, misstated),
    )
    .await
    .expect("send relay frame");
    let got = within(
        "a receive of the misstated frame",
        comm0.recv(&mut buf, 1, 6),
    )
    .await;
    assert!(matches!(got, Err(NexarError::Timeout { .. })), "{got:?}");
    let well_formed = relay_frame(&identity, 1, 7, 1, &[7u8; 4]);
    within(
        "the well-formed frame",
        conn.send(FrameKind::Relay, 0, 0, 1, well_formed),
    )
    .await
    .expect("send relay frame");
    within(
        "a receive of the well-formed frame",
        comm0.recv(&mut buf, 1, 7),
    )
    .await
    .expect("the well-formed frame");
    assert_eq!(buf, [7u8; 4]);
    ep.close();
}

/// `KRegular` with fewer than two links per rank is refused at start: with one, an odd
/// world has no links at all and an even one splits into pairs, so every message past a
/// pair would fail as if its peer were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_k_regular_topology_of_fewer_than_two_links_is_refused() {
    for k in [0, 1] {
        let refused = within(
            "a cluster refused",
            Cluster::local_with(5, config(Topology::KRegular { k })),
        )
        .await;
        assert!(
            matches!(refused, Err(NexarError::InvalidArgument(ref m)) if m.contains("k >= 2")),
            "k = {k}: {refused:?}"
        );
    }
}
