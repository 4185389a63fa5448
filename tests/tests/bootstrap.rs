//! Seed/worker bootstrap in one process over loopback: formation, and every refusal.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use nexar_actors::{BootstrapError, NexarError, Node, Secret, Seed, SeedOptions};
use nexar_device::ReduceOp;
use nexar_transport::{ClusterCa, Endpoint, NodeId, TransportConfig};

use nexar_tests::closed_by_pin_check;
use nexar_tests::seeded::{
    finish_all, join_all, join_all_where, join_opts as opts, DEADLINE, LOOPBACK,
};

async fn exercise(nodes: &[Node]) {
    let comms: Vec<_> = nodes.iter().map(|n| n.communicator()).collect();
    let world = comms.len();
    let tasks: Vec<_> = comms
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                let mut v = vec![c.rank() as u64 + 1; 4096];
                c.all_reduce(&mut v, ReduceOp::Sum).await?;
                c.barrier().await?;
                Ok::<_, NexarError>(v[0])
            })
        })
        .collect();
    for t in tasks {
        let got = tokio::time::timeout(DEADLINE, t)
            .await
            .expect("deadline")
            .expect("task")
            .expect("collective");
        assert_eq!(got as usize, world * (world + 1) / 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_and_four_workers_form_a_mesh_and_report_done() {
    let seed = Seed::start(LOOPBACK, 4, SeedOptions::default())
        .await
        .expect("seed");
    let nodes = join_all(&seed, 4).await;
    assert_eq!(
        nodes.iter().map(|n| n.rank()).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    let formed = tokio::time::timeout(DEADLINE, seed.wait_formed())
        .await
        .expect("the seed did not see the cluster form within the deadline")
        .expect("formed");
    assert_eq!(formed.len(), 4);
    for n in &nodes {
        assert_eq!(
            n.mesh_addrs(),
            formed.as_slice(),
            "every node got the seed's peer list"
        );
        assert_eq!(
            n.mesh_addrs()[n.rank()].port(),
            n.local_addr().expect("addr").port()
        );
    }
    exercise(&nodes).await;
    tokio::time::timeout(DEADLINE, finish_all(nodes))
        .await
        .expect("the nodes did not finish within the deadline");
    let report = tokio::time::timeout(DEADLINE, seed.wait_finished())
        .await
        .expect("deadline")
        .expect("report");
    assert_eq!(report.ok, vec![0, 1, 2, 3]);
    assert!(report.failed.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused() {
    let seed = Seed::start(LOOPBACK, 1, SeedOptions::default())
        .await
        .expect("seed");
    let mut o = opts(&seed);
    o.join.secret = Secret::random();
    let joined = tokio::time::timeout(DEADLINE, Node::join(o))
        .await
        .expect("the join with a wrong secret did not end within the deadline");
    match joined {
        Err(NexarError::Bootstrap(BootstrapError::Refused(reason))) => {
            assert!(reason.contains("secret"), "{reason}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_fingerprint_makes_the_worker_refuse_the_seed() {
    let seed = Seed::start(LOOPBACK, 1, SeedOptions::default())
        .await
        .expect("seed");
    let mut o = opts(&seed);
    o.join.fingerprint[0] ^= 1;
    let joined = tokio::time::timeout(DEADLINE, Node::join(o))
        .await
        .expect("the join with a wrong fingerprint did not end within the deadline");
    match joined {
        Err(NexarError::Bootstrap(BootstrapError::FingerprintMismatch(_))) => {}
        other => panic!("expected a fingerprint mismatch, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_seed_is_reported_within_the_deadline() {
    // A seed address that never answers: a UDP socket that stays bound (so nobody else can
    // take its port) for the whole test and is never read.
    let silent = UdpSocket::bind(LOOPBACK).expect("a silent socket");
    let seed = Seed::start(LOOPBACK, 1, SeedOptions::default())
        .await
        .expect("seed");
    let mut o = opts(&seed);
    o.join.seed = silent.local_addr().expect("addr");
    o.timeout = Duration::from_secs(2);
    let joined = tokio::time::timeout(DEADLINE, Node::join(o))
        .await
        .expect("the join of a silent seed did not end within the deadline");
    // At the join's own deadline (2 s), not at QUIC's idle timeout (10 s), which would
    // also end the join with `SeedUnreachable`, another reason.
    assert!(
        matches!(
            &joined,
            Err(NexarError::Bootstrap(BootstrapError::SeedUnreachable { reason, .. }))
                if reason.contains("no admission within 2s")
        ),
        "{:?}",
        joined.err()
    );
    drop(silent);
}

/// The cluster CA can hold more than one certificate for a rank (a worker that left before
/// formation keeps its own when its rank goes to another worker): the members take, for
/// each rank, only the certificate the seed gave the rank's worker. A connection with
/// another one, even from the same CA, is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_the_seed_did_not_give_a_rank_is_refused() {
    let ca = std::sync::Arc::new(ClusterCa::generate().expect("ca"));
    let mut so = SeedOptions::default();
    so.ca = Some(ca.clone());
    let seed = Seed::start(LOOPBACK, 2, so).await.expect("seed");
    let nodes = join_all(&seed, 2).await;
    let again = ca
        .issue(NodeId(0))
        .expect("a second certificate for rank 0");
    let ep = Endpoint::bind(LOOPBACK, &again, TransportConfig::default()).expect("bind");
    let conn = tokio::time::timeout(DEADLINE, ep.connect(nodes[1].mesh_addrs()[1], NodeId(1)))
        .await
        .expect("the handshake with rank 1 did not end within the deadline")
        .expect("the handshake passes: the CA signed it");
    let closed = tokio::time::timeout(Duration::from_secs(20), conn.quic().closed())
        .await
        .expect("rank 1 closes a connection with a certificate it was not given for rank 0");
    // Rank 1 closed a connection that this side never used: left open, it would outlive
    // the wait.
    assert!(
        closed_by_pin_check(&closed),
        "want rank 1's pin check to close the connection, got: {closed}"
    );
    ep.close();
    exercise(&nodes).await;
}

/// A worker holds one of the seed's handshake slots only until it has proved it knows
/// the secret, not for the rest of its job: with room for one handshake at a time, three
/// workers still join one after another (the first two waiting for formation meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_gives_its_handshake_slot_back_once_admitted() {
    let mut so = SeedOptions::default();
    so.max_handshakes = 1;
    let seed = Seed::start(LOOPBACK, 3, so).await.expect("seed");
    let a = tokio::spawn(Node::join(opts(&seed)));
    tokio::time::timeout(DEADLINE, seed.wait_admitted(0))
        .await
        .expect("deadline")
        .expect("rank 0 admitted");
    let b = tokio::spawn(Node::join(opts(&seed)));
    tokio::time::timeout(DEADLINE, seed.wait_admitted(1))
        .await
        .expect("deadline")
        .expect("rank 1 admitted while rank 0 waits for formation");
    let c = tokio::time::timeout(DEADLINE, Node::join(opts(&seed)))
        .await
        .expect("the third worker did not join within the deadline")
        .expect("third worker");
    let a = tokio::time::timeout(DEADLINE, a)
        .await
        .expect("the first worker did not join within the deadline")
        .expect("task")
        .expect("first worker");
    let b = tokio::time::timeout(DEADLINE, b)
        .await
        .expect("the second worker did not join within the deadline")
        .expect("task")
        .expect("second worker");
    exercise(&[a, b, c]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cannot_take_another_nodes_rank() {
    let seed = Seed::start(LOOPBACK, 2, SeedOptions::default())
        .await
        .expect("seed");
    let mut first = opts(&seed);
    first.rank = Some(1);
    let a = tokio::spawn(Node::join(first));
    tokio::time::timeout(DEADLINE, seed.wait_admitted(1))
        .await
        .expect("deadline")
        .expect("rank 1 admitted");
    let mut thief = opts(&seed);
    thief.rank = Some(1);
    let stolen = tokio::time::timeout(DEADLINE, Node::join(thief))
        .await
        .expect("the join asking for a taken rank did not end within the deadline");
    match stolen {
        Err(NexarError::Bootstrap(BootstrapError::Refused(reason))) => {
            assert!(reason.contains("already taken"), "{reason}")
        }
        other => panic!("rank theft was not refused: {other:?}"),
    }
    let mut bad = opts(&seed);
    bad.rank = Some(7);
    let outside = tokio::time::timeout(DEADLINE, Node::join(bad))
        .await
        .expect("the join asking for rank 7 of 2 did not end within the deadline");
    assert!(
        matches!(
            outside,
            Err(NexarError::Bootstrap(BootstrapError::Refused(_)))
        ),
        "{:?}",
        outside.err()
    );
    // The rightful rank 1 and an unranked worker (given rank 0) form the cluster.
    let b = tokio::time::timeout(DEADLINE, Node::join(opts(&seed)))
        .await
        .expect("the second worker did not join within the deadline")
        .expect("second worker");
    let a = tokio::time::timeout(DEADLINE, a)
        .await
        .expect("the first worker did not join within the deadline")
        .expect("task")
        .expect("first worker");
    assert_eq!((a.rank(), b.rank()), (1, 0));
    exercise(&[b, a]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_silent_clients_do_not_stop_formation() {
    let mut so = SeedOptions::default();
    // Long enough for the real workers' handshakes on a loaded machine: the silent
    // client need not time out for the cluster to form.
    so.handshake_timeout = Duration::from_secs(10);
    let seed = Seed::start(LOOPBACK, 3, so).await.expect("seed");
    let seed_addr = seed.local_addr().expect("addr");
    // Random UDP bytes at the seed's port (bounded: 200 datagrams).
    let junk = UdpSocket::bind(LOOPBACK).expect("junk socket");
    for i in 0..200u32 {
        let bytes: Vec<u8> = (0..(i % 1200) + 1)
            .map(|j| (i.wrapping_mul(31) ^ j) as u8)
            .collect();
        let _ = junk.send_to(&bytes, seed_addr);
    }
    // A client that completes the TLS handshake and then never says anything.
    let silent_ep = nexar_transport::bootstrap_client(
        LOOPBACK,
        seed.join_string().fingerprint,
        &TransportConfig::default(),
    )
    .expect("client");
    let silent = tokio::time::timeout(
        DEADLINE,
        silent_ep.connect(seed_addr, "seed.nexar").expect("connect"),
    )
    .await
    .expect("the silent client's handshake did not end within the deadline")
    .expect("handshake");
    // A client that announces a 4 GiB message.
    let liar_ep = nexar_transport::bootstrap_client(
        LOOPBACK,
        seed.join_string().fingerprint,
        &TransportConfig::default(),
    )
    .expect("client");
    let liar = tokio::time::timeout(
        DEADLINE,
        liar_ep.connect(seed_addr, "seed.nexar").expect("connect"),
    )
    .await
    .expect("the lying client's handshake did not end within the deadline")
    .expect("handshake");
    let (mut s, _r) = tokio::time::timeout(DEADLINE, liar.open_bi())
        .await
        .expect("the lying client's stream did not open within the deadline")
        .expect("stream");
    tokio::time::timeout(DEADLINE, s.write_all(&u32::MAX.to_be_bytes()))
        .await
        .expect("the lying client's announcement was not written within the deadline")
        .expect("write");
    // A normal cluster still forms.
    let nodes = join_all(&seed, 3).await;
    exercise(&nodes).await;
    drop(silent);
    drop(liar);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formation_deadline_names_missing_ranks() {
    let mut so = SeedOptions::default();
    // Long enough for the two workers to arrive on a loaded machine.
    so.formation_timeout = Duration::from_secs(5);
    let seed = Seed::start(LOOPBACK, 3, so).await.expect("seed");
    let a = tokio::spawn(Node::join(opts(&seed)));
    let b = tokio::spawn(Node::join(opts(&seed)));
    for t in [a, b] {
        match tokio::time::timeout(DEADLINE, t)
            .await
            .expect("deadline")
            .expect("task")
        {
            Err(NexarError::Bootstrap(BootstrapError::Formation(reason))) => {
                assert!(reason.contains("ranks 2 did not arrive"), "{reason}")
            }
            other => panic!("expected a formation error, got {other:?}"),
        }
    }
    let formed = tokio::time::timeout(DEADLINE, seed.wait_formed())
        .await
        .expect("the seed did not give up on formation within the deadline");
    assert!(formed.is_err(), "{formed:?}");
    // A latecomer is told at once (it used to wait, with nobody left to answer it).
    let late = tokio::time::timeout(DEADLINE, Node::join(opts(&seed)))
        .await
        .expect("an answer for the latecomer");
    match late {
        Err(NexarError::Bootstrap(BootstrapError::Refused(reason))) => {
            assert!(reason.contains("did not form"), "{reason}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A worker admitted by the seed that cannot start its node (its mesh port is taken)
/// tells the seed why, and the seed's formation failure names the reason next to the
/// rank it is missing, rather than only the rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_start_its_node_tells_the_seed_why() {
    let taken = UdpSocket::bind(LOOPBACK).expect("a socket holding a port");
    let mut so = SeedOptions::default();
    // Time for one failed join and then another's admission, on a loaded machine.
    so.formation_timeout = Duration::from_secs(15);
    let seed = Seed::start(LOOPBACK, 2, so).await.expect("seed");
    let mut o = opts(&seed);
    o.listen = taken.local_addr().expect("addr");
    let failed = tokio::time::timeout(DEADLINE, Node::join(o))
        .await
        .expect("the join on a taken port did not end within the deadline");
    assert!(failed.is_err(), "a node on a taken port started");
    let other = tokio::time::timeout(DEADLINE, Node::join(opts(&seed)))
        .await
        .expect("the second join did not end within the deadline");
    match other {
        Err(NexarError::Bootstrap(BootstrapError::Formation(reason))) => assert!(
            reason.contains("did not arrive") && reason.contains("could not start their node"),
            "{reason}"
        ),
        other => panic!("expected a formation error, got {:?}", other.err()),
    }
    drop(taken);
}

/// Settings a node cannot start with are refused before the join contacts the seed (here
/// a seed that never answers: reaching it would end the join with `SeedUnreachable` at
/// its deadline instead), so no seed admits a worker, and holds a rank for it, that
/// cannot take the rank up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_a_node_cannot_start_with_are_refused_before_the_seed_is_asked() {
    let silent = UdpSocket::bind(LOOPBACK).expect("a silent socket");
    let seed = Seed::start(LOOPBACK, 1, SeedOptions::default())
        .await
        .expect("seed");
    for (setting, adjust) in [
        (
            "op_timeout",
            (|o: &mut nexar_actors::JoinOptions| o.config.op_timeout = Duration::ZERO)
                as fn(&mut nexar_actors::JoinOptions),
        ),
        ("send_window", |o| o.config.transport.send_window = 1500),
        ("idle_timeout", |o| {
            o.config.transport.idle_timeout = Duration::MAX
        }),
    ] {
        let mut o = opts(&seed);
        o.join.seed = silent.local_addr().expect("addr");
        o.timeout = Duration::from_secs(2);
        adjust(&mut o);
        let joined = tokio::time::timeout(DEADLINE, Node::join(o))
            .await
            .expect("the join did not end within the deadline");
        let refused = joined.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            refused.contains(setting) && !refused.contains("no admission"),
            "{setting}: {refused}"
        );
    }
    drop(silent);
}

/// A node's QUIC server refuses, in the TLS handshake, a client certificate that the
/// cluster CA did not issue. The client trusts the cluster CA (so it accepts the node's
/// certificate) and its certificate names a node the members pin no certificate for and
/// that is no member: only the TLS check can refuse it (the node would hold such a
/// connection open as one from a node about to join).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_refuses_a_certificate_from_another_ca() {
    let ca = Arc::new(ClusterCa::generate().expect("ca"));
    let mut so = SeedOptions::default();
    so.ca = Some(ca.clone());
    let seed = Seed::start(LOOPBACK, 2, so).await.expect("seed");
    let nodes = join_all(&seed, 2).await;
    let target = SocketAddr::from((
        Ipv4Addr::LOCALHOST,
        nodes[0].local_addr().expect("addr").port(),
    ));
    let foreign = ClusterCa::generate()
        .expect("ca")
        .issue(NodeId(7))
        .expect("identity");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der()).expect("root");
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![foreign.cert_der().clone()], foreign.key_der())
        .expect("client cert");
    tls.alpn_protocols = vec![nexar_transport::ALPN.to_vec()];
    let quic_tls = quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic tls");
    let mut client = quinn::Endpoint::client(LOOPBACK).expect("client");
    client.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic_tls)));
    let ended = tokio::time::timeout(DEADLINE, async {
        match client
            .connect(target, &NodeId(0).dns_name())
            .expect("start")
            .await
        {
            Err(e) => e,
            // TLS 1.3: the client counts the handshake done once it has sent its
            // certificate and Finished; the server's verdict arrives as the close.
            Ok(conn) => conn.closed().await,
        }
    })
    .await
    .expect("rank 0 did not refuse the foreign client certificate within the deadline");
    // A close from the peer with a TLS alert (QUIC's CRYPTO_ERROR range): the handshake
    // refused the certificate, not the application.
    match ended {
        quinn::ConnectionError::ConnectionClosed(close)
            if (0x100..0x200).contains(&u64::from(close.error_code))
                && close.reason.starts_with(b"invalid peer certificate") => {}
        other => panic!(
            "want rank 0's TLS handshake to refuse the certificate (a TLS alert, \
             \"invalid peer certificate\"), got: {other:?}"
        ),
    }
    client.close(0u32.into(), b"");
    exercise(&nodes).await;
}

/// Whether this host has an IPv6 loopback (the IPv6 tests below need one).
fn has_ipv6_loopback() -> bool {
    let ok = UdpSocket::bind("[::1]:0").is_ok();
    if !ok {
        eprintln!("no IPv6 loopback on this host: skipped");
    }
    ok
}

/// A seed listening on `[::]` sees workers that reach it over IPv4 as `::ffff:a.b.c.d`;
/// it hands out their IPv4 addresses, which their peers' IPv4 sockets can dial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_seed_hands_ipv4_workers_ipv4_mesh_addresses() {
    if !has_ipv6_loopback() {
        return;
    }
    let mut so = SeedOptions::default();
    so.formation_timeout = Duration::from_secs(20);
    let seed = Seed::start("[::]:0".parse().expect("addr"), 3, so)
        .await
        .expect("seed");
    assert!(
        seed.join_string().seed.is_ipv4(),
        "the join string names 127.0.0.1"
    );
    // Listening on all IPv4 interfaces, the workers leave their address to the seed.
    let any: SocketAddr = "0.0.0.0:0".parse().expect("addr");
    let nodes = join_all_where(&seed, 3, |o| o.listen = any).await;
    let formed = tokio::time::timeout(DEADLINE, seed.wait_formed())
        .await
        .expect("the seed did not see the cluster form within the deadline")
        .expect("formed");
    assert!(
        formed.iter().all(|a| a.ip() == Ipv4Addr::LOCALHOST),
        "{formed:?}"
    );
    exercise(&nodes).await;
}

/// Workers reaching the seed over IPv6 are reachable where the seed says they are: on
/// all interfaces (the default) they listen on `[::]`, and bound to one IPv4 address
/// they give that address to their peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_of_an_ipv6_seed_are_reachable_at_the_addresses_handed_out() {
    if !has_ipv6_loopback() {
        return;
    }
    for (listen, want) in [
        ("0.0.0.0:0", "::1".parse::<std::net::IpAddr>().expect("ip")),
        ("127.0.0.1:0", Ipv4Addr::LOCALHOST.into()),
    ] {
        let mut so = SeedOptions::default();
        so.formation_timeout = Duration::from_secs(20);
        let seed = Seed::start("[::1]:0".parse().expect("addr"), 3, so)
            .await
            .expect("seed");
        let at: SocketAddr = listen.parse().expect("addr");
        let nodes = join_all_where(&seed, 3, |o| o.listen = at).await;
        let formed = tokio::time::timeout(DEADLINE, seed.wait_formed())
            .await
            .expect("the seed did not see the cluster form within the deadline")
            .expect("formed");
        assert!(
            formed.iter().all(|a| a.ip() == want),
            "{listen}: {formed:?}"
        );
        exercise(&nodes).await;
    }
}

/// A rank past what the protocol carries is refused before the seed is asked (it once
/// wrapped around to a small rank and could take another worker's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_too_large_for_the_protocol_is_refused() {
    let seed = Seed::start(LOOPBACK, 2, SeedOptions::default())
        .await
        .expect("seed");
    for rank in [nexar_actors::MAX_WORLD, u32::MAX as usize + 2] {
        let mut o = opts(&seed);
        o.rank = Some(rank);
        let joined = tokio::time::timeout(DEADLINE, Node::join(o))
            .await
            .expect("deadline");
        match joined {
            Err(NexarError::InvalidArgument(why)) => assert!(why.contains("out of range"), "{why}"),
            other => panic!(
                "rank {rank}: expected InvalidArgument, got {:?}",
                other.err()
            ),
        }
    }
    assert!(seed.admitted().is_empty());
}

/// What a node sent before it finished reaches its peers: finishing waits (bounded by
/// `finish_timeout`) for the peers to finish too, instead of closing connections with data
/// still in flight (which QUIC then drops), and a peer that finished is not reported as
/// failed, whatever it reports; a node dropped without finishing is a loss.
/// Transport settings the node itself adjusts (here an `idle_timeout` under the
/// `keep_alive`, which the node raises to its `heartbeat_timeout`) are taken on the way in
/// through the seed as they are by the mesh: the bootstrap connection checks the settings
/// the node will use, not the raw ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_join_with_transport_settings_the_node_adjusts() {
    let seed = Seed::start(LOOPBACK, 2, SeedOptions::default())
        .await
        .expect("seed");
    let nodes = join_all_where(&seed, 2, |o| {
        o.config.heartbeat_timeout = Duration::from_secs(5);
        o.config.transport.idle_timeout = Duration::from_secs(2);
        o.config.transport.keep_alive = Duration::from_secs(3);
    })
    .await;
    exercise(&nodes).await;
    tokio::time::timeout(DEADLINE, finish_all(nodes))
        .await
        .expect("the nodes did not finish within the deadline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_sent_just_before_finishing_arrives() {
    let seed = Seed::start(LOOPBACK, 3, SeedOptions::default())
        .await
        .expect("seed");
    let mut nodes = join_all_where(&seed, 3, |o| {
        // The whole message is taken into the sender's buffers at once: its send returns
        // with nearly all of it still to be carried.
        o.config.transport.send_window = 64 << 20;
        o.config.transport.stream_window = 64 << 20;
    })
    .await;
    let failing = nodes.pop().expect("rank 2");
    let receiver = nodes.pop().expect("rank 1");
    let sender = nodes.pop().expect("rank 0");
    let len = 32 << 20;
    let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let comm = sender.communicator();
    let send = tokio::spawn(async move {
        comm.send(&payload, 1, 5).await?;
        sender.finish(true).await;
        Ok::<_, NexarError>(())
    });
    let comm = receiver.communicator();
    let mut failures = comm.failures();
    let mut got = vec![0u8; len];
    let received = tokio::time::timeout(DEADLINE, comm.recv(&mut got, 0, 5))
        .await
        .expect("deadline");
    received.expect("the message sent before finishing");
    assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    // Rank 2 is dropped: its peers see it lost, while rank 0, which finished, is not.
    drop(failing);
    let lost = tokio::time::timeout(DEADLINE, failures.changed())
        .await
        .expect("the failed rank is noticed")
        .expect("watch");
    assert_eq!(lost, vec![2], "only the rank that failed is a failure");
    let (sent, finished) = tokio::join!(
        tokio::time::timeout(DEADLINE, send),
        tokio::time::timeout(DEADLINE, receiver.finish(true))
    );
    sent.expect("deadline").expect("task").expect("send");
    finished.expect("the receiver did not finish within the deadline");
    let report = tokio::time::timeout(DEADLINE, seed.wait_finished())
        .await
        .expect("deadline")
        .expect("report");
    assert_eq!(report.ok, vec![0, 1]);
    assert!(report.failed.contains(&2), "{:?}", report.failed);
}

/// Nodes that finish together: none waits out its `finish_timeout` (set far past the
/// test's deadline), and none records another as failed, not even the last to close,
/// whose farewell is confirmed before it closes and whose close says it finished.
async fn finish_together_without_failures(
    world: usize,
    adjust: impl Fn(&mut nexar_actors::JoinOptions),
) {
    let seed = Seed::start(LOOPBACK, world, SeedOptions::default())
        .await
        .expect("seed");
    let nodes = join_all_where(&seed, world, |o| {
        o.config.finish_timeout = Duration::from_secs(600);
        adjust(o);
    })
    .await;
    exercise(&nodes).await;
    let watches: Vec<_> = nodes.iter().map(|n| n.communicator().failures()).collect();
    tokio::time::timeout(DEADLINE, finish_all(nodes))
        .await
        .expect("every node finished on its peers' farewells");
    for (rank, w) in watches.iter().enumerate() {
        assert!(
            w.current().is_empty(),
            "rank {rank} saw {:?} fail",
            w.current()
        );
    }
    let report = tokio::time::timeout(DEADLINE, seed.wait_finished())
        .await
        .expect("deadline")
        .expect("report");
    assert_eq!(report.ok, (0..world).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_of_a_full_mesh_finish_together_without_failures() {
    for _ in 0..3 {
        finish_together_without_failures(4, |_| {}).await;
    }
}

/// On a ring each node reaches most others through relays: farewells go through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_of_a_sparse_topology_finish_together_without_failures() {
    finish_together_without_failures(6, |o| {
        o.config.topology = nexar_actors::Topology::KRegular { k: 2 };
    })
    .await;
}

/// Over the trusted lane a peer's TCP lane may end before its QUIC close arrives: the
/// lane's end alone does not make it a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_trusted_lanes_finish_together_without_failures() {
    for _ in 0..3 {
        finish_together_without_failures(3, |o| o.config.trusted_fabric = true).await;
    }
}
