#!/usr/bin/env bash
# Regenerates the "Full tables" of BENCHMARKS.md: for each world size, in one process
# (`nexar local`) and across processes (a seed and N workers on loopback, one runtime
# thread each), the p2p, pingpong and all-reduce sweep, then the other ops, then the
# efficiency target's other ops at the sizes the second sweep skips (1 and 16 MiB), so
# that every cell of the target is measured. Every row of 1 MiB and more is held against
# c measured around it (p2p streams of 1 MiB messages right before and after it, the `c`
# column), smaller rows against the best p2p row of 1 MiB and more of their own run (the
# header prints the first run's), and eff@size against the p2p row of the same size in
# the same run (the table prints the first run's p2p rows).
# With RUNS > 1 every world size and
# mode runs that many times, one after the other, and each cell is the median over the
# runs (min and max: the extremes). Prints Markdown.
#
#   cargo build --release -p nexar-cli && bench/full-tables.sh [WORLDS...] > tables.md
#
# Environment: NEXAR (the binary; default target/release/nexar), ITERS (10), WARMUP (3),
# RUNS (1), EXTRA (more bench flags for every run, e.g. `--zero-copy`).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/procs.sh
BIN=${NEXAR:-target/release/nexar}
ITERS=${ITERS:-10}
WARMUP=${WARMUP:-3}
RUNS=${RUNS:-1}
read -r -a EXTRA <<<"${EXTRA:-}"
WORLDS=("${@:-2 4 8}")
read -r -a WORLDS <<<"${WORLDS[*]}"
FIRST=(--ops p2p,pingpong,all_reduce --min-bytes 4K --max-bytes 64M)
# p2p runs again at these sizes for the same-size efficiency (eff@size); its rows are not
# printed twice.
OTHERS=(--ops p2p,broadcast,reduce,all_gather,reduce_scatter,all_to_all,gather,scatter,sendrecv,barrier
  --min-bytes 1K --max-bytes 64M --step-factor 16)
# The target's ops at 1 and 16 MiB, which OTHERS' sweep (1K, 16K, 256K, 4M, 64M) skips.
TARGETS=(--ops p2p,broadcast,all_gather,reduce_scatter --min-bytes 1M --max-bytes 16M
  --step-factor 16)
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

# One bench run on N ranks in one process; JSON rows on stdout.
local_run() {
  local n=$1; shift
  "$BIN" --json local --world "$n" bench --iters "$ITERS" --warmup "$WARMUP" "${EXTRA[@]}" "$@"
}

# The same across processes: rank 0's JSON rows on stdout.
procs_run() {
  local n=$1; shift
  procs_bench "$BIN" "$n" "$tmp" --iters "$ITERS" --warmup "$WARMUP" "${EXTRA[@]}" "$@"
}

table() { python3 bench/tables.py table "$1" "$2" "$3"; }
best_c() { python3 bench/tables.py best-c "$1"; }

for where in local procs; do
  if [ "$where" = local ]; then
    echo "### In-process (\`nexar local --world N bench\`)"
  else
    echo "### Multi-process (seed + N workers on loopback, \`--threads 1\`)"
  fi
  echo
  for n in "${WORLDS[@]}"; do
    load=$(cut -d' ' -f1-3 /proc/loadavg | sed 's/ /, /g')
    cs=()
    : >"$tmp/rows.json"
    for _ in $(seq 1 "$RUNS"); do
      "${where}_run" "$n" "${FIRST[@]}" >"$tmp/first.json"
      c=$(best_c "$tmp/first.json")
      cs+=("${c:--}")
      "${where}_run" "$n" "${OTHERS[@]}" >"$tmp/others.json"
      "${where}_run" "$n" "${TARGETS[@]}" >"$tmp/targets.json"
      { cat "$tmp/first.json"; grep -hv '"op":"p2p"' "$tmp/others.json" "$tmp/targets.json"; } >>"$tmp/rows.json"
    done
    if [ "$where" = local ]; then what="$n ranks, one process"; else what="$n ranks, $n processes"; fi
    table "$what" "$load" "${cs[*]}" <"$tmp/rows.json"
  done
done
