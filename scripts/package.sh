#!/usr/bin/env bash
# Builds the host's Debian package, target/package/vgpu_VERSION-1_amd64.deb,
# from the workspace's release build (made first if missing), with
# cargo-deb (installed from crates.io, pinned, if missing, by
# scripts/cargo-tools.sh). Prints the package's path. docs/install.md,
# "From the Debian package".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/cargo-tools.sh deb >&2
for f in vgpu-mediatord vgpu-vmm vgpuctl vgpu-smi vgpu-k8s libcuda.so; do
    if [ ! -e "target/release/$f" ]; then
        cargo build --release --workspace >&2
        break
    fi
done
OUT=target/package
STAGE=target/release/deb-staging
rm -rf "$OUT" "$STAGE"
mkdir -p "$OUT" "$STAGE/links"
# What is generated rather than kept: the unit with the package's paths,
# the manual pages and completions from vgpuctl's definition, and the
# libraries' other names.
sed 's|/usr/local/bin/|/usr/bin/|g' packaging/systemd/vgpu-mediatord.service > "$STAGE/vgpu-mediatord.service"
target/release/vgpuctl man --dir "$STAGE/man" >/dev/null
gzip -9n "$STAGE"/man/*.1
target/release/vgpuctl completions bash > "$STAGE/vgpuctl.bash"
target/release/vgpuctl completions zsh > "$STAGE/_vgpuctl"
ln -s libcuda.so "$STAGE/links/libcuda.so.1"
ln -s libcuda.so "$STAGE/links/libnvidia-ml.so.1"
# Stripped: the release build keeps debug info for backtraces here.
cargo deb -p vgpu-mediator --no-build --strip --output "$OUT/" >&2
ls "$OUT"/vgpu_*.deb
