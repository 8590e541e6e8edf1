# A managed VM as a provider launches it: `vgpuctl vm create` boots Debian's
# stock kernel from a root disk image, with a network interface on a bridge
# and a vGPU; the guest reaches the host and back and runs the CUDA samples
# installed on its disk. Then the VM is listed, stopped and started (its
# disk keeps what the first boot wrote), brought back after the daemon is
# killed, and deleted: its vGPU tenant goes and its memory is scrubbed.
. /scenarios/lib.sh
flags="--device-memory 128MiB"
start_mediator $flags
ctl() { vgpuctl --run-dir $run "$@"; }
state() { ctl -o json vm show web | grep '"state"' | head -1 | tr -d ' ",' | cut -d: -f2; }
con=$run/state/vms/web/console.log
now() { cut -d' ' -f1 /proc/uptime; }
# Waits until the console shows $1 at least $2 times (default once).
wait_console() {
    i=0
    while [ "$(grep -c "$1" $con 2>/dev/null)" -lt "${2:-1}" ] && ! vm_triple_faulted web && [ $i -lt 6000 ]; do sleep 0.05; i=$((i + 1)); done
    # Said when it gave up: the test then shows what the console had.
    [ "$(grep -c "$1" $con 2>/dev/null)" -ge "${2:-1}" ] || echo "WAIT-TIMEOUT: $1 x${2:-1} after $i polls"
}
scrubbed() { ctl metrics | grep '^vgpu_device_scrubbed_bytes_total{' | grep 'device="cpu0"' | awk '{print $NF}'; }
# The host side: a bridge with an address; the daemon makes the VM's tap in it.
brctl addbr br0
ip addr add 10.0.2.1/24 dev br0
ip link set br0 up
# The daemon jails VMMs as the user vgpu (999:999 in L1's /etc/passwd) by
# default: the disk the guest writes must be that user's.
busybox chown 999:999 /l2/root.img
t0=$(now)
ctl vm create web --vcpus 1 --memory 256MiB --kernel /l2/vmlinuz --initramfs /l2/boot-initrd \
    --cmdline "console=ttyS0 root=/dev/vda reboot=k panic=-1 quiet loglevel=3 l2test=disk" \
    --disk /l2/root.img --net bridge=br0 --vgpu-memory 64MiB
t1=$(now)
wait_console L2-USERSPACE
t2=$(now)
echo "VM-CREATE-RETURNED-S=$(awk "BEGIN {print $t1 - $t0}")"
echo "VM-FIRST-USERSPACE-S=$(awk "BEGIN {print $t2 - $t0}")"
echo "TAP-IN-BRIDGE=$(ls /sys/class/net/br0/brif | tr '\n' ' ')"
# The daemon's child is the jail's supervisor; the VMM is its only child.
sup=$(ctl -o json vm show web | grep '"pid"' | tr -dc 0-9)
echo "VMM-JAIL-UID=$(awk '/^Uid:/ {print $2}' /proc/$(cat /proc/$sup/task/$sup/children 2>/dev/null | tr -d ' ')/status 2>/dev/null)"
wait_console L2-NET-UP
ping -c 3 -W 2 10.0.2.15 2>&1 | sed 's/^/L1-PING: /'
wait_console L2-DISK-READY
echo "== vgpuctl -o json vm list"
echo "VMLIST-BEGIN"
ctl -o json vm list
echo "VMLIST-END"
ctl vm list
ctl vm stop web --timeout 30 >/dev/null
echo "STOPPED-STATE=$(state)"
ctl vm start web >/dev/null
echo "STARTED-STATE=$(state)"
wait_console L2-DISK-READY 2
echo "== the daemon is killed and started again"
pid=$(ctl -o json vm show web | grep '"pid"' | tr -dc 0-9)
kill -9 $(pidof vgpu-mediatord)
sleep 1
echo "VMM-AFTER-KILL=$(test -d /proc/$pid && echo alive || echo gone)"
start_mediator $flags
wait_console L2-DISK-READY 3
echo "RESTORED-STATE=$(state)"
echo "VM-RESTARTS=$(ctl -o json vm show web | grep '"restarts"' | tr -dc 0-9)"
# A VM the restart policy brought back booted once more than the steps
# above: its VMM's log says why (an L2 triple fault is the emulator's,
# which the test harness recognises and runs the scenario again for).
grep -E "triple fault|ERROR|WARN" $run/state/vms/web/vmm.log 2>/dev/null | grep -v "unmapped address" | sed 's/^/VMM-LOG: /'
echo "== the guest's console"
sed 's/^/CONSOLE: /' $con
ctl vm delete web
echo "TENANTS-AFTER-DELETE=$(ctl -o json tenant list | grep -c '"name"')"
echo "VMS-AFTER-DELETE=$(ctl -o json vm list | grep -c '"name"')"
# The tap goes when the last descriptor on it closes, as the jailed VMM's
# processes are reaped: give it up to 10 s.
i=0
while [ "$(ls /sys/class/net/br0/brif | wc -l)" != 0 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
echo "TAPS-AFTER-DELETE=$(ls /sys/class/net/br0/brif | wc -l)"
echo "== the next tenant takes all of the device's memory, which the VM's guest had filled in part: it reads zeros"
h=$(ctl tenant create next --memory 128MiB)
before=$(scrubbed)
VGPU_SOCKET=$h tenant_probe check 134217728 2>&1 | sed 's/^/NEXT-TENANT: /'
after=$(scrubbed)
echo "SCRUBBED-FOR-NEXT=$(awk "BEGIN {printf \"%d\", $after - $before}")"
echo "VMDISK-DONE"
