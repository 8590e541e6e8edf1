# A stock Linux guest on the `cuda` backend, with the test double of
# NVIDIA's driver (vgpu-testdriver in /opt/testdriver: tests only) as the
# driver: the daemon serves one GPU and no CPU device, the VM tenant's
# vhost-user backend and CUDA context live in an executor of its own, and
# the guest runs the CUDA samples and the CUDA runtime program through
# /dev/dri. Prints the device's executors and its arbiter, and which of
# the daemon's processes map the guest's RAM.
. /scenarios/lib.sh
mkdir -p $run
LD_LIBRARY_PATH=/opt/testdriver VGPU_TESTDRIVER_GPUS=4GiB \
    vgpu-mediatord --run-dir $run --launch-timeout-ms 120000 --cuda required --cpu-devices 0 2>/tmp/mediator.err &
daemon=$!
i=0
while ! vgpuctl --run-dir $run -o json device list >/dev/null 2>&1 && [ $i -lt 400 ]; do sleep 0.05; i=$((i + 1)); done
vgpuctl --run-dir $run device list | sed 's/^/DEVICE: /'
vm=$(vgpuctl --run-dir $run tenant create vm1 --memory 64MiB --vm)
log=/tmp/l2-serial.log
: > $log
vgpu-vmm --kernel /l2/vmlinuz --initramfs /l2/initrd --vcpus 2 --memory 512 --serial $log --vgpu socket=$vm \
    --cmdline "console=ttyS0 reboot=k panic=-1 quiet loglevel=3 l2test=cuda" 2>/tmp/vmm.err &
vmm=$!
i=0
while [ -z "$(vgpuctl --run-dir $run -o json device show gpu0 | tr -d ' \n' | grep -o '"executors":\[{[^]]*\]')" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
echo "EXECUTORS=$(vgpuctl --run-dir $run -o json device show gpu0 | tr -d ' \n' | grep -o '"executors":\[[^]]*\]')"
arbiter=$(vgpuctl --run-dir $run -o json device show gpu0 | tr -d ' \n' | grep -o '"worker_pid":[0-9]*' | cut -d: -f2)
echo "ARBITER=$arbiter"
# Once the guest computes, its RAM is mapped by the tenant's executor (its
# vhost-user backend) and by no other process of the daemon's.
exec_pid=$(vgpuctl --run-dir $run -o json device show gpu0 | tr -d ' \n' | grep -o '"executors":\[[^]]*\]' | grep -o '"pid":[0-9]*' | head -1 | cut -d: -f2)
i=0
while ! grep -q L2-SAMPLE $log 2>/dev/null && kill -0 $vmm 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.1; i=$((i + 1)); done
echo "EXEC-GUEST-RAM=$(grep -c vgpu-guest-ram /proc/$exec_pid/maps)"
echo "ARBITER-GUEST-RAM=$(grep -c vgpu-guest-ram /proc/$arbiter/maps)"
echo "DAEMON-GUEST-RAM=$(grep -c vgpu-guest-ram /proc/$daemon/maps)"
wait $vmm
echo "VMM-EXIT=$?"
sed 's/^/CONSOLE: /' $log
grep -v "unmapped address ignored" /tmp/vmm.err | tail -n 40 | sed 's/^/VMM-ERR: /'
grep -E 'ERROR|WARN|panicked|forbidden' /tmp/mediator.err | head -20 | sed 's/^/MEDIATOR: /'
echo "CUDADOUBLE-DONE"
