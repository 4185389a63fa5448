//! Printing job results, as a table for people or as JSON lines for programs.

use std::io::{self, Write};
use std::time::Duration;

use nexar_cli::{CheckResult, ClusterInfo};
use serde_json::json;

/// Milliseconds with microsecond resolution, so JSON stays short.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Prints one line per check and a summary line. With `json`, each line is an object:
/// `{"check","ok","ranks","ms","error"}` per check, then
/// `{"summary":"smoke","ok","ranks","checks","passed","failed","ms"}`.
pub(crate) fn smoke(out: &mut impl Write, results: &[CheckResult], json: bool) -> io::Result<()> {
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
        let summary = json!({
            "summary": "smoke", "ok": failed == 0, "ranks": ranks, "checks": results.len(),
            "passed": results.len() - failed, "failed": failed, "ms": millis(total),
        });
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
        writeln!(
            out,
            "{status}: {} of {} checks passed on {ranks} ranks in {:.1} ms",
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
        assert!(smoke(&mut buf, &results(), json).is_ok());
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
}
