//! Transport tuning.
//!
//! Defaults come from measurements of quinn 0.11 on a 2-vCPU loopback (see
//! `shared/TRANSPORT-NOTES.md` and the crate docs): one connection is CPU-bound per packet,
//! so the UDP payload size is the largest lever (1472 B: ~0.55 GB/s, 6500 B with GSO:
//! ~1.4 GB/s, 65000 B: ~25% less CPU per byte again). quinn's GSO batches above 64 KiB are
//! refused by the kernel (EMSGSIZE, silently dropped), so the endpoint's socket splits
//! them, and MTU discovery may go up to 65000 bytes (it settles at the path's MTU). Windows are sized so one stream is never window-bound
//! on a LAN and so that the streams a receiver may park (early arrivals past the budget)
//! can never use up the connection window needed by the stream it is waiting for.

use std::sync::Arc;
use std::time::Duration;

use crate::TransportError;

/// Settings for a nexar QUIC endpoint. Every field has a documented default.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TransportConfig {
    /// Largest payload one frame may carry; bigger frames are refused (default 1 GiB).
    pub max_frame_bytes: u64,
    /// Bytes of early arrivals (frames nobody waits for yet) buffered per endpoint before
    /// readers stop reading and QUIC flow control pushes back (default 256 MiB).
    pub early_budget_bytes: usize,
    /// Per-stream receive window (default 16 MiB).
    pub stream_window: u32,
    /// Concurrent unidirectional streams a peer may open on one connection (default 32).
    /// The connection window is `stream_window * (max_streams + 1)`, so streams parked on
    /// the budget can never block the one a receiver waits for.
    pub max_streams: u32,
    /// Largest UDP payload, also the MTU discovery upper bound (default 65000: datagrams
    /// grow to what the path carries, from `initial_mtu` up; on loopback that is all of it).
    pub max_udp_payload: u16,
    /// Starting UDP payload before MTU discovery (default 1200, safe on any path).
    pub initial_mtu: u16,
    /// UDP socket send and receive buffer request in bytes (default 8 MiB; the kernel may
    /// clamp it).
    pub socket_buffer_bytes: usize,
    /// A connection silent this long is closed (default 10 s).
    pub idle_timeout: Duration,
    /// QUIC keep-alive interval (default 1 s).
    pub keep_alive: Duration,
    /// Deadline for reading a frame header once a stream opens (default 10 s).
    pub header_timeout: Duration,
    /// Deadline for a QUIC/TLS handshake (default 10 s).
    pub handshake_timeout: Duration,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            max_frame_bytes: 1 << 30,
            early_budget_bytes: 256 << 20,
            stream_window: 16 << 20,
            max_streams: 32,
            max_udp_payload: 65_000,
            initial_mtu: 1200,
            socket_buffer_bytes: 8 << 20,
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(1),
            header_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl TransportConfig {
    /// Builds the quinn transport configuration.
    pub(crate) fn quinn_transport(&self) -> Result<Arc<quinn::TransportConfig>, TransportError> {
        let bad = |e: &dyn std::fmt::Display| TransportError::TlsConfig(e.to_string());
        let mut t = quinn::TransportConfig::default();
        let conn_window = u64::from(self.stream_window) * (u64::from(self.max_streams) + 1);
        t.stream_receive_window(quinn::VarInt::from_u32(self.stream_window));
        t.receive_window(quinn::VarInt::from_u64(conn_window).map_err(|e| bad(&e))?);
        t.send_window(conn_window);
        t.max_concurrent_uni_streams(quinn::VarInt::from_u32(self.max_streams));
        t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(0));
        t.initial_mtu(self.initial_mtu.min(self.max_udp_payload));
        t.min_mtu(1200);
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_udp_payload);
        t.mtu_discovery_config(Some(mtu));
        t.keep_alive_interval(Some(self.keep_alive));
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout).map_err(|e| bad(&e))?;
        t.max_idle_timeout(Some(idle));
        Ok(Arc::new(t))
    }

    /// Builds the quinn endpoint configuration.
    pub(crate) fn quinn_endpoint(&self) -> Result<quinn::EndpointConfig, TransportError> {
        let mut e = quinn::EndpointConfig::default();
        e.max_udp_payload_size(self.max_udp_payload)
            .map_err(|err| TransportError::TlsConfig(err.to_string()))?;
        Ok(e)
    }
}
