//! Hostile and foreign peers: malformed frames from a certified client, and a client whose
//! certificate was not issued by the cluster CA.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use nexar_actors::{Cluster, NexarError, NodeConfig};
use nexar_tests::{closed_by_pin_check, on_all_ranks};
use nexar_transport::{
    ClusterCa, Endpoint, FrameHeader, FrameKind, NodeId, StreamRefusal, TransportConfig,
};

const DEADLINE: Duration = Duration::from_secs(60);

async fn cluster_still_works(cluster: &Cluster) {
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        comm.barrier().await?;
        let mut v = vec![comm.rank() as i64 + 1; 1000];
        comm.all_reduce(&mut v, nexar_device::ReduceOp::Sum).await?;
        let world = comm.world_size() as i64;
        assert!(v.iter().all(|x| *x == world * (world + 1) / 2));
        Ok::<_, NexarError>(())
    })
    .await;
    for r in res {
        r.expect("cluster broken after hostile input");
    }
}

/// Writes raw bytes on a fresh stream and returns the code the receiver stopped it with.
async fn refused_with(conn: &quinn::Connection, bytes: Vec<u8>) -> Option<u32> {
    let stopped = async {
        let mut s = conn.open_uni().await.expect("open stream");
        // The receiver may stop the stream before we finish writing: that is the point.
        let _ = s.write_all(&bytes).await;
        s.stopped().await
    };
    match tokio::time::timeout(Duration::from_secs(20), stopped).await {
        Ok(Ok(code)) => code.map(|c| c.into_inner() as u32),
        Ok(Err(_)) => None,
        Err(_) => panic!("the stream was not opened, written, and read or refused within 20 s"),
    }
}

fn framed(h: &FrameHeader) -> Vec<u8> {
    h.encode()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversize_frames_are_refused_and_cluster_keeps_working() {
    let mut config = NodeConfig::default();
    config.transport.max_frame_bytes = 1 << 20;
    config.collectives.max_message_bytes = 1 << 20;
    config.op_timeout = Duration::from_secs(3);
    let cluster = tokio::time::timeout(DEADLINE, Cluster::local_with(3, config))
        .await
        .expect("the cluster did not form within the deadline")
        .expect("cluster");
    // A raw client holding a genuine cluster certificate for node 1.
    let (ep, conn, _identity) =
        tokio::time::timeout(DEADLINE, nexar_tests::impostor(&cluster, 1, 0))
            .await
            .expect("the impostor's handshake did not end within the deadline");
    let raw = conn.quic();

    // Streams are left open (no FIN) so the receiver's STOP_SENDING is what ends them: a
    // finished stream whose bytes were all acknowledged reports no code.
    // Garbage where a header should be.
    let mut garbage = vec![0u8, 5];
    garbage.extend_from_slice(&[0xff; 5]);
    assert_eq!(
        refused_with(raw, garbage).await,
        Some(StreamRefusal::BadHeader as u32)
    );
    // A header length prefix over the maximum.
    assert_eq!(
        refused_with(raw, vec![0xff, 0xff, 1, 2, 3]).await,
        Some(StreamRefusal::BadHeader as u32)
    );
    // Oversize frame: announced length above max_frame_bytes.
    let big = FrameHeader::new(FrameKind::Data, 0, 0, 0, 1, 2 << 20);
    assert_eq!(
        refused_with(raw, framed(&big)).await,
        Some(StreamRefusal::FrameTooLarge as u32)
    );
    // Wrong protocol version.
    let mut other = FrameHeader::new(FrameKind::Data, 0, 1, 0, 1, 0);
    other.version = nexar_transport::PROTOCOL_VERSION.wrapping_add(1);
    assert_eq!(
        refused_with(raw, framed(&other)).await,
        Some(StreamRefusal::BadVersion as u32)
    );
    // Length disagrees with the bytes sent: more bytes than announced...
    let long = FrameHeader::new(FrameKind::Data, 0, 3, 0, 1, 4);
    let mut bytes = framed(&long);
    bytes.extend_from_slice(&[7; 40]);
    assert_eq!(
        refused_with(raw, bytes).await,
        Some(StreamRefusal::LengthMismatch as u32)
    );
    // ...and fewer: the stream ends early. Rank 0 must never see the truncated frame: a
    // receive for exactly its key (p2p tag 2, first message from rank 1) times out.
    let short = FrameHeader::new(FrameKind::Data, 0, 2, 0, 1, 100);
    let mut bytes = framed(&short);
    bytes.extend_from_slice(&[7; 10]);
    tokio::time::timeout(DEADLINE, async {
        let mut s = raw.open_uni().await.expect("open stream");
        s.write_all(&bytes).await.expect("write");
        s.finish().expect("finish");
    })
    .await
    .expect("the truncated frame was not written within the deadline");
    let mut buf = [0u8; 100];
    let comm0 = cluster.communicators()[0].clone();
    let received = tokio::time::timeout(DEADLINE, comm0.recv(&mut buf, 1, 2))
        .await
        .expect("rank 0's receive of the truncated frame outlived its op_timeout");
    assert!(
        matches!(received, Err(NexarError::Timeout { .. })),
        "{received:?}"
    );
    // A forged source: the certificate says node 1, the header claims node 2.
    let forged = FrameHeader::new(FrameKind::Data, 0, 4, 0, 2, 1);
    let mut bytes = framed(&forged);
    bytes.push(1);
    assert_eq!(
        refused_with(raw, bytes).await,
        Some(StreamRefusal::SourceMismatch as u32)
    );

    // The hostile connection itself stays open and the cluster keeps working.
    assert!(raw.close_reason().is_none());
    cluster_still_works(&cluster).await;
    for comm in cluster.communicators() {
        assert!(comm.failed_ranks().is_empty());
    }
    drop(conn);
    ep.close();
}

/// An endpoint holding a fresh certificate from `cluster`'s CA for `node`, and its
/// connection to rank 0 (its handshake within `DEADLINE`).
async fn dial_rank_0(cluster: &Cluster, node: NodeId) -> (Endpoint, nexar_transport::Connection) {
    let identity = cluster.ca().issue(node).expect("identity");
    let ep = Endpoint::bind(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        &identity,
        TransportConfig::default(),
    )
    .expect("bind");
    let conn = tokio::time::timeout(DEADLINE, ep.connect(cluster.addrs()[0], NodeId(0)))
        .await
        .expect("the handshake with rank 0 did not end within the deadline")
        .expect("handshake");
    (ep, conn)
}

/// The cluster CA may have issued more than one certificate naming a node (a worker that
/// left before formation kept its certificate when its rank went to another): the ranks
/// take only the one the membership names. A connection with another one is closed, and
/// a frame sent on it is not delivered; the real node's connections are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_certificate_for_a_rank_is_refused() {
    let mut config = NodeConfig::default();
    config.op_timeout = Duration::from_secs(2);
    let cluster = tokio::time::timeout(DEADLINE, Cluster::local_with(2, config))
        .await
        .expect("the cluster did not form within the deadline")
        .expect("cluster");
    // The TLS handshake passes (the CA signed it); rank 0 then closes the connection.
    let (ep, conn) = dial_rank_0(&cluster, NodeId(1)).await;
    let forged = conn.send(
        FrameKind::Data,
        0,
        77,
        0,
        bytes::Bytes::from_static(b"forged"),
    );
    // Whether the send gets through before the close does not matter, only that it ends.
    let _ = tokio::time::timeout(DEADLINE, forged)
        .await
        .expect("the forged send did not end within the deadline");
    let closed = tokio::time::timeout(Duration::from_secs(20), conn.quic().closed())
        .await
        .expect("rank 0 closes a connection with another certificate for node 1");
    assert!(
        closed_by_pin_check(&closed),
        "want rank 0's pin check to close the connection, got: {closed}"
    );
    let comm0 = cluster.communicators()[0].clone();
    let mut buf = [0u8; 6];
    let received = tokio::time::timeout(DEADLINE, comm0.recv(&mut buf, 1, 77))
        .await
        .expect("rank 0's receive of the forged frame outlived its op_timeout");
    assert!(
        matches!(received, Err(NexarError::Timeout { .. })),
        "{received:?}"
    );
    ep.close();
    cluster_still_works(&cluster).await;
}

/// A member that keeps dialling another with its own certificate (a misbehaving node)
/// holds at most a few extra connections there: the others are closed, where each used to
/// be kept, with a reader, for as long as it stayed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_keeps_dialling_gets_its_extra_connections_closed() {
    const DIALS: usize = 12;
    let cluster = tokio::time::timeout(DEADLINE, Cluster::local(2))
        .await
        .expect("the cluster did not form within the deadline")
        .expect("cluster");
    let identity = cluster.identity(1).expect("rank 1's identity");
    let ep = Endpoint::bind(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        identity,
        TransportConfig::default(),
    )
    .expect("bind");
    let mut conns = Vec::new();
    for _ in 0..DIALS {
        let conn = tokio::time::timeout(DEADLINE, ep.connect(cluster.addrs()[0], NodeId(0)))
            .await
            .expect("the handshake with rank 0 did not end within the deadline")
            .expect("handshake");
        conns.push(conn);
    }
    let open = || {
        conns
            .iter()
            .filter(|c| c.quic().close_reason().is_none())
            .count()
    };
    nexar_tests::until(
        || format!("{} of {DIALS} extra connections still open", open()),
        || open() <= 4,
    )
    .await;
    ep.close();
    cluster_still_works(&cluster).await;
}

/// A node of the cluster that is not a member (its certificate from the cluster's CA, its
/// id in no membership) has its connection held unread, with at most the node's
/// admission window (64 KiB) of data in flight: it cannot make a member hold the full
/// connection window (528 MiB by default) of what it sends on streams nobody reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_member_cannot_make_a_node_hold_more_than_its_admission_window() {
    let cluster = tokio::time::timeout(DEADLINE, Cluster::local(2))
        .await
        .expect("the cluster did not form within the deadline")
        .expect("cluster");
    let (ep, conn) = dial_rank_0(&cluster, NodeId(99)).await;
    let mut stream = conn.quic().open_uni().await.expect("a stream");
    let chunk = vec![0u8; 64 << 10];
    let mut written = 0usize;
    // Bounded: 4 MiB at most, each write given half a second to be taken.
    while written < 4 << 20 {
        match tokio::time::timeout(Duration::from_millis(500), stream.write(&chunk)).await {
            Ok(Ok(n)) => written += n,
            Ok(Err(e)) => panic!("the parked connection failed instead: {e}"),
            Err(_) => break,
        }
    }
    assert!(
        written <= 64 << 10,
        "{written} bytes in flight on a non-member's connection"
    );
    ep.close();
    cluster_still_works(&cluster).await;
}

/// Whether a QUIC close code carries a TLS alert (QUIC's CRYPTO_ERROR range, 0x100-0x1ff):
/// the handshake failed, as opposed to a close by the application.
fn is_tls_alert(code: quinn::TransportErrorCode) -> bool {
    (0x100..0x200).contains(&u64::from(code))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_from_another_ca_is_refused() {
    let cluster = tokio::time::timeout(DEADLINE, Cluster::local(2))
        .await
        .expect("the cluster did not form within the deadline")
        .expect("cluster");
    let foreign_ca = ClusterCa::generate().expect("ca");
    let foreign = foreign_ca.issue(NodeId(1)).expect("identity");

    // 1. Through nexar's own endpoint: it does not trust the cluster's server either. The
    //    client's own TLS check ends the handshake (the peer does not close it).
    let ep = Endpoint::bind(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        &foreign,
        TransportConfig::default(),
    )
    .expect("bind");
    let dialled = tokio::time::timeout(DEADLINE, ep.connect(cluster.addrs()[0], NodeId(0)))
        .await
        .expect("the foreign endpoint's handshake did not end within the deadline");
    match dialled {
        Err(nexar_transport::TransportError::Connect { reason, .. }) => assert!(
            reason.contains("invalid peer certificate") && !reason.contains("by peer"),
            "want the client's TLS to refuse the server's certificate: {reason}"
        ),
        other => panic!(
            "want a refused handshake, got {:?}",
            other.map(|c| c.peer())
        ),
    }
    ep.close();

    // 2. A client that trusts the real cluster CA (so it accepts the server) but presents a
    //    certificate from a foreign CA: the server's TLS must refuse it. The certificate
    //    names a node the cluster pins no certificate for and that is no member, so only
    //    the TLS check can refuse it: the node would hold such a connection open as one from
    //    a node about to join.
    let stranger = foreign_ca.issue(NodeId(7)).expect("identity");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cluster.ca().cert_der()).expect("root");
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![stranger.cert_der().clone()], stranger.key_der())
        .expect("client cert");
    tls.alpn_protocols = vec![nexar_transport::ALPN.to_vec()];
    let quic_tls = quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic tls");
    let mut client =
        quinn::Endpoint::client(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("client");
    client.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic_tls)));
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        match client
            .connect(cluster.addrs()[0], &NodeId(0).dns_name())
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
    .expect("the server did not refuse the foreign client certificate within 20 s");
    match ended {
        quinn::ConnectionError::ConnectionClosed(close)
            if is_tls_alert(close.error_code)
                && close.reason.starts_with(b"invalid peer certificate") => {}
        other => panic!(
            "want the server's TLS handshake to refuse the certificate (a TLS alert, \
             \"invalid peer certificate\"), got: {other:?}"
        ),
    }
    client.close(0u32.into(), b"");
    cluster_still_works(&cluster).await;
}

/// A client's TLS that, on the server's certificate, signals `started` and then stalls
/// until `release` (or the deadline): a client that starts a handshake and goes silent.
#[derive(Debug)]
struct Stalled {
    started: std::sync::mpsc::SyncSender<()>,
    release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

fn stalled_error() -> rustls::Error {
    rustls::Error::General("a stalled client".into())
}

/// The two signature checks have the trait's two signatures (TLS 1.2 and 1.3); a stalled
/// client never gets to either.
impl rustls::client::danger::ServerCertVerifier for Stalled {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let _ = self.started.try_send(());
        if let Ok(release) = self.release.lock() {
            let _ = release.recv_timeout(2 * DEADLINE);
        }
        Err(stalled_error())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Err(stalled_error())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Err(stalled_error())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A client that starts a handshake with a node and goes silent holds up only itself: a
/// cluster peer connects meanwhile. (The node's handshake and idle timeouts are set past
/// the test's deadline: a node that ran handshakes one at a time would keep the peer
/// waiting until the peer's own handshake gave up.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_handshake_does_not_hold_up_other_connections() {
    let mut config = NodeConfig::default();
    config.transport.handshake_timeout = 3 * DEADLINE;
    // QUIC's idle timeout would end the silent handshake first.
    config.transport.idle_timeout = 3 * DEADLINE;
    let cluster = tokio::time::timeout(DEADLINE, Cluster::local_with(2, config))
        .await
        .expect("the cluster did not form within the deadline")
        .expect("cluster");
    let (started_tx, started) = std::sync::mpsc::sync_channel(1);
    let (release, release_rx) = std::sync::mpsc::channel();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Stalled {
            started: started_tx,
            release: std::sync::Mutex::new(release_rx),
            provider,
        }))
        .with_no_client_auth();
    tls.alpn_protocols = vec![nexar_transport::ALPN.to_vec()];
    let quic_tls = quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic tls");
    let target = cluster.addrs()[0];
    // On a runtime and thread of its own, which the stalled verifier blocks.
    let silent = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let mut client = quinn::Endpoint::client(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
                .expect("client");
            client.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic_tls)));
            let connecting = client
                .connect(target, &NodeId(0).dns_name())
                .expect("start");
            let _ = tokio::time::timeout(3 * DEADLINE, connecting).await;
        });
    });
    started
        .recv_timeout(DEADLINE)
        .expect("the silent client did not get the node's certificate within the deadline");
    let (ep, conn, _) = tokio::time::timeout(DEADLINE, nexar_tests::impostor(&cluster, 1, 0))
        .await
        .expect("a peer's handshake did not end within the deadline");
    assert_eq!(conn.peer(), NodeId(0));
    ep.close();
    let _ = release.send(());
    silent.join().expect("the silent client's thread");
    cluster_still_works(&cluster).await;
}
