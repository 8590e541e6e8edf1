# MSI through VFIO (run with images/nested/run-vfio.sh and VFIO_AHCI=IMAGE):
# an AHCI controller, which has MSI and no MSI-X, with a disk over an image
# the test wrote, is bound to vfio-pci and passed to Debian's stock kernel,
# whose ahci driver reads the test's marker and writes its own with MSI
# interrupts; the test finds that marker in the image after QEMU exits.
. /scenarios/lib.sh
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
bind_vfio $dev
echo "AHCI-DRIVER=$(busybox basename "$(busybox readlink /sys/bus/pci/devices/$dev/driver)")"
run_vfio_vm $dev ahci
echo "MSI-DONE"
