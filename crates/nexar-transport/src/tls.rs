//! rustls configuration: TLS 1.3 only, mutual authentication against the cluster CA.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::{NodeIdentity, TransportError};

/// The ALPN protocol every nexar connection negotiates.
pub const ALPN: &[u8] = b"nexar/1";

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(e: impl std::fmt::Display) -> TransportError {
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
