#!/usr/bin/env bash
# The demo's VMs, ROUNDS times in a row (default 20): in one boot of the
# nested test host, vm-a and vm-b (1 vCPU each, vGPUs of 64 and 32 MiB on
# one CPU device, a host tenant computing beside them) are made with
# vgpuctl, boot Debian's kernel, run the CUDA samples and the CUDA runtime
# program, and are deleted; a VM that does not finish has its console and
# VMM log printed. Exits 0 only when every round passed.
# Usage: scripts/soak-vms.sh [ROUNDS]   (about a minute a round)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROUNDS="${1:-20}"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [ROUNDS]" >&2; exit 2; }
source "$ROOT/scripts/setup.sh"
source "$ROOT/images/nested/watchdog.sh"
LOG="$(mktemp /tmp/vgpu-soak.XXXXXX.log)"
LIMIT="${SOAK_ROUND_LIMIT:-240}"
echo "soak: $ROUNDS rounds of the demo's two VMs in the nested test host (log: $LOG)"
# Every round prints a line within its limit: a longer silence is L1
# stuck, whose state the watchdog records before it ends the run.
MON="$LOG.monitor"
l1_watchdog "$LOG" "$MON" $((LIMIT + 120)) &
WATCH=$!
NESTED_MONITOR="$MON" NESTED_APPEND="rounds=$ROUNDS" bash "$ROOT/images/nested/run.sh" soak $((300 + LIMIT * ROUNDS)) \
    | stdbuf -oL tr -d '\r' | stdbuf -oL sed 's/\x1b\[[0-9;?]*[A-Za-z]//g' | tee "$LOG" | grep --line-buffered -E '^SOAK-|^\[vm-' || true
kill "$WATCH" 2>/dev/null || true
rm -f "$MON"
if grep -q "SOAK-RESULT passed=$ROUNDS rounds=$ROUNDS" "$LOG"; then
    echo "soak: $ROUNDS of $ROUNDS rounds passed"
    exit 0
fi
[ -s "$LOG.l1-state" ] && echo "soak: L1 stopped making progress; its CPU and APIC state: $LOG.l1-state" >&2
echo "soak: FAILED ($(grep -o 'SOAK-RESULT.*' "$LOG" || echo 'no result: the nested host did not finish'))" >&2
exit 1
