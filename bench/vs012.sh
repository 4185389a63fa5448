#!/usr/bin/env bash
# Runs nexar 0.1.2's all-reduce (bench/nexar012, built with `cargo build --release` in
# that directory) and ours alternately, ROUNDS times, for 2 and 4 ranks in one process at
# 4 MiB and 64 MiB, both as 10 timed calls after 3 warm-up in a fresh cluster; prints
# each pair of busbw figures, then the medians and their ratio per cell.
#
#   bench/vs012.sh ROUNDS NEXAR012_COMPARE [NEXAR]
#
# Each side's output goes to a file and is read after the run: a parser started in a pipe
# beside the bench (python takes tens of ms of CPU to start) would share the two cores
# with a run that lasts ~100 ms, and measured our 2-rank 4 MiB row at half its speed.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
ROUNDS=$1 OLD=$2 NEW=${3:-target/release/nexar}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for _ in $(seq 1 "$ROUNDS"); do
  for w in 2 4; do
    for b in 4194304 67108864; do
      NEXAR012_NO_BARRIER=1 timeout 120 "$OLD" "$w" "$b" 10 >"$tmp/old" 2>/dev/null || true
      "$NEW" --json local --world "$w" bench --ops all_reduce --min-bytes "$b" \
        --max-bytes "$b" --iters 10 --warmup 3 >"$tmp/new" 2>/dev/null
      old=$(grep -o 'busbw [0-9.]*' "$tmp/old" | cut -d' ' -f2 || true)
      new=$(grep -o '"busbw_gbps":[0-9.]*' "$tmp/new" | cut -d: -f2)
      echo "$w $b ${old:-FAIL} $new" | tee -a "$tmp/pairs"
    done
  done
done
python3 - "$tmp/pairs" <<'PY'
import statistics as st, sys
cells = {}
for line in open(sys.argv[1]):
    w, b, old, new = line.split()
    o, n = cells.setdefault((int(w), int(b)), ([], []))
    if old != "FAIL":
        o.append(float(old))
    n.append(float(new))
for (w, b), (o, n) in sorted(cells.items()):
    mo, mn = st.median(o), st.median(n)
    print(f"{w} ranks {b >> 20} MiB: 0.1.2 {mo:.3f} ({len(o)} runs), ours {mn:.3f}: {mn / mo:.2f}x")
PY
