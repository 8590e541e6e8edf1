# The VM's API with a stock Linux guest, through vgpuctl: info, pause,
# resume, then shutdown (Ctrl-Alt-Del on the i8042): the guest reboots
# itself and the VMM exits 0.
log=/tmp/l2-serial.log
api=/tmp/vm.sock
: > $log
/bin/vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 2 --memory 256 --serial $log --api-socket $api \
    --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=idle" 2>/tmp/vmm.err &
vmm=$!
i=0
while ! grep -q L2-IDLE $log && kill -0 $vmm 2>/dev/null && [ $i -lt 6000 ]; do sleep 0.05; i=$((i + 1)); done
grep -q L2-IDLE $log && echo "SAW-L2-IDLE-BEFORE-API-CALLS"
vgpuctl vmm --socket $api info
vgpuctl vmm --socket $api pause
echo "PAUSED-STATE=$(vgpuctl -o json vmm --socket $api info | grep '"state"' | tr -d ' ",' | cut -d: -f2)"
vgpuctl vmm --socket $api resume
vgpuctl vmm --socket $api shutdown
# Watchdog: a guest that ignores the request is killed (VMM exit 4).
(sleep 60; vgpuctl vmm --socket $api kill) >/dev/null 2>&1 &
wait $vmm
echo "VMM-EXIT=$?"
cat $log
cat /tmp/vmm.err
