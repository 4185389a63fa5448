"""Markdown tables from `nexar --json ... bench` rows, for bench/full-tables.sh.

    python3 bench/tables.py table TITLE LOAD CS < rows.json  # one Markdown table
    python3 bench/tables.py best-c rows.json                  # best p2p CPU s/GB >= 1 MiB
    python3 bench/tables.py summary tables.md                 # the efficiency target's rows
    python3 bench/tables.py ceiling tables.md SIZE:COPY,REDUCE...  # the best eff each row could get

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
    # Each op's rows together, by size (a later run may add sizes of an op seen earlier).
    first = {}
    for m in out:
        first.setdefault(m["op"], len(first))
    out.sort(key=lambda m: (first[m["op"]], m["bytes"]))
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
            "-" if eff is None else f"{eff * 100:.1f}%",
            "-" if eff_size is None else f"{eff_size * 100:.1f}%",
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


def parse(lines):
    """full-tables.sh's Markdown as {(section, op, size): cells} and the sections in order."""
    rows, sections, section = {}, [], None
    for line in lines:
        if line.startswith("#### "):
            section = line[5:].strip()
            sections.append(section)
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) < 15 or cells[0] in ("op", "---"):
            continue
        rows[(section, cells[0], cells[1])] = cells
    return rows, sections


def targets(rows):
    """The efficiency target's rows: its four collectives from 1 MiB up."""
    return [(k, c) for k, c in rows.items() if k[1] in TARGET_OPS and k[2] in TARGET_SIZES]


def summary(lines):
    """Reads full-tables.sh's Markdown and prints, for the efficiency target's rows: how
    many are under 80% on eff and on eff@size (and which), the medians, the collectives'
    CPU per byte against sendrecv's of the same size in the same table, and the p2p
    stream's CPU per byte at each size."""
    rows, sections = parse(lines)
    target = targets(rows)
    if not target:
        sys.exit("no all_reduce, broadcast, all_gather or reduce_scatter rows of 1 MiB+")
    # Every table should have all of them (a table cut short has none): say which it lacks.
    missing = [(sec, op, sz) for sec in sections
               for op in TARGET_OPS for sz in TARGET_SIZES if (sec, op, sz) not in rows]
    for col, name in ((11, "eff"), (12, "eff@size")):
        vals = [(k, v) for k, c in target if (v := number(c[col])) is not None]
        # A row without the figure is neither under 80% nor over: named, not counted.
        blank = [k for k, c in target if number(c[col]) is None]
        low = [(k, v) for k, v in vals if v < 80]
        med = statistics.median(v for _, v in vals) if vals else float("nan")
        print(f"{name}: {len(low)} of {len(vals)} rows under 80%, median {med:.1f}%")
        for (sec, op, sz), v in low:
            print(f"  {sec}: {op} {sz} {v:.1f}%")
        if blank:
            print(f"{name}: {len(blank)} target rows without the figure")
            for sec, op, sz in blank:
                print(f"  {sec}: {op} {sz}")
    if missing:
        print(f"missing: {len(missing)} target rows not measured")
        for sec, op, sz in missing:
            print(f"  {sec}: {op} {sz}")
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


def local_work(op, world, copy_s, reduce_s):
    """CPU s per wire GB of the work a collective of `op` on `world` ranks does besides
    what a p2p stream does for the same bytes, and cannot skip, with buffers lent to the
    transport (the tables' zero-copy API). A stream's receiver copies every byte into the
    destination; where a collective reduces a received byte instead, only the reduction's
    cost over that copy is extra (it also reads the rank's own operand). So:
    reduce-scatter, the reduction over the copy for every byte; all-reduce, for the half
    of its wire bytes in its reduce-scatter; an out-of-place all-gather, the copy of its
    own block from input to output (1 byte a rank for every world - 1 it sends);
    broadcast, nothing."""
    over = max(reduce_s - copy_s, 0.0)
    return {
        "broadcast": 0.0,
        "all_gather": copy_s / (world - 1),
        "reduce_scatter": over,
        "all_reduce": over / 2,
    }[op]


def speeds_for(specs, size_b):
    """The (copy, reduce) GB/s of the spec for the smallest size at or above `size_b`
    (the largest spec's past them all)."""
    fits = [s for s in specs if s[0] >= size_b]
    return min(fits)[1:] if fits else max(specs)[1:]


def parse_speeds(args):
    """`4M:13.96,14.28 64M:13.21,8.48` -> [(4 MiB, 13.96, 14.28), (64 MiB, 13.21, 8.48)]."""
    specs = []
    for arg in args:
        size_s, _, pair = arg.partition(":")
        copy, _, reduce = pair.partition(",")
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size_b = int(size_s[:-1]) * units[size_s[-1]] if size_s[-1] in units else int(size_s)
        specs.append((size_b, float(copy), float(reduce)))
    if not specs:
        sys.exit("ceiling needs at least one SIZE:COPY,REDUCE (GB/s)")
    return specs


def bytes_of(label):
    """"4 MiB" -> 4194304."""
    n, unit = label.split()
    return int(n) << {"B": 0, "KiB": 10, "MiB": 20}[unit]


def ceiling(lines, specs):
    """For each target row under 80% on eff: the least CPU per wire byte it could take
    here (its floor) and the eff that floor would score (its ceiling). The floor is the
    transport's own cost at the same size in the same table (the p2p stream's, or
    sendrecv's, every rank sending and receiving at once, where that is lower) plus
    `local_work` at the speeds of `specs` (GB/s of the streaming copy and of the
    reduction of received pieces onto a base, for buffers of each size, from `cargo
    bench -p nexar-device --bench kernels`; a row takes the spec of the smallest size at
    or above its own). Both parts are optimistic: a collective on N ranks that costs no
    more than one stream between two, and kernels as fast as in a loop on one idle core.
    A ceiling under 80% is a row that no schedule can bring to the target on this
    machine, with this transport. The last column takes sendrecv's cost alone (where the
    table has it) as the transport's: what a row could score were its collective as
    cheap as every rank streaming at once."""
    rows, _ = parse(lines)
    print("| setup | op | size | eff | CPU s/GB | transport | local | floor | ceiling "
          "| CPU over floor | ceiling, sendrecv's transport |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for (sec, op, sz), c in targets(rows):
        eff, cpu, c_run = number(c[11]), number(c[9]), number(c[10])
        if eff is None or eff >= 80 or not cpu or not c_run:
            continue
        p2p, sr = (number(rows[k][9]) if k in rows else None
                   for k in ((sec, "p2p", sz), (sec, "sendrecv", sz)))
        same = [v for v in (p2p, sr) if v]
        if not same:
            continue
        world = int(sec.split()[0])
        copy_gbps, reduce_gbps = speeds_for(specs, bytes_of(sz))
        local = local_work(op, world, 1 / copy_gbps, 1 / reduce_gbps)
        transport = min(same)
        floor = transport + local
        out.append(c_run / floor < 0.8)
        busy = f"{100 * c_run / (sr + local):.0f}%" if sr else "-"
        print(f"| {sec} | {op} | {sz} | {eff:.0f}% | {cpu:.2f} | {transport:.2f} | "
              f"{local:.3f} | {floor:.2f} | {100 * c_run / floor:.0f}% | "
              f"{100 * (cpu / floor - 1):+.0f}% | {busy} |")
    print(f"\n{sum(out)} of {len(out)} rows under 80% have a ceiling under 80%.")


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
    elif sys.argv[1] == "ceiling":
        with open(sys.argv[2]) as f:
            ceiling(f, parse_speeds(sys.argv[3:]))
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
