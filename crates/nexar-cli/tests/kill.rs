//! Kill -9 one worker process of five during a loop of all-reduces: the survivors notice,
//! rebuild the communicator under automatic recovery and finish with correct results.

mod support;

use std::time::{Duration, Instant};

use support::{assert_exit, spawn_seed, spawn_worker, Proc};

/// All-reduces each worker runs: far more than the worker gets through while the test
/// reacts to its first progress line (500 iterations) and freezes it, so the kill hits a
/// running loop even when the test's thread waits a while for a core.
const ITERS: u64 = 20000;

/// The iteration numbers in the soak's lines of `stderr` that contain `what` (`" at
/// iteration "` for progress, `" lost rank 4 at iteration "` for a lost peer; see
/// `nexar_cli::soak_rank`), in order.
fn iterations(stderr: &str, what: &str) -> Vec<u64> {
    stderr
        .lines()
        .filter_map(|l| l.split_once(what))
        .map(|(_, rest)| {
            let n = rest.split(' ').next().unwrap_or_default();
            n.parse()
                .unwrap_or_else(|e| panic!("no iteration number ({e}) in: {rest}"))
        })
        .collect()
}

#[test]
fn survivors_of_a_killed_worker_finish_the_all_reduce_loop_on_four_ranks() {
    let deadline = Instant::now() + Duration::from_secs(240);
    let (mut seed, join) = spawn_seed(5, &["--timeout", "120"]);
    let iters = ITERS.to_string();
    let mut workers: Vec<Proc> = (0..5)
        .map(|i| {
            let name = format!("worker {i}");
            // The soak's progress events on stderr say when the loop is running.
            let args = ["--log", "warn,nexar_cli::soak=info", "soak"];
            let job = ["--iters", &iters, "--elems", "128"];
            spawn_worker(&name, &join, &[&args[..], &job].concat())
        })
        .collect();
    // Wait (bounded) until every worker has joined, and the one holding rank 4 has
    // reported progress (its loop is running), then kill it.
    let victim = loop {
        assert!(Instant::now() < deadline, "workers did not all join");
        let joined: Vec<Option<usize>> = workers
            .iter()
            .map(|w| {
                let err = w.stderr_so_far();
                (0..5).find(|r| err.contains(&format!("joined as rank {r} of 5")))
            })
            .collect();
        if joined.iter().all(Option::is_some) {
            break joined
                .iter()
                .position(|r| *r == Some(4))
                .expect("someone holds rank 4");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    loop {
        let err = workers[victim].stderr_so_far();
        if !iterations(&err, " at iteration ").is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rank 4 reported no progress; stderr:\n{err}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Frozen first, so that what it reached is read while nothing moves (the others wait
    // for it in their next all-reduce), and the kill lands where the reading says.
    workers[victim].freeze();
    assert!(
        workers[victim].is_there(),
        "rank 4 exited before it was frozen"
    );
    let err = workers[victim].stderr_so_far();
    let reached = iterations(&err, " at iteration ")
        .last()
        .copied()
        .unwrap_or(0);
    assert!(
        reached < ITERS,
        "rank 4 finished its loop ({reached} iterations) before the kill"
    );
    workers[victim].kill();
    for (i, w) in workers.iter_mut().enumerate() {
        let out = w.wait(deadline);
        if i == victim {
            continue;
        }
        assert_exit(&format!("worker {i}"), &out, 0);
        assert!(
            out.stdout.contains(&format!(
                "finished {ITERS} iterations; world 4 after 1 recoveries"
            )),
            "worker {i}:\n{}\n{}",
            out.stdout,
            out.stderr
        );
        // The kill hit the loop while it ran: the survivor lost rank 4 mid-loop.
        let lost = iterations(&out.stderr, " lost rank 4 at iteration ");
        assert!(
            lost.len() == 1 && lost[0] < ITERS,
            "worker {i}: want one loss of rank 4 before iteration {ITERS} (rank 4 had \
             reached {reached} at the kill), got {lost:?}; stderr:\n{}",
            out.stderr
        );
    }
    // The seed reports the killed rank as failed.
    let out = seed.wait(deadline);
    assert_exit("seed", &out, 1);
}
