# A large 64-bit BAR through VFIO (run with images/nested/run-vfio.sh and
# VFIO_IVSHMEM=FILE): QEMU's ivshmem device, whose BAR 2 is a 512 MiB file
# the test wrote, is bound to vfio-pci and passed to Debian's stock kernel.
# vgpu-vmm places the BAR in its window above guest RAM; the guest reads
# the test's words at both ends of it and writes its own, which the test
# finds in the file after QEMU exits.
. /scenarios/lib.sh
dev=""
for d in /sys/bus/pci/devices/*; do
    [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ] && dev=$(busybox basename $d)
done
echo "IVSHMEM-ADDR=$dev"
echo "IVSHMEM-L1-BAR2=$(sed -n 3p /sys/bus/pci/devices/$dev/resource)"
grp=$(busybox basename "$(busybox readlink /sys/bus/pci/devices/$dev/iommu_group)")
echo "IVSHMEM-GROUP-DEVICES=$(ls /sys/kernel/iommu_groups/$grp/devices | tr '\n' ' ')"
bind_vfio $dev
run_vfio_vm $dev bigbar
echo "BIGBAR-DONE"
