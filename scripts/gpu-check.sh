#!/bin/bash
# Every GPU check and benchmark, in one run on a machine with an NVIDIA GPU
# (see scripts/gpu-bundle.sh). Logs go to $OUT (default /tmp/gpu-check).
# The most important run first; each has a time limit, so what finished is
# kept when the machine's time runs short.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
# Workers run as `vgpu` when the daemon is root.
if [ "$(id -u)" = 0 ] && ! id vgpu >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin vgpu
fi
root=$PWD
B=$root/.gpu/bin
ws=$(cat .gpu/workspace)
if [ "$ws" != "$root" ] && [ ! -e "$ws" ]; then
    mkdir -p "$(dirname "$ws")" && ln -s "$root" "$ws"
fi
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv
    command -v cc gcc
    nproc
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# GPU_ONLY="gpu_cuda syscalls" runs just the steps it names.
step() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_ONLY:-}" ] && [[ " $GPU_ONLY " != *" $name "* ]]; then
        return
    fi
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - t0)) s"
}
step gpu_cuda "${GPU_TEST_LIMIT:-240}" "$B/gpu_cuda" --test-threads 1 --nocapture
grep -E "^test |test result|GPU shares|SKIPPED|panicked" "$OUT/gpu_cuda.log" | head -40
step syscalls "${GPU_SYSCALLS_LIMIT:-150}" env OUT="$OUT" bash "$root/scripts/gpu-syscalls.sh"
step cuda-bench-process 120 "$B/vgpu-cuda-bench" --quick --isolation process
step fastpath 60 "$B/fastpath-bench" --quick
step fastpath-unpinned 60 "$root/.gpu/alt/fastpath-bench" --quick
step cuda-bench-shared 90 "$B/vgpu-cuda-bench" --quick --isolation shared
tail -n 30 "$OUT/cuda-bench-process.log" 2>/dev/null
grep -E "launch_|null_call_ring" "$OUT/fastpath.log" "$OUT/fastpath-unpinned.log" 2>/dev/null
