#!/usr/bin/env bash
# Builds the nested test host under target/nested/:
#   kernel/            Debian's generic linux-image-amd64, unpacked (L1 and L2 kernel)
#   l2.cpio.gz         L2 initramfs: busybox, the virtio modules, /init (images/nested/l2-init)
#   l2-root.img        L2 root disk: ext4 with the same tree, its /sbin/init is l2-init
#   l2-boot.cpio.gz    L2 boot initramfs for that disk: virtio-blk and ext4, then
#                      switch_root to root= (images/nested/l2-boot-init)
#   l1.cpio.gz         L1 initramfs: busybox, kvm + kvm-amd, vgpu-vmm and its libraries,
#                      the L2 kernel and initramfs, and images/nested/scenarios/*
# Needs the workspace built (release) and images/nested/packages.sh run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/target/nested"
BIN="$ROOT/target/release"
mkdir -p "$OUT"

# 1. The kernel package, downloaded (not installed) and unpacked once.
if [ ! -f "$OUT/kernel/.done" ]; then
    rm -rf "$OUT/kernel" "$OUT/debs"
    mkdir -p "$OUT/debs" "$OUT/kernel"
    meta_dep="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
    if [ -z "$meta_dep" ]; then
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        meta_dep="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
    fi
    [ -n "$meta_dep" ] || { echo "nested: cannot resolve linux-image-amd64 (run apt-get update)" >&2; exit 1; }
    (cd "$OUT/debs" && apt-get download -qq "$meta_dep" 2>/dev/null || apt-get download "$meta_dep")
    dpkg-deb -x "$OUT"/debs/linux-image-*.deb "$OUT/kernel"
    touch "$OUT/kernel/.done"
fi
KVER="$(ls "$OUT/kernel/lib/modules" | head -1)"
MODDIR="$OUT/kernel/lib/modules/$KVER/kernel"
VMLINUZ="$OUT/kernel/boot/vmlinuz-$KVER"
echo "$VMLINUZ" > "$OUT/vmlinuz.path"

# Prints the .ko paths for the named modules, dependencies first.
declare -A seen=()
mods() {
    local m f deps
    for m in "$@"; do
        [ -n "$m" ] || continue
        [ -z "${seen[$m]:-}" ] || continue
        seen[$m]=1
        f="$(find "$MODDIR" -name "$m.ko" -o -name "${m//_/-}.ko" | head -1)"
        if [ -z "$f" ]; then
            # Built into the kernel: nothing to load.
            grep -qE "/(${m}|${m//_/-})\.ko\$" "$OUT/kernel/lib/modules/$KVER/modules.builtin" && continue
            echo "nested: module $m not found in $KVER" >&2
            exit 1
        fi
        deps="$(strings -a "$f" | sed -n 's/^depends=//p' | head -1 | tr ',' ' ')"
        # shellcheck disable=SC2086
        mods $deps
        echo "$f"
    done
}

# Copies a dynamically linked program and the libraries it loads.
copy_prog() {
    local prog="$1" dest="$2" lib
    install -D -m 0755 "$prog" "$dest/bin/$(basename "$prog")"
    for lib in $(ldd "$prog" | grep -oE '/[^ ]+\.so[^ ]*'); do
        install -D -m 0755 "$lib" "$dest$lib"
    done
}

base_tree() {
    local d="$1"
    rm -rf "$d"
    mkdir -p "$d"/{bin,sbin,proc,sys,dev,tmp,mnt,modules,run}
    cp "$(command -v busybox)" "$d/bin/busybox"
    for a in sh mount umount insmod mkdir cat echo grep sed awk ls sleep dd od hexdump head tail wc poweroff reboot sync dmesg seq tr cut ip ping switch_root date rm pidof brctl basename devmem printf; do
        ln -sf busybox "$d/bin/$a"
    done
}

pack() {
    (cd "$1" && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 > "$2"
}

# The C samples, built against our cuda.h and libcuda.so, for both levels.
SAMPLES="$OUT/samples"
mkdir -p "$SAMPLES"
for p in vectorAdd matrixMul reduction tenant_probe; do
    cc -O2 -Wall -I "$ROOT/guest-driver-shim/include" -DKERNEL_DIR='"/opt/vgpu/kernels"' \
        -o "$SAMPLES/$p" "$ROOT/samples/$p.c" -L "$BIN" -lcuda -lm
done
cc -O2 -Wall -o "$SAMPLES/drm_probe" "$ROOT/samples/drm_probe.c"

# The CUDA runtime program, on PyPI's libcudart (target/pyenv, from
# scripts/setup.sh). Guests get its kernels as PTX that NVRTC compiles
# here: libnvrtc (about 100 MiB) stays out of the initramfs.
NV="$(echo "$ROOT"/target/pyenv/lib/python3*/site-packages/nvidia)"
[ -d "$NV/cuda_runtime" ] || { echo "nested: $NV/cuda_runtime is missing (run scripts/setup.sh)" >&2; exit 1; }
cc -O2 -Wall -I "$NV/cuda_runtime/include" -I "$NV/cuda_nvcc/include" -I "$NV/cuda_nvrtc/include" \
    -o "$SAMPLES/runtime_probe" "$ROOT/samples/runtime_probe.c" -L "$NV/cuda_runtime/lib" -l:libcudart.so.12 -ldl
LD_LIBRARY_PATH="$NV/cuda_runtime/lib:$NV/cuda_nvrtc/lib" "$SAMPLES/runtime_probe" --emit-ptx "$SAMPLES/runtime_probe.ptx" compute_70 >/dev/null

# The shim and the samples, as a guest (or L1 host process) installs them.
install_vgpu_userspace() {
    local d="$1"
    mkdir -p "$d/opt/vgpu/lib" "$d/opt/vgpu/kernels"
    install -m 0755 "$BIN/libcuda.so" "$d/opt/vgpu/lib/libcuda.so.1"
    for lib in $(ldd "$BIN/libcuda.so" | grep -oE '/[^ ]+\.so[^ ]*'); do
        install -D -m 0755 "$lib" "$d$lib"
    done
    cp "$ROOT"/samples/kernels/*.ptx "$d/opt/vgpu/kernels/"
    for p in vectorAdd matrixMul reduction tenant_probe; do
        LD_LIBRARY_PATH="$BIN" copy_prog "$SAMPLES/$p" "$d"
    done
    copy_prog "$BIN/vgpu-smi" "$d"
    copy_prog "$SAMPLES/drm_probe" "$d"
    copy_prog "$SAMPLES/runtime_probe" "$d"
    install -m 0755 "$NV/cuda_runtime/lib/libcudart.so.12" "$d/opt/vgpu/lib/"
    for lib in $(ldd "$NV/cuda_runtime/lib/libcudart.so.12" | grep -oE '/[^ ]+\.so[^ ]*'); do
        install -D -m 0755 "$lib" "$d$lib"
    done
    cp "$SAMPLES/runtime_probe.ptx" "$d/opt/vgpu/kernels/"
}

# 2. L2: the guest our VMM boots.
L2="$OUT/l2-root"
base_tree "$L2"
install_vgpu_userspace "$L2"
# Resolved first: a failure inside $(...) in a for list would go unnoticed.
# nvme: the guest's driver for a passthrough NVMe device (scenarios/vfio.sh);
# ahci and sd_mod: for a passthrough AHCI controller, which has MSI and no
# MSI-X (scenarios/vfio-msi.sh).
l2_mods="$(mods virtio_pci virtio-rng virtio-gpu nvme ahci sd_mod)"
i=0
for f in $l2_mods; do
    i=$((i + 1))
    cp "$f" "$L2/modules/$(printf '%02d' $i)-$(basename "$f")"
done
install -m 0755 "$ROOT/images/nested/l2-init" "$L2/init"
pack "$L2" "$OUT/l2.cpio.gz"

# 2b. L2 as a provider's VM boots: a root disk and a small boot initramfs.
# The boot initramfs loads only what mounting the disk needs (virtio-blk,
# ext4); the disk holds the L2 tree with l2-init as /sbin/init and the
# other modules (virtio-gpu, virtio-net, virtio-rng). mkfs.ext4 -d fills
# the image without root or a loop device.
BOOT="$OUT/l2-boot-root"
base_tree "$BOOT"
mkdir -p "$BOOT/newroot"
boot_mods="$(mods virtio_pci virtio_blk crc32c_generic ext4)"
i=0
for f in $boot_mods; do
    i=$((i + 1))
    cp "$f" "$BOOT/modules/$(printf '%02d' $i)-$(basename "$f")"
done
install -m 0755 "$ROOT/images/nested/l2-boot-init" "$BOOT/init"
pack "$BOOT" "$OUT/l2-boot.cpio.gz"
DISK="$OUT/l2-disk-root"
rm -rf "$DISK"
cp -a "$L2" "$DISK"
rm -f "$DISK"/modules/*.ko "$DISK/init"
disk_mods="$(mods virtio-rng virtio-gpu virtio_net | grep -vxF -e "$boot_mods" || true)"
i=0
for f in $disk_mods; do
    i=$((i + 1))
    cp "$f" "$DISK/modules/$(printf '%02d' $i)-$(basename "$f")"
done
install -m 0755 "$ROOT/images/nested/l2-init" "$DISK/sbin/init"
rm -f "$OUT/l2-root.img"
mkfs.ext4 -q -F -L vgpu-root -d "$DISK" "$OUT/l2-root.img" 96M

# 3. L1: the host our VMM runs in.
L1="$OUT/l1-root"
base_tree "$L1"
# vfio, vfio_iommu_type1, vfio-pci: passthrough (scenarios/vfio.sh, run-vfio.sh).
# No nvme in modules/: L1 leaves the NVMe device unbound for vfio-pci to
# take (scenarios/vfio.sh).
l1_mods="$(mods kvm-amd tun bridge vfio vfio_iommu_type1 vfio-pci)"
i=0
for f in $l1_mods; do
    i=$((i + 1))
    cp "$f" "$L1/modules/$(printf '%02d' $i)-$(basename "$f")"
done
# The nvme driver, loaded only by scenarios/vfio-pool.sh: there the NVMe
# device starts on L1's own driver, which the mediator unbinds to lend it
# and binds it back to on return.
mkdir -p "$L1/optional"
i=0
for f in $(mods nvme); do
    i=$((i + 1))
    cp "$f" "$L1/optional/$(printf '%02d' $i)-$(basename "$f")"
done
copy_prog "$BIN/vgpu-vmm" "$L1"
copy_prog "$BIN/vgpuctl" "$L1"
copy_prog "$BIN/vgpu-mediatord" "$L1"
install_vgpu_userspace "$L1"
# Device workers drop to the system user vgpu (devices.worker_user).
mkdir -p "$L1/etc"
printf 'root:x:0:0:root:/root:/bin/sh\nvgpu:x:999:999::/nonexistent:/bin/false\n' > "$L1/etc/passwd"
printf 'root:x:0:\nvgpu:x:999:\n' > "$L1/etc/group"
mkdir -p "$L1/l2" "$L1/scenarios"
cp "$VMLINUZ" "$L1/l2/vmlinuz"
cp "$OUT/l2.cpio.gz" "$L1/l2/initrd"
cp "$OUT/l2-boot.cpio.gz" "$L1/l2/boot-initrd"
cp "$OUT/l2-root.img" "$L1/l2/root.img"
# Managed VMs' VMMs run jailed as vgpu by default (docs/vms.md): the kernel
# and initramfs must be readable by it (Debian's vmlinuz may be 0600); the
# scenarios give it the disks they write.
chmod 0644 "$L1"/l2/*
cp "$ROOT"/images/nested/scenarios/*.sh "$L1/scenarios/"
# The test double of NVIDIA's driver (testdriver/, tests only), for the
# `cudadouble` scenario: the cuda backend and its executors in L1 without
# a GPU. Only that scenario puts it on a library path.
mkdir -p "$L1/opt/testdriver"
strip -o "$L1/opt/testdriver/libcuda.so.1" "$BIN/libvgpu_testdriver.so"
ln -sf libcuda.so.1 "$L1/opt/testdriver/libnvidia-ml.so.1"
for lib in $(ldd "$BIN/libvgpu_testdriver.so" | grep -oE '/[^ ]+\.so[^ ]*'); do
    install -D -m 0755 "$lib" "$L1$lib"
done
# QEMU as a second L1 VMM, only for the VMM comparison
# (scripts/compare-vmms.sh, NESTED_WITH_QEMU=1): the same L2 under QEMU
# with -enable-kvm, to tell the emulator's faults from ours. About 60 MiB,
# so the default image goes without it.
if [ "${NESTED_WITH_QEMU:-0}" = 1 ]; then
    copy_prog "$(command -v qemu-system-x86_64)" "$L1"
    mkdir -p "$L1/usr/share/qemu"
    for f in /usr/share/seabios/bios-256k.bin /usr/share/qemu/linuxboot_dma.bin /usr/share/qemu/kvmvapic.bin; do
        cp -L "$f" "$L1/usr/share/qemu/"
    done
fi
install -m 0755 "$ROOT/images/nested/l1-init" "$L1/init"
pack "$L1" "$OUT/l1.cpio.gz"
echo "nested: built $OUT/l1.cpio.gz ($(du -h "$OUT/l1.cpio.gz" | cut -f1)) for kernel $KVER" >&2
