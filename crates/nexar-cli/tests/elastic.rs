//! Elastic membership with real processes: a cluster of three workers grows to five as two
//! more join through the seed, shrinks to four when one is asked to stop (SIGTERM, a
//! graceful leave), and checks an all-reduce at every size.

mod support;

use std::time::{Duration, Instant};

use support::{assert_exit, spawn_seed, spawn_worker, Proc};

fn worker(join: &str, name: &str) -> Proc {
    spawn_worker(
        name,
        join,
        &["elastic", "--pace-ms", "10", "--elems", "4096"],
    )
}

#[test]
fn workers_grow_from_three_to_five_and_shrink_to_four() {
    let deadline = Instant::now() + Duration::from_secs(240);
    let (mut seed, join) = spawn_seed(
        3,
        &["--min-world", "2", "--max-world", "5", "--timeout", "120"],
    );
    let mut workers: Vec<Proc> = (0..3)
        .map(|i| worker(&join, &format!("worker {i}")))
        .collect();
    for w in &mut workers {
        w.until("world 3 all_reduce ok", deadline);
    }
    // Two more join the running job and enter at the next resize point.
    workers.extend((3..5).map(|i| worker(&join, &format!("worker {i}"))));
    for w in &mut workers {
        w.until("world 5 all_reduce ok", deadline);
    }
    // One of the first three is asked to stop: it leaves gracefully, and the others go on
    // with four ranks, without an error.
    let mut leaver = workers.remove(1);
    leaver.terminate();
    let out = leaver.wait(deadline);
    assert_exit("leaving worker", &out, 0);
    assert!(
        out.stdout.contains("left the cluster"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    for w in &mut workers {
        w.until("world 4 all_reduce ok", deadline);
    }
    // The job ends when every remaining member is asked to stop (whether they leave one by
    // one or stop together at the same point).
    for w in &workers {
        w.terminate();
    }
    for (i, w) in workers.iter_mut().enumerate() {
        let out = w.wait(deadline);
        assert_exit(&format!("worker {i}"), &out, 0);
        assert!(
            !out.stdout.contains("FAIL"),
            "worker {i}:\n{}\n{}",
            out.stdout,
            out.stderr
        );
        assert!(
            out.stdout.contains("stopped at iteration") || out.stdout.contains("left the cluster"),
            "worker {i}:\n{}\n{}",
            out.stdout,
            out.stderr
        );
    }
    // Every node that took part, the two that joined late included, reported success.
    let out = seed.wait(deadline);
    assert_exit("seed", &out, 0);
    assert!(
        out.stderr.contains("PASS: 5 of 5 workers reported success"),
        "{}",
        out.stderr
    );
}

/// A worker whose leave the cluster refuses (it would fall below its minimum world) stays;
/// a second SIGTERM then ends it at once, as SIGTERM does by default (watching for the
/// first one had replaced that default for good, so only SIGKILL could stop it).
#[test]
fn a_second_sigterm_ends_a_worker_whose_leave_is_refused() {
    let deadline = Instant::now() + Duration::from_secs(120);
    let (_seed, join) = spawn_seed(2, &["--min-world", "2", "--timeout", "60"]);
    let mut workers: Vec<Proc> = (0..2)
        .map(|i| worker(&join, &format!("worker {i}")))
        .collect();
    for w in &mut workers {
        w.until("world 2 all_reduce ok", deadline);
    }
    let stays = &mut workers[0];
    stays.terminate();
    stays.until("staying", deadline);
    stays.terminate();
    let out = stays.wait(deadline);
    assert_exit("worker told twice", &out, 143);
    assert!(
        out.stdout.contains("second SIGTERM") || out.stderr.contains("second SIGTERM"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
}

/// A node still waiting to join when the job ends is told so before the seed exits
/// (`nexar seed` used to exit as the job ended, its answer to the waiting node unsent:
/// the node saw only the seed go away). The member paces its iterations ten minutes
/// apart, so that it reaches no resize point that would let the joiner in (and stays
/// alive, its connection to the seed with it, however long the joiner takes to queue),
/// then is killed: the job ends (failed) when the seed sees it gone.
#[test]
fn a_node_waiting_to_join_is_told_the_job_finished() {
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut seed, join) = spawn_seed(1, &["--max-world", "2", "--timeout", "60"]);
    let mut member = spawn_worker(
        "member",
        &join,
        &["elastic", "--pace-ms", "600000", "--elems", "4096"],
    );
    member.until("world 1 all_reduce ok", deadline);
    let mut joiner = worker(&join, "joiner");
    while !seed
        .stderr_so_far()
        .contains("nodes waiting to join at the next resize point: 1")
    {
        assert!(
            Instant::now() < deadline,
            "the joiner never queued:\n{}",
            seed.stderr_so_far()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    member.kill();
    let out = joiner.wait(deadline);
    assert_exit("joiner", &out, 3);
    assert!(
        out.stderr.contains("the cluster finished its job"),
        "joiner: exit {:?}\n{}\n{}",
        out.code,
        out.stdout,
        out.stderr
    );
    // The job failed: its member went without reporting.
    let out = seed.wait(deadline);
    assert_exit("seed", &out, 1);
}
