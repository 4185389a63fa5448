//! The README's main command, run through the real `nexar` binary.

// Not every helper there is used here.
#[allow(dead_code)]
mod support;

use std::time::{Duration, Instant};

use support::{assert_exit, Finished, Proc};

/// Runs `nexar ARGS` to completion within `limit`. Its stdout and stderr are drained as it
/// runs (a chatty child, e.g. with RUST_LOG=trace inherited, would otherwise block on a
/// full pipe), and it is killed if it outlives the limit.
fn run(args: &[&str], limit: Duration) -> Finished {
    let mut cmd = support::nexar();
    cmd.args(args);
    Proc::spawn(&format!("nexar {}", args.join(" ")), &mut cmd).wait(Instant::now() + limit)
}

/// What a failed assertion shows: the exit code and all the child printed.
fn shown(out: &Finished) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.code, out.stdout, out.stderr
    )
}

/// README's main command, its arguments read from README itself.
#[test]
fn readme_smoke_command_passes_on_four_ranks() {
    let readme = include_str!("../../../README.md");
    let line = readme
        .lines()
        .find(|l| l.starts_with("cargo run --release -p nexar-cli -- "))
        .expect("README's main command");
    let args: Vec<&str> = line["cargo run --release -p nexar-cli -- ".len()..]
        .split_whitespace()
        .collect();
    assert_eq!(
        args,
        ["local", "--world", "4", "smoke"],
        "README's main command changed"
    );
    let out = run(&args, Duration::from_secs(120));
    assert_exit("nexar local --world 4 smoke", &out, 0);
    assert!(
        out.stdout.contains("13 of 13 checks passed"),
        "{}",
        shown(&out)
    );
    assert!(!out.stdout.contains("FAIL"), "{}", shown(&out));
    // A clean shutdown refuses nothing: the connections' long-lived message streams end
    // with them, quietly.
    assert!(
        !out.stderr.contains("refusing inbound frame"),
        "{}",
        shown(&out)
    );
}

#[test]
fn json_smoke_reports_every_check_ok() {
    let out = run(
        &["local", "--world", "3", "smoke", "--json"],
        Duration::from_secs(120),
    );
    assert_exit("nexar local --world 3 smoke --json", &out, 0);
    let lines: Vec<serde_json::Value> = out
        .stdout
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {l}\n{}", shown(&out)))
        })
        .collect();
    assert!(lines.len() >= 13, "{}", shown(&out));
    assert!(
        lines
            .iter()
            .all(|v| v["ok"] == serde_json::Value::Bool(true)),
        "{}",
        shown(&out)
    );
}

#[test]
fn zero_ranks_is_a_usage_error() {
    let out = run(&["local", "--world", "0", "smoke"], Duration::from_secs(30));
    assert_exit("nexar local --world 0 smoke", &out, 2);
    assert!(out.stderr.contains("at least one rank"), "{}", shown(&out));
}

#[test]
fn the_elastic_job_without_a_seed_is_a_usage_error() {
    let out = run(
        &["local", "--world", "2", "elastic"],
        Duration::from_secs(60),
    );
    assert_exit("nexar local --world 2 elastic", &out, 2);
    assert!(out.stderr.contains("needs a seed"), "{}", shown(&out));
}

/// Refused before any node starts: no cluster to bring up, nor to shut down.
#[test]
fn the_elastic_job_is_refused_before_a_cluster_starts() {
    let out = run(
        &["--log", "debug", "local", "--world", "2", "elastic"],
        Duration::from_secs(60),
    );
    assert_exit("nexar --log debug local --world 2 elastic", &out, 2);
    assert!(
        out.stderr.lines().all(|l| l.starts_with("error: ")),
        "{}",
        shown(&out)
    );
}

/// A soak or elastic loop over no iterations or no elements would check nothing.
#[test]
fn empty_soak_and_elastic_loops_are_usage_errors() {
    for args in [
        &["local", "--world", "1", "soak", "--elems", "0"][..],
        &["local", "--world", "1", "soak", "--iters", "0"],
        &["local", "--world", "1", "elastic", "--elems", "0"],
        &["local", "--world", "1", "elastic", "--iters", "0"],
    ] {
        let out = run(args, Duration::from_secs(60));
        assert_exit(&format!("nexar {}", args.join(" ")), &out, 2);
        assert!(out.stderr.contains("must be at least 1"), "{}", shown(&out));
    }
}

/// A buffer no allocator can serve is the soak's failure, said as such: not a panic
/// (2^64 bytes) nor an abort (4 PiB).
#[test]
fn a_soak_buffer_that_cannot_be_allocated_fails_and_says_why() {
    for elems in ["2305843009213693952", "562949953421312"] {
        let args = ["local", "--world", "1", "soak", "--elems", elems];
        let out = run(&args, Duration::from_secs(60));
        assert_exit(&format!("nexar {}", args.join(" ")), &out, 1);
        assert!(
            out.stdout.contains(&format!(
                "soak: FAIL: could not allocate {elems} f64 elements: memory allocation failed"
            )),
            "{}",
            shown(&out)
        );
        assert!(!out.stderr.contains("panicked"), "{}", shown(&out));
    }
}

#[test]
fn bad_world_bounds_are_a_usage_error_for_the_seed() {
    let out = run(
        &[
            "seed",
            "--listen",
            "127.0.0.1:0",
            "--world",
            "3",
            "--max-world",
            "2",
        ],
        Duration::from_secs(60),
    );
    assert_exit("nexar seed --world 3 --max-world 2", &out, 2);
    assert!(out.stderr.contains("bounds"), "{}", shown(&out));
    // A world past the most a peer list carries, refused by the seed itself.
    let out = run(
        &["seed", "--listen", "127.0.0.1:0", "--world", "600000"],
        Duration::from_secs(60),
    );
    assert_exit("nexar seed --world 600000", &out, 2);
    assert!(out.stderr.contains("too large"), "{}", shown(&out));
}

/// A join string naming a seed that never answers: a loopback UDP socket kept bound (so
/// that no test beside this one takes its port) and never read, for tests whose worker
/// must fail before it reaches any seed.
fn silent_join() -> (std::net::UdpSocket, String) {
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("a silent socket");
    let addr = silent.local_addr().expect("its address");
    let join = format!("nexar://{addr}/{}/{}", "ab".repeat(32), "cd".repeat(32));
    (silent, join)
}

/// A rank out of range, refused by the node before it reaches the seed, is a usage error.
#[test]
fn a_worker_rank_out_of_range_is_a_usage_error() {
    let (_silent, join) = silent_join();
    let out = run(
        &["worker", "--join", &join, "--rank", "4000000000", "info"],
        Duration::from_secs(60),
    );
    assert_exit("nexar worker --rank 4000000000", &out, 2);
    assert!(out.stderr.contains("out of range"), "{}", shown(&out));
}

#[test]
fn a_worker_thread_count_out_of_range_is_a_usage_error() {
    let (_silent, join) = silent_join();
    for threads in ["0", "1025", "18446744073709551615"] {
        let out = run(
            &["worker", "--join", &join, "--threads", threads, "smoke"],
            Duration::from_secs(60),
        );
        assert_exit(&format!("nexar worker --threads {threads}"), &out, 2);
        assert!(out.stderr.contains("--threads"), "{}", shown(&out));
    }
}

/// A bad `TOKIO_WORKER_THREADS` is a usage error for every command, not a panic in the
/// runtime's start.
#[test]
fn a_bad_runtime_thread_variable_is_a_usage_error() {
    for value in ["0", "lots"] {
        let mut cmd = support::nexar();
        cmd.env("TOKIO_WORKER_THREADS", value)
            .args(["local", "--world", "1", "info"]);
        let what = format!("TOKIO_WORKER_THREADS={value} nexar local --world 1 info");
        let out = Proc::spawn(&what, &mut cmd).wait(Instant::now() + Duration::from_secs(60));
        assert_exit(&what, &out, 2);
        assert!(
            out.stderr.contains("TOKIO_WORKER_THREADS"),
            "{}",
            shown(&out)
        );
    }
    // A good one is taken.
    let mut cmd = support::nexar();
    cmd.env("TOKIO_WORKER_THREADS", "1")
        .args(["local", "--world", "1", "info"]);
    let what = "TOKIO_WORKER_THREADS=1 nexar local --world 1 info";
    let out = Proc::spawn(what, &mut cmd).wait(Instant::now() + Duration::from_secs(60));
    assert_exit(what, &out, 0);
}

/// The rest of a doc's code block from the line that starts with `start` (to the block's
/// end).
fn doc_block<'a>(doc: &'a str, start: &str) -> &'a str {
    let from = doc
        .find(start)
        .unwrap_or_else(|| panic!("no `{start}` in the doc"));
    let block = &doc[from..];
    &block[..block.find("```").expect("the end of its code block")]
}

/// Runs `script` with `bash -c` in `dir`, without the test's launcher variables, within
/// 120 s.
fn bash(what: &str, dir: &std::path::Path, script: &str) -> Finished {
    let mut cmd = std::process::Command::new("bash");
    support::without_launcher(&mut cmd)
        .current_dir(dir)
        .arg("-c")
        .arg(script);
    Proc::spawn(what, &mut cmd).wait(Instant::now() + Duration::from_secs(120))
}

/// The README's multi-process smoke run, from the README itself (after its build line,
/// with this build's binary), as `bash` runs it: it passes, and a worker that fails
/// makes the whole of it fail (its last line waits for each worker).
#[test]
fn readme_multi_process_smoke_passes_and_reports_a_failed_worker() {
    let script = doc_block(include_str!("../../../README.md"), "JOIN=$( ($nexar seed");
    let bin = env!("CARGO_BIN_EXE_nexar");
    let dir = std::env::temp_dir();
    let run_script =
        |what: &str, script: String| bash(what, &dir, &format!("nexar={bin}\n{script}"));
    let out = run_script("the README's multi-process run", script.to_string());
    assert_exit("the README's multi-process run", &out, 0);
    assert_eq!(
        out.stdout.matches("13 of 13 checks passed").count(),
        4,
        "{}",
        shown(&out)
    );
    // A worker refuses a flag it does not know (and the seed gives up soon).
    let failing = script
        .replace(" smoke &", " smoke --no-such-flag &")
        .replace("--world 4 &", "--world 4 --timeout 2 &");
    assert_ne!(failing, script, "the README's run changed shape");
    let out = run_script("the README's run with failing workers", failing);
    assert!(out.code.is_some_and(|c| c != 0), "{}", shown(&out));
}

/// BENCHMARKS.md's multi-process run, from the file itself (with this build's binary, 2
/// ranks and one small size): it passes and rank 0 prints the table; and when rank 0
/// fails (here its table cannot be written), so does the whole of it, although the other
/// ranks succeed. Its last line used to look at the other ranks only.
#[test]
fn the_benchmarks_multi_process_run_passes_and_reports_a_failed_rank_0() {
    let script = doc_block(include_str!("../../../BENCHMARKS.md"), "N=4\nexec 3<");
    let small = script
        .replace("target/release/nexar", env!("CARGO_BIN_EXE_nexar"))
        .replace("N=4", "N=2")
        .replace(
            "--min-bytes 4K --max-bytes 64M",
            "--min-bytes 4K --max-bytes 4K --iters 2 --warmup 1",
        );
    let dir = std::env::temp_dir().join(format!("nexar-bench-doc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let run_script = |what: &str, script: &str| bash(what, &dir, script);
    let out = run_script("BENCHMARKS' multi-process run", &small);
    assert_exit("BENCHMARKS' multi-process run", &out, 0);
    assert!(out.stdout.contains("all_reduce"), "{}", shown(&out));
    let failing = small.replacen("--warmup 1; ok=$?", "--warmup 1 >/dev/full; ok=$?", 1);
    assert_ne!(failing, small, "BENCHMARKS' run changed shape");
    let out = run_script("BENCHMARKS' run with rank 0 failing", &failing);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.code.is_some_and(|c| c != 0), "{}", shown(&out));
}

/// `.ci/run` runs the test command README gives, after the gates README says it runs
/// first (fmt, clippy with and without the `cuda` feature, the bench build).
#[test]
fn ci_runs_the_readme_test_command_after_the_gates_readme_names() {
    let readme = include_str!("../../../README.md");
    let ci = include_str!("../../../.ci/run");
    let block = readme
        .find("Run the tests")
        .map(|i| &readme[i..])
        .and_then(|r| r.find("```sh\n").map(|j| &r[j + "```sh\n".len()..]))
        .expect("README's test block");
    let command = block.lines().next().expect("README's test command");
    assert!(command.starts_with("cargo test"), "{command}");
    let at = |what: &str| {
        ci.lines()
            .position(|l| l.starts_with(what))
            .unwrap_or_else(|| panic!(".ci/run does not run `{what}`"))
    };
    let tests = at(command);
    // The same command, not one that starts like it: only output redirections follow.
    let ran = ci.lines().nth(tests).unwrap_or_default();
    assert_eq!(
        ran.split(" 2>&1").next(),
        Some(command),
        ".ci/run's test command differs from README's"
    );
    for gate in [
        "cargo fmt --all -- --check",
        "cargo clippy --workspace --all-targets --locked -- -D warnings",
        "cargo clippy -p nexar-device -p nexar-actors -p nexar-tests --all-targets --locked",
        "cargo bench --workspace --no-run",
    ] {
        assert!(at(gate) < tests, "`{gate}` does not come before the tests");
    }
    assert!(
        ci.contains("--features nexar-device/cuda"),
        ".ci/run's second clippy is not the cuda one"
    );
}

/// The scripts BENCHMARKS.md tells users to run parse (`bash -n`, and Python's parser),
/// and `tables.py summary` over BENCHMARKS.md itself prints the summary the
/// file quotes for its full tables. Python's checks skip, saying so, without a `python3`
/// of 3.8 or later.
#[test]
fn the_bench_scripts_parse_and_the_quoted_summary_is_the_tables() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let scripts = [
        "bench/abba.sh",
        "bench/datagrams.sh",
        "bench/full-tables.sh",
        "bench/procs.sh",
        "bench/vs012.sh",
        "crates/nexar-device/gpu-check.sh",
        ".ci/run",
    ];
    for script in scripts {
        let out = std::process::Command::new("bash")
            .arg("-n")
            .arg(root.join(script))
            .output()
            .expect("bash");
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let python = |args: &[&str]| {
        std::process::Command::new("python3")
            .args(args)
            .current_dir(&root)
            .output()
    };
    // The scripts use Python 3.8's syntax.
    let recent = "import sys; sys.exit(sys.version_info < (3, 8))";
    if !python(&["-c", recent]).is_ok_and(|v| v.status.success()) {
        eprintln!("skipping the Python scripts' checks: no python3 of 3.8 or later");
        return;
    }
    for script in ["bench/tables.py", "bench/cpu-split.py"] {
        // Parsed, not compiled: nothing is written next to the script.
        let parse = "import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])";
        let out = python(&["-c", parse, script]).expect("python3");
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = python(&["bench/tables.py", "summary", "BENCHMARKS.md"]).expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = String::from_utf8_lossy(&out.stdout);
    let first = summary.lines().next().expect("a summary line");
    assert!(first.starts_with("eff: "), "{summary}");
    let doc = include_str!("../../../BENCHMARKS.md");
    assert!(
        doc.contains(&format!("```text\n{first}\n")),
        "BENCHMARKS.md does not quote its tables' summary, `{first}`"
    );
}
