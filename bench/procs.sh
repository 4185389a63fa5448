# Sourced by the bench scripts: runs one `nexar bench` across processes on loopback.
#
#   procs_bench NEXAR N LOGDIR BENCH_ARGS...
#
# Starts a seed and N workers (`--threads 1` each, one rank per process), every worker
# running `bench BENCH_ARGS`; rank 0's JSON rows go to stdout, each process's stderr to
# LOGDIR (seed.log, w0.log...).
procs_bench() {
  local bin=$1 n=$2 logs=$3
  shift 3
  exec 3< <("$bin" seed --listen 127.0.0.1:0 --world "$n" 2>"$logs/seed.log")
  local join
  read -r join <&3
  for i in $(seq 1 $((n - 1))); do
    "$bin" worker --join "$join" --listen 127.0.0.1:0 --rank "$i" --threads 1 \
      bench "$@" >/dev/null 2>"$logs/w$i.log" &
  done
  "$bin" --json worker --join "$join" --listen 127.0.0.1:0 --rank 0 --threads 1 \
    bench "$@" 2>"$logs/w0.log"
  wait
  exec 3<&-
}
