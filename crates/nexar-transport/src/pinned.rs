//! The bootstrap channel: a worker reaches the seed before it has a certificate, so it
//! authenticates the seed by the SHA-256 fingerprint of the seed's certificate (carried in
//! the join string) instead of a CA, and presents no certificate itself. The seed presents
//! its certificate and does not ask for one: workers prove knowledge of the cluster secret
//! inside the channel instead.

use std::net::SocketAddr;
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::tls::{provider, tls_err};
use crate::{NodeIdentity, TransportConfig, TransportError};

/// ALPN of the bootstrap channel.
pub const BOOTSTRAP_ALPN: &[u8] = b"nexar-boot/1";

/// Accepts exactly one server certificate: the one whose SHA-256 is pinned. The handshake
/// signature is still verified, so only the holder of that certificate's key passes.
#[derive(Debug)]
struct PinnedVerifier {
    fingerprint: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        // Not secret material: the fingerprint is public, a plain comparison is fine.
        if got == self.fingerprint {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "seed certificate fingerprint mismatch".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Binds the seed's bootstrap endpoint at `addr`, presenting `identity` and requiring no
/// client certificate.
pub fn bootstrap_server(
    addr: SocketAddr,
    identity: &NodeIdentity,
    config: &TransportConfig,
) -> Result<quinn::Endpoint, TransportError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_no_client_auth()
        .with_single_cert(vec![identity.cert_der().clone()], identity.key_der())
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![BOOTSTRAP_ALPN.to_vec()];
    let quic = QuicServerConfig::try_from(tls).map_err(tls_err)?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
    server.transport_config(bootstrap_transport(config)?);
    Ok(quinn::Endpoint::server(server, addr)?)
}

/// A client endpoint (bound at `local`) that trusts only the server certificate whose
/// SHA-256 is `fingerprint`.
pub fn bootstrap_client(
    local: SocketAddr,
    fingerprint: [u8; 32],
    config: &TransportConfig,
) -> Result<quinn::Endpoint, TransportError> {
    let mut ep = quinn::Endpoint::client(local)?;
    ep.set_default_client_config(bootstrap_client_config(fingerprint, config)?);
    Ok(ep)
}

/// The client configuration of [`bootstrap_client`]: trusts only the server certificate
/// whose SHA-256 is `fingerprint`, and speaks the bootstrap protocol.
pub fn bootstrap_client_config(
    fingerprint: [u8; 32],
    config: &TransportConfig,
) -> Result<quinn::ClientConfig, TransportError> {
    let verifier = Arc::new(PinnedVerifier {
        fingerprint,
        provider: provider(),
    });
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    tls.alpn_protocols = vec![BOOTSTRAP_ALPN.to_vec()];
    let quic = QuicClientConfig::try_from(tls).map_err(tls_err)?;
    let mut client = quinn::ClientConfig::new(Arc::new(quic));
    client.transport_config(bootstrap_transport(config)?);
    Ok(client)
}

/// Small windows (bootstrap messages are tiny), no QUIC datagrams, and the configured
/// idle timeout and keep-alive. `config` is checked as the mesh's endpoint checks it, so a
/// value that would make the mesh refuse it is refused here, before the seed admits this
/// node (a zero keep-alive would also make this connection ping without pause).
fn bootstrap_transport(
    config: &TransportConfig,
) -> Result<Arc<quinn::TransportConfig>, TransportError> {
    config.check()?;
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_uni_streams(0u32.into());
    t.max_concurrent_bidi_streams(1u32.into());
    t.stream_receive_window((256u32 << 10).into());
    t.receive_window((512u32 << 10).into());
    // Never used; quinn's default would buffer a client's datagrams (1.25 MB of them,
    // each holding its whole packet) before that client has proved anything.
    t.datagram_receive_buffer_size(None);
    t.keep_alive_interval(Some(config.keep_alive));
    let idle = quinn::IdleTimeout::try_from(config.idle_timeout).map_err(tls_err)?;
    t.max_idle_timeout(Some(idle));
    Ok(Arc::new(t))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A configuration the mesh's endpoint would refuse is refused for the bootstrap
    /// connection too, before any seed sees this node (a zero keep-alive made it ping
    /// without pause).
    #[test]
    fn bootstrap_connections_refuse_what_the_mesh_refuses() {
        let bad = TransportConfig {
            keep_alive: std::time::Duration::ZERO,
            ..TransportConfig::default()
        };
        match bootstrap_client_config([0; 32], &bad) {
            Err(TransportError::Config(msg)) => assert!(msg.contains("keep_alive"), "{msg}"),
            other => panic!(
                "expected a configuration error, got {:?}",
                other.map(|_| ())
            ),
        }
        assert!(bootstrap_client_config([0; 32], &TransportConfig::default()).is_ok());
    }

    /// Neither end of a bootstrap connection takes QUIC datagrams: a client that has not
    /// proved the secret could otherwise make the seed buffer them.
    #[tokio::test]
    async fn bootstrap_connections_take_no_datagrams() {
        let ca = crate::ClusterCa::generate().unwrap();
        let seed_id = ca.issue(crate::NodeId(0)).unwrap();
        let config = TransportConfig::default();
        let localhost = SocketAddr::from(([127, 0, 0, 1], 0));
        let server = bootstrap_server(localhost, &seed_id, &config).unwrap();
        let fingerprint = crate::cert_fingerprint(seed_id.cert_der());
        let client = bootstrap_client(localhost, fingerprint, &config).unwrap();
        let within = std::time::Duration::from_secs(20);
        let accept = async {
            let incoming = server.accept().await.expect("an incoming connection");
            incoming.await.expect("accepted")
        };
        let dial = async {
            client
                .connect(server.local_addr().unwrap(), "seed.nexar")
                .unwrap()
                .await
                .expect("connected")
        };
        let (at_seed, at_client) =
            tokio::time::timeout(within, async { tokio::join!(accept, dial) })
                .await
                .expect("connected within the deadline");
        assert_eq!(
            at_client.max_datagram_size(),
            None,
            "the seed takes datagrams"
        );
        assert_eq!(
            at_seed.max_datagram_size(),
            None,
            "the client takes datagrams"
        );
    }
}
