//! End-to-end authentication for frames that travel through relays: the origin signs, the
//! destination checks the signature against the origin's certificate, and that
//! certificate against the cluster CA. A relay can forward a frame but cannot forge one.

use std::sync::Arc;

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{
    EcdsaKeyPair, UnparsedPublicKey, ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_ASN1_SIGNING,
};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::{CertificateDer, UnixTime};

use crate::tls::provider;
use crate::{node_id_from_cert, NodeId, NodeIdentity, TransportError};

/// Signs messages with a node's private key (ECDSA P-256, SHA-256).
pub struct Signer {
    key: EcdsaKeyPair,
    rng: SystemRandom,
    cert: CertificateDer<'static>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer").finish_non_exhaustive()
    }
}

/// `pkcs8` as the ECDSA P-256 key a node signs with.
fn signing_key(pkcs8: &[u8]) -> Result<EcdsaKeyPair, TransportError> {
    EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8).map_err(|e| {
        TransportError::Certificate(format!("a node's key must be ECDSA P-256 (PKCS#8): {e}"))
    })
}

/// Refuses a key that [`Signer::new`] could not sign with.
pub(crate) fn check_signing_key(pkcs8: &[u8]) -> Result<(), TransportError> {
    signing_key(pkcs8).map(drop)
}

impl Signer {
    /// A signer for `identity`'s key.
    pub fn new(identity: &NodeIdentity) -> Result<Signer, TransportError> {
        let rng = SystemRandom::new();
        let key = signing_key(identity.key_der().secret_der())?;
        Ok(Signer {
            key,
            rng,
            cert: identity.cert_der().clone(),
        })
    }

    /// The certificate that proves who signed.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// Signs `msg`, behind [`SIGNING_CONTEXT`]: what is signed is never `msg` alone, so
    /// no choice of `msg` makes this node's key sign what another protocol that uses the
    /// key would take (a TLS 1.3 handshake's signature starts with 64 spaces).
    pub fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.key
            .sign(&self.rng, &in_context(msg))
            .map(|s| s.as_ref().to_vec())
            .map_err(|_| TransportError::Certificate("signing failed".into()))
    }
}

/// What every [`Signer`] signature covers before its message (and every
/// [`SignatureVerifier`] check expects): it binds the node's TLS key's signatures made here
/// to this use.
pub const SIGNING_CONTEXT: &[u8] = b"nexar signed message/1\0";

/// `msg` behind [`SIGNING_CONTEXT`].
fn in_context(msg: &[u8]) -> Vec<u8> {
    let mut whole = Vec::with_capacity(SIGNING_CONTEXT.len() + msg.len());
    whole.extend_from_slice(SIGNING_CONTEXT);
    whole.extend_from_slice(msg);
    whole
}

/// Checks signatures made by any node of the cluster.
pub struct SignatureVerifier {
    chain: Arc<dyn ClientCertVerifier>,
}

impl std::fmt::Debug for SignatureVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignatureVerifier").finish_non_exhaustive()
    }
}

impl SignatureVerifier {
    /// A verifier trusting the cluster CA `ca`.
    pub fn new(ca: &CertificateDer<'static>) -> Result<SignatureVerifier, TransportError> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(ca.clone())
            .map_err(|e| TransportError::TlsConfig(e.to_string()))?;
        let chain = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| TransportError::TlsConfig(e.to_string()))?;
        Ok(SignatureVerifier { chain })
    }

    /// The SHA-256 of the public key `cert` holds: what stays the same however the
    /// certificate's bytes are encoded (a relay can re-encode the CA's ECDSA signature on it
    /// so that it still verifies under another certificate hash), and differs from one
    /// node process to the next (each generates its key).
    pub fn public_key_fingerprint(cert: &[u8]) -> Result<[u8; 32], TransportError> {
        use sha2::Digest;
        let (_, parsed) = x509_parser::parse_x509_certificate(cert)
            .map_err(|e| TransportError::BadPeerIdentity(format!("relayed certificate: {e}")))?;
        let point = parsed.public_key().subject_public_key.data.as_ref();
        Ok(sha2::Sha256::digest(point).into())
    }

    /// Verifies that `cert` was issued by the cluster CA and that `sig` over `msg` was made
    /// with its key by a [`Signer`] (behind [`SIGNING_CONTEXT`]); returns the node the
    /// certificate names.
    pub fn verify(&self, cert: &[u8], msg: &[u8], sig: &[u8]) -> Result<NodeId, TransportError> {
        self.verify_signer(cert, msg, sig).map(|(node, _)| node)
    }

    /// [`verify`](Self::verify), returning also the certificate's
    /// [`public_key_fingerprint`](Self::public_key_fingerprint), from the same parse.
    pub fn verify_signer(
        &self,
        cert: &[u8],
        msg: &[u8],
        sig: &[u8],
    ) -> Result<(NodeId, [u8; 32]), TransportError> {
        use sha2::Digest;
        let der = CertificateDer::from(cert);
        self.chain
            .verify_client_cert(&der, &[], UnixTime::now())
            .map_err(|e| TransportError::BadPeerIdentity(format!("relayed certificate: {e}")))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(cert)
            .map_err(|e| TransportError::BadPeerIdentity(format!("relayed certificate: {e}")))?;
        let point = parsed.public_key().subject_public_key.data.as_ref();
        UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, point)
            .verify(&in_context(msg), sig)
            .map_err(|_| {
                TransportError::BadPeerIdentity("bad signature on a relayed frame".into())
            })?;
        Ok((node_id_from_cert(&der)?, sha2::Sha256::digest(point).into()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::ClusterCa;

    /// Two certificates of one key (issued twice from one request: other serial numbers,
    /// other bytes) have one public-key fingerprint; another key has another.
    #[test]
    fn a_public_key_fingerprint_follows_the_key_not_the_certificate_bytes() {
        let ca = ClusterCa::generate().unwrap();
        let (csr, _key) = crate::generate_csr().unwrap();
        let a = ca.sign_request(&csr, NodeId(3)).unwrap();
        let b = ca.sign_request(&csr, NodeId(3)).unwrap();
        assert_ne!(a.as_ref(), b.as_ref());
        let fp = SignatureVerifier::public_key_fingerprint;
        assert_eq!(fp(a.as_ref()).unwrap(), fp(b.as_ref()).unwrap());
        let other = ca.issue(NodeId(3)).unwrap();
        assert_ne!(fp(a.as_ref()).unwrap(), fp(other.cert_der()).unwrap());
        assert!(fp(b"not a certificate").is_err());
    }

    /// A signature covers the signing context before the message: it does not verify as
    /// a signature of the message alone, so no message makes the key sign bytes of the
    /// caller's choosing (a TLS handshake's, say).
    #[test]
    fn a_signature_covers_the_context_not_the_bare_message() {
        let ca = ClusterCa::generate().unwrap();
        let a = ca.issue(NodeId(3)).unwrap();
        let signer = Signer::new(&a).unwrap();
        let sig = signer.sign(b"hello").unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(a.cert_der()).unwrap();
        let point = parsed.public_key().subject_public_key.data.as_ref();
        let key = UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, point);
        assert!(key.verify(b"hello", &sig).is_err());
        assert!(key
            .verify(&[SIGNING_CONTEXT, b"hello"].concat(), &sig)
            .is_ok());
    }

    #[test]
    fn signatures_verify_only_for_the_signer_and_message() {
        let ca = ClusterCa::generate().unwrap();
        let a = ca.issue(NodeId(3)).unwrap();
        let signer = Signer::new(&a).unwrap();
        let v = SignatureVerifier::new(&ca.cert_der()).unwrap();
        let sig = signer.sign(b"hello").unwrap();
        assert_eq!(v.verify(a.cert_der(), b"hello", &sig).unwrap(), NodeId(3));
        // With the signer's key fingerprint, the same as the certificate's.
        assert_eq!(
            v.verify_signer(a.cert_der(), b"hello", &sig).unwrap(),
            (
                NodeId(3),
                SignatureVerifier::public_key_fingerprint(a.cert_der()).unwrap()
            )
        );
        assert!(v.verify(a.cert_der(), b"hellO", &sig).is_err());
        // Another node's certificate with this signature: refused.
        let b = ca.issue(NodeId(4)).unwrap();
        assert!(v.verify(b.cert_der(), b"hello", &sig).is_err());
        // A certificate from another CA, self-consistent signature: refused.
        let other = ClusterCa::generate().unwrap().issue(NodeId(3)).unwrap();
        let osig = Signer::new(&other).unwrap().sign(b"hello").unwrap();
        assert!(v.verify(other.cert_der(), b"hello", &osig).is_err());
    }
}
