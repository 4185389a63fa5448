//! Elastic membership in one process over loopback: nodes join a running cluster through
//! the seed and leave it gracefully at resize points, within the seed's world bounds.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use nexar_actors::{BootstrapError, NexarError, Node, NodeConfig, Seed, SeedOptions};
use nexar_device::ReduceOp;
use tokio::task::JoinHandle;

use nexar_tests::seeded::{
    finish_all, join_all as form, join_all_with, join_opts as opts, DEADLINE, LOOPBACK,
};
use nexar_tests::within;

async fn bounded<T>(what: &str, t: JoinHandle<T>) -> T {
    tokio::time::timeout(DEADLINE, t)
        .await
        .unwrap_or_else(|_| panic!("{what}: deadline"))
        .unwrap_or_else(|e| panic!("{what}: task failed: {e}"))
}

async fn seed(world: usize, min: usize, max: usize) -> Seed {
    let mut o = SeedOptions::default();
    o.min_world = min;
    o.max_world = Some(max);
    Seed::start(LOOPBACK, world, o).await.expect("seed")
}

/// Starts a node that asks to join the running cluster and waits until the seed queued it.
async fn queue_joiner(seed: &Seed) -> JoinHandle<Result<Node, NexarError>> {
    let before = seed.queued();
    let t = tokio::spawn(Node::join(opts(seed)));
    tokio::time::timeout(DEADLINE, seed.wait_queued(before + 1))
        .await
        .expect("queued within the deadline")
        .expect("seed running");
    t
}

/// One resize point: the nodes at `leave` (indices into `nodes`) leave, the others resize.
/// Returns the members that stayed and each leaver's result, in that order.
async fn resize_point(
    nodes: Vec<Node>,
    leave: &[usize],
) -> (Vec<Node>, Vec<(Node, Result<(), NexarError>)>) {
    let tasks: Vec<_> = nodes
        .into_iter()
        .enumerate()
        .map(|(i, mut n)| {
            let leaving = leave.contains(&i);
            tokio::spawn(async move {
                if leaving {
                    let r = n.leave().await;
                    (n, Some(r))
                } else {
                    n.resize().await.expect("resize");
                    (n, None)
                }
            })
        })
        .collect();
    let mut stayed = Vec::new();
    let mut left = Vec::new();
    for t in tasks {
        match bounded("resize point", t).await {
            (n, None) => stayed.push(n),
            (n, Some(r)) => left.push((n, r)),
        }
    }
    (stayed, left)
}

/// Every node all-reduces its rank + 1 and checks the sum for the world it sees; returns
/// the nodes sorted by rank.
async fn check_all_reduce(nodes: Vec<Node>, world: usize) -> Vec<Node> {
    let tasks: Vec<_> = nodes
        .into_iter()
        .map(|n| {
            tokio::spawn(async move {
                let c = n.communicator();
                let mut v = vec![c.rank() as u64 + 1; 1000];
                let r = c.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v);
                (n, c.world_size(), r)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        let (n, w, r) = bounded("all_reduce", t).await;
        assert_eq!(w, world, "node {} sees world {w}", n.rank());
        let v = r.expect("all_reduce");
        assert!(v.iter().all(|x| *x as usize == world * (world + 1) / 2));
        out.push(n);
    }
    out.sort_by_key(|n| n.rank());
    let ranks: Vec<usize> = out.iter().map(|n| n.rank()).collect();
    assert_eq!(ranks, (0..world).collect::<Vec<_>>(), "ranks are 0..world");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_from_three_to_five_then_shrink_to_four() {
    let seed = seed(3, 2, 5).await;
    let nodes = check_all_reduce(form(&seed, 3).await, 3).await;
    let a = queue_joiner(&seed).await;
    let b = queue_joiner(&seed).await;
    let (mut nodes, left) = resize_point(nodes, &[]).await;
    assert!(left.is_empty());
    nodes.push(bounded("joiner", a).await.expect("first joiner"));
    nodes.push(bounded("joiner", b).await.expect("second joiner"));
    let nodes = check_all_reduce(nodes, 5).await;
    assert_eq!(seed.queued(), 0);

    // Rank 1 leaves gracefully; nobody else sees an error, and nobody records a failure.
    let failures: Vec<_> = nodes.iter().map(|n| n.communicator().failures()).collect();
    let (nodes, mut left) = resize_point(nodes, &[1]).await;
    assert_eq!(left.len(), 1);
    let (leaver, r) = left.remove(0);
    r.expect("leave");
    within("the leaver's finish", leaver.finish(true)).await;
    let nodes = check_all_reduce(nodes, 4).await;
    // The departure is not a failure on any survivor, even after the leaver shut down.
    for f in &failures {
        assert!(
            f.current().is_empty(),
            "a departure was reported as a failure"
        );
    }
    for n in &nodes {
        assert!(n.communicator().failed_ranks().is_empty());
    }
    finish_all(nodes).await;
    let report = tokio::time::timeout(DEADLINE, seed.wait_finished())
        .await
        .expect("report deadline")
        .expect("report");
    assert_eq!(
        report.ok,
        vec![0, 1, 2, 3, 4],
        "every node that took part reports ok"
    );
    assert!(report.failed.is_empty());
    assert_eq!(
        report.joined.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        vec![3, 4],
        "the two late joiners got fresh node ids"
    );
    assert!(report.succeeded());
}

const SMALL_WINDOW: u64 = nexar_tests::SMALL_SEND_WINDOW;

fn small_window_config() -> NodeConfig {
    let mut config = NodeConfig::default();
    config.transport.send_window = SMALL_WINDOW as u32;
    config
}

/// The windows every node's connections take, by node.
fn windows(nodes: &[Node]) -> Vec<Vec<u64>> {
    let per_node = nodes.iter().map(|n| n.communicator().send_windows());
    per_node
        .map(|w| w.into_iter().map(|(_, bytes)| bytes).collect())
        .collect()
}

/// While the cluster has two nodes each gives the other one and a half send windows (no
/// other node sends to it); once a third joins, the connections in use go back to one
/// before the resize point returns. (A connection still being attached when the world
/// grows is set back by its peer's actor afterwards, which this does not exercise.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_peer_takes_each_connection_back_to_one_send_window() {
    let seed = seed(2, 2, 3).await;
    let config = small_window_config();
    let nodes = check_all_reduce(join_all_with(&seed, 2, &config).await, 2).await;
    let sole = nexar_tests::sole_peer_window(SMALL_WINDOW);
    assert!(
        sole > SMALL_WINDOW,
        "this host's receive buffer holds 1.5 windows"
    );
    assert_eq!(windows(&nodes), vec![vec![sole]; 2]);
    let joiner = {
        let before = seed.queued();
        let mut o = opts(&seed);
        o.config = config.clone();
        let t = tokio::spawn(Node::join(o));
        tokio::time::timeout(DEADLINE, seed.wait_queued(before + 1))
            .await
            .expect("queued within the deadline")
            .expect("seed running");
        t
    };
    let (mut nodes, left) = resize_point(nodes, &[]).await;
    assert!(left.is_empty());
    nodes.push(bounded("joiner", joiner).await.expect("joiner"));
    let nodes = check_all_reduce(nodes, 3).await;
    // The old members learnt of the third before the resize point returned; the joiner's
    // connections were made in a world of three.
    assert_eq!(windows(&nodes), vec![vec![SMALL_WINDOW; 2]; 3]);
    finish_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_world_admits_only_what_fits_and_keeps_the_rest_queued() {
    let seed = seed(2, 1, 3).await;
    let nodes = form(&seed, 2).await;
    let a = queue_joiner(&seed).await;
    let b = queue_joiner(&seed).await;
    let (mut nodes, _) = resize_point(nodes, &[]).await;
    nodes.push(bounded("joiner", a).await.expect("first joiner"));
    assert_eq!(
        seed.queued(),
        1,
        "the second joiner still waits: the world is at its max"
    );
    let nodes = check_all_reduce(nodes, 3).await;
    // A full world: a resize point changes nothing.
    let (nodes, _) = resize_point(nodes, &[]).await;
    assert_eq!(seed.queued(), 1);
    let nodes = check_all_reduce(nodes, 3).await;
    // One leaves and the queued node takes its place at the same point.
    let (mut nodes, mut left) = resize_point(nodes, &[0]).await;
    let (leaver, r) = left.remove(0);
    r.expect("leave");
    within("the leaver's finish", leaver.finish(true)).await;
    nodes.push(bounded("joiner", b).await.expect("second joiner"));
    let nodes = check_all_reduce(nodes, 3).await;
    finish_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_below_min_world_is_refused_and_the_node_stays() {
    let seed = seed(3, 3, 3).await;
    let nodes = form(&seed, 3).await;
    let (mut nodes, left) = resize_point(nodes, &[2]).await;
    for (n, r) in left {
        match r {
            Err(NexarError::Bootstrap(BootstrapError::LeaveRefused(why))) => {
                assert!(why.contains("minimum"), "{why}")
            }
            other => panic!("expected a refused leave, got {other:?}"),
        }
        nodes.push(n);
    }
    let nodes = check_all_reduce(nodes, 3).await;
    finish_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_size_cluster_refuses_late_joins() {
    let seed = Seed::start(LOOPBACK, 2, SeedOptions::default())
        .await
        .expect("seed");
    let nodes = form(&seed, 2).await;
    match within("the late join", Node::join(opts(&seed))).await {
        Err(NexarError::Bootstrap(BootstrapError::Refused(why))) => {
            assert!(why.contains("fixed"), "{why}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    finish_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_join_without_a_resize_point_fails_at_the_deadline() {
    let mut o = SeedOptions::default();
    o.max_world = Some(3);
    // It bounds the members' formation too: room for a slow machine.
    o.formation_timeout = Duration::from_secs(5);
    let seed = Seed::start(LOOPBACK, 2, o).await.expect("seed");
    let nodes = form(&seed, 2).await;
    let late = queue_joiner(&seed).await;
    match bounded("late joiner", late).await {
        // A membership change that did not happen, not a formation that failed.
        Err(NexarError::Bootstrap(BootstrapError::Resize(why))) => {
            assert!(why.contains("resize point"), "{why}")
        }
        other => panic!("expected the queue deadline, got {other:?}"),
    }
    assert_eq!(seed.queued(), 0);
    // The members never noticed.
    let nodes = check_all_reduce(nodes, 2).await;
    finish_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_world_bounds_are_rejected() {
    for (world, min, max) in [(3, 0, 3), (3, 4, 5), (3, 1, 2)] {
        let mut o = SeedOptions::default();
        o.min_world = min;
        o.max_world = Some(max);
        match Seed::start(LOOPBACK, world, o).await {
            Err(NexarError::InvalidArgument(why)) => assert!(why.contains("bounds"), "{why}"),
            other => panic!("({world}, {min}, {max}): expected an error, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_node_is_replaced_after_the_survivors_shrink_and_adopt() {
    // Room for one more than formed, so the seed takes joins once the cluster runs.
    let seed = seed(3, 1, 4).await;
    let mut nodes = form(&seed, 3).await;
    // Node 2 crashes (drops without reporting): the others see it lost.
    let crashed = nodes.pop().expect("three nodes");
    let mut watches: Vec<_> = nodes.iter().map(|n| n.communicator().failures()).collect();
    drop(crashed);
    for w in &mut watches {
        let lost = tokio::time::timeout(DEADLINE, w.changed())
            .await
            .expect("loss noticed")
            .expect("watch");
        assert_eq!(lost, vec![2]);
    }
    // The survivors shrink and adopt the result; a replacement joins at the next point.
    let tasks: Vec<_> = nodes
        .into_iter()
        .map(|mut n| {
            tokio::spawn(async move {
                let before = n.mesh_addrs().to_vec();
                let small = n.communicator().shrink().await.expect("shrink");
                assert_eq!(small.world_size(), 2);
                n.adopt(small).expect("adopt");
                // The addresses follow the adopted ranks: the crashed node's is gone.
                assert_eq!(n.mesh_addrs(), &before[..2]);
                n
            })
        })
        .collect();
    let mut nodes = Vec::new();
    for t in tasks {
        nodes.push(bounded("shrink", t).await);
    }
    let replacement = queue_joiner(&seed).await;
    let (mut nodes, _) = resize_point(nodes, &[]).await;
    nodes.push(
        bounded("replacement", replacement)
            .await
            .expect("replacement joins"),
    );
    let nodes = check_all_reduce(nodes, 3).await;
    // A communicator of another node cannot be adopted.
    let mut nodes = nodes;
    let other = nodes[1].communicator();
    assert!(matches!(
        nodes[0].adopt(other),
        Err(NexarError::InvalidArgument(_))
    ));
    finish_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_nobody_can_reach_fails_the_resize_point_and_changes_nothing() {
    let seed = seed(3, 1, 4).await;
    let mut config = NodeConfig::default();
    config.connect_timeout = Duration::from_secs(2);
    let nodes = join_all_with(&seed, 3, &config).await;
    let watches: Vec<_> = nodes.iter().map(|n| n.communicator().failures()).collect();
    // The joiner advertises the address of a socket that never answers: the members
    // cannot dial it.
    let silent = std::net::UdpSocket::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .expect("silent socket");
    let mut o = opts(&seed);
    o.advertise = Some(silent.local_addr().expect("silent address"));
    o.config.connect_timeout = Duration::from_secs(2);
    let before = seed.queued();
    let unreachable = tokio::spawn(Node::join(o));
    tokio::time::timeout(DEADLINE, seed.wait_queued(before + 1))
        .await
        .expect("queued")
        .expect("seed");
    // Rank 2 also asks to leave at this point: nothing may change, so it must stay.
    let tasks: Vec<_> = nodes
        .into_iter()
        .enumerate()
        .map(|(i, mut n)| {
            tokio::spawn(async move {
                let r = if i == 2 {
                    n.leave().await
                } else {
                    n.resize().await.map(|_| ())
                };
                (n, r)
            })
        })
        .collect();
    let mut nodes = Vec::new();
    for t in tasks {
        let (n, r) = bounded("failed resize point", t).await;
        match r {
            Err(NexarError::Bootstrap(BootstrapError::Resize(why))) => {
                assert!(why.contains("connect"), "{why}")
            }
            other => panic!("expected the resize point to fail, got {other:?}"),
        }
        nodes.push(n);
    }
    assert!(bounded("unreachable joiner", unreachable).await.is_err());
    // The cluster is as it was, records no failure, and its next resize point works.
    let nodes = check_all_reduce(nodes, 3).await;
    for w in &watches {
        assert!(
            w.current().is_empty(),
            "a provisional joiner counted as a failure"
        );
    }
    let (nodes, _) = resize_point(nodes, &[]).await;
    let nodes = check_all_reduce(nodes, 3).await;
    finish_all(nodes).await;
    // The joiner never entered: the job's report neither lists it nor counts it failed.
    let report = tokio::time::timeout(DEADLINE, seed.wait_finished())
        .await
        .expect("report deadline")
        .expect("report");
    assert!(report.succeeded(), "{report:?}");
    assert!(report.joined.is_empty(), "{report:?}");
    drop(silent);
}

/// After a split, each group adopts its own communicator and has resize points of its
/// own: the seed takes a point from either group, in any order (it used to take only the
/// members of the last plan, so the second group was refused as strangers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_groups_of_a_split_each_pass_resize_points() {
    let seed = seed(4, 1, 4).await;
    let nodes = form(&seed, 4).await;
    let tasks: Vec<_> = nodes
        .into_iter()
        .map(|mut n| {
            tokio::spawn(async move {
                let color = (n.rank() / 2) as u32;
                let group = n.communicator().split(color, 0).await.expect("split");
                n.adopt(group).expect("adopt");
                (color, n)
            })
        })
        .collect();
    let mut groups: [Vec<Node>; 2] = [Vec::new(), Vec::new()];
    for t in tasks {
        let (color, n) = bounded("split", t).await;
        groups[color as usize].push(n);
    }
    let [mut a, mut b] = groups;
    for round in [0, 1, 0] {
        let group = if round == 0 { &mut a } else { &mut b };
        let (stayed, _) = resize_point(std::mem::take(group), &[]).await;
        *group = check_all_reduce(stayed, 2).await;
    }
    finish_all(a.into_iter().chain(b).collect()).await;
}
