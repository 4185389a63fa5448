//! The README's main command, run through the real `nexar` binary.

use std::process::Command;
use std::time::{Duration, Instant};

fn run_with_deadline(args: &[&str], deadline: Duration) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nexar"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start nexar");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("poll nexar").is_some() {
            return child.wait_with_output().expect("collect output");
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            panic!("nexar {args:?} did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn readme_smoke_command_passes_on_four_ranks() {
    let out = run_with_deadline(
        &["local", "--world", "4", "smoke"],
        Duration::from_secs(120),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("13 of 13 checks passed"), "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
    // A clean shutdown refuses nothing: the connections' long-lived message streams end
    // with them, quietly.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("refusing inbound frame"), "{stderr}");
}

#[test]
fn json_smoke_reports_every_check_ok() {
    let out = run_with_deadline(
        &["local", "--world", "3", "smoke", "--json"],
        Duration::from_secs(120),
    );
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    assert!(lines.len() >= 13);
    assert!(lines
        .iter()
        .all(|v| v["ok"] == serde_json::Value::Bool(true)));
}

#[test]
fn zero_ranks_is_a_usage_error() {
    let out = run_with_deadline(&["local", "--world", "0", "smoke"], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least one rank"));
}

#[test]
fn the_elastic_job_without_a_seed_is_a_usage_error() {
    let out = run_with_deadline(
        &["local", "--world", "2", "elastic"],
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs a seed"));
}

#[test]
fn bad_world_bounds_are_a_usage_error_for_the_seed() {
    let out = run_with_deadline(
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
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bounds"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn zero_worker_threads_is_a_usage_error() {
    let join = format!(
        "nexar://127.0.0.1:9/{}/{}",
        "ab".repeat(32),
        "cd".repeat(32)
    );
    let out = run_with_deadline(
        &["worker", "--join", &join, "--threads", "0", "smoke"],
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--threads"));
}
