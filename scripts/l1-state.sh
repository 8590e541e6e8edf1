#!/usr/bin/env bash
# Prints the state of the nested test host's emulated CPUs through QEMU's
# human monitor (images/nested/run.sh with NESTED_MONITOR=SOCKET): each
# CPU's registers (RFLAGS' IF, HLT), its local APIC (the timer, IRR, ISR)
# and where QEMU's CPU threads are. For an L1 that went silent: a CPU
# halted with interrupts enabled, a timer armed and nothing in its IRR is
# a lost timer interrupt; one halted with IF clear never wakes.
# Usage: scripts/l1-state.sh SOCKET
set -euo pipefail
SOCK="${1:?usage: $0 MONITOR_SOCKET}"
[ -S "$SOCK" ] || { echo "l1-state: $SOCK is not a socket (start run.sh with NESTED_MONITOR=$SOCK)" >&2; exit 2; }
python3 - "$SOCK" <<'PY'
import re, signal, socket, sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.settimeout(2)

def read():
    out = b""
    while not out.endswith(b"(qemu) "):
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")

read()


def ask(cmd, show=True):
    s.sendall(cmd.encode() + b"\n")
    # The monitor echoes the command as it is typed (with cursor
    # movements) on its first line and ends with its prompt.
    lines = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", read().replace("\r", "")).splitlines()[1:]
    text = "\n".join(l for l in lines if l.strip() != "(qemu)").strip()
    if show:
        print(f"== {cmd}")
        print(text)
    return text


ask("info status")
cpus = re.findall(r"CPU #(\d+)", ask("info cpus"))
ask("info registers -a")
for n in cpus:
    ask(f"cpu {n}", show=False)
    ask("info lapic")
ask("info pic")
PY
