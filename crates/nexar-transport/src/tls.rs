//! rustls configuration: TLS 1.3 only, mutual authentication against the cluster CA.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::{NodeIdentity, TransportError};

/// The ALPN protocol every nexar connection negotiates. Its number changes with the
/// framing on QUIC streams (2: small frames share a message stream, see `wire.rs`), so
/// nodes that would misread each other's streams fail at the handshake instead.
pub const ALPN: &[u8] = b"nexar/2";

/// The TLS 1.3 suites we offer, in order of preference. AES-128-GCM comes first: with
/// AES instructions it is the cheapest suite per byte (10 AES rounds against AES-256's 14),
/// and on this path every byte is sealed and opened once per hop. aws-lc-rs's default
/// order puts AES-256-GCM first, and a peer takes the first suite of the client's list
/// that it supports. AES-256-GCM and ChaCha20-Poly1305 stay on offer, after it.
const CIPHER_SUITES: &[rustls::SupportedCipherSuite] = &[
    rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256,
    rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_256_GCM_SHA384,
    rustls::crypto::aws_lc_rs::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
];

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: CIPHER_SUITES.to_vec(),
        ..rustls::crypto::aws_lc_rs::default_provider()
    })
}

pub(crate) fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::TlsConfig(e.to_string())
}

fn roots(identity: &NodeIdentity) -> Result<Arc<RootCertStore>, TransportError> {
    let mut roots = RootCertStore::empty();
    roots.add(identity.ca_der().clone()).map_err(tls_err)?;
    Ok(Arc::new(roots))
}

/// Server side: present our certificate, require a client certificate from the cluster CA.
pub(crate) fn server_config(
    identity: &NodeIdentity,
) -> Result<rustls::ServerConfig, TransportError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(identity)?, provider())
        .build()
        .map_err(tls_err)?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![identity.cert_der().clone()], identity.key_der())
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// Client side: verify the server against the cluster CA (its name is checked per
/// connection against the node we dial) and present our certificate.
pub(crate) fn client_config(
    identity: &NodeIdentity,
) -> Result<rustls::ClientConfig, TransportError> {
    let verifier = WebPkiServerVerifier::builder_with_provider(roots(identity)?, provider())
        .build()
        .map_err(tls_err)?;
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_webpki_verifier(verifier)
        .with_client_auth_cert(vec![identity.cert_der().clone()], identity.key_der())
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{ClusterCa, NodeId};

    /// Moves every pending TLS record from `from` to `to`.
    fn flush(
        from: &mut impl std::ops::DerefMut<Target = rustls::ConnectionCommon<impl Sized>>,
        to: &mut impl std::ops::DerefMut<Target = rustls::ConnectionCommon<impl Sized>>,
    ) {
        let mut wire = Vec::new();
        while from.wants_write() {
            from.write_tls(&mut wire).unwrap();
        }
        let mut rest = &wire[..];
        while !rest.is_empty() {
            to.read_tls(&mut rest).unwrap();
            to.process_new_packets().unwrap();
        }
    }

    /// Two nodes' TLS configurations, after a handshake between them in memory.
    fn handshaken() -> (rustls::ClientConnection, rustls::ServerConnection) {
        let ca = ClusterCa::generate().unwrap();
        let client_cfg = client_config(&ca.issue(NodeId(0)).unwrap()).unwrap();
        let server_cfg = server_config(&ca.issue(NodeId(1)).unwrap()).unwrap();
        let name = rustls::pki_types::ServerName::try_from(NodeId(1).dns_name()).unwrap();
        let mut client = rustls::ClientConnection::new(Arc::new(client_cfg), name).unwrap();
        let mut server = rustls::ServerConnection::new(Arc::new(server_cfg)).unwrap();
        // A TLS 1.3 handshake with client authentication takes two round trips.
        for _ in 0..4 {
            flush(&mut client, &mut server);
            flush(&mut server, &mut client);
        }
        assert!(!client.is_handshaking() && !server.is_handshaking());
        (client, server)
    }

    #[test]
    fn peers_negotiate_aes_128_gcm() {
        let (client, server) = handshaken();
        let want = rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
        assert_eq!(
            client.negotiated_cipher_suite().map(|s| s.suite()),
            Some(want)
        );
        assert_eq!(
            server.negotiated_cipher_suite().map(|s| s.suite()),
            Some(want)
        );
    }

    /// The key exchange is the hybrid post-quantum X25519MLKEM768 (rustls'
    /// `prefer-post-quantum`): traffic recorded now cannot be decrypted later by
    /// breaking X25519 alone.
    #[test]
    fn peers_agree_on_a_post_quantum_key_exchange() {
        let (client, server) = handshaken();
        let want = rustls::NamedGroup::X25519MLKEM768;
        let group = |g: Option<&'static dyn rustls::crypto::SupportedKxGroup>| g.map(|g| g.name());
        assert_eq!(group(client.negotiated_key_exchange_group()), Some(want));
        assert_eq!(group(server.negotiated_key_exchange_group()), Some(want));
    }
}
