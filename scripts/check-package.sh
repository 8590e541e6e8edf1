#!/usr/bin/env bash
# Builds the Debian package (scripts/package.sh), unpacks it into a clean
# root, checks that it carries what an installed host needs, then runs the
# README's by-hand steps from the unpacked files: the daemon, vgpuctl and
# libcuda.so.1 as installed, with the daemon telling a NOTIFY_SOCKET it is
# ready, as the unit's Type=notify expects. (Unpacked, not installed with
# dpkg: the maintainer scripts would change this machine's users.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
fail() { echo "check-package: $*" >&2; exit 1; }
deb="$(scripts/package.sh | tail -1)"
[ -f "$deb" ] || fail "scripts/package.sh made no package"
root="$(mktemp -d)"
run="/tmp/vgpu-package-$$"
work="$(mktemp -d)"
mediator=""
cleanup() {
    [ -z "$mediator" ] || kill "$mediator" 2>/dev/null || true
    rm -rf "$root" "$work"
    for _ in 1 2 3 4 5 6 7 8 9 10; do pgrep -f "vgpu-mediatord --run-dir $run( |$)" >/dev/null || break; sleep 0.5; done
    rm -rf "$run"
}
trap cleanup EXIT
# Workers re-execute the daemon as the user vgpu: the root must be
# traversable, as / is.
chmod 755 "$root"
dpkg-deb -x "$deb" "$root"
dpkg-deb -e "$deb" "$root/DEBIAN"
for f in usr/bin/vgpu-mediatord usr/bin/vgpu-vmm usr/bin/vgpuctl usr/bin/vgpu-smi usr/bin/vgpu-k8s usr/lib/vgpu/libcuda.so \
    usr/lib/systemd/system/vgpu-mediatord.service usr/lib/sysusers.d/vgpu.conf usr/lib/tmpfiles.d/vgpu.conf \
    etc/vgpu/mediator.toml usr/share/man/man1/vgpuctl.1.gz usr/share/man/man1/vgpuctl-tenant-create.1.gz \
    usr/share/bash-completion/completions/vgpuctl \
    usr/share/doc/vgpu/install.md usr/share/doc/vgpu/kubernetes.md usr/share/doc/vgpu/k8s/device-plugin.yaml usr/share/doc/vgpu/k8s/dra-driver.yaml \
    usr/share/doc/vgpu/k8s/examples/dra-claim.yaml usr/share/doc/vgpu/api/mediator.yaml; do
    [ -f "$root/$f" ] || fail "/$f is not in the package"
done
for l in libcuda.so.1 libnvidia-ml.so.1; do
    [ "$(readlink "$root/usr/lib/vgpu/$l")" = libcuda.so ] || fail "/usr/lib/vgpu/$l is not a link to libcuda.so"
done
unit="$root/usr/lib/systemd/system/vgpu-mediatord.service"
grep -qx 'Type=notify' "$unit" || fail "the unit is not Type=notify"
grep -q '^ExecStart=/usr/bin/vgpu-mediatord ' "$unit" || fail "the unit does not start /usr/bin/vgpu-mediatord"
docs="$(sed -n 's|^Documentation=file://||p' "$unit")"
[ -f "$root$docs" ] || fail "the unit's Documentation= ($docs) is not in the package"
grep -qx '/etc/vgpu/mediator.toml' "$root/DEBIAN/conffiles" || fail "/etc/vgpu/mediator.toml is not a conffile"
grep -q '^u vgpu ' "$root/usr/lib/sysusers.d/vgpu.conf" || fail "sysusers.d does not declare the user vgpu"
zcat "$root/usr/share/man/man1/vgpuctl.1.gz" | grep -q '^\.TH' || fail "the manual page is not roff"
"$root/usr/bin/vgpuctl" --version >/dev/null || fail "the packaged vgpuctl does not run"

# The README's by-hand steps, from the unpacked files.
notify="$work/notify"
python3 - "$notify" > "$work/ready" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(60)
print(s.recv(4096).decode(), flush=True)
PY
listener=$!
for _ in $(seq 100); do [ -S "$notify" ] && break; sleep 0.1; done
NOTIFY_SOCKET="$notify" "$root/usr/bin/vgpu-mediatord" --run-dir "$run" --cpu-devices 1 --device-memory 512MiB 2>"$work/mediator.log" &
mediator=$!
wait "$listener" || fail "the daemon did not notify readiness within 60 s: $(tail -5 "$work/mediator.log")"
grep -qx 'READY=1' "$work/ready" || fail "the daemon notified $(cat "$work/ready"), not READY=1"
V=("$root/usr/bin/vgpuctl" --run-dir "$run")
"${V[@]}" tenant create alice --memory 256MiB >/dev/null
"${V[@]}" device list >/dev/null
cc -O2 -I guest-driver-shim/include -DKERNEL_DIR='"samples/kernels"' -o "$work/vectorAdd" samples/vectorAdd.c -L "$root/usr/lib/vgpu" -lcuda -lm
VGPU_SOCKET="$run/tenants/alice.sock" LD_LIBRARY_PATH="$root/usr/lib/vgpu" "$work/vectorAdd" > "$work/sample" 2>&1 || true
grep -q "vectorAdd: PASSED" "$work/sample" || fail "vectorAdd on the packaged libcuda.so.1 did not pass: $(cat "$work/sample")"
"${V[@]}" tenant delete alice >/dev/null
echo "check-package: $(basename "$deb") carries the host's files, and the README's steps pass from them"
