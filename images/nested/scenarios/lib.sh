# Shared by the scenarios (sourced; does nothing when run on its own).
export LD_LIBRARY_PATH=/opt/vgpu/lib
run=/tmp/vgpu

# Starts vgpu-mediatord on $run with the given flags and waits until its
# API answers (a socket file an earlier daemon left is not enough). A
# kernel here runs under two levels of emulation, beside the VMs' vCPUs:
# the 10 s default launch limit (made for real hosts) cut matrixMul off
# under load in the soak, so these daemons allow 120 s. L1's kernel
# argument mediator_args=A,B adds flags A B (NESTED_APPEND on the host:
# "mediator_args=--isolation,process").
start_mediator() {
    mkdir -p $run
    extra=$(tr ' ' '\n' </proc/cmdline | sed -n 's/^mediator_args=//p' | tr ',' ' ')
    # shellcheck disable=SC2086
    vgpu-mediatord --run-dir $run --launch-timeout-ms 120000 "$@" $extra 2>/tmp/mediator.err &
    i=0
    while ! vgpuctl --run-dir $run -o json device list >/dev/null 2>&1 && [ $i -lt 400 ]; do sleep 0.05; i=$((i + 1)); done
}

# True while L1 has more than 90 s left before the host's timeout for
# this run (nested_timeout= on its command line; run.sh sets it; 3600 s
# without it). A scenario that waits on a guest stops there, so that a
# stalled run still prints the guest's console and the daemon's log
# before QEMU is killed, instead of a bare timeout.
before_deadline() {
    limit=$(tr ' ' '\n' </proc/cmdline | sed -n 's/^nested_timeout=//p')
    awk -v limit="${limit:-3600}" '{ exit !($1 < limit - 90) }' /proc/uptime
}

# Says the scenario stopped waiting for guest $1 at the deadline, with
# the daemon's last log lines, and kills that guest's VMM (pid $2).
stalled() {
    echo "SCENARIO-STALLED: $1 had not finished at L1 uptime $(cut -d' ' -f1 /proc/uptime) s, close to the host's timeout; the daemon's last lines follow, the guest's console after them"
    tail -n 40 /tmp/mediator.err | sed 's/^/MEDIATOR-LOG: /'
    kill -9 "$2"
}

# True when managed VM $1's VMM has logged a guest triple fault. No
# scenario's guest does that on purpose: under this emulator it is the
# emulator's fault (docs/vmm.md), and the test harness runs a scenario
# whose output shows one again. A wait on the guest stops there, instead
# of spending minutes of the run on a guest that is gone or rebooting.
vm_triple_faulted() {
    grep -q "guest triple fault" $run/state/vms/$1/vmm.log 2>/dev/null
}

# The driver PCI function $1 is bound to, or "none".
drv() {
    d=$(busybox readlink /sys/bus/pci/devices/$1/driver)
    if [ -n "$d" ]; then busybox basename "$d"; else echo none; fi
}

# The (last) PCI function of class $1 (0x010802: NVMe).
pci_of_class() {
    found=""
    for d in /sys/bus/pci/devices/*; do
        [ "$(cat $d/class)" = "$1" ] && found=$(busybox basename $d)
    done
    echo "$found"
}

# Binds PCI function $1 to vfio-pci.
bind_vfio() {
    echo vfio-pci > /sys/bus/pci/devices/$1/driver_override
    echo $1 > /sys/bus/pci/drivers_probe
}

# Boots the stock L2 kernel with PCI function $1 passed through and
# l2test=$2 (and vgpu-vmm flags $3, unquoted), waits (at most 300 s) for the VMM to end, and prints
# VMM-EXIT, VMM-SECONDS, the guest's console (CONSOLE: lines) and the
# VMM's log (VMM-ERR: lines).
run_vfio_vm() {
    log=/tmp/l2-serial.log
    # Made by the VMM (a jailed one makes it for the jail's uid).
    rm -f $log
    start=$(cut -d' ' -f1 /proc/uptime)
    VGPU_LOG=info /bin/vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 1 --memory 256 \
        --serial $log --vfio $1 $3 --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=$2" 2>/tmp/vmm.err &
    vmm=$!
    i=0
    while kill -0 $vmm 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 $vmm 2>/dev/null; then
        echo "VMM-TIMEOUT"
        kill -9 $vmm
    fi
    wait $vmm
    echo "VMM-EXIT=$?"
    end=$(cut -d' ' -f1 /proc/uptime)
    echo "VMM-SECONDS=$(echo "$start $end" | awk '{printf "%.2f", $2 - $1}')"
    sed 's/^/CONSOLE: /' $log
    sed 's/^/VMM-ERR: /' /tmp/vmm.err
}

# Makes the demo's VMs with `vgpuctl vm create` (the daemon on $run):
# vm-a (vGPU 64MiB, weight 2) and vm-b (vGPU 32MiB), 1 vCPU each, booting
# Debian's kernel from their own copy of the ext4 root disk, running
# l2-init's demo test and then stopping (restart never).
create_demo_vms() {
    for vm in a b; do
        create_demo_vm $vm
    done
}

# Makes one of the demo's VMs (a or b).
create_demo_vm() {
    for vm in $1; do
        if [ $vm = a ]; then mem=64MiB; w=2; else mem=32MiB; w=1; fi
        cp /l2/root.img /tmp/vm-$vm.img
        # VMMs run jailed as the user vgpu (999:999 here) by default: its disk is its.
        busybox chown 999:999 /tmp/vm-$vm.img
        vgpuctl --run-dir $run vm create vm-$vm --vcpus 1 --memory 384MiB --kernel /l2/vmlinuz --initramfs /l2/boot-initrd \
            --cmdline "console=ttyS0 root=/dev/vda reboot=k panic=-1 quiet loglevel=3 l2test=demo" \
            --disk /tmp/vm-$vm.img --vgpu-memory $mem --weight $w --restart never >/dev/null
    done
}
