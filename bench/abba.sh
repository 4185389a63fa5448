#!/usr/bin/env bash
# Compares two nexar builds (or two sets of bench flags) in A-B-B-A order, so that a VM
# whose speed drifts during the comparison favours neither side, and prints per row the
# medians of time_us, cpu_us_per_call, CPU s/GB and busbw, with every run's time.
#
#   bench/abba.sh PAIRS WORLD "BENCH ARGS" A B
#
# A and B are each a binary, optionally followed by extra bench flags, quoted together
# ("target/release/nexar --spin-us 1000"). PROCS=1 runs a seed and WORLD workers on
# loopback (`--threads 1`) instead of `nexar local --world WORLD`.
#
#   bench/abba.sh 8 4 "--ops all_reduce --min-bytes 4K --max-bytes 4K --iters 300" \
#     /tmp/old/nexar target/release/nexar
set -euo pipefail
if [ $# -ne 5 ]; then
  sed -n '2,13p' "$0" >&2
  exit 2
fi
PAIRS=$1 WORLD=$2 ARGS=$3 A=$4 B=$5
cd "$(dirname "$0")/.."
. bench/procs.sh
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

# One bench run of SIDE (binary and flags); JSON rows on stdout.
run() {
  local -a side
  read -r -a side <<<"$1"
  local bin=${side[0]} extra=("${side[@]:1}")
  local -a args
  read -r -a args <<<"$ARGS"
  if [ "${PROCS:-0}" = 1 ]; then
    procs_bench "$bin" "$WORLD" "$tmp" "${args[@]}" "${extra[@]}"
  else
    "$bin" --json local --world "$WORLD" bench "${args[@]}" "${extra[@]}"
  fi
}

for r in $(seq 1 "$PAIRS"); do
  if [ $((r % 2)) = 1 ]; then order=(A B); else order=(B A); fi
  for side in "${order[@]}"; do
    if [ "$side" = A ]; then what=$A; else what=$B; fi
    run "$what" | sed "s/^/$side /" >>"$tmp/rows"
  done
done
python3 - "$tmp/rows" "$A" "$B" <<'PY'
import json, statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    side, _, j = line.partition(" ")
    try:
        r = json.loads(j)
    except ValueError:
        continue
    rows.setdefault((r["op"], r["bytes"], side), []).append(r)
print(f"A = {sys.argv[2]}\nB = {sys.argv[3]}")
med = lambda v, k: st.median([r[k] for r in v if r.get(k) is not None] or [float("nan")])
for (op, size, side), v in sorted(rows.items()):
    times = " ".join(f"{r['time_us']:.0f}" for r in v)
    print(f"{op:14} {size:>9} {side}  time_us {med(v, 'time_us'):9.1f}  "
          f"cpu_us {med(v, 'cpu_us_per_call'):9.1f}  s/GB {med(v, 'cpu_s_per_gb'):7.3f}  "
          f"busbw {med(v, 'busbw_gbps'):6.3f}  | {times}")
PY
