#!/bin/bash
# Builds what scripts/gpu-check.sh runs on a machine with an NVIDIA GPU
# (which has no Rust toolchain): stripped release binaries and the gpu_cuda
# test binary in .gpu/bin, and a second fastpath-bench whose daemon runs
# with lane pinning and the compute nice value off (.gpu/alt), for
# comparison. Copy the repository and .gpu/ to that machine, then run
# scripts/gpu-check.sh from the repository's root.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --all-targets
rm -rf .gpu && mkdir -p .gpu/bin .gpu/alt
for b in vgpu-mediatord vgpuctl vgpu-smi libcuda.so vgpu-cuda-bench fastpath-bench share-bench; do
    strip -o .gpu/bin/$b target/release/$b
done
test_bin=$(ls -t target/release/deps/gpu_cuda-* | grep -v '\.d$' | head -1)
strip -o .gpu/bin/gpu_cuda "$test_bin"
cp .gpu/bin/fastpath-bench .gpu/bin/libcuda.so .gpu/alt/
cat > .gpu/alt/vgpu-mediatord <<'EOS'
#!/bin/sh
# The daemon with lane pinning and the compute nice value off.
real="$(dirname "$0")/../bin/vgpu-mediatord"
if [ "$1" = worker ]; then exec "$real" "$@"; fi
exec "$real" "$@" --pin-lanes false --compute-nice 0
EOS
chmod +x .gpu/alt/vgpu-mediatord
# strace and the libraries it loads, with this machine's loader, for
# scripts/gpu-syscalls.sh.
if command -v strace >/dev/null; then
    mkdir -p .gpu/strace/lib
    cp "$(command -v strace)" .gpu/strace/strace
    cp -L /lib64/ld-linux-x86-64.so.2 .gpu/strace/ld.so
    for lib in $(ldd "$(command -v strace)" | grep -oE '/[^ ]+\.so[^ ]*'); do
        cp -L "$lib" .gpu/strace/lib/
    done
fi
# The tests find samples/ at the path they were built in.
pwd > .gpu/workspace
du -sh .gpu
