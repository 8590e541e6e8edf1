# Shared by the scenarios (sourced; does nothing when run on its own).
export LD_LIBRARY_PATH=/opt/vgpu/lib
run=/tmp/vgpu

# Starts vgpu-mediatord on $run with the given flags and waits for its API.
start_mediator() {
    mkdir -p $run
    vgpu-mediatord --run-dir $run "$@" 2>/tmp/mediator.err &
    i=0
    while [ ! -S $run/api.sock ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
}
