"""Markdown tables from `nexar --json ... bench` rows, for bench/full-tables.sh.

    python3 bench/tables.py table TITLE LOAD CS < rows.json  # one Markdown table
    python3 bench/tables.py best-c rows.json                  # best p2p CPU s/GB >= 1 MiB
    python3 bench/tables.py summary tables.md                 # the efficiency target's rows

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


# The efficiency target: these ops, from 1 MiB up.
TARGET_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
TARGET_SIZES = ("1 MiB", "4 MiB", "16 MiB", "64 MiB")


def number(cell):
    """A cell's number ("83%" -> 83.0, "0.94" -> 0.94); None for "-"."""
    try:
        return float(cell.rstrip("%"))
    except ValueError:
        return None


def summary(lines):
    """Reads full-tables.sh's Markdown and prints, for the efficiency target's rows: how
    many are under 80% on eff and on eff@size (and which), the medians, the collectives'
    CPU per byte against sendrecv's of the same size in the same table, and the p2p
    stream's CPU per byte at each size."""
    rows, sections, section = {}, [], None
    for line in lines:
        if line.startswith("#### "):
            section = line[5:].strip()
            sections.append(section)
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) < 15 or cells[0] in ("op", "---"):
            continue
        rows[(section, cells[0], cells[1])] = cells
    target = [(k, c) for k, c in rows.items() if k[1] in TARGET_OPS and k[2] in TARGET_SIZES]
    if not target:
        sys.exit("no all_reduce, broadcast, all_gather or reduce_scatter rows of 1 MiB+")
    for col, name in ((11, "eff"), (12, "eff@size")):
        vals = [(k, v) for k, c in target if (v := number(c[col])) is not None]
        low = [(k, v) for k, v in vals if v < 80]
        med = statistics.median(v for _, v in vals) if vals else float("nan")
        print(f"{name}: {len(low)} of {len(target)} rows under 80%, median {med:.0f}%")
        for (sec, op, sz), v in low:
            print(f"  {sec}: {op} {sz} {v:.0f}%")
    ratios = []
    for (sec, op, sz), c in target:
        sr = rows.get((sec, "sendrecv", sz))
        mine, theirs = number(c[9]), sr and number(sr[9])
        if mine and theirs:
            ratios.append(theirs / mine)
    if ratios:
        print(f"sendrecv CPU s/GB over the collective's, same size and table: median "
              f"{statistics.median(ratios):.2f}, {sum(r >= 0.8 for r in ratios)} of "
              f"{len(ratios)} at 0.8 or more")
    for sec in sections:
        p2p = [(sz, rows[(sec, "p2p", sz)][9]) for sz in TARGET_SIZES if (sec, "p2p", sz) in rows]
        if p2p:
            print(f"p2p CPU s/GB, {sec}: " + ", ".join(f"{sz} {v}" for sz, v in p2p))


if __name__ == "__main__":
    if sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3], sys.argv[4], rows_of(sys.stdin))
    elif sys.argv[1] == "best-c":
        with open(sys.argv[2]) as f:
            c = best_c(rows_of(f))
        print(f"{c:.3f}" if c else "")
    elif sys.argv[1] == "summary":
        with open(sys.argv[2]) as f:
            summary(f)
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
