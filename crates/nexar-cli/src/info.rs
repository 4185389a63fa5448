//! A description of a cluster, for `nexar local info` and `nexar worker info`.

use std::net::SocketAddr;

use nexar_actors::{Cluster, NodeId};

/// What one rank of a cluster is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// The rank in the world communicator.
    pub rank: usize,
    /// The node behind the rank.
    pub node: NodeId,
    /// The UDP address the rank's QUIC endpoint listens on, when it could be read.
    pub addr: Option<SocketAddr>,
}

/// The shape of a cluster: its world size and the ranks described, in rank order (every
/// rank for an in-process cluster; only its own for a worker of a multi-process one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterInfo {
    /// Number of ranks.
    pub world: usize,
    /// One entry per rank described, in rank order.
    pub ranks: Vec<RankInfo>,
}

impl ClusterInfo {
    /// Describes `cluster` from its world communicators and listen addresses.
    pub fn of(cluster: &Cluster) -> ClusterInfo {
        let addrs = cluster.addrs();
        // `addrs` skips endpoints whose address cannot be read, so only trust it to line
        // up with the ranks when nothing was skipped.
        let complete = addrs.len() == cluster.world_size();
        let ranks = cluster
            .communicators()
            .iter()
            .map(|comm| {
                let rank = comm.rank();
                RankInfo {
                    rank,
                    node: comm.members()[rank],
                    addr: if complete {
                        addrs.get(rank).copied()
                    } else {
                        None
                    },
                }
            })
            .collect();
        ClusterInfo {
            world: cluster.world_size(),
            ranks,
        }
    }
}
