#!/usr/bin/env bash
# Boots L1 under QEMU TCG with emulated SVM and runs one scenario from
# images/nested/scenarios inside it; the console goes to stdout. L1 powers
# off when the scenario ends. Usage: run.sh SCENARIO [TIMEOUT_SECONDS]
# NESTED_SMP sets L1's CPU count (default 2); NESTED_APPEND adds words to
# L1's kernel command line, which scenarios read (soak: rounds=N);
# NESTED_INITRD names another L1 image in target/nested;
# NESTED_CPU replaces L1's CPU model; NESTED_ACCEL replaces the TCG options
# (default thread=multi: one host thread per L1 CPU); NESTED_QEMU_LOG
# names a file for QEMU's CPU-reset log, where an L1 triple fault (which
# `-no-reboot` turns into a silent exit) shows as "Triple fault";
# NESTED_MONITOR names a unix socket for QEMU's human monitor, through
# which scripts/l1-state.sh reads L1's CPU and local APIC when it stops
# making progress. L1 learns the timeout (nested_timeout=), so a
# scenario can stop waiting in time to print what it has
# (scenarios/lib.sh, before_deadline).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/target/nested"
SCENARIO="$1"
TIMEOUT="${2:-600}"
LOG=()
[ -n "${NESTED_QEMU_LOG:-}" ] && LOG=(-d cpu_reset -D "$NESTED_QEMU_LOG")
[ -n "${NESTED_MONITOR:-}" ] && LOG+=(-monitor "unix:$NESTED_MONITOR,server,nowait")
exec timeout --foreground -k 5 "$TIMEOUT" qemu-system-x86_64 \
    -accel "tcg,${NESTED_ACCEL:-thread=multi}" -cpu "${NESTED_CPU:-max,svm=on}" -smp "${NESTED_SMP:-2}" -m 2048 \
    -machine q35 -nographic -no-reboot -nodefaults -serial stdio \
    -kernel "$(cat "$OUT/vmlinuz.path")" -initrd "$OUT/${NESTED_INITRD:-l1.cpio.gz}" \
    -append "console=ttyS0 panic=-1 quiet loglevel=3 scenario=$SCENARIO nested_timeout=$TIMEOUT ${NESTED_APPEND:-}" "${LOG[@]}"
