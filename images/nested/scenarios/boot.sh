# A stock Debian kernel boots to userspace under vgpu-vmm with 2 vCPUs,
# reads /dev/hwrng through virtio-rng, prints its markers and reboots.
# Also measures the time from starting the VMM to the guest's marker.
log=/tmp/l2-serial.log
: > $log
start=$(cut -d' ' -f1 /proc/uptime)
/bin/vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 2 --memory 256 --serial $log \
    --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=boot" 2>/tmp/vmm.err &
vmm=$!
i=0
while ! grep -q L2-MARKER-OK $log && kill -0 $vmm 2>/dev/null && [ $i -lt 6000 ]; do sleep 0.05; i=$((i + 1)); done
marker=$(cut -d' ' -f1 /proc/uptime)
wait $vmm
echo "VMM-EXIT=$?"
cat $log
cat /tmp/vmm.err
echo "VMM-TO-MARKER-SECONDS=$(echo "$start $marker" | awk '{printf "%.2f", $2 - $1}')"
