//! Join strings and the messages of the bootstrap channel.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::BootstrapError;

/// Version of the bootstrap protocol (3: the peer list and plans carry each member's
/// certificate fingerprint).
pub(crate) const BOOT_VERSION: u16 = 3;
/// Largest bootstrap message accepted where nothing below says otherwise (a certificate
/// request, a reason, a short list).
pub(crate) const MAX_MSG: usize = 256 << 10;
/// Largest message a worker reads from the seed (which it has authenticated by the pinned
/// certificate of its join string): a peer list or plan of up to [`max_boot_world`]
/// members.
pub(crate) const MAX_FROM_SEED: usize = 64 << 20;
/// An upper bound on one member's bytes in a peer list or plan (a node id, an IPv6
/// address and port, a certificate fingerprint; about 70 encoded).
const MEMBER_BYTES: usize = 128;
/// An upper bound on one member's bytes in a worker's message to the seed (a node id in
/// each of a resize point's two lists).
const ID_BYTES: usize = 24;

/// The largest world whose peer list and plans fit a message from the seed.
pub(crate) const fn max_boot_world() -> usize {
    (MAX_FROM_SEED - MAX_MSG) / MEMBER_BYTES
}

/// The largest message the seed reads from an admitted worker of a cluster of at most
/// `max_world` members (a resize point lists the members).
pub(crate) fn max_from_worker(max_world: usize) -> usize {
    MAX_MSG.saturating_add(max_world.saturating_mul(ID_BYTES))
}
/// Label for the keying material exported from the TLS session.
const EKM_LABEL: &[u8] = b"EXPORTER-nexar-join-proof";

/// The cluster secret: 32 random bytes. Its `Debug` output is redacted, and `==` takes
/// the same time wherever two secrets differ.
#[derive(Clone)]
pub struct Secret(pub [u8; 32]);

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl Eq for Secret {}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A fresh random secret from the operating system's generator.
    pub fn random() -> Secret {
        Secret(rand::random())
    }

    /// Parses 64 hex digits (surrounding whitespace ignored, e.g. from a file).
    pub fn from_hex(s: &str) -> Result<Secret, BootstrapError> {
        let bytes = hex::decode(s.trim()).map_err(|e| BootstrapError::BadSecret(e.to_string()))?;
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| BootstrapError::BadSecret("must be 32 bytes (64 hex digits)".into()))?;
        Ok(Secret(arr))
    }

    /// The secret as 64 hex digits.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// HMAC-SHA256 over `ekm` (keying material exported from the TLS session) and `role`.
    pub(crate) fn prove(&self, ekm: &[u8], role: &[u8]) -> Vec<u8> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        mac.update(ekm);
        mac.update(role);
        mac.finalize().into_bytes().to_vec()
    }

    /// Constant-time check of a proof made by [`Secret::prove`].
    pub(crate) fn verify(&self, ekm: &[u8], role: &[u8], proof: &[u8]) -> bool {
        let Ok(mut mac) = <Hmac<Sha256> as Mac>::new_from_slice(&self.0) else {
            return false;
        };
        mac.update(ekm);
        mac.update(role);
        mac.verify_slice(proof).is_ok()
    }
}

/// Exports 32 bytes of keying material bound to this connection's TLS session.
pub(crate) fn session_ekm(conn: &quinn::Connection) -> Result<[u8; 32], BootstrapError> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, EKM_LABEL, b"")
        .map_err(|_| BootstrapError::Protocol("cannot export TLS keying material".into()))?;
    Ok(out)
}

/// Everything a worker needs to join: `nexar://ADDR/SECRET_HEX/FINGERPRINT_HEX`.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinString {
    /// The seed's bootstrap address.
    pub seed: SocketAddr,
    /// The cluster secret.
    pub secret: Secret,
    /// SHA-256 of the seed's certificate.
    pub fingerprint: [u8; 32],
}

impl fmt::Debug for JoinString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinString")
            .field("seed", &self.seed)
            .field("fingerprint", &hex::encode(self.fingerprint))
            .finish_non_exhaustive()
    }
}

impl fmt::Display for JoinString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "nexar://{}/{}/{}",
            self.seed,
            self.secret.to_hex(),
            hex::encode(self.fingerprint)
        )
    }
}

impl FromStr for JoinString {
    type Err = BootstrapError;

    /// Parses `nexar://ADDR/SECRET_HEX/FINGERPRINT_HEX`. Errors never repeat the string's
    /// parts: one misplaced `/` puts the secret into another part, and the error ends up
    /// in logs.
    fn from_str(s: &str) -> Result<JoinString, BootstrapError> {
        let bad = |m: &str| BootstrapError::BadJoinString(m.to_string());
        let rest = s
            .trim()
            .strip_prefix("nexar://")
            .ok_or_else(|| bad("missing nexar:// prefix"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [addr, secret, fp] = parts[..] else {
            return Err(bad(&format!(
                "expected nexar://ADDR/SECRET/FINGERPRINT, found {} part(s) after nexar://",
                parts.len()
            )));
        };
        let seed = addr
            .parse()
            .map_err(|_| bad("the seed address is not IP:PORT"))?;
        let fingerprint = hex::decode(fp)
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| bad("the fingerprint is not 64 hex digits"))?;
        let secret =
            Secret::from_hex(secret).map_err(|_| bad("the secret is not 64 hex digits"))?;
        Ok(JoinString {
            seed,
            secret,
            fingerprint,
        })
    }
}

/// Messages on the bootstrap stream (each a u32 big-endian length and a postcard body).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum BootMsg {
    /// Worker -> seed: proof of the secret, a certificate request, an optional rank.
    Hello {
        version: u16,
        proof: Vec<u8>,
        csr: Vec<u8>,
        rank: Option<u32>,
    },
    /// Seed -> worker: admitted as `rank` of `world`, with its certificate and the CA.
    Welcome {
        rank: u32,
        world: u32,
        cert: Vec<u8>,
        ca: Vec<u8>,
    },
    /// Worker -> seed: the mesh endpoint is listening (port; advertised address if set).
    Listening {
        port: u16,
        advertise: Option<SocketAddr>,
    },
    /// Seed -> worker: every rank's mesh address and certificate (SHA-256 of its DER), in
    /// rank order.
    Peers {
        addrs: Vec<SocketAddr>,
        certs: Vec<[u8; 32]>,
    },
    /// Worker -> seed: the mesh is formed.
    Ready,
    /// Worker -> seed: the worker's job finished (`ok` says how).
    Done { ok: bool },
    /// Either way: refusal or failure with a reason.
    Refused { reason: String },
    /// Seed -> worker: a membership change (to the coordinator of a resize point, and to
    /// each node it admits into the running cluster).
    Plan(Plan),
    /// Coordinator -> seed: the members have reached a resize point; `leaving` want out.
    Resize {
        members: Vec<u64>,
        leaving: Vec<u64>,
    },
    /// Coordinator -> seed: every member of `epoch`'s communicator has it.
    Committed { epoch: u64 },
}

/// A membership change decided by the seed at a resize point.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Plan {
    /// Membership epoch (1 for the first change after formation).
    pub(crate) epoch: u64,
    /// Id of the new communicator.
    pub(crate) comm: u64,
    /// The new members in rank order: node id and mesh address. Members that stay keep
    /// their relative order and come first; joining nodes follow in the order they joined.
    pub(crate) members: Vec<(u64, SocketAddr)>,
    /// Each member's certificate (SHA-256 of its DER), in the order of `members`: the only
    /// one the others accept for that node.
    pub(crate) certs: Vec<[u8; 32]>,
    /// Why requested departures were refused (the world would drop below its minimum).
    pub(crate) note: Option<String>,
}

pub(crate) async fn write_msg(
    send: &mut quinn::SendStream,
    msg: &BootMsg,
) -> Result<(), BootstrapError> {
    write_frame(send, encode_frame(msg)?).await
}

/// `msg` as it goes on a stream: its length (4 bytes, big-endian), then its postcard
/// encoding. One encoding can go to many streams ([`write_frame`]): quinn keeps the bytes
/// it is given until they are acknowledged, without a copy per stream.
pub(crate) fn encode_frame(msg: &BootMsg) -> Result<bytes::Bytes, BootstrapError> {
    let body = postcard::to_stdvec(msg).map_err(|e| BootstrapError::Protocol(e.to_string()))?;
    let len = u32::try_from(body.len())
        .map_err(|_| BootstrapError::Protocol(format!("a message of {} bytes", body.len())))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame.into())
}

/// Writes a message that [`encode_frame`] encoded.
pub(crate) async fn write_frame(
    send: &mut quinn::SendStream,
    frame: bytes::Bytes,
) -> Result<(), BootstrapError> {
    send.write_chunk(frame)
        .await
        .map_err(|e| BootstrapError::Protocol(format!("write: {e}")))
}

/// [`write_msg`] within `within`, or an error saying the peer took nothing: one that
/// grants no flow-control credit would otherwise hold the write for ever. Cut short, the
/// stream may be mid-message.
pub(crate) async fn write_within(
    send: &mut quinn::SendStream,
    msg: &BootMsg,
    within: Duration,
) -> Result<(), BootstrapError> {
    write_frame_within(send, encode_frame(msg)?, within).await
}

/// [`write_within`] for a message that [`encode_frame`] encoded.
pub(crate) async fn write_frame_within(
    send: &mut quinn::SendStream,
    frame: bytes::Bytes,
    within: Duration,
) -> Result<(), BootstrapError> {
    tokio::time::timeout(within, write_frame(send, frame))
        .await
        .map_err(|_| {
            BootstrapError::Protocol(format!("the peer took no message within {within:?}"))
        })?
}

/// Writes `msg` as the stream's last message and waits until the peer has it (so that
/// closing the connection next cannot swallow it), for at most `within` in all; the
/// caller closes either way.
pub(crate) async fn send_last(send: &mut quinn::SendStream, msg: &BootMsg, within: Duration) {
    let _ = tokio::time::timeout(within, async {
        if write_msg(send, msg).await.is_ok() {
            let _ = send.finish();
            let _ = send.stopped().await;
        }
    })
    .await;
}

/// Reads one message; `None` at a clean end of stream.
pub(crate) async fn read_msg(
    recv: &mut quinn::RecvStream,
) -> Result<Option<BootMsg>, BootstrapError> {
    read_msg_max(recv, MAX_MSG).await
}

/// The largest hello a seed reads (a certificate request and a proof take about 1 KiB).
pub(crate) const MAX_HELLO: usize = 16 << 10;

/// [`read_msg`] of a message of at most `max` bytes.
pub(crate) async fn read_msg_max(
    recv: &mut quinn::RecvStream,
    max: usize,
) -> Result<Option<BootMsg>, BootstrapError> {
    let mut len = [0u8; 4];
    match recv.read_exact(&mut len).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(BootstrapError::Protocol(format!("read: {e}"))),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n > max {
        return Err(BootstrapError::Protocol(format!(
            "message of {n} bytes exceeds {max}"
        )));
    }
    let mut body = vec![0u8; n];
    recv.read_exact(&mut body)
        .await
        .map_err(|e| BootstrapError::Protocol(format!("read: {e}")))?;
    postcard::from_bytes(&body)
        .map(Some)
        .map_err(|e| BootstrapError::Protocol(format!("undecodable message: {e}")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn join_string_round_trips_v4_and_v6() {
        for addr in ["127.0.0.1:4000", "[::1]:4000", "[fe80::1]:9"] {
            let j = JoinString {
                seed: addr.parse().unwrap(),
                secret: Secret::random(),
                fingerprint: [7; 32],
            };
            let parsed: JoinString = j.to_string().parse().unwrap();
            assert_eq!(parsed, j);
        }
    }

    #[test]
    fn a_peer_list_and_a_plan_of_the_largest_world_fit_a_message_from_the_seed() {
        let world = max_boot_world();
        // The largest entries: IPv6 addresses with five-digit ports, node ids of 10 bytes.
        let addr: SocketAddr = "[fd00:1:2:3:4:5:6:7]:65535".parse().unwrap();
        let certs = vec![[0xff; 32]; world];
        let peers = BootMsg::Peers {
            addrs: vec![addr; world],
            certs: certs.clone(),
        };
        let plan = BootMsg::Plan(Plan {
            epoch: u64::MAX,
            comm: u64::MAX,
            members: vec![(u64::MAX, addr); world],
            certs,
            note: Some("x".repeat(1000)),
        });
        for msg in [peers, plan] {
            let len = postcard::to_stdvec(&msg).unwrap().len();
            assert!(len <= MAX_FROM_SEED, "{len} bytes");
            // Well past the general cap: a cap that did not grow would refuse it.
            assert!(len > 64 * MAX_MSG, "{len} bytes");
        }
        let resize = BootMsg::Resize {
            members: vec![u64::MAX; world],
            leaving: vec![u64::MAX; world],
        };
        let len = postcard::to_stdvec(&resize).unwrap().len();
        assert!(len <= max_from_worker(world), "{len} bytes");
    }

    #[test]
    fn bad_join_strings_are_rejected() {
        for s in [
            "",
            "http://x",
            "nexar://127.0.0.1:1/zz/00",
            "nexar://nothost/00/00",
            "nexar://127.0.0.1:1/00/00",
        ] {
            assert!(s.parse::<JoinString>().is_err(), "{s}");
        }
    }

    /// A join string with one `/` too many (or too few) is refused, and no error names
    /// the secret, wherever the split put it.
    #[test]
    fn join_string_errors_never_repeat_the_secret() {
        let good = JoinString {
            seed: "10.0.0.1:7000".parse().unwrap(),
            secret: Secret::random(),
            fingerprint: [7; 32],
        };
        let hex = good.secret.to_hex();
        let fp = hex::encode(good.fingerprint);
        let addr = good.seed;
        let mut bad_secret = hex.clone();
        bad_secret.replace_range(10..11, "x");
        for s in [
            format!("{good}/"),
            format!("nexar://{addr}/extra/{hex}/{fp}"),
            format!("nexar://{addr}/{hex}"),
            format!("nexar://{addr}/{hex}/{fp}/x"),
            format!("nexar://{addr}/{bad_secret}/{fp}"),
            format!("nexar://{addr}/{hex}/{}", &fp[2..]),
            format!("nexar://{addr}x/{hex}/{fp}"),
        ] {
            let e = s.parse::<JoinString>().unwrap_err().to_string();
            assert!(
                !e.contains(&hex[..16]) && !e.contains(&bad_secret[..16]),
                "{s}: {e}"
            );
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_secret_and_session() {
        let s = Secret::random();
        let p = s.prove(b"session-a", b"worker");
        assert!(s.verify(b"session-a", b"worker", &p));
        assert!(!s.verify(b"session-b", b"worker", &p));
        assert!(!Secret::random().verify(b"session-a", b"worker", &p));
        assert!(!format!("{s:?}").contains(&s.to_hex()));
    }
}
