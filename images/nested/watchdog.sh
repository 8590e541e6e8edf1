# Sourced by scripts that run the nested test host for long (the demo, the
# soak). l1_watchdog LOG SOCKET LIMIT, started in the background beside
# images/nested/run.sh (run with NESTED_MONITOR=SOCKET, its console
# written to LOG): once LOG has not grown for LIMIT seconds while QEMU
# runs, L1 has stopped making progress (seen with one emulated CPU: QEMU
# idle, L1 halted for good). It writes L1's CPU and local APIC state to
# LOG.l1-state (scripts/l1-state.sh), says so on stderr and ends that QEMU.
# The caller kills it once run.sh has returned.
l1_watchdog() {
    local log="$1" sock="$2" limit="$3" root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    while sleep 10; do
        pgrep -f "unix:$sock,server" >/dev/null && [ -e "$log" ] || continue
        local age=$(( $(date +%s) - $(stat -c %Y "$log") ))
        if [ "$age" -ge "$limit" ]; then
            bash "$root/scripts/l1-state.sh" "$sock" > "$log.l1-state" 2>&1 || true
            echo "nested: L1 printed nothing for ${age} s: it stopped making progress; its CPU and APIC state are in $log.l1-state" >&2
            pkill -f "unix:$sock,server" || true
            return 0
        fi
    done
}
