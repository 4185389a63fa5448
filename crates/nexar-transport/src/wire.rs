//! Wire format: a frame is `[u16 header length, big endian][postcard FrameHeader][payload
//! bytes]`; the payload never passes through serde. Frames travel on unidirectional QUIC
//! streams in one of two ways:
//! - a frame whose payload is over [`MESSAGE_FRAME_BYTES`](crate::MESSAGE_FRAME_BYTES),
//!   and every control or relay frame, has a stream of its own: the frame, then FIN;
//! - smaller data frames, heartbeats, abandonment notices and farewells share the
//!   connection's message stream, which starts with a zero header length (two zero
//!   bytes, which no frame begins with) and then carries frames back to back. A sender has one at a time per connection; should one end part-way through a
//!   frame, the receiver discards that frame and the sender's next frame opens a new one.

use serde::{Deserialize, Serialize};

/// Version of the frame format; a frame with another version is refused. (2: frames of
/// kind [`FrameKind::Abandoned`]. 3: a relay frame's header carries its hop count in
/// `step`, which picks the relay budget it takes. 4: frames of kind
/// [`FrameKind::Farewell`].)
pub const PROTOCOL_VERSION: u8 = 4;

/// Largest encoded header accepted (postcard varints keep real headers at 52 bytes at
/// most: version and kind, then five varints of up to 10 bytes).
pub const MAX_HEADER_BYTES: usize = 64;

/// What a frame is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FrameKind {
    /// Payload for a keyed mailbox (point-to-point or a collective step).
    Data,
    /// Liveness beacon; carries no payload (one with a payload is refused).
    Heartbeat,
    /// Runtime control message, routed to the node's control channel.
    Control,
    /// A frame for another node, travelling through this one (sparse topologies). The
    /// payload is an envelope that names the origin and destination and is signed by the
    /// origin.
    Relay,
    /// The sender gave up on the data frame with this key (a send that failed part-way:
    /// see [`MailboxTable::abandon`](crate::MailboxTable::abandon)); carries no payload.
    Abandoned,
    /// The sender is done with this connection's peer: its job is over and it will send
    /// nothing more. It closes the connection once the peer has said the same (so
    /// nothing either sent is still in flight when it closes); carries no payload.
    Farewell,
    /// Trusted lane only: the sender asks to send the data frame with this key; the
    /// payload is its length (8 bytes, big endian). See [`TcpLane::announce`](crate::TcpLane::announce).
    Announce,
    /// Trusted lane only: the answer to an [`Announce`](Self::Announce) with this key (its
    /// receiver takes the frame, or will discard it); carries no payload.
    Clear,
    /// Trusted lane only: the receiver gives back credit for data frames sent on it
    /// ([`TcpLane::take_credit`](crate::TcpLane::take_credit)); the payload is the
    /// number of bytes (8 bytes, big endian).
    Credit,
}

/// The header in front of every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrameHeader {
    /// Must equal [`PROTOCOL_VERSION`].
    pub version: u8,
    /// Frame kind.
    pub kind: FrameKind,
    /// Communicator id.
    pub comm: u64,
    /// Tag: a collective's sequence number or a point-to-point tag.
    pub tag: u64,
    /// Step within the tag (a collective's message index, or a point-to-point sequence).
    pub step: u64,
    /// Sender's node id; must match the certificate of the connection it arrives on.
    pub src: u64,
    /// Payload length in bytes.
    pub len: u64,
}

impl FrameHeader {
    /// A header of the current version.
    pub fn new(kind: FrameKind, comm: u64, tag: u64, step: u64, src: u64, len: u64) -> FrameHeader {
        FrameHeader {
            version: PROTOCOL_VERSION,
            kind,
            comm,
            tag,
            step,
            src,
            len,
        }
    }

    /// The encoded header (length prefix included) of a frame carrying `len` payload bytes
    /// from `src`, or `FrameTooLarge` when `len` exceeds `max`: the check and encoding every
    /// lane does before it sends.
    pub(crate) fn for_payload(
        kind: FrameKind,
        comm: u64,
        tag: u64,
        step: u64,
        src: u64,
        len: usize,
        max: u64,
    ) -> Result<bytes::Bytes, crate::TransportError> {
        let len = len as u64;
        if len > max {
            return Err(crate::TransportError::FrameTooLarge { len, max });
        }
        Ok(bytes::Bytes::from(
            FrameHeader::new(kind, comm, tag, step, src, len).encode(),
        ))
    }

    /// Encodes the length prefix and header.
    pub fn encode(&self) -> Vec<u8> {
        // Room for the largest header up front: growing from two bytes cost several
        // reallocations per frame.
        let mut out = Vec::with_capacity(2 + MAX_HEADER_BYTES);
        out.extend_from_slice(&[0, 0]);
        // Serialising a fixed struct into a Vec cannot fail.
        match postcard::to_extend(self, out) {
            Ok(mut v) => {
                let n = (v.len() - 2) as u16;
                v[..2].copy_from_slice(&n.to_be_bytes());
                v
            }
            Err(_) => unreachable!("postcard to a Vec never fails"),
        }
    }

    /// Decodes a header body (without the length prefix).
    pub fn decode(bytes: &[u8]) -> Result<FrameHeader, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

/// Application error codes used when a receiver stops a stream it refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum StreamRefusal {
    /// Payload length over the configured maximum.
    FrameTooLarge = 1,
    /// Header missing, over [`MAX_HEADER_BYTES`], or not decodable.
    BadHeader = 2,
    /// Unknown protocol version.
    BadVersion = 3,
    /// The stream carried fewer or more payload bytes than the header said, or could not
    /// be read to its end (a reset).
    LengthMismatch = 4,
    /// Header `src` differs from the authenticated peer.
    SourceMismatch = 5,
    /// A frame for this mailbox key is already buffered.
    Duplicate = 6,
    /// The frame belongs to a collective this node has finished or abandoned, or its
    /// sender abandoned it (a notice came first).
    Retired = 7,
    /// The node is shutting down, the connection ended, the sender was declared lost, or
    /// the frame waited past the node's discard time.
    Shutdown = 8,
    /// The frame's body brought no new byte for the receiver's
    /// [`body_timeout`](crate::TransportConfig::body_timeout).
    Stalled = 9,
}

impl StreamRefusal {
    /// The QUIC error code sent with STOP_SENDING.
    pub fn code(self) -> quinn::VarInt {
        quinn::VarInt::from_u32(self as u32)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn header_round_trip_and_size() {
        let h = FrameHeader::new(
            FrameKind::Data,
            u64::MAX,
            u64::MAX,
            u64::MAX,
            u64::MAX,
            u64::MAX,
        );
        let enc = h.encode();
        let n = u16::from_be_bytes([enc[0], enc[1]]) as usize;
        assert_eq!(n, enc.len() - 2);
        assert!(n <= MAX_HEADER_BYTES);
        assert_eq!(FrameHeader::decode(&enc[2..]).unwrap(), h);
    }

    #[test]
    fn garbage_does_not_decode() {
        assert!(FrameHeader::decode(&[0xff; 3]).is_err());
    }
}
