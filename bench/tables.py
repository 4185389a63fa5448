"""Markdown tables from `nexar --json ... bench` rows, for bench/full-tables.sh.

    python3 bench/tables.py table TITLE LOAD CS < rows.json  # one Markdown table
    python3 bench/tables.py best-c rows.json                  # best p2p CPU s/GB >= 1 MiB

`rows.json` may hold several runs of the same sweep (CS: each run's c, space-separated):
each cell is then the median over the runs of that op and size (min and max: the
extremes over the runs; check: ok only when every run was).
"""
import json
import statistics
import sys


def rows_of(lines):
    rows = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and "op" in r:
            rows.append(r)
    return rows


def best_c(rows):
    cs = [r["cpu_s_per_gb"] for r in rows
          if r["op"] == "p2p" and r["bytes"] >= 1 << 20 and r.get("cpu_s_per_gb")]
    return min(cs) if cs else None


def size(b):
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << k and b % (1 << k) == 0:
            return f"{b >> k} {unit}"
    return f"{b} B"


def num(v, fmt):
    return "-" if v is None else format(v, fmt)


def median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def merged(rows):
    """One row per (op, size) in first-seen order, each value the median over the runs."""
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["bytes"]), []).append(r)
    out = []
    for (op, size_b), rs in groups.items():
        m = {k: median(rs, k) for k in (
            "time_us", "algbw_gbps", "busbw_gbps", "cpu_us_per_call", "cpu_s_per_gb",
            "efficiency", "c_s_per_gb", "efficiency_at_size", "minflt_per_call", "mem_ratio")}
        m.update(op=op, bytes=size_b, runs=len(rs),
                 algorithm="/".join(sorted({r["algorithm"] for r in rs})),
                 min_us=min(r["min_us"] for r in rs), max_us=max(r["max_us"] for r in rs),
                 ok=all(r["ok"] for r in rs))
        out.append(m)
    return out


def table(title, load, cs, rows):
    runs = [c for c in cs.split() if c != "-"]
    rows = merged(rows)
    print(f"#### {title}\n")
    if len(cs.split()) > 1:
        head = (f"median of {len(cs.split())} runs; best p2p CPU s/GB (>= 1 MiB) per run: "
                f"{', '.join(runs)}; ")
    else:
        head = f"best p2p CPU s/GB (>= 1 MiB) = {float(runs[0]):.2f}; " if runs else ""
    print(f"{head}load before the run: `{load}`\n")
    print("| op | size | alg | time_us med | min / max | algbw | busbw | check | "
          "CPU us/call | CPU s/GB | c | eff | eff@size | faults/call | mem_x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eff = r.get("efficiency")
        eff_size = r.get("efficiency_at_size")
        cells = [
            r["op"], size(r["bytes"]), r["algorithm"], f"{r['time_us']:.0f}",
            f"{r['min_us']:.0f} / {r['max_us']:.0f}", f"{r['algbw_gbps']:.3f}",
            f"{r['busbw_gbps']:.3f}", "ok" if r["ok"] else "FAIL",
            num(r.get("cpu_us_per_call"), ".0f"), num(r.get("cpu_s_per_gb"), ".2f"),
            num(r.get("c_s_per_gb"), ".2f"),
            "-" if eff is None else f"{eff * 100:.0f}%",
            "-" if eff_size is None else f"{eff_size * 100:.0f}%",
            num(r.get("minflt_per_call"), ".0f"), num(r.get("mem_ratio"), ".2f"),
        ]
        print("| " + " | ".join(cells) + " |")
    print()


if __name__ == "__main__":
    if sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3], sys.argv[4], rows_of(sys.stdin))
    elif sys.argv[1] == "best-c":
        with open(sys.argv[2]) as f:
            c = best_c(rows_of(f))
        print(f"{c:.3f}" if c else "")
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
