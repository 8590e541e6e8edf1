# MSI through VFIO (run with images/nested/run-vfio.sh and VFIO_AHCI=IMAGE):
# an AHCI controller, which has MSI and no MSI-X, with a disk over an image
# the test wrote, is bound to vfio-pci and passed to Debian's stock kernel,
# whose ahci driver reads the test's marker and writes its own with MSI
# interrupts; the test finds that marker in the image after QEMU exits.
log=/tmp/l2-serial.log
dev=""
for d in /sys/bus/pci/devices/*; do
    [ "$(cat $d/class)" = 0x010601 ] || continue
    a=$(busybox basename $d)
    grp=$(busybox basename "$(busybox readlink $d/iommu_group)")
    # The chipset's own AHCI shares its group with the LPC bridge.
    [ "$(ls /sys/kernel/iommu_groups/$grp/devices | wc -l)" = 1 ] && dev=$a
done
echo "AHCI-ADDR=$dev"
echo "AHCI-CAPS=$(busybox hexdump -s 0x34 -n 1 -e '1/1 "%02x"' /sys/bus/pci/devices/$dev/config)"
echo vfio-pci > /sys/bus/pci/devices/$dev/driver_override
echo $dev > /sys/bus/pci/drivers_probe
echo "AHCI-DRIVER=$(busybox basename "$(busybox readlink /sys/bus/pci/devices/$dev/driver)")"
: > $log
VGPU_LOG=info /bin/vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 1 --memory 256 \
    --serial $log --vfio $dev --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=ahci" 2>/tmp/vmm.err &
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
echo "MSI-DONE"
