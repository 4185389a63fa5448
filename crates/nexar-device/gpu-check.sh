#!/usr/bin/env bash
# One-shot check of nexar-device's CUDA adapter on a machine with an NVIDIA GPU.
#
#   crates/nexar-device/gpu-check.sh [MiB]      (default 64)
#
# 1. builds nexar-device with `--features cuda --release`;
# 2. runs its unit tests, failing if the GPU tests were skipped (no device found);
# 3. runs the `cuda_staging` example: staging GB/s (device->host, host->device through
#    pinned buffers) and f32 sum kernel GB/s;
# 4. runs a 4-rank in-process all-reduce of GPU buffers over QUIC, checked against the
#    CPU result, and prints its time and busbw; and a 2-rank bf16 all-reduce of NaNs of
#    different payloads, whose bits must match the CPU's on every rank.
#
# Needs the NVIDIA driver (libcuda) and NVRTC (libnvrtc.so.12 or libnvrtc.so) on the
# loader path; CUDA toolkits usually keep NVRTC in /usr/local/cuda/lib64, added below.
# For a CUDA 13 toolkit, export CUDARC_CUDA_VERSION=13000 first (picks libnvrtc.so.13).
# Set CARGO_TARGET_DIR to reuse a build directory.
set -euo pipefail

cd "$(dirname "$0")/../.."
MIB="${1:-64}"

for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -d "$d" ]; then
        export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
done

echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null \
    || echo "(nvidia-smi not available)"

echo "== build (release, --features cuda)"
cargo build -p nexar-device --features cuda --release --all-targets

echo "== unit tests"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test -p nexar-device --features cuda --release -- --nocapture --test-threads=1 2>&1 | tee "$log"
if grep -q "skipping: no CUDA device" "$log"; then
    echo "FAIL: GPU tests were skipped; see the reason above" >&2
    exit 1
fi

echo "== staging and kernel bandwidth (${MIB} MiB)"
cargo run -p nexar-device --features cuda --release --example cuda_staging -- "$MIB"

echo "== 4-rank in-process all-reduce of GPU buffers vs the CPU result"
cargo test -p nexar-tests --features cuda --release --test device -- --nocapture 2>&1 | tee "$log"
if grep -q "skipping: no CUDA device" "$log"; then
    echo "FAIL: the GPU all-reduce test was skipped; see the reason above" >&2
    exit 1
fi

echo "== gpu-check: all passed"
