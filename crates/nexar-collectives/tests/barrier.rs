//! The barrier's promise: no rank leaves it before every rank has entered it.

use std::collections::HashSet;

use nexar_collectives::{barrier, Action, Schedule};

/// Runs the barrier schedules of every rank of `world` but `absent`, which never enters:
/// sends are delivered at once, a receive completes once its message was sent. Returns
/// the ranks whose barrier completed.
fn run_without(world: usize, absent: usize) -> Vec<usize> {
    let mut ranks: Vec<Option<Box<dyn Schedule>>> = (0..world)
        .map(|r| (r != absent).then(|| barrier(r, world).expect("a barrier schedule")))
        .collect();
    // Messages sent: (from, to, step).
    let mut sent: HashSet<(usize, usize, u32)> = HashSet::new();
    // Receives issued and not yet completed: (rank, id, from, step).
    let mut waiting = Vec::new();
    let mut out = Vec::new();
    for _ in 0..10_000 {
        let mut moved = false;
        for (rank, s) in ranks.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            out.clear();
            s.poll(&mut out);
            for a in out.drain(..) {
                moved = true;
                match a {
                    Action::Send { id, peer, step, .. } => {
                        sent.insert((rank, peer, step));
                        s.complete(id).expect("a send completes");
                    }
                    Action::Recv { id, peer, step, .. } => waiting.push((rank, id, peer, step)),
                    other => panic!("a barrier has no {other:?}"),
                }
            }
        }
        let (ready, still): (Vec<_>, Vec<_>) = waiting
            .into_iter()
            .partition(|&(rank, _, from, step)| sent.contains(&(from, rank, step)));
        waiting = still;
        for (rank, id, ..) in ready {
            moved = true;
            if let Some(s) = &mut ranks[rank] {
                s.complete(id).expect("a receive completes");
            }
        }
        if !moved {
            break;
        }
    }
    ranks
        .iter()
        .enumerate()
        .filter(|(_, s)| s.as_ref().is_some_and(|s| s.is_done()))
        .map(|(r, _)| r)
        .collect()
}

/// With any one rank absent, no other rank's barrier completes, whatever the world. (A
/// round's message went out once the round before's had come, though the earlier
/// rounds' may not have: on 6 ranks rank 5 left the barrier with rank 0 never in it.)
#[test]
fn no_rank_leaves_a_barrier_that_a_rank_never_entered() {
    for world in 2..=17 {
        for absent in 0..world {
            let done = run_without(world, absent);
            assert!(
                done.is_empty(),
                "world {world}, rank {absent} absent: ranks {done:?} left the barrier"
            );
        }
    }
}

/// With every rank in, every rank's barrier completes.
#[test]
fn every_rank_leaves_a_barrier_that_all_entered() {
    for world in 1..=17 {
        assert_eq!(
            run_without(world, world).len(),
            world,
            "world {world}: not every rank left"
        );
    }
}
