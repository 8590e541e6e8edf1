# A jailed VMM (--jail, as Firecracker's jailer) with cgroup v2 limits
# boots the stock Linux guest: uid 40123, PID 1 of its own namespace, no
# capabilities, every thread under seccomp, in its own cgroup with
# memory.max and pids.max; the API shuts the guest down through the socket
# bound before the jail, and the VMM exits 0. L1's root is an initramfs,
# so the jail enters its root with MS_MOVE and chroot instead of pivot_root.
log=/tmp/l2-serial.log
api=/tmp/vm.sock
mkdir -p /sys/fs/cgroup
mount -t cgroup2 none /sys/fs/cgroup && echo "CGROUP2=mounted"
echo "CGROUP-CONTROLLERS=$(cat /sys/fs/cgroup/cgroup.controllers)"
/bin/vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 2 --memory 256 --serial $log --api-socket $api \
    --jail /tmp/jail --jail-uid 40123 --jail-gid 40123 --jail-memory 512MiB --jail-pids 64 \
    --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=idle" 2>/tmp/vmm.err &
sup=$!
i=0
while ! grep -q L2-IDLE $log 2>/dev/null && kill -0 $sup 2>/dev/null && [ $i -lt 6000 ]; do sleep 0.05; i=$((i + 1)); done
grep -q L2-IDLE $log && echo "SAW-L2-IDLE"
vmm=$(cat /proc/$sup/task/$sup/children | tr -d ' ')
echo "JAIL-UID=$(awk '/^Uid:/ {print $2 $3 $4 $5}' /proc/$vmm/status)"
echo "JAIL-NSPID=$(awk '/^NSpid:/ {print $3}' /proc/$vmm/status)"
echo "JAIL-CAPEFF=$(awk '/^CapEff:/ {print $2}' /proc/$vmm/status)"
[ "$(readlink /proc/$vmm/ns/mnt)" != "$(readlink /proc/self/ns/mnt)" ] && echo "JAIL-OWN-MNT-NS=yes"
[ "$(readlink /proc/$vmm/ns/net)" != "$(readlink /proc/self/ns/net)" ] && echo "JAIL-OWN-NET-NS=yes"
echo "JAIL-ROOT=$(cd /proc/$vmm/root && find . -type f -o -type c | sort | tr '\n' ' ')"
cg=$(sed -n 's/^0:://p' /proc/$vmm/cgroup)
echo "JAIL-CGROUP=$cg"
echo "JAIL-MEMORY-MAX=$(cat /sys/fs/cgroup$cg/memory.max)"
echo "JAIL-PIDS-MAX=$(cat /sys/fs/cgroup$cg/pids.max)"
echo "JAIL-MEMORY-CURRENT=$(cat /sys/fs/cgroup$cg/memory.current)"
n=0
s=0
for t in /proc/$vmm/task/*; do
    case "$(cat $t/comm)" in kvm-nx-lpage*) continue ;; esac
    n=$((n + 1))
    grep -q '^Seccomp:.2' $t/status && s=$((s + 1))
done
echo "JAIL-THREADS=$n"
echo "JAIL-SECCOMP-THREADS=$s"
vgpuctl vmm --socket $api info
vgpuctl vmm --socket $api shutdown
(sleep 60; vgpuctl vmm --socket $api kill) >/dev/null 2>&1 &
wait $sup
echo "VMM-EXIT=$?"
echo "CGROUPS-LEFT=$(ls /sys/fs/cgroup/vgpu-vmm | grep -c '^vm-')"
[ -e $api ] || echo "API-SOCKET-REMOVED"
cat $log
cat /tmp/vmm.err

# Tenant executors (--isolation process) in cgroups of their own, bounded
# as the device view says; a deleted tenant's group goes with its executor.
. /scenarios/lib.sh
start_mediator --isolation process --device-memory 256MiB
ta=$(vgpuctl --run-dir $run tenant create ta --memory 32MiB)
vgpuctl --run-dir $run tenant create tb --memory 64MiB >/dev/null
VGPU_SOCKET=$ta vectorAdd 2>&1 | sed 's/^/EXEC-SAMPLE: /'
echo "EXEC-VIEW=$(vgpuctl --run-dir $run -o json device show cpu0 | tr -d ' \n' | grep -o '"executors":\[.*\]' | sed 's/^"executors"://')"
for p in /proc/[0-9]*; do
    tr '\0' ' ' <$p/cmdline 2>/dev/null | grep -q -- '--grant-fd' || continue
    pid=${p#/proc/}
    cg=$(sed -n 's/^0:://p' $p/cgroup)
    echo "EXEC-BOUND=$pid $cg $(cat /sys/fs/cgroup$cg/memory.max) $(cat /sys/fs/cgroup$cg/pids.max) $(awk '/^Max open files/ {print $4 "/" $5}' $p/limits)"
done
# A grown quota raises the running executor's memory bound.
vgpuctl --run-dir $run tenant set tb --memory 96MiB >/dev/null
for p in /proc/[0-9]*; do
    tr '\0' ' ' <$p/cmdline 2>/dev/null | grep -q -- '--grant-fd' || continue
    cg=$(sed -n 's/^0:://p' $p/cgroup)
    case $cg in */cpu0.tb.*) echo "EXEC-GROWN=$(cat /sys/fs/cgroup$cg/memory.max)" ;; esac
done
echo "EXEC-GROWN-VIEW=$(vgpuctl --run-dir $run -o json device show cpu0 | tr -d ' \n' | grep -o '"executors":\[.*\]' | sed 's/^"executors"://')"
vgpuctl --run-dir $run tenant delete ta >/dev/null
i=0
while ls /sys/fs/cgroup/vgpu-mediatord | grep -q '^cpu0\.ta\.' && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done
echo "EXEC-CGROUPS-LEFT=$(ls /sys/fs/cgroup/vgpu-mediatord | grep '^cpu0\.' | tr '\n' ' ')"
echo "JAIL-DONE"
