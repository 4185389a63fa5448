//! `nexar seed` and `nexar worker` as separate processes on loopback: a cluster forms and
//! passes the smoke checks, and workers with a wrong secret or fingerprint are turned away.

mod support;

use std::time::{Duration, Instant};

use nexar_actors::{JoinString, Secret};
use nexar_cli::checks;
use support::{assert_exit, nexar, spawn_seed, spawn_worker, Proc};

/// Time for a whole cluster run, start to finish.
const RUN: Duration = Duration::from_secs(240);

fn seed(world: usize, extra: &[&str]) -> (Proc, String) {
    spawn_seed(world, extra)
}

fn worker(name: &str, join: &str, job: &str) -> Proc {
    spawn_worker(name, join, &[job])
}

/// Waits for every smoke worker and asserts it exited 0 having passed every check;
/// returns their outputs in worker order.
fn smoke_outputs(workers: &mut [Proc], deadline: Instant) -> Vec<support::Finished> {
    let n = checks().len();
    let mut outs = Vec::new();
    for (i, w) in workers.iter_mut().enumerate() {
        let out = w.wait(deadline);
        assert_exit(&format!("worker {i}"), &out, 0);
        assert!(
            out.stdout
                .contains(&format!("{n} of {n} checks passed on rank")),
            "worker {i}:\n{}",
            out.stdout
        );
        outs.push(out);
    }
    outs
}

#[test]
fn seed_and_four_worker_processes_pass_the_smoke_checks() {
    let deadline = Instant::now() + RUN;
    let (mut seed, join) = seed(4, &["--json", "--timeout", "120"]);
    let mut workers: Vec<Proc> = (0..4)
        .map(|i| worker(&format!("worker {i}"), &join, "smoke"))
        .collect();
    let mut ranks = Vec::new();
    for out in smoke_outputs(&mut workers, deadline) {
        let i = ranks.len();
        for check in checks() {
            assert!(
                out.stdout
                    .lines()
                    .any(|l| l.starts_with(check.name) && l.ends_with("PASS")),
                "worker {i}: no PASS line for {}:\n{}",
                check.name,
                out.stdout
            );
        }
        assert!(!out.stdout.contains("FAIL"), "worker {i}:\n{}", out.stdout);
        ranks.push(out.stdout.clone());
    }
    let out = seed.wait(deadline);
    assert_exit("seed", &out, 0);
    let summary: serde_json::Value =
        serde_json::from_str(out.stdout.trim()).expect("the seed's summary is one JSON line");
    assert_eq!(summary["ok"], true, "{summary}");
    assert_eq!(summary["passed"], 4, "{summary}");
    assert!(
        out.stderr.contains("waiting for workers:") && out.stderr.contains("4/4 joined"),
        "{}",
        out.stderr
    );
    // Each worker held a different rank.
    for r in 0..4 {
        let tag = format!("checks passed on rank {r} of 4");
        assert_eq!(
            ranks.iter().filter(|o| o.contains(&tag)).count(),
            1,
            "{ranks:?}"
        );
    }
}

#[test]
fn wrong_secret_or_fingerprint_exits_3_and_says_why() {
    let deadline = Instant::now() + RUN;
    let (mut seed, join) = seed(1, &["--timeout", "120"]);
    let good: JoinString = join.parse().expect("the seed prints a valid join string");

    let mut bad = good.clone();
    bad.secret = Secret::random();
    let out = worker("wrong secret", &bad.to_string(), "info").wait(deadline);
    assert_exit("wrong secret", &out, 3);
    assert!(
        out.stderr.contains("wrong cluster secret"),
        "{}",
        out.stderr
    );

    let mut bad = good.clone();
    bad.fingerprint[0] ^= 1;
    let out = worker("wrong fingerprint", &bad.to_string(), "info").wait(deadline);
    assert_exit("wrong fingerprint", &out, 3);
    assert!(
        out.stderr.contains("is not the seed") && out.stderr.contains("fingerprint mismatch"),
        "{}",
        out.stderr
    );

    // The seed is unharmed: a worker that reads the join string from the environment, as
    // under a launcher, joins, and the seed reports success.
    let mut cmd = nexar();
    cmd.args(["worker", "--listen", "127.0.0.1:0", "info"])
        .env("NEXAR_JOIN", &join)
        .env("NEXAR_WORLD_SIZE", "1");
    let out = Proc::spawn("env worker", &mut cmd).wait(deadline);
    assert_exit("env worker", &out, 0);
    assert!(out.stdout.contains("world: 1"), "{}", out.stdout);
    let out = seed.wait(deadline);
    assert_exit("seed", &out, 0);
    assert!(
        out.stderr.contains("PASS: 1 of 1 workers reported success"),
        "{}",
        out.stderr
    );
}

#[test]
fn formation_deadline_exits_3_naming_the_missing_ranks() {
    let deadline = Instant::now() + RUN;
    let (mut seed, _join) = seed(2, &["--timeout", "1"]);
    let out = seed.wait(deadline);
    assert_exit("seed", &out, 3);
    assert!(
        out.stderr.contains("ranks 0, 1 did not arrive"),
        "{}",
        out.stderr
    );
}

#[test]
fn a_worker_without_join_string_is_a_usage_error() {
    // `nexar()` leaves out the launcher variables of the test's environment.
    let mut cmd = nexar();
    cmd.args(["worker", "info"]);
    let out = Proc::spawn("worker", &mut cmd).wait(Instant::now() + Duration::from_secs(30));
    assert_exit("worker", &out, 2);
    assert!(out.stderr.contains("NEXAR_JOIN"), "{}", out.stderr);
}

#[test]
fn worker_processes_pass_the_smoke_checks_over_the_trusted_lane() {
    let deadline = Instant::now() + RUN;
    let (mut seed, join) = seed(3, &["--timeout", "120"]);
    let mut workers: Vec<Proc> = (0..3)
        .map(|i| {
            spawn_worker(
                &format!("worker {i}"),
                &join,
                &["--trusted-fabric", "smoke"],
            )
        })
        .collect();
    smoke_outputs(&mut workers, deadline);
    assert_exit("seed", &seed.wait(deadline), 0);
}

/// Runs `info` on a seed and `world` workers with `args` before the job; returns each
/// worker's standard error once all exited 0.
fn info_run(world: usize, args: &[&str], deadline: Instant) -> Vec<String> {
    let (mut seed, join) = seed(world, &["--timeout", "120"]);
    let mut workers: Vec<Proc> = (0..world)
        .map(|i| {
            let mut all = args.to_vec();
            all.push("info");
            spawn_worker(&format!("worker {i}"), &join, &all)
        })
        .collect();
    let errs = workers
        .iter_mut()
        .enumerate()
        .map(|(i, w)| {
            let out = w.wait(deadline);
            assert_exit(&format!("worker {i}"), &out, 0);
            out.stderr
        })
        .collect();
    assert_exit("seed", &seed.wait(deadline), 0);
    errs
}

/// The `(place on the host, CPUs)` a worker said it bound to, if it did.
fn bound(stderr: &str) -> Option<(usize, String)> {
    let line = stderr.lines().find(|l| l.starts_with("bound to CPU "))?;
    let mut words = line["bound to CPU ".len()..].split_whitespace();
    let cpus = words.next()?.to_string();
    let place = words.nth(1)?.parse().ok()?;
    Some((place, cpus))
}

/// How many CPUs this process may run on (its affinity mask, `Cpus_allowed_list`).
fn cpus_allowed() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list");
    list.trim()
        .split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().expect("a CPU"), b.parse().expect("a CPU"));
                b - a + 1
            }
            None => 1,
        })
        .sum()
}

#[cfg(target_os = "linux")]
#[test]
fn workers_sharing_a_host_bind_to_cpus_in_turn() {
    let deadline = Instant::now() + RUN;
    let (allowed, usable) = (
        cpus_allowed(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let mut places: Vec<(usize, String)> = info_run(3, &["--threads", "1"], deadline)
        .iter()
        .filter_map(|e| bound(e))
        .collect();
    places.sort();
    if allowed < 2 || usable < allowed {
        // One CPU (each worker has it all already), or a CPU quota under the CPUs allowed
        // (which, not the CPUs, sets the workers' share): no binding.
        assert!(places.is_empty(), "{places:?}");
    } else {
        // Each worker's threads (all of them: the CPUs are read back from every thread)
        // went to one CPU, by its place among the three on this host, and the first two
        // places got different CPUs.
        assert_eq!(
            places.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![0, 1, 2],
            "{places:?}"
        );
        for (_, list) in &places {
            assert!(list.parse::<usize>().is_ok(), "{places:?}");
        }
        assert_ne!(places[0].1, places[1].1, "{places:?}");
    }
    // Told not to, or with a thread per CPU, no worker binds.
    for args in [&["--threads", "1", "--no-bind-cpus"][..], &[]] {
        let errs = info_run(2, args, deadline);
        assert!(
            errs.iter().all(|e| bound(e).is_none()),
            "{args:?}: {errs:?}"
        );
    }
}

/// A seed and a worker whose standard error nobody reads any more (`2>&1 | head -1`, a
/// closed terminal) run to the end: their progress lines are dropped. (`eprintln!`
/// panicked on the closed pipe, killing the seed mid-formation.)
#[test]
fn a_closed_standard_error_does_not_stop_a_seed_or_a_worker() {
    let deadline = Instant::now() + RUN;
    let mut seed = Proc::spawn_with_stderr_closed(
        "seed",
        nexar().args(["seed", "--listen", "127.0.0.1:0", "--world", "1"]),
    );
    let join = seed.line(Duration::from_secs(30));
    let mut worker = Proc::spawn_with_stderr_closed(
        "worker",
        nexar().args(["worker", "--join", &join, "--listen", "127.0.0.1:0", "info"]),
    );
    let w = worker.wait(deadline);
    assert_eq!(w.code, Some(0), "worker: {w:?}");
    let s = seed.wait(deadline);
    assert_eq!(s.code, Some(0), "seed: {s:?}");
}
