# The VMM comparison: the same two L2 guests (Debian's kernel, the boot
# initramfs, a copy of the ext4 root disk, 1 vCPU and 384 MiB each, the
# cpuload test) run at once, `rounds=N` times, under vgpu-vmm (vmm=ours)
# or under QEMU with -enable-kvm (vmm=qemu, an image built with
# NESTED_WITH_QEMU=1). A host tenant keeps L1's CPUs busy with the CPU
# device's kernels meanwhile, as the demo's samples do. A guest that ends
# without printing GUEST-DONE died (a triple fault ends both VMMs: ours
# with exit code 3, QEMU's with -no-reboot). Prints one COMPARE-ROUND line
# a round and COMPARE-RESULT at the end.
. /scenarios/lib.sh
rounds=$(sed -n 's/.*rounds=\([0-9]*\).*/\1/p' /proc/cmdline)
[ -n "$rounds" ] || rounds=20
vmm=$(sed -n 's/.*vmm=\([a-z]*\).*/\1/p' /proc/cmdline)
[ -n "$vmm" ] || vmm=ours
start_mediator --device-memory 128MiB
h=$(vgpuctl --run-dir $run tenant create host --memory 32MiB)
cmdline="console=ttyS0 root=/dev/vda reboot=k panic=-1 quiet loglevel=3 l2test=cpuload"
boot_vm() {
    cp /l2/root.img /tmp/vm-$1.img
    rm -f /tmp/vm-$1.log /tmp/vm-$1.err
    if [ $vmm = qemu ]; then
        qemu-system-x86_64 -enable-kvm -cpu host -machine pc -smp 1 -m 384 -L /usr/share/qemu \
            -nodefaults -no-user-config -display none -no-reboot -serial file:/tmp/vm-$1.log \
            -d cpu_reset,guest_errors -D /tmp/vm-$1.err \
            -kernel /l2/vmlinuz -initrd /l2/boot-initrd -append "$cmdline" \
            -drive file=/tmp/vm-$1.img,if=virtio,format=raw >/dev/null 2>>/tmp/vm-$1.err &
    else
        vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/boot-initrd --vcpus 1 --memory 384 --no-rng \
            --serial /tmp/vm-$1.log --disk path=/tmp/vm-$1.img --cmdline "$cmdline" >/dev/null 2>/tmp/vm-$1.err &
    fi
    pid=$!
}
passed=0
died=0
r=1
while [ $r -le $rounds ]; do
    t0=$(cut -d' ' -f1 /proc/uptime)
    boot_vm a
    pa=$pid
    boot_vm b
    pb=$pid
    ( while kill -0 $pa 2>/dev/null || kill -0 $pb 2>/dev/null; do VGPU_SOCKET=$h matrixMul 64 >/dev/null 2>&1; done ) &
    load=$!
    line=""
    for vm in a b; do
        if [ $vm = a ]; then p=$pa; else p=$pb; fi
        i=0
        while kill -0 $p 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.2; i=$((i + 1)); done
        kill -0 $p 2>/dev/null && { echo "COMPARE-TIMEOUT round $r vm-$vm"; kill -9 $p; }
        wait $p
        code=$?
        if grep -q GUEST-DONE /tmp/vm-$vm.log; then
            line="$line vm-$vm=ok"
            passed=$((passed + 1))
        else
            line="$line vm-$vm=DIED(exit=$code)"
            died=$((died + 1))
            tail -n 5 /tmp/vm-$vm.log | sed "s/^/[vm-$vm console tail] /"
            grep -v "unmapped address ignored" /tmp/vm-$vm.err | tail -n 80 | sed "s/^/[vm-$vm vmm] /"
        fi
    done
    wait $load
    t1=$(cut -d' ' -f1 /proc/uptime)
    echo "COMPARE-ROUND $r vmm=$vmm$line ($(echo "$t0 $t1" | awk '{printf "%.0f", $2 - $1}') s)"
    r=$((r + 1))
done
echo "COMPARE-RESULT vmm=$vmm passed=$passed died=$died runs=$((rounds * 2))"
