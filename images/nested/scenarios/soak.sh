# The soak: the demo's two VMs (1 vCPU each, vGPUs of 64 and 32 MiB on
# one CPU device, a host tenant computing beside them) made, run to the
# end of their CUDA samples and deleted, `rounds=N` times in a row (20 by
# default) in one L1 boot. Each round prints one SOAK-ROUND line; a VM that
# does not finish has its console tail and VMM log (with the vCPU trace of
# a triple fault) printed. The last line is SOAK-RESULT.
. /scenarios/lib.sh
rounds=$(sed -n 's/.*rounds=\([0-9]*\).*/\1/p' /proc/cmdline)
[ -n "$rounds" ] || rounds=20
start_mediator --device-memory 256MiB
ctl() { vgpuctl --run-dir $run "$@"; }
state() { ctl -o json vm show $1 | grep '"state"' | tr -d ' ",' | cut -d: -f2; }
h=$(ctl tenant create host --memory 32MiB)
passed=0
r=1
while [ $r -le $rounds ]; do
    t0=$(cut -d' ' -f1 /proc/uptime)
    create_demo_vms
    VGPU_SOCKET=$h vectorAdd >/tmp/host.log 2>&1 || echo "SOAK-HOST-FAILED round $r: $(tail -n 3 /tmp/host.log)"
    VGPU_SOCKET=$h reduction 65536 >/tmp/host.log 2>&1 || echo "SOAK-HOST-FAILED round $r: $(tail -n 3 /tmp/host.log)"
    ok=0
    line=""
    for vm in a b; do
        i=0
        while [ "$(state vm-$vm)" != stopped ] && [ $i -lt 3000 ]; do sleep 0.2; i=$((i + 1)); done
        ctl vm console vm-$vm --bytes 1000000 > /tmp/vm-$vm.log
        exit=$(ctl vm show vm-$vm | grep "^restart")
        if grep -q GUEST-DONE /tmp/vm-$vm.log && [ "$(grep -c PASSED /tmp/vm-$vm.log)" -ge 3 ] \
            && grep -q "runtime probe: all passed" /tmp/vm-$vm.log; then
            ok=$((ok + 1))
            line="$line vm-$vm=ok"
        else
            line="$line vm-$vm=FAILED"
            echo "SOAK-FAILED round $r vm-$vm: $exit"
            grep -E 'vectorAdd|matrixMul|reduction|runtime probe|FAIL|rror|GUEST-DONE|L2:' /tmp/vm-$vm.log | sed "s/^/[vm-$vm console] /"
            tail -n 5 /tmp/vm-$vm.log | sed "s/^/[vm-$vm console tail] /"
            ctl vm logs vm-$vm --bytes 20000 2>/dev/null | grep -v "unmapped address ignored" | sed "s/^/[vm-$vm vmm] /"
        fi
    done
    ctl vm delete vm-a >/dev/null
    ctl vm delete vm-b >/dev/null
    [ $ok -eq 2 ] && passed=$((passed + 1))
    t1=$(cut -d' ' -f1 /proc/uptime)
    echo "SOAK-ROUND $r$line ($(echo "$t0 $t1" | awk '{printf "%.0f", $2 - $1}') s)"
    r=$((r + 1))
done
echo "SOAK-RESULT passed=$passed rounds=$rounds"
