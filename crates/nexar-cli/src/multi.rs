//! Multi-process clusters: watching a seed form its cluster, and what a worker knows
//! about itself, for `nexar seed` and `nexar worker`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use nexar_actors::{BootstrapError, Node, Seed};

use crate::{ClusterInfo, RankInfo};

/// How often [`wait_formed_with_progress`] looks at the admitted ranks.
pub const PROGRESS_POLL: Duration = Duration::from_millis(500);

/// Waits until `seed` has formed its cluster, like [`Seed::wait_formed`], calling
/// `progress` with the admitted ranks (ascending) first and then whenever they change,
/// checked every `poll`.
///
/// Ends when the cluster forms or formation fails; the seed's formation deadline
/// ([`SeedOptions::formation_timeout`](nexar_actors::SeedOptions)) bounds the wait, and its
/// error names the ranks that did not arrive.
pub async fn wait_formed_with_progress(
    seed: &Seed,
    poll: Duration,
    mut progress: impl FnMut(&[usize]),
) -> Result<Vec<SocketAddr>, BootstrapError> {
    let mut last = None;
    loop {
        let admitted = seed.admitted();
        if last.as_ref() != Some(&admitted) {
            progress(&admitted);
            last = Some(admitted);
        }
        if let Ok(formed) = tokio::time::timeout(poll, seed.wait_formed()).await {
            return formed;
        }
    }
}

/// Waits for the seed's cluster to finish its job ([`Seed::wait_finished`]), calling
/// `progress` with the number of nodes waiting to join each time it changes (looked at
/// every `poll`). Ends when every member reported its job done, or left.
pub async fn wait_finished_with_progress(
    seed: &Seed,
    poll: Duration,
    mut progress: impl FnMut(usize),
) -> Result<nexar_actors::SeedReport, BootstrapError> {
    let mut last = 0;
    loop {
        let queued = seed.queued();
        if queued != last {
            progress(queued);
            last = queued;
        }
        if let Ok(finished) = tokio::time::timeout(poll, seed.wait_finished()).await {
            return finished;
        }
    }
}

/// An `--advertise` value: `HOST:PORT`, an IP, or a host name (port 0 where none is
/// given), with every address a name resolves to, so that one of the listener's family
/// can be picked.
#[derive(Clone, Debug, PartialEq)]
pub struct Advertise(Vec<SocketAddr>);

impl Advertise {
    /// Parses `HOST:PORT`, a bare IP or a bare host name.
    pub fn parse(s: &str) -> Result<Advertise, String> {
        if let Ok(addr) = s.parse::<SocketAddr>() {
            return Ok(Advertise(vec![addr]));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Advertise(vec![SocketAddr::new(ip, 0)]));
        }
        let resolved = match s.rsplit_once(':') {
            Some((_, port)) if port.parse::<u16>().is_ok() => s.to_socket_addrs(),
            _ => (s, 0).to_socket_addrs(),
        };
        let addrs: Vec<SocketAddr> = resolved
            .map_err(|e| {
                format!("`{s}` is not HOST:PORT, an IP or a host name that resolves: {e}")
            })?
            .collect();
        if addrs.is_empty() {
            return Err(format!("`{s}` resolves to no address"));
        }
        Ok(Advertise(addrs))
    }

    /// The first address a socket bound at `listen` answers on: an IPv4 listener only
    /// IPv4 addresses; an IPv6 one any (a dual-stack socket takes IPv4 too).
    pub fn for_listener(&self, listen: SocketAddr) -> Result<SocketAddr, String> {
        self.0
            .iter()
            .copied()
            .find(|a| listen.is_ipv6() || a.is_ipv4())
            .ok_or_else(|| {
                format!(
                    "--advertise names only IPv6 addresses ({}), but the socket listens on \
                     IPv4 ({listen}): advertise an IPv4 address, or listen on [::]",
                    self.0[0].ip()
                )
            })
    }
}

/// The address peers most likely dial to reach a worker's mesh endpoint bound at `bound`:
/// `advertise` when given, else `bound` when its IP is specific, else the local IP this
/// host would use to reach `seed` (the seed records a worker at the address it sees it
/// from, which is that one unless a NAT sits in between), with the bound port.
///
/// Finding the route sends nothing: it only connects an unbound UDP socket.
pub fn mesh_addr(bound: SocketAddr, advertise: Option<SocketAddr>, seed: SocketAddr) -> SocketAddr {
    if let Some(addr) = advertise {
        return addr;
    }
    if !bound.ip().is_unspecified() {
        return bound;
    }
    let any = if seed.is_ipv6() {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    };
    let routed = UdpSocket::bind(SocketAddr::new(any, 0))
        .and_then(|sock| {
            sock.connect(seed)?;
            sock.local_addr()
        })
        .map(|local| local.ip());
    SocketAddr::new(routed.unwrap_or(bound.ip()), bound.port())
}

/// Describes the one rank `node` holds: its world size and a single [`RankInfo`] whose
/// `addr` is `mesh` (see [`mesh_addr`]).
pub fn node_info(node: &Node, mesh: Option<SocketAddr>) -> ClusterInfo {
    let comm = node.communicator();
    let rank = comm.rank();
    ClusterInfo {
        world: comm.world_size(),
        ranks: vec![RankInfo {
            rank,
            node: comm.members()[rank],
            addr: mesh,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_addr_prefers_advertise_then_a_specific_bind() {
        let seed: SocketAddr = "127.0.0.1:7000".parse().expect("addr");
        let adv: SocketAddr = "10.0.0.5:9000".parse().expect("addr");
        let bound: SocketAddr = "127.0.0.1:4000".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:4000".parse().expect("addr");
        assert_eq!(mesh_addr(any, Some(adv), seed), adv);
        assert_eq!(mesh_addr(bound, None, seed), bound);
        // Loopback routes to a seed on loopback through loopback.
        assert_eq!(mesh_addr(any, None, seed), bound);
    }

    #[test]
    fn advertise_takes_an_address_an_ip_or_a_name() {
        let one = |s: &str| Advertise::parse(s).map(|a| a.0);
        let addr = |s: &str| s.parse::<SocketAddr>().expect("addr");
        assert_eq!(one("10.0.0.1:7000"), Ok(vec![addr("10.0.0.1:7000")]));
        assert_eq!(one("10.0.0.1"), Ok(vec![addr("10.0.0.1:0")]));
        assert_eq!(one("[::1]:7000"), Ok(vec![addr("[::1]:7000")]));
        assert!(one("localhost").is_ok_and(|a| a.iter().all(|a| a.port() == 0)));
        assert!(one("localhost:7001").is_ok_and(|a| a.iter().all(|a| a.port() == 7001)));
        assert!(Advertise::parse("no such host.invalid").is_err());
    }

    #[test]
    fn advertise_picks_an_address_the_listener_answers_on() {
        let addr = |s: &str| s.parse::<SocketAddr>().expect("addr");
        let both = Advertise(vec![addr("[::1]:7000"), addr("127.0.0.1:7000")]);
        assert_eq!(
            both.for_listener(addr("0.0.0.0:7000")),
            Ok(addr("127.0.0.1:7000"))
        );
        assert_eq!(both.for_listener(addr("[::]:7000")), Ok(addr("[::1]:7000")));
        let v6 = Advertise(vec![addr("[::1]:0")]);
        let err = v6.for_listener(addr("127.0.0.1:0")).expect_err("family");
        assert!(err.contains("IPv4"), "{err}");
        assert_eq!(v6.for_listener(addr("[::]:0")), Ok(addr("[::1]:0")));
    }
}
