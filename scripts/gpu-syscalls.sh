#!/bin/bash
# Measures the system calls a `cuda` backend executor makes once it runs,
# on a machine with an NVIDIA GPU: the facts a seccomp allow-list for GPU
# executors is made from. strace (bundled by scripts/gpu-bundle.sh) attaches
# to one tenant's executor, with every thread, while the tenant runs the
# samples, a ring storm (launches kept in flight: cuEventQuery), two
# streams with allocations between their launches, a captured graph (the
# executor's stream capture and cuGraphLaunch), quota and scrub
# probes, a kernel fault and a runaway kernel. strace follows the daemon from its start (a running
# executor, under its own uid, cannot be attached to), so
# $OUT/syscalls-trace.log.gz holds every process's calls but the hot waits
# and plain reads and writes, with arguments; $OUT/executors.txt names the
# executors' pids (scripts/syscalls-of.py picks their calls out). Run from
# the repository's root after scripts/gpu-check.sh, which makes the `vgpu`
# user.
set -u
OUT=${OUT:-/tmp/gpu-syscalls}
mkdir -p "$OUT"
root=$PWD
B=$root/.gpu/bin
S=$root/.gpu/strace
strace() { "$S/ld.so" --library-path "$S/lib" "$S/strace" "$@"; }
tmp=$(mktemp -d /tmp/vgpu-syscalls.XXXXXX)
chmod 755 "$tmp"
for p in vectorAdd matrixMul reduction tenant_probe; do
    cc -O2 -I "$root/guest-driver-shim/include" -DKERNEL_DIR="\"$root/samples/kernels\"" -o "$tmp/$p" "$root/samples/$p.c" -L "$B" -lcuda -lm || exit 1
done
mkdir -p "$tmp/lib" && ln -s "$B/libcuda.so" "$tmp/lib/libcuda.so.1"
run=$tmp/run
strace -f -qq -ttt -e 'trace=!futex,nanosleep,clock_nanosleep,sched_yield,epoll_wait,epoll_pwait,poll,ppoll,read,write,clock_gettime,getrandom' \
    -o "$OUT/syscalls-trace.log" "$B/vgpu-mediatord" --run-dir "$run" --cuda required --cpu-devices 0 --isolation process --launch-timeout-ms 3000 2> "$OUT/syscalls-mediator.log" &
med=$!
for _ in $(seq 300); do "$B/vgpuctl" --run-dir "$run" device list >/dev/null 2>&1 && break; sleep 0.1; done
sock=$("$B/vgpuctl" --run-dir "$run" tenant create traced --memory 2GiB --device gpu0)
executor() { "$B/vgpuctl" --run-dir "$run" -o json device show gpu0 | tr -d ' \n' | grep -o '"executors":\[[^]]*\]' | grep -o '"pid":[0-9]*' | head -1 | cut -d: -f2; }
executor > "$OUT/executors.txt"
echo "executor of the traced tenant: pid $(cat "$OUT/executors.txt")"
sleep 1
t() { echo "== $*"; VGPU_SOCKET=$sock LD_LIBRARY_PATH=$tmp/lib timeout 60 "$@" 2>&1 | tail -n 3; }
t "$tmp/vectorAdd"
t "$tmp/matrixMul" 512
t "$tmp/reduction"
t "$tmp/tenant_probe" quota 2147483648
t "$tmp/tenant_probe" check 268435456
t "$tmp/tenant_probe" storm 20000
t "$tmp/tenant_probe" streams 20000
t "$tmp/tenant_probe" graph 16 500
t "$tmp/tenant_probe" ptx faults.ptx spin
t "$tmp/tenant_probe" fault 1099511627776
sleep 1
executor >> "$OUT/executors.txt"
t "$tmp/vectorAdd"
executor >> "$OUT/executors.txt"
pkill -TERM -P $med; wait $med 2>/dev/null
gzip -f "$OUT/syscalls-trace.log"
ls -la "$OUT"
rm -rf "$tmp"
