# A stock Linux guest runs CUDA Driver API programs through /dev/dri and
# libcuda.so.1 on the mediator's CPU device, while a host-socket tenant
# runs on the same device. The host tenant first leaves a pattern in
# device memory, which the guest's fresh allocation must not see. Late in
# the guest's run the device's worker is killed under one of its contexts.
. /scenarios/lib.sh
start_mediator --device-memory 256MiB
vm=$(vgpuctl --run-dir $run tenant create vm1 --memory 32MiB --vm)
host=$(vgpuctl --run-dir $run tenant create host1 --memory 32MiB)
VGPU_SOCKET=$host tenant_probe fill 16777216 2>&1 | sed 's/^/HOST-FILL: /'
log=/tmp/l2-serial.log
: > $log
start=$(cut -d' ' -f1 /proc/uptime)
vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 2 --memory 512 --serial $log --vgpu socket=$vm \
    --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=cuda" 2>/tmp/vmm.err &
vmm=$!
# The host tenant works on the same device while the VM runs.
for r in "vectorAdd" "reduction 65536"; do
    VGPU_SOCKET=$host $r 2>&1 | sed 's/^/HOST-SAMPLE: /'
done
# The guest asks for its backend to end under one of its contexts.
pid=$(vgpuctl --run-dir $run -o json device show cpu0 | tr -d ' \n' | grep -o '"worker_pid":[0-9]*' | cut -d: -f2)
while ! grep -q L2-RELIVE-READY $log 2>/dev/null && kill -0 $vmm 2>/dev/null && before_deadline; do sleep 0.2; done
grep -q L2-RELIVE-READY $log && kill -9 $pid && echo "KILLED-WORKER=$pid"
while kill -0 $vmm 2>/dev/null && before_deadline; do sleep 0.5; done
kill -0 $vmm 2>/dev/null && stalled "the guest" $vmm
wait $vmm
echo "VMM-EXIT=$?"
end=$(cut -d' ' -f1 /proc/uptime)
echo "VM-SECONDS=$(echo "$start $end" | awk '{printf "%.1f", $2 - $1}')"
cat $log
vgpuctl --run-dir $run metrics | grep -E '^vgpu_tenant_(kernels_total|memory_quota_bytes|scrubbed_bytes_total)' | sed 's/^/METRIC: /'
tail -5 /tmp/vmm.err
grep -E 'hung up|reconnected' /tmp/vmm.err | sed 's/^/VMM-LINK: /'
grep -E 'ERROR|panicked' /tmp/mediator.err | head -5
