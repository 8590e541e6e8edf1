# A large 64-bit BAR through VFIO (run with images/nested/run-vfio.sh and
# VFIO_IVSHMEM=FILE): QEMU's ivshmem device, whose BAR 2 is a 512 MiB file
# the test wrote, is bound to vfio-pci and passed to Debian's stock kernel.
# vgpu-vmm places the BAR in its window above guest RAM; the guest reads
# the test's words at both ends of it and writes its own, which the test
# finds in the file after QEMU exits.
log=/tmp/l2-serial.log
dev=""
for d in /sys/bus/pci/devices/*; do
    [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ] && dev=$(busybox basename $d)
done
echo "IVSHMEM-ADDR=$dev"
echo "IVSHMEM-L1-BAR2=$(sed -n 3p /sys/bus/pci/devices/$dev/resource)"
grp=$(busybox basename "$(busybox readlink /sys/bus/pci/devices/$dev/iommu_group)")
echo "IVSHMEM-GROUP-DEVICES=$(ls /sys/kernel/iommu_groups/$grp/devices | tr '\n' ' ')"
echo vfio-pci > /sys/bus/pci/devices/$dev/driver_override
echo $dev > /sys/bus/pci/drivers_probe
: > $log
VGPU_LOG=info /bin/vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 1 --memory 256 \
    --serial $log --vfio $dev --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=bigbar" 2>/tmp/vmm.err &
vmm=$!
i=0
while kill -0 $vmm 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.1; i=$((i + 1)); done
if kill -0 $vmm 2>/dev/null; then
    echo "VMM-TIMEOUT"
    kill -9 $vmm
fi
wait $vmm
echo "VMM-EXIT=$?"
sed 's/^/CONSOLE: /' $log
sed 's/^/VMM-ERR: /' /tmp/vmm.err | grep -v -i "unmapped\|ignored" | head -30
echo "BIGBAR-DONE"
