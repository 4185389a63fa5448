//! Printing job results, as a table for people or as JSON lines for programs.

use std::io::{self, Write};
use std::net::SocketAddr;
use std::time::Duration;

use nexar_actors::SeedReport;
use nexar_cli::{CheckResult, ClusterInfo};
use serde_json::json;

/// Milliseconds with microsecond resolution, so JSON stays short.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Prints one line per check and a summary line. With `json`, each line is an object:
/// `{"check","ok","ranks","ms","error"}` per check, then
/// `{"summary":"smoke","ok","ranks","checks","passed","failed","ms"}`.
///
/// `rank` is set when the results are one rank's part of the checks (`nexar worker`): the
/// summary then says so, and its JSON object gets a `"rank"` field.
pub(crate) fn smoke(
    out: &mut impl Write,
    results: &[CheckResult],
    rank: Option<usize>,
    json: bool,
) -> io::Result<()> {
    let failed = results.iter().filter(|r| !r.ok()).count();
    let total: Duration = results.iter().map(|r| r.elapsed).sum();
    let ranks = results.first().map_or(0, |r| r.ranks);
    if json {
        for r in results {
            let line = json!({
                "check": r.name, "ok": r.ok(), "ranks": r.ranks, "ms": millis(r.elapsed), "error": r.error,
            });
            writeln!(out, "{line}")?;
        }
        let mut summary = json!({
            "summary": "smoke", "ok": failed == 0, "ranks": ranks, "checks": results.len(),
            "passed": results.len() - failed, "failed": failed, "ms": millis(total),
        });
        if let Some(rank) = rank {
            summary["rank"] = json!(rank);
        }
        writeln!(out, "{summary}")?;
    } else {
        writeln!(out, "{:<16} {:>5} {:>10}  result", "check", "ranks", "ms")?;
        for r in results {
            let verdict = match &r.error {
                None => "PASS".to_string(),
                Some(e) => format!("FAIL  {e}"),
            };
            writeln!(
                out,
                "{:<16} {:>5} {:>10.1}  {verdict}",
                r.name,
                r.ranks,
                millis(r.elapsed)
            )?;
        }
        let status = if failed == 0 { "PASS" } else { "FAIL" };
        let scope = match rank {
            Some(rank) => format!("rank {rank} of {ranks}"),
            None => format!("{ranks} ranks"),
        };
        writeln!(
            out,
            "{status}: {} of {} checks passed on {scope} in {:.1} ms",
            results.len() - failed,
            results.len(),
            millis(total)
        )?;
    }
    out.flush()
}

/// Prints the world size and one line per rank. With `json`, one object per rank:
/// `{"world","rank","node","addr"}` (`addr` is null when unknown).
pub(crate) fn info(out: &mut impl Write, info: &ClusterInfo, json: bool) -> io::Result<()> {
    if json {
        for r in &info.ranks {
            let line = json!({
                "world": info.world, "rank": r.rank, "node": r.node.0, "addr": r.addr.map(|a| a.to_string()),
            });
            writeln!(out, "{line}")?;
        }
    } else {
        writeln!(out, "world: {}", info.world)?;
        writeln!(out, "{:>5} {:>6}  addr", "rank", "node")?;
        for r in &info.ranks {
            let addr = r
                .addr
                .map_or_else(|| "unknown".to_string(), |a| a.to_string());
            writeln!(out, "{:>5} {:>6}  {addr}", r.rank, r.node.0)?;
        }
    }
    out.flush()
}

/// Prints how a multi-process cluster went, as the seed saw it: a verdict line and one line
/// per rank with its mesh address. With `json`, one object:
/// `{"summary":"seed","ok","world","passed","failed","ranks":[{"rank","ok","addr"}]}`.
pub(crate) fn seed(out: &mut impl Write, report: &SeedReport, json: bool) -> io::Result<()> {
    let rows: Vec<(usize, bool, Option<SocketAddr>)> = (0..report.world)
        .map(|r| (r, report.ok.contains(&r), report.addrs.get(r).copied()))
        .collect();
    let all_ok = report.failed.is_empty() && report.ok.len() == report.world;
    if json {
        let ranks: Vec<_> = rows
            .iter()
            .map(|(rank, ok, addr)| json!({"rank": rank, "ok": ok, "addr": addr.map(|a| a.to_string())}))
            .collect();
        let summary = json!({
            "summary": "seed", "ok": all_ok, "world": report.world,
            "passed": report.ok.len(), "failed": report.failed.len(), "ranks": ranks,
        });
        writeln!(out, "{summary}")?;
    } else {
        let status = if all_ok { "PASS" } else { "FAIL" };
        writeln!(
            out,
            "{status}: {} of {} workers reported success",
            report.ok.len(),
            report.world
        )?;
        writeln!(out, "{:>5}  {:<6}  addr", "rank", "result")?;
        for (rank, ok, addr) in rows {
            let result = if ok { "ok" } else { "FAILED" };
            let addr = addr.map_or_else(|| "unknown".to_string(), |a| a.to_string());
            writeln!(out, "{rank:>5}  {result:<6}  {addr}")?;
        }
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn results() -> Vec<CheckResult> {
        vec![
            CheckResult {
                name: "barrier",
                ranks: 2,
                elapsed: Duration::from_micros(1500),
                error: None,
            },
            CheckResult {
                name: "scan",
                ranks: 2,
                elapsed: Duration::from_millis(2),
                error: Some("rank 1: bad".into()),
            },
        ]
    }

    fn render(json: bool) -> String {
        let mut buf = Vec::new();
        assert!(smoke(&mut buf, &results(), None, json).is_ok());
        String::from_utf8_lossy(&buf).into_owned()
    }

    #[test]
    fn smoke_json_is_one_object_per_line() {
        let lines: Vec<serde_json::Value> = render(true)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[0],
            json!({"check": "barrier", "ok": true, "ranks": 2, "ms": 1.5, "error": null})
        );
        assert_eq!(lines[1]["error"], "rank 1: bad");
        assert_eq!(
            (&lines[2]["passed"], &lines[2]["failed"], &lines[2]["ok"]),
            (&json!(1), &json!(1), &json!(false))
        );
    }

    #[test]
    fn smoke_table_has_row_per_check_and_summary() {
        let text = render(false);
        assert!(
            text.contains("PASS") && text.contains("FAIL  rank 1: bad"),
            "{text}"
        );
        assert_eq!(
            text.lines().last(),
            Some("FAIL: 1 of 2 checks passed on 2 ranks in 3.5 ms")
        );
    }

    #[test]
    fn worker_summary_names_its_rank() {
        let mut buf = Vec::new();
        assert!(smoke(&mut buf, &results()[..1], Some(1), false).is_ok());
        let text = String::from_utf8_lossy(&buf);
        assert_eq!(
            text.lines().last(),
            Some("PASS: 1 of 1 checks passed on rank 1 of 2 in 1.5 ms")
        );
    }

    #[test]
    fn seed_summary_lists_every_rank() {
        let report = SeedReport {
            world: 2,
            addrs: vec![
                "10.0.0.2:5000".parse().expect("addr"),
                "10.0.0.3:5000".parse().expect("addr"),
            ],
            ok: vec![0],
            failed: vec![1],
        };
        let mut buf = Vec::new();
        assert!(seed(&mut buf, &report, true).is_ok());
        let v: serde_json::Value = serde_json::from_slice(&buf).expect("one JSON object");
        assert_eq!((&v["ok"], &v["failed"]), (&json!(false), &json!(1)));
        assert_eq!(
            v["ranks"][1],
            json!({"rank": 1, "ok": false, "addr": "10.0.0.3:5000"})
        );
        let mut buf = Vec::new();
        assert!(seed(&mut buf, &report, false).is_ok());
        let text = String::from_utf8_lossy(&buf);
        assert!(
            text.starts_with("FAIL: 1 of 2 workers reported success"),
            "{text}"
        );
        assert!(text.contains("    1  FAILED  10.0.0.3:5000"), "{text}");
    }
}
