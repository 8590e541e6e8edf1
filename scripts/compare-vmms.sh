#!/usr/bin/env bash
# The VMM comparison in the nested test host: the same two L2 guests
# (cpuload test, 1 vCPU each, no vGPU) ROUNDS times in one L1 boot, under
# vgpu-vmm (VMM=ours) or under QEMU with -enable-kvm (VMM=qemu). A guest
# that dies has its console and VMM log printed; an L1 kernel oops shows
# in the console. docs/vmm.md keeps the results.
# Usage: scripts/compare-vmms.sh ours|qemu [ROUNDS]   (NESTED_SMP etc. as for run.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VMM="${1:-}"
ROUNDS="${2:-20}"
[[ "$VMM" =~ ^(ours|qemu)$ && "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 ours|qemu [ROUNDS]" >&2; exit 2; }
command -v qemu-system-x86_64 >/dev/null || { echo "compare: qemu-system-x86_64 is missing (scripts/setup.sh installs it)" >&2; exit 1; }
[ -f "$ROOT/target/release/vgpu-vmm" ] || { echo "compare: build first (scripts/setup.sh)" >&2; exit 1; }
NESTED_WITH_QEMU=1 bash "$ROOT/images/nested/build.sh"
cp "$ROOT/target/nested/l1.cpio.gz" "$ROOT/target/nested/l1-qemu.cpio.gz"
LOG="$(mktemp /tmp/vgpu-compare.XXXXXX.log)"
echo "compare: $ROUNDS rounds of two cpuload guests under $VMM (log: $LOG)"
NESTED_INITRD=l1-qemu.cpio.gz NESTED_APPEND="rounds=$ROUNDS vmm=$VMM" bash "$ROOT/images/nested/run.sh" compare $((300 + 300 * ROUNDS)) \
    | stdbuf -oL tr -d '\r' | stdbuf -oL sed 's/\x1b\[[0-9;?]*[A-Za-z]//g' | tee "$LOG" \
    | grep --line-buffered -E '^COMPARE-|^\[vm-|BUG:|Kernel panic|RIP:' || true
# The default image again, without QEMU.
bash "$ROOT/images/nested/build.sh" >/dev/null 2>&1
grep -q "COMPARE-RESULT vmm=$VMM passed=$((ROUNDS * 2)) " "$LOG" && exit 0
echo "compare: not every guest finished ($(grep -o 'COMPARE-RESULT.*' "$LOG" || echo 'no result: L1 did not finish'))" >&2
exit 1
