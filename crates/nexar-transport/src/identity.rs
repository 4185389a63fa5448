//! Cluster certificate authority and node identities.
//!
//! Every node holds a certificate issued by the cluster CA whose subject alternative name
//! is `n<id>.nexar` (a DNS name). The transport derives a peer's [`NodeId`] only from that
//! verified certificate, never from anything the peer says.

use std::fmt;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};

use crate::TransportError;

/// Identity of a node in a cluster (in a formed cluster it equals the node's global rank).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

const NAME_SUFFIX: &str = ".nexar";

impl NodeId {
    /// The DNS name carried in this node's certificate and checked by TLS: `n<id>.nexar`.
    pub fn dns_name(self) -> String {
        format!("n{}{NAME_SUFFIX}", self.0)
    }

    /// Parses a name produced by [`NodeId::dns_name`], and only such a name: `n01.nexar`
    /// is refused, so a certificate names one node for the side that dials it (TLS
    /// matches `n1.nexar` exactly) and for the side that reads its name.
    pub fn from_dns_name(name: &str) -> Option<NodeId> {
        let digits = name.strip_prefix('n')?.strip_suffix(NAME_SUFFIX)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let id = NodeId(digits.parse().ok()?);
        (id.dns_name() == name).then_some(id)
    }
}

/// The cluster certificate authority: it issues one certificate per node.
pub struct ClusterCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa")
            .field("fingerprint", &fingerprint_hex(self.cert.der()))
            .finish_non_exhaustive()
    }
}

fn cert_err(e: impl fmt::Display) -> TransportError {
    TransportError::Certificate(e.to_string())
}

impl ClusterCa {
    /// Creates a fresh CA with a new ECDSA P-256 key.
    pub fn generate() -> Result<ClusterCa, TransportError> {
        let key = KeyPair::generate().map_err(cert_err)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "nexar cluster CA");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).map_err(cert_err)?;
        Ok(ClusterCa { cert, key })
    }

    /// The CA certificate (DER), the trust root every node pins.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// Issues an identity (a fresh key pair and a certificate naming `node`).
    pub fn issue(&self, node: NodeId) -> Result<NodeIdentity, TransportError> {
        let key = KeyPair::generate().map_err(cert_err)?;
        let cert = self
            .node_params(node)?
            .signed_by(&key, &self.cert, &self.key)
            .map_err(cert_err)?;
        Ok(NodeIdentity {
            node,
            cert: cert.der().clone(),
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
            ca: self.cert_der(),
        })
    }

    /// Signs a certificate signing request (DER) for `node`, ignoring whatever names the
    /// request asks for: the CA alone decides the identity. Private keys never leave the
    /// requesting node.
    pub fn sign_request(
        &self,
        csr_der: &[u8],
        node: NodeId,
    ) -> Result<CertificateDer<'static>, TransportError> {
        let csr = rcgen::CertificateSigningRequestParams::from_der(&csr_der.to_vec().into())
            .map_err(cert_err)?;
        let cert = self
            .node_params(node)?
            .signed_by(&csr.public_key, &self.cert, &self.key)
            .map_err(cert_err)?;
        Ok(cert.der().clone())
    }

    fn node_params(&self, node: NodeId) -> Result<CertificateParams, TransportError> {
        let mut params = CertificateParams::new(vec![node.dns_name()]).map_err(cert_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, node.dns_name());
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        Ok(params)
    }
}

/// A fresh key pair and a certificate signing request for it. The private key stays with
/// the caller; the request carries only the public key (the CA decides the node name).
pub fn generate_csr() -> Result<(Vec<u8>, PrivatePkcs8KeyDer<'static>), TransportError> {
    let key = KeyPair::generate().map_err(cert_err)?;
    let csr = CertificateParams::new(Vec::<String>::new())
        .map_err(cert_err)?
        .serialize_request(&key)
        .map_err(cert_err)?;
    Ok((
        csr.der().to_vec(),
        PrivatePkcs8KeyDer::from(key.serialize_der()),
    ))
}

/// A node's credentials: its certificate, private key and the cluster CA it trusts.
pub struct NodeIdentity {
    node: NodeId,
    cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
    ca: CertificateDer<'static>,
}

impl fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity {
            node: self.node,
            cert: self.cert.clone(),
            key: self.key.clone_key(),
            ca: self.ca.clone(),
        }
    }
}

impl NodeIdentity {
    /// Assembles an identity from parts, checking that `cert` names a nexar node and that
    /// `key` is an ECDSA P-256 key (PKCS#8), the kind nodes sign relayed frames with: any
    /// other fails here, not once the node runs. That `cert` is `key`'s is checked where
    /// the identity is first used ([`Endpoint::bind`](crate::Endpoint::bind)); that `ca`
    /// issued `cert`, by every peer's TLS handshake.
    pub fn from_parts(
        cert: CertificateDer<'static>,
        key: PrivatePkcs8KeyDer<'static>,
        ca: CertificateDer<'static>,
    ) -> Result<NodeIdentity, TransportError> {
        let node = node_id_from_cert(&cert)?;
        crate::signing::check_signing_key(key.secret_pkcs8_der())?;
        Ok(NodeIdentity {
            node,
            cert,
            key,
            ca,
        })
    }

    /// The node this identity names.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// This node's certificate (DER).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// The cluster CA certificate (DER) this node trusts.
    pub fn ca_der(&self) -> &CertificateDer<'static> {
        &self.ca
    }

    /// The private key (DER, PKCS#8). Secret: never send it anywhere.
    pub fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }
}

/// Extracts the node id from a certificate's `n<id>.nexar` subject alternative name.
/// Exactly one such name must be present.
pub fn node_id_from_cert(cert: &CertificateDer<'_>) -> Result<NodeId, TransportError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| TransportError::BadPeerIdentity(format!("unparsable certificate: {e}")))?;
    let san = parsed
        .subject_alternative_name()
        .map_err(|e| TransportError::BadPeerIdentity(format!("bad subject alternative name: {e}")))?
        .ok_or_else(|| {
            TransportError::BadPeerIdentity("certificate has no subject alternative name".into())
        })?;
    let mut found = None;
    for name in &san.value.general_names {
        if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
            if let Some(id) = NodeId::from_dns_name(dns) {
                if found.replace(id).is_some() {
                    return Err(TransportError::BadPeerIdentity(
                        "certificate names more than one node".into(),
                    ));
                }
            }
        }
    }
    found.ok_or_else(|| TransportError::BadPeerIdentity("certificate names no nexar node".into()))
}

/// SHA-256 of a certificate's DER bytes, as lower-case hex (used to pin a seed's certificate).
pub fn fingerprint_hex(cert: &CertificateDer<'_>) -> String {
    let digest = Sha256::digest(cert.as_ref());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn dns_name_round_trip() {
        for id in [0u64, 1, 7, 1234567] {
            assert_eq!(
                NodeId::from_dns_name(&NodeId(id).dns_name()),
                Some(NodeId(id))
            );
        }
        assert_eq!(NodeId::from_dns_name("n.nexar"), None);
        assert_eq!(NodeId::from_dns_name("nx1.nexar"), None);
        assert_eq!(NodeId::from_dns_name("n1.example"), None);
        // Leading zeros name node 1 to a reader, but TLS matches only `n1.nexar`.
        assert_eq!(NodeId::from_dns_name("n01.nexar"), None);
        assert_eq!(NodeId::from_dns_name("n00.nexar"), None);
    }

    /// An identity assembled with a key a node cannot sign relayed frames with (Ed25519
    /// here; TLS would take it) is refused when it is assembled, naming the kind needed.
    #[test]
    fn an_identity_with_a_key_that_is_not_p256_is_refused() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue(NodeId(3)).unwrap();
        let (_, p256) = generate_csr().unwrap();
        assert!(NodeIdentity::from_parts(id.cert_der().clone(), p256, id.ca_der().clone()).is_ok());
        let ed = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let ed = PrivatePkcs8KeyDer::from(ed.serialize_der());
        match NodeIdentity::from_parts(id.cert_der().clone(), ed, id.ca_der().clone()) {
            Err(TransportError::Certificate(why)) => assert!(why.contains("P-256"), "{why}"),
            other => panic!("an Ed25519 key was taken: {:?}", other.map(|i| i.node())),
        }
    }

    #[test]
    fn issued_cert_names_node() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue(NodeId(42)).unwrap();
        assert_eq!(node_id_from_cert(id.cert_der()).unwrap(), NodeId(42));
        assert_eq!(fingerprint_hex(id.ca_der()).len(), 64);
    }

    #[test]
    fn csr_is_signed_for_assigned_node_only() {
        let ca = ClusterCa::generate().unwrap();
        let key = KeyPair::generate().unwrap();
        // The requester asks to be node 9; the CA decides it is node 3.
        let csr = CertificateParams::new(vec![NodeId(9).dns_name()])
            .unwrap()
            .serialize_request(&key)
            .unwrap();
        let cert = ca.sign_request(csr.der(), NodeId(3)).unwrap();
        assert_eq!(node_id_from_cert(&cert).unwrap(), NodeId(3));
    }
}
