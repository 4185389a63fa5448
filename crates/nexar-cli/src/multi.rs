//! Multi-process clusters: watching a seed form its cluster, and what a worker knows
//! about itself, for `nexar seed` and `nexar worker`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
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
}
