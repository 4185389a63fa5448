//! `nexar local bench` and `nexar worker bench` through the real binary, with tiny sizes:
//! the rows are there, well formed and right. Speed is never asserted.

mod support;

use std::time::{Duration, Instant};

use support::{assert_exit, Finished, Proc};

/// Runs `nexar ARGS` to the end (at most 120 s), its output read as it comes: a child that
/// writes more than a pipe holds never blocks.
fn nexar(args: &[&str]) -> Finished {
    let deadline = Instant::now() + Duration::from_secs(120);
    Proc::spawn(&format!("nexar {args:?}"), support::nexar().args(args)).wait(deadline)
}

/// Runs `nexar ARGS`, requires success, and returns its standard output.
fn passing(args: &[&str]) -> String {
    let out = nexar(args);
    assert_exit(&format!("nexar {args:?}"), &out, 0);
    out.stdout
}

#[test]
fn json_rows_have_the_required_keys_and_pass() {
    let stdout = passing(&[
        "local",
        "--world",
        "2",
        "bench",
        "--ops",
        "all_reduce,barrier",
        "--min-bytes",
        "8",
        "--max-bytes",
        "1K",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    // all_reduce at 8, 32, 128, 512 bytes, then one barrier row.
    let ops: Vec<(&str, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["op"].as_str().unwrap_or("?"),
                r["bytes"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        ops,
        [
            ("all_reduce", 8),
            ("all_reduce", 32),
            ("all_reduce", 128),
            ("all_reduce", 512),
            ("barrier", 0)
        ]
    );
    for row in &rows {
        for key in [
            "op",
            "bytes",
            "world",
            "time_us",
            "algbw_gbps",
            "busbw_gbps",
            "ok",
            "min_us",
            "max_us",
            "count",
            "dtype",
            "algorithm",
            "efficiency",
            "efficiency_at_size",
            "c_s_per_gb",
            "barrier_cpu_us_per_call",
        ] {
            assert!(row.get(key).is_some(), "no {key} in {row}");
        }
        assert_eq!(row["ok"], true, "{row}");
        assert_eq!(row["world"], 2, "{row}");
        assert!(row["time_us"].as_f64().is_some_and(|t| t > 0.0), "{row}");
    }
    // Two ranks: busbw = algbw x 2(n-1)/n = algbw.
    assert_eq!(rows[3]["count"], 128);
    assert_eq!(rows[3]["busbw_gbps"], rows[3]["algbw_gbps"]);
}

#[test]
fn every_op_checks_out_on_three_ranks() {
    let stdout = passing(&[
        "local",
        "--world",
        "3",
        "bench",
        "--ops",
        "all",
        "--min-bytes",
        "96",
        "--max-bytes",
        "400",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--dtype",
        "bf16",
    ]);
    let pair = ["p2p", "pingpong"];
    for op in pair
        .into_iter()
        .chain(COLLECTIVES)
        .chain(["barrier", "sendrecv"])
    {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("{op} "))),
            "no {op} row:\n{stdout}"
        );
    }
    assert!(!stdout.contains("WRONG"), "{stdout}");
}

/// The collectives with data (every one `--zero-copy` covers).
const COLLECTIVES: [&str; 8] = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
];

/// A 3-rank bench of `ops` at 768 KiB (so zero-copy sends are lent) with `flags`: the
/// header names the forms (`header`) and every op has a checked row.
fn forms_check_out(flags: &[&str], ops: &[&str], header: &str) {
    let joined = ops.join(",");
    let mut args = vec![
        "local",
        "--world",
        "3",
        "bench",
        "--ops",
        &joined,
        "--min-bytes",
        "768K",
        "--max-bytes",
        "768K",
        "--iters",
        "3",
        "--warmup",
        "1",
    ];
    args.extend_from_slice(flags);
    let stdout = passing(&args);
    assert!(stdout.contains(header), "{stdout}");
    for op in ops {
        let row = stdout.lines().find(|l| l.starts_with(&format!("{op} ")));
        assert!(
            row.is_some_and(|r| r.split_whitespace().any(|w| w == "ok")),
            "no checked {op} row:\n{stdout}"
        );
    }
}

/// `--zero-copy` runs the collectives it covers on zero-copy buffers, large enough to be
/// lent (over 64 KiB per send), and every result checks out; the header says so.
#[test]
fn zero_copy_collectives_check_out() {
    forms_check_out(
        &["--zero-copy"],
        &[&COLLECTIVES[..], &["sendrecv"]].concat(),
        "zero-copy buffers",
    );
}

#[test]
fn rows_from_one_mib_are_held_against_p2p_measured_around_them() {
    let stdout = passing(&[
        "--json",
        "local",
        "--world",
        "2",
        "bench",
        "--ops",
        "p2p,all_reduce",
        "--min-bytes",
        "256K",
        "--max-bytes",
        "1M",
        "--iters",
        "5",
        "--warmup",
        "0",
    ]);
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let get = |op: &str, bytes: u64| {
        rows.iter()
            .find(|r| r["op"] == op && r["bytes"] == bytes)
            .unwrap_or_else(|| panic!("no {op} row of {bytes} bytes in {stdout}"))
    };
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    // Under 1 MiB: the run's best p2p row of 1 MiB and more (here the only one), also
    // where the row's CPU is lost in its barriers' (it then has no efficiency; 2 calls of
    // 256 KiB once measured 0 here).
    let small = get("all_reduce", 256 << 10);
    assert_eq!(
        small["c_s_per_gb"],
        get("p2p", 1 << 20)["cpu_s_per_gb"],
        "{small}"
    );
    // From 1 MiB: its own c, and the efficiency is wire bytes x c / CPU.
    let big = get("all_reduce", 1 << 20);
    let c = f(big, "c_s_per_gb");
    assert!(c > 0.0, "{big}");
    let eff = f(big, "wire_bytes_per_call") / 1e9 * c / (f(big, "cpu_us_per_call") / 1e6);
    assert!((eff - f(big, "efficiency")).abs() < 0.01, "{eff} vs {big}");
    // The barriers that start the calls are measured and kept out of the CPU per call.
    assert!(f(big, "barrier_cpu_us_per_call") > 0.0, "{big}");
}

#[test]
fn in_place_collectives_check_out() {
    let ops = ["all_gather", "reduce_scatter"];
    forms_check_out(
        &["--in-place"],
        &ops,
        ", all_gather and reduce_scatter in place",
    );
    forms_check_out(
        &["--in-place", "--zero-copy"],
        &ops,
        "zero-copy buffers, all_gather and reduce_scatter in place",
    );
}

/// A run that writes more than a pipe holds (its trace log, on stderr) finishes: the test
/// reads its output as it comes.
#[test]
fn a_run_that_writes_more_than_a_pipe_holds_finishes() {
    let out = nexar(&[
        "--log", "trace", "local", "--world", "2", "bench", "--ops", "barrier", "--iters", "2",
        "--warmup", "0",
    ]);
    assert_exit("nexar --log trace local bench", &out, 0);
    let logged = out.stderr.len();
    assert!(logged > 64 << 10, "only {logged} bytes on stderr");
}

#[test]
fn a_bad_op_name_is_a_usage_error() {
    let out = nexar(&[
        "local",
        "--world",
        "2",
        "bench",
        "--ops",
        "all_reduce,allreduce",
    ]);
    assert_exit("nexar bench --ops all_reduce,allreduce", &out, 2);
    assert!(
        out.stderr.contains("unknown op `allreduce`"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.is_empty(), "{}", out.stdout);
}

/// Options out of range, or that leave nothing to measure, are usage errors that say why,
/// before anything is printed.
#[test]
fn options_that_cannot_run_are_usage_errors() {
    for (args, says) in [
        (
            &[
                "--world",
                "2",
                "bench",
                "--min-bytes",
                "1M",
                "--max-bytes",
                "4K",
            ][..],
            "--min-bytes (1048576) is above --max-bytes (4096)",
        ),
        (
            &["--world", "1", "bench", "--ops", "p2p"],
            "nothing to measure: p2p needs 2 ranks, the world has 1",
        ),
        (
            &["--world", "2", "bench", "--iters", "100000000000"],
            "at most 1000000",
        ),
        (
            &["--world", "2", "bench", "--warmup", "100000000000"],
            "at most 1000000",
        ),
        (
            &["--world", "2", "bench", "--cpu-per-gb=-1"],
            "must be a finite number above 0",
        ),
        (
            &["--world", "2", "bench", "--cpu-per-gb", "NaN"],
            "must be a finite number above 0",
        ),
        (
            &["--world", "8", "bench", "--iters", "1000000"],
            "every rank would gather 8000000 call times",
        ),
        // The default ops: barrier would be the only row.
        (
            &[
                "--world",
                "4",
                "bench",
                "--min-bytes",
                "2",
                "--max-bytes",
                "2",
            ],
            "nothing to measure: all_reduce needs 4 bytes (one f32), the sweep stops at 2",
        ),
        (
            &[
                "--world",
                "4",
                "bench",
                "--dtype",
                "f64",
                "--min-bytes",
                "4",
                "--max-bytes",
                "4",
            ],
            "nothing to measure: all_reduce needs 8 bytes (one f64)",
        ),
        (
            &["--world", "1", "bench", "--ops", "p2p,barrier"],
            "nothing to measure: p2p needs 2 ranks, the world has 1",
        ),
    ] {
        let out = nexar(&[&["local"][..], args].concat());
        assert_exit(&format!("nexar local {args:?}"), &out, 2);
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
        assert!(out.stdout.is_empty(), "{args:?}: {}", out.stdout);
    }
}

/// Buffers no allocator can serve (4 PiB, beyond any address space) stop the run with an
/// error that says so on every rank, not an abort.
#[test]
fn buffers_that_cannot_be_allocated_stop_the_run_with_an_error() {
    let args = [
        "local",
        "--world",
        "2",
        "bench",
        "--ops",
        "all_reduce",
        "--min-bytes",
        "4194304G",
        "--max-bytes",
        "4194304G",
        "--iters",
        "1",
        "--warmup",
        "0",
    ];
    let out = nexar(&args);
    assert_exit(&format!("nexar {args:?}"), &out, 1);
    assert!(
        out.stderr.contains(
            "could not allocate the buffers of all_reduce at 4503599627370496 bytes \
             (1125899906842624 x f32): memory allocation failed"
        ),
        "{}",
        out.stderr
    );
}

/// A seed for two workers and both workers (ranks 0 and 1), each running `job`.
fn seed_and_two_workers(job: &[&str]) -> (Proc, Vec<Proc>) {
    let mut seed = Proc::spawn(
        "seed",
        support::nexar().args(["seed", "--listen", "127.0.0.1:0", "--world", "2"]),
    );
    let join = seed.line(Duration::from_secs(30));
    let workers = (0..2)
        .map(|rank| {
            let rank = rank.to_string();
            Proc::spawn(
                &format!("worker {rank}"),
                support::nexar()
                    .args(["worker", "--join", &join, "--listen", "127.0.0.1:0"])
                    .args(["--rank", &rank])
                    .args(job),
            )
        })
        .collect();
    (seed, workers)
}

#[test]
fn worker_processes_bench_together_and_rank_zero_prints() {
    let deadline = Instant::now() + Duration::from_secs(180);
    let bench = [
        "bench",
        "--ops",
        "all_reduce,p2p",
        "--min-bytes",
        "64",
        "--max-bytes",
        "256",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
    ];
    let (mut seed, mut workers) = seed_and_two_workers(&bench);
    let outs: Vec<_> = workers.iter_mut().map(|w| w.wait(deadline)).collect();
    for (i, out) in outs.iter().enumerate() {
        assert_exit(&format!("worker {i}"), out, 0);
    }
    let rows: Vec<serde_json::Value> = outs[0]
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    // p2p first, then all_reduce, at 64 and 256 bytes; two processes.
    assert_eq!(rows.len(), 4, "{}", outs[0].stdout);
    assert_eq!(
        (&rows[0]["op"], &rows[2]["op"]),
        (&"p2p".into(), &"all_reduce".into())
    );
    for row in &rows {
        assert_eq!(
            (&row["ok"], &row["processes"]),
            (&true.into(), &2.into()),
            "{row}"
        );
    }
    assert!(outs[1].stdout.trim().is_empty(), "{}", outs[1].stdout);
    assert_exit("seed", &seed.wait(deadline), 0);
}

/// Bench options that cannot run on the world the workers formed are a usage error on
/// every worker (exit 2), as they are for `nexar local`.
#[test]
fn worker_bench_options_that_cannot_run_are_usage_errors() {
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut seed, mut workers) =
        seed_and_two_workers(&["bench", "--min-bytes", "1K", "--max-bytes", "8"]);
    for (i, w) in workers.iter_mut().enumerate() {
        let out = w.wait(deadline);
        assert_exit(&format!("worker {i}"), &out, 2);
        assert!(out.stderr.contains("--min-bytes"), "{}", out.stderr);
    }
    seed.wait(deadline);
}
