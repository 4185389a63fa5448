//! Printing job results, as a table for people or as JSON lines for programs.

use std::io::{self, Write};
use std::net::SocketAddr;
use std::time::Duration;

use nexar_actors::SeedReport;
use nexar_cli::{BenchOptions, BenchRow, CheckResult, ClusterInfo};
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
        .map(|r| (r, report.addrs.get(r).copied()))
        .chain(report.joined.iter().map(|(r, a)| (*r, Some(*a))))
        .map(|(r, addr)| (r, report.ok.contains(&r), addr))
        .collect();
    let all_ok = report.succeeded();
    let nodes = rows.len();
    if json {
        let ranks: Vec<_> = rows
            .iter()
            .map(|(rank, ok, addr)| json!({"rank": rank, "ok": ok, "addr": addr.map(|a| a.to_string())}))
            .collect();
        let summary = json!({
            "summary": "seed", "ok": all_ok, "world": report.world, "nodes": nodes,
            "passed": report.ok.len(), "failed": report.failed.len(), "ranks": ranks,
        });
        writeln!(out, "{summary}")?;
    } else {
        let status = if all_ok { "PASS" } else { "FAIL" };
        writeln!(
            out,
            "{status}: {} of {nodes} workers reported success",
            report.ok.len(),
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

/// Prints the bench table's title and column names; nothing with `json` (every line is
/// then a row object).
pub(crate) fn bench_header(
    out: &mut impl Write,
    world: usize,
    opts: &BenchOptions,
    json: bool,
) -> io::Result<()> {
    if json {
        return Ok(());
    }
    writeln!(
        out,
        "# nexar bench: {world} ranks, dtype {}, {} timed calls after {} warm-up{}; time = \
         median of the slowest rank's time per call (us); bandwidths in GB/s",
        opts.dtype.name(),
        opts.iters,
        opts.warmup,
        match (opts.zero_copy, opts.in_place) {
            (false, false) => "",
            (true, false) => ", zero-copy buffers",
            (false, true) => ", all_gather and reduce_scatter in place",
            (true, true) => ", zero-copy buffers, all_gather and reduce_scatter in place",
        }
    )?;
    writeln!(
        out,
        "# cpu_us: CPU time per call, all threads and processes, less the barrier that \
         starts it; wire_B: payload bytes all ranks send per call; s/GB: cpu per GB sent; \
         eff: c / (s/GB), c the p2p s/GB of 4 MiB messages measured just before and after \
         the row (rows from 1 MiB) or the best p2p s/GB from 1 MiB; eff@sz: the same with \
         the p2p s/GB of the same size; flt: minor faults per call; mem_x: peak memory \
         growth / buffer bytes"
    )?;
    writeln!(
        out,
        "{:<14} {:>10} {:>10} {:>5} {:>5} {:<17} {:>10} {:>10} {:>10} {:>7} {:>7} {:>5} {:>10} \
         {:>11} {:>6} {:>5} {:>7} {:>8} {:>5}",
        "op",
        "size",
        "count",
        "type",
        "redop",
        "algorithm",
        "time_us",
        "min_us",
        "max_us",
        "algbw",
        "busbw",
        "check",
        "cpu_us",
        "wire_B",
        "s/GB",
        "eff%",
        "eff@sz%",
        "flt",
        "mem_x"
    )?;
    out.flush()
}

/// Prints one bench row: a table line, or with `json` one object with the keys op, bytes,
/// count, dtype, redop, world, processes, algorithm, iters, time_us, min_us, max_us,
/// algbw_gbps, busbw_gbps, ok, error, cpu_us_per_call, barrier_cpu_us_per_call,
/// wire_bytes_per_call, cpu_s_per_gb, efficiency, c_s_per_gb, efficiency_at_size,
/// minflt_per_call, peak_rss_bytes, user_bytes, mem_ratio (null where unknown).
pub(crate) fn bench_row(out: &mut impl Write, r: &BenchRow, json: bool) -> io::Result<()> {
    let round = |v: f64, digits: i32| {
        let scale = 10f64.powi(digits);
        (v * scale).round() / scale
    };
    let cpu_us = r.cpu_s.map(|s| round(s * 1e6, 1));
    if json {
        let line = json!({
            "op": r.op.name(), "bytes": r.bytes, "count": r.count, "dtype": r.dtype.name(),
            "redop": r.op.redop(), "world": r.world, "processes": r.processes,
            "algorithm": r.algorithm, "iters": r.iters,
            "time_us": round(r.time_us, 2), "min_us": round(r.min_us, 2),
            "max_us": round(r.max_us, 2), "algbw_gbps": round(r.algbw_gbps, 4),
            "busbw_gbps": round(r.busbw_gbps, 4), "ok": r.ok, "error": r.error,
            "cpu_us_per_call": cpu_us,
            "barrier_cpu_us_per_call": r.barrier_cpu_s.map(|s| round(s * 1e6, 1)),
            "wire_bytes_per_call": r.wire_bytes,
            "cpu_s_per_gb": r.cpu_s_per_gb.map(|c| round(c, 3)),
            "efficiency": r.efficiency.map(|e| round(e, 3)),
            "c_s_per_gb": r.c_s_per_gb.map(|c| round(c, 3)),
            "efficiency_at_size": r.efficiency_at_size.map(|e| round(e, 3)),
            "minflt_per_call": r.minflt_per_iter.map(|f| round(f, 1)),
            "peak_rss_bytes": r.peak_rss_bytes, "user_bytes": r.user_bytes,
            "mem_ratio": r.mem_ratio.map(|m| round(m, 3)),
        });
        writeln!(out, "{line}")?;
        return out.flush();
    }
    let opt = |v: Option<f64>, digits: usize| {
        v.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
    };
    let check = if r.ok { "ok" } else { "WRONG" };
    writeln!(
        out,
        "{:<14} {:>10} {:>10} {:>5} {:>5} {:<17} {:>10.1} {:>10.1} {:>10.1} {:>7.3} {:>7.3} \
         {:>5} {:>10} {:>11} {:>6} {:>5} {:>7} {:>8} {:>5}",
        r.op.name(),
        r.bytes,
        r.count,
        r.dtype.name(),
        r.op.redop(),
        r.algorithm,
        r.time_us,
        r.min_us,
        r.max_us,
        r.algbw_gbps,
        r.busbw_gbps,
        check,
        opt(cpu_us, 0),
        r.wire_bytes,
        opt(r.cpu_s_per_gb, 2),
        opt(r.efficiency.map(|e| e * 100.0), 0),
        opt(r.efficiency_at_size.map(|e| e * 100.0), 0),
        opt(r.minflt_per_iter, 0),
        opt(r.mem_ratio, 2)
    )?;
    if let Some(e) = &r.error {
        writeln!(out, "#   check failed: {e}")?;
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
            ok: vec![0, 2],
            failed: vec![1],
            joined: vec![(2, "10.0.0.4:5000".parse().expect("addr"))],
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
            text.starts_with("FAIL: 2 of 3 workers reported success"),
            "{text}"
        );
        assert!(text.contains("    1  FAILED  10.0.0.3:5000"), "{text}");
        assert!(text.contains("    2  ok      10.0.0.4:5000"), "{text}");
    }
}
