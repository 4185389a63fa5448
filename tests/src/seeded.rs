//! Clusters formed through a [`Seed`] in one process, over loopback.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use nexar_actors::{JoinOptions, NexarError, Node, NodeConfig, Seed};

/// 127.0.0.1, port 0.
pub const LOOPBACK: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

/// Deadline for a join or a whole step of a seeded test.
pub const DEADLINE: Duration = crate::STEP_DEADLINE;

/// Options for joining `seed` from loopback, with a 10 s admission deadline.
pub fn join_opts(seed: &Seed) -> JoinOptions {
    let mut o = JoinOptions::new(seed.join_string().clone());
    o.listen = LOOPBACK;
    o.timeout = Duration::from_secs(10);
    o
}

/// Joins `n` nodes with `config` concurrently (each bounded by [`DEADLINE`]) and returns
/// them sorted by rank. Panics if one fails.
pub async fn join_all_with(seed: &Seed, n: usize, config: &NodeConfig) -> Vec<Node> {
    join_all_where(seed, n, |o| o.config = config.clone()).await
}

/// Joins `n` nodes concurrently with [`join_opts`] as `adjust` leaves them (each bounded
/// by [`DEADLINE`]) and returns them sorted by rank. Panics if one fails.
pub async fn join_all_where(seed: &Seed, n: usize, adjust: impl Fn(&mut JoinOptions)) -> Vec<Node> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let mut o = join_opts(seed);
            adjust(&mut o);
            tokio::spawn(Node::join(o))
        })
        .collect();
    let mut nodes = Vec::new();
    for t in tasks {
        let joined: Result<Node, NexarError> = tokio::time::timeout(DEADLINE, t)
            .await
            .expect("join deadline")
            .expect("join task");
        nodes.push(joined.expect("join"));
    }
    nodes.sort_by_key(|n| n.rank());
    nodes
}

/// [`join_all_with`] the default configuration.
pub async fn join_all(seed: &Seed, n: usize) -> Vec<Node> {
    join_all_with(seed, n, &NodeConfig::default()).await
}

/// Finishes every node at once, as separate processes would: [`Node::finish`] waits for
/// the peers to finish too (up to `NodeConfig::finish_timeout`), so finishing them one
/// after the other would make each wait for the next.
pub async fn finish_all(nodes: Vec<Node>) {
    let all = futures::future::join_all(nodes.into_iter().map(|n| n.finish(true)));
    crate::within("every node's finish", all).await;
}
