# Passthrough from a pool through the lifecycle CLI (run with
# images/nested/run-vfio.sh): the NVMe device starts on L1's own nvme
# driver, listed in the mediator's config as passthrough device `nvme0` in
# pool `whole`. `vgpuctl vm create --passthrough whole` lends it (unbound
# from nvme, bound to vfio-pci) to a VM whose stock Debian kernel reads the
# host's marker and writes its own; a second VM asking the same pool is
# refused; on delete the device is reset, bound back to nvme and scrubbed,
# with a scrub record in `vgpuctl device show`, and L1 reads the guest's
# marker through its own driver again.
. /scenarios/lib.sh
ctl() { vgpuctl --run-dir $run "$@"; }
nvme=$(pci_of_class 0x010802)
echo "NVME-ADDR=$nvme"
echo "NVME-RESET-METHOD=$(cat /sys/bus/pci/devices/$nvme/reset_method 2>/dev/null)"
for m in /optional/*.ko; do insmod "$m" || echo "L1: insmod $m failed"; done
wait_disk() {
    i=0
    while [ ! -b /dev/nvme0n1 ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
}
wait_disk
echo "NVME-DRIVER-BEFORE=$(drv $nvme)"
echo "L1-READ-BEFORE=$(dd if=/dev/nvme0n1 bs=512 count=1 2>/dev/null | tr -d '\000\n')"

cat > /tmp/pt.toml <<TOML
[[devices.passthrough]]
name = "nvme0"
address = "$nvme"
[[pools]]
name = "whole"
devices = ["nvme0"]
TOML
start_mediator --config /tmp/pt.toml --device-memory 64MiB
echo "== vgpuctl device list"
ctl device list
con=$run/state/vms/pt1/console.log
ctl vm create pt1 --memory 256MiB --kernel /l2/vmlinuz --initramfs /l2/initrd --restart never \
    --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=nvme" --passthrough whole >/tmp/create.out 2>&1
echo "CREATE-EXIT=$?"
sed 's/^/CREATE: /' /tmp/create.out
echo "NVME-DRIVER-LENT=$(drv $nvme)"
echo "LENT-STATE=$(ctl -o json device show nvme0 | grep '"state"' | head -1 | tr -d ' ",' | cut -d: -f2)"
echo "VMSHOW-BEGIN"
ctl -o json vm show pt1
echo "VMSHOW-END"
# The same pool has nothing left for a second VM.
ctl vm create pt2 --memory 64MiB --kernel /l2/vmlinuz --passthrough whole >/tmp/bad.out 2>&1
echo "SECOND-EXIT=$?"
sed 's/^/SECOND-ERR: /' /tmp/bad.out
echo "VMS-AFTER-SECOND=$(ctl -o json vm list | grep -c '"api_socket"')"
# The guest reads, writes and reboots; its restart policy leaves it stopped.
i=0
while ! grep -q L2-NVME-READBACK $con 2>/dev/null && ! vm_triple_faulted pt1 && [ $i -lt 3000 ]; do sleep 0.1; i=$((i + 1)); done
i=0
while ! ctl -o json vm show pt1 | grep -q '"state": "stopped"' && ! vm_triple_faulted pt1 && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
sed 's/^/CONSOLE: /' $con
# The VMM's own log: how it ended (a guest triple fault is the emulator's).
tail -n 20 $run/state/vms/pt1/vmm.log 2>/dev/null | sed 's/^/VMM-LOG: /'
t0=$(cut -d' ' -f1 /proc/uptime)
ctl vm delete pt1
echo "DELETE-EXIT=$?"
# The return (reset, rebind, scrub) runs on after the delete answers.
devstate() { ctl -o json device show nvme0 | grep '"state"' | head -1 | tr -d ' ",' | cut -d: -f2; }
i=0
while [ "$(devstate)" = returning ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
t1=$(cut -d' ' -f1 /proc/uptime)
echo "DELETE-SECONDS=$(awk "BEGIN {print $t1 - $t0}")"
echo "NVME-DRIVER-AFTER=$(drv $nvme)"
echo "NVME-OVERRIDE-AFTER=$(cat /sys/bus/pci/devices/$nvme/driver_override)"
echo "== vgpuctl device show nvme0"
ctl device show nvme0
echo "DEVSHOW-BEGIN"
ctl -o json device show nvme0
echo "DEVSHOW-END"
ctl metrics | grep '^vgpu_passthrough' | sed 's/^/METRIC: /'
wait_disk
echo "L1-READ-GUEST=$(dd if=/dev/nvme0n1 bs=512 skip=1 count=1 2>/dev/null | tr -d '\000\n')"
sed 's/^/MEDIATOR-LOG: /' /tmp/mediator.err | grep -i -E "passthrough|error|panic" | head -20
# The daemon again, now running its VMMs jailed (uid 1000): a passthrough
# VM from the same pool gets the device inside the jail, and returns it.
kill $(pidof vgpu-mediatord)
# The next daemon starts once this one (and its workers) are gone.
i=0
while pidof vgpu-mediatord >/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
echo "OLD-DAEMON-GONE=$(pidof vgpu-mediatord >/dev/null && echo no || echo yes)"
rm -f $run/api.sock
chmod 0644 /l2/vmlinuz /l2/initrd
# With cgroup v2 there, the daemon gives each jailed VMM memory and task
# limits.
mkdir -p /sys/fs/cgroup
mount -t cgroup2 none /sys/fs/cgroup
start_mediator --config /tmp/pt.toml --device-memory 64MiB --vm-jail 1000:1000
con=$run/state/vms/pt3/console.log
ctl vm create pt3 --memory 256MiB --kernel /l2/vmlinuz --initramfs /l2/initrd --restart never \
    --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=nvme" --passthrough whole >/tmp/create3.out 2>&1
echo "JAILED-CREATE-EXIT=$?"
sed 's/^/JAILED-CREATE: /' /tmp/create3.out
pid=$(ctl -o json vm show pt3 | grep '"pid"' | tr -dc 0-9)
vmm=$(cat /proc/$pid/task/$pid/children 2>/dev/null | tr -d ' ')
echo "JAILED-VMM-UID=$(awk '/^Uid:/ {print $2}' /proc/$vmm/status 2>/dev/null)"
cg=$(sed -n 's/^0:://p' /proc/$vmm/cgroup 2>/dev/null)
echo "JAILED-MEMORY-MAX=$(cat /sys/fs/cgroup$cg/memory.max 2>/dev/null)"
echo "JAILED-PIDS-MAX=$(cat /sys/fs/cgroup$cg/pids.max 2>/dev/null)"
i=0
while ! grep -q L2-NVME-DONE $con 2>/dev/null && ! vm_triple_faulted pt3 && [ $i -lt 3000 ]; do sleep 0.1; i=$((i + 1)); done
sed 's/^/JAILED-CONSOLE: /' $con
tail -n 20 $run/state/vms/pt3/vmm.log 2>/dev/null | sed 's/^/JAILED-VMM-LOG: /'
i=0
while ! ctl -o json vm show pt3 | grep -q '"state": "stopped"' && ! vm_triple_faulted pt3 && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
ctl vm delete pt3 >/dev/null
i=0
while [ "$(devstate)" = returning ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
echo "JAILED-AFTER-STATE=$(devstate)"
echo "JAILED-AFTER-DRIVER=$(drv $nvme)"
sed 's/^/MEDIATOR-LOG: /' /tmp/mediator.err | grep -i -E "error|panic" | head -20
echo "VFIO-POOL-DONE"
