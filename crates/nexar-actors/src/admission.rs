//! Places for handshakes a listener holds before the client has authenticated: so many
//! in all, and a quarter of them (at least one) from any one IP address, so that no one
//! host can take them all and keep everyone else out. And the log of the handshakes a
//! listener rejects, which no client can flood.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use nexar_transport::WarnThrottle;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The handshake places of one listener.
#[derive(Debug)]
pub(crate) struct Admission {
    all: Arc<Semaphore>,
    per_source: usize,
    sources: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// Why [`Admission::admit`] found no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// The client's address holds its share already.
    Source,
    /// Every place is held.
    All,
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Full::Source => "too many handshakes from this address at once",
            Full::All => "too many handshakes at once",
        })
    }
}

impl Admission {
    /// Room for `most` handshakes at once (at least 1), `most / 4` (at least 1) of them
    /// from any one address.
    pub(crate) fn new(most: usize) -> Admission {
        let most = most.clamp(1, Semaphore::MAX_PERMITS);
        Admission {
            all: Arc::new(Semaphore::new(most)),
            per_source: (most / 4).max(1),
            sources: Arc::default(),
        }
    }

    /// [`admit`](Self::admit) for `client` at `remote`: the client back with its place,
    /// or, without a place, the client refused with `refuse` (and the `what` handshake
    /// said at debug level).
    pub(crate) fn admit_or_refuse<C>(
        &self,
        client: C,
        remote: std::net::SocketAddr,
        what: &str,
        refuse: impl FnOnce(C),
    ) -> Option<(C, HandshakeSlot)> {
        match self.admit(remote.ip()) {
            Ok(slot) => Some((client, slot)),
            Err(full) => {
                tracing::debug!(%remote, "{what} handshake refused: {full}");
                refuse(client);
                None
            }
        }
    }

    /// A place for a client at `ip`, held until the returned slot is dropped. Addresses
    /// count by source: IPv4-mapped ones as IPv4, IPv6 ones by their /64 (one host holds
    /// a whole /64, and could show a QUIC retry as many of its addresses as it likes).
    pub(crate) fn admit(&self, ip: IpAddr) -> Result<HandshakeSlot, Full> {
        let ip = match ip.to_canonical() {
            IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from_bits(
                v6.to_bits() & !((1u128 << 64) - 1),
            )),
            v4 => v4,
        };
        let source = {
            let mut map = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
            let held = map.entry(ip).or_insert(0);
            if *held >= self.per_source {
                return Err(Full::Source);
            }
            *held += 1;
            SourceSlot {
                sources: self.sources.clone(),
                ip,
            }
        };
        let all = self
            .all
            .clone()
            .try_acquire_owned()
            .map_err(|_| Full::All)?;
        Ok(HandshakeSlot {
            _all: all,
            _source: source,
        })
    }
}

/// A client's place among a listener's handshakes: one of all of them, and one of its
/// address's.
#[derive(Debug)]
pub(crate) struct HandshakeSlot {
    _all: OwnedSemaphorePermit,
    _source: SourceSlot,
}

/// One of the handshakes counted for an address, given back when dropped.
#[derive(Debug)]
struct SourceSlot {
    sources: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut map = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = map.get_mut(&self.ip) {
            *held -= 1;
            if *held == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// The handshakes a listener rejected, logged through a [`WarnThrottle`]: anyone who can
/// reach the listener can fail a handshake as often as it likes. Clones count together.
#[derive(Debug, Clone, Default)]
pub(crate) struct Rejections(WarnThrottle);

impl Rejections {
    /// Logs the rejection of the `what` handshake of the client at `remote`, and returns
    /// whether it was logged at warn level.
    pub(crate) fn report(
        &self,
        remote: std::net::SocketAddr,
        error: &dyn std::fmt::Display,
        what: &str,
    ) -> bool {
        match self.0.count() {
            Some(so_far) => {
                tracing::warn!(%remote, %error, so_far, "{what} handshake rejected");
                true
            }
            None => {
                tracing::debug!(%remote, %error, "{what} handshake rejected");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Admission, Full, Rejections};
    use nexar_transport::{
        EVENTS_PER_SUMMARY as REJECTIONS_PER_SUMMARY, WARNED_EVENTS as WARNED_REJECTIONS,
    };
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    /// An address gets a quarter of the places, the others the rest; places come back
    /// when their slots are dropped, an IPv4-mapped address counts as its IPv4 one, and
    /// IPv6 addresses count by their /64.
    #[test]
    fn each_address_holds_at_most_a_quarter_of_the_places() {
        let a = Admission::new(8);
        let one = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        let mapped = IpAddr::V6(Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        let held: Vec<_> = (0..2).map(|_| a.admit(one).expect("a place")).collect();
        assert_eq!(a.admit(one).err(), Some(Full::Source));
        assert_eq!(
            a.admit(mapped).err(),
            Some(Full::Source),
            "the same address"
        );
        // Two addresses of one /64 share its quarter.
        let host = |i: u16| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 1, 0, 0, 0, i));
        let one_host: Vec<_> = (0..2).map(|i| a.admit(host(i)).expect("a place")).collect();
        assert_eq!(a.admit(host(7)).err(), Some(Full::Source), "the same /64");
        let others: Vec<_> = (2..6)
            .map(|i| {
                a.admit(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, i, 0, 0, 0, 1)))
                    .expect("a place")
            })
            .collect();
        assert_eq!(
            a.admit(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9))).err(),
            Some(Full::All)
        );
        drop(held);
        assert!(a.admit(mapped).is_ok());
        drop((others, one_host));
        assert!(a.sources.lock().map(|m| m.len()).unwrap_or(usize::MAX) <= 1);
        assert_eq!(Admission::new(0).per_source, 1);
    }

    /// A listener says its first `WARNED_REJECTIONS` rejected handshakes at warn level and
    /// then one in `REJECTIONS_PER_SUMMARY`, counted across the clones its handshake tasks
    /// hold.
    #[test]
    fn rejections_past_the_first_few_are_warned_of_in_summaries() {
        let remote = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
        let log = Rejections::default();
        let warned: Vec<usize> = (0..3 * REJECTIONS_PER_SUMMARY)
            .filter(|i| log.clone().report(remote, &format!("failure {i}"), "test"))
            .collect();
        let summaries: Vec<usize> = (1..=3).map(|k| k * REJECTIONS_PER_SUMMARY - 1).collect();
        assert_eq!(
            warned[..WARNED_REJECTIONS],
            (0..WARNED_REJECTIONS).collect::<Vec<_>>()
        );
        assert_eq!(warned[WARNED_REJECTIONS..], summaries);
    }
}
