#!/usr/bin/env bash
# Counts the UDP datagrams an in-process bench sends per call, by what they carry (stream
# data, ACKs, MAX_STREAMS...), from quinn's packet trace. Deterministic enough to compare
# builds on a noisy machine, where timings are not.
#
#   bench/datagrams.sh NEXAR WORLD CALLS [BENCH ARGS...]
#   bench/datagrams.sh target/release/nexar 4 200 --ops all_reduce --min-bytes 4K --max-bytes 4K
#
# Counts cover the whole run (cluster start, the bench's barriers and checks), divided by
# CALLS: use one op and one size, and enough calls that the start is small beside them.
# The run has one runtime thread, so that log lines of different connections never
# interleave (a datagram's frames are the lines logged just before it); the total is the
# same with two, and varies by a few percent between runs (when ACKs go out depends on
# timing).
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
BIN=$1 WORLD=$2 CALLS=$3
shift 3
trace=$(mktemp)
trap 'rm -f "$trace"' EXIT
TOKIO_WORKER_THREADS=1 RUST_LOG=quinn_proto=trace NO_COLOR=1 "$BIN" local --world "$WORLD" bench \
  --iters "$CALLS" --warmup 0 "$@" 2>"$trace" >/dev/null
python3 - "$trace" "$CALLS" <<'PY'
import collections, re, sys
calls = int(sys.argv[2])
frames, kinds, total = [], collections.Counter(), 0
for line in open(sys.argv[1], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    # A datagram line can itself be inside a `send{...}` span: test for it first.
    m = re.search(r"sending \d+ bytes in (\d+) datagrams", line)
    if m:
        n = int(m.group(1))
        kinds[" + ".join(sorted(set(frames))) or "(no frame logged)"] += n
        total += n
        frames = []
        continue
    m = re.search(r"send\{space=Data pn=\d+\}: \S+: (\w+)", line)
    if m:
        frames.append(m.group(1))
print(f"datagrams per call: {total / calls:.2f}")
for kind, n in kinds.most_common(10):
    print(f"  {n / calls:6.2f}  {kind}")
PY
