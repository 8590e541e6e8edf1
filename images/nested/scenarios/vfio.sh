# Whole-device passthrough (run with images/nested/run-vfio.sh, which adds
# the emulated Intel IOMMU and an NVMe device): bad --vfio input is refused
# with its reason and leaves every driver as it was; then the NVMe device
# is bound to vfio-pci and vgpu-vmm passes it to Debian's stock kernel,
# whose nvme driver reads the host's marker and writes its own.
. /scenarios/lib.sh
vmm_args="--kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 1 --memory 256"
nvme=$(pci_of_class 0x010802)
echo "NVME-ADDR=$nvme"
echo "NVME-DRIVER-BEFORE=$(drv $nvme)"
grp=$(busybox basename "$(busybox readlink /sys/bus/pci/devices/$nvme/iommu_group)")
echo "NVME-GROUP=$grp"
echo "NVME-GROUP-DEVICES=$(ls /sys/kernel/iommu_groups/$grp/devices | tr '\n' ' ')"

# Refused: each prints its exit status and message.
bad() {
    name=$1
    shift
    /bin/vgpu-vmm $vmm_args --serial /tmp/bad.log --cmdline "console=ttyS0 l2test=none" "$@" >/tmp/bad.out 2>&1
    echo "BAD-$name-EXIT=$?"
    sed "s/^/BAD-$name-ERR: /" /tmp/bad.out
}
bad UNBOUND --vfio $nvme
bad HOSTBRIDGE --vfio 0000:00:00.0
bad GARBAGE --vfio not-a-pci-address
bad MISSING --vfio 0000:00:1e.7
echo "NVME-DRIVER-AFTER-BAD=$(drv $nvme)"
echo "HOSTBRIDGE-DRIVER-AFTER-BAD=$(drv 0000:00:00.0)"
echo "VFIO-NODES-AFTER-BAD=$(ls /dev/vfio | tr '\n' ' ')"

bind_vfio $nvme
echo "NVME-DRIVER-BOUND=$(drv $nvme)"
echo "VFIO-NODES=$(ls /dev/vfio | tr '\n' ' ')"

run_vfio_vm $nvme nvme
# The same device again, with the VMM in its jail (uid 1000, no
# capabilities): only this device's sysfs entries and VFIO nodes are
# exposed.
mkdir -p /tmp/jail
chmod 0644 /l2/vmlinuz /l2/initrd
run_vfio_vm $nvme nvme "--jail /tmp/jail --jail-uid 1000 --jail-gid 1000" | sed 's/^/JAILED-/'
echo "NVME-DRIVER-AFTER=$(drv $nvme)"
echo "VFIO-DONE"
