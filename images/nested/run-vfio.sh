#!/usr/bin/env bash
# Boots L1 as run.sh does, plus what VFIO passthrough needs in the nested
# host (DESIGN §8): QEMU's emulated Intel IOMMU (interrupt remapping,
# caching mode), an emulated NVMe device over IMAGE (a raw file the caller
# made), and intel_iommu=on iommu=pt on L1's command line. Runs one
# scenario from images/nested/scenarios; the console goes to stdout.
# Usage: run-vfio.sh SCENARIO IMAGE [TIMEOUT_SECONDS]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/target/nested"
SCENARIO="$1"
IMAGE="$2"
TIMEOUT="${3:-600}"
[ -f "$IMAGE" ] || { echo "run-vfio.sh: no image file $IMAGE" >&2; exit 2; }
# With VFIO_IVSHMEM=FILE (512 MiB), also an ivshmem device whose 64-bit
# BAR 2 is that file (scenarios/vfio-bigbar.sh).
extra=()
if [ -n "${VFIO_IVSHMEM:-}" ]; then
    extra=(-object "memory-backend-file,id=hostmem,share=on,mem-path=$VFIO_IVSHMEM,size=512M" -device ivshmem-plain,memdev=hostmem)
fi
# With VFIO_AHCI=IMAGE, also an AHCI controller (MSI, no MSI-X) with a disk
# over IMAGE (scenarios/vfio-msi.sh).
if [ -n "${VFIO_AHCI:-}" ]; then
    extra+=(-drive "file=$VFIO_AHCI,if=none,id=sd,format=raw" -device ich9-ahci,id=ahci0 -device ide-hd,drive=sd,bus=ahci0.0)
fi
# The IOMMU comes before any PCI device, as QEMU requires.
# NESTED_QEMU_LOG: QEMU's CPU-reset log, as in run.sh.
LOG=()
[ -n "${NESTED_QEMU_LOG:-}" ] && LOG=(-d cpu_reset -D "$NESTED_QEMU_LOG")
exec timeout --foreground -k 5 "$TIMEOUT" qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max,svm=on -smp 2 -m 2048 \
    -machine q35 -device intel-iommu,intremap=on,caching-mode=on \
    -nographic -no-reboot -nodefaults -serial stdio \
    -drive file="$IMAGE",if=none,id=nv,format=raw -device nvme,drive=nv,serial=vgpu-nvme \
    "${extra[@]}" \
    -kernel "$(cat "$OUT/vmlinuz.path")" -initrd "$OUT/l1.cpio.gz" \
    -append "console=ttyS0 panic=-1 quiet loglevel=3 intel_iommu=on iommu=pt scenario=$SCENARIO nested_timeout=$TIMEOUT" "${LOG[@]}"
