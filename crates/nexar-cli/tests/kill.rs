//! Kill -9 one worker process of five during a loop of all-reduces: the survivors notice,
//! rebuild the communicator under automatic recovery and finish with correct results.

mod support;

use std::time::{Duration, Instant};

use support::{assert_exit, spawn_seed, spawn_worker, Proc};

#[test]
fn survivors_of_a_killed_worker_finish_the_all_reduce_loop_on_four_ranks() {
    let deadline = Instant::now() + Duration::from_secs(240);
    let (mut seed, join) = spawn_seed(5, &["--timeout", "120"]);
    let mut workers: Vec<Proc> = (0..5)
        .map(|i| {
            let name = format!("worker {i}");
            spawn_worker(&name, &join, &["soak", "--iters", "8000", "--elems", "128"])
        })
        .collect();
    // Wait (bounded) until every worker has joined, then kill the one holding rank 4.
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
    workers[victim].kill();
    for (i, w) in workers.iter_mut().enumerate() {
        let out = w.wait(deadline);
        if i == victim {
            continue;
        }
        assert_exit(&format!("worker {i}"), &out, 0);
        assert!(
            out.stdout
                .contains("finished 8000 iterations; world 4 after 1 recoveries"),
            "worker {i}:\n{}\n{}",
            out.stdout,
            out.stderr
        );
    }
    // The seed reports the killed rank as failed.
    let out = seed.wait(deadline);
    assert_exit("seed", &out, 1);
}
