#!/usr/bin/env bash
# Installs what the nested test host needs: QEMU 10 from bookworm-backports
# (QEMU TCG with -cpu max,svm=on gives L1 a working kvm_amd), busybox,
# cpio and binutils. Safe to run again; sourced by scripts/setup.sh.
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
if ! qemu-system-x86_64 --version 2>/dev/null | grep -qE 'version (9|[1-9][0-9])\.'; then
    if [ ! -e /etc/apt/sources.list.d/backports.sources ] && ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
        echo "nested: adding the bookworm-backports apt source" >&2
        $SUDO tee /etc/apt/sources.list.d/backports.sources >/dev/null <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    need+=(qemu)
fi
command -v busybox >/dev/null 2>&1 || need+=(busybox-static)
command -v cpio >/dev/null 2>&1 || need+=(cpio)
command -v strings >/dev/null 2>&1 || need+=(binutils)
if ((${#need[@]})); then
    echo "nested: installing ${need[*]}" >&2
    $SUDO apt-get update -qq
    for p in "${need[@]}"; do
        if [ "$p" = qemu ]; then
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -t bookworm-backports qemu-system-x86 >/dev/null
        else
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$p" >/dev/null
        fi
    done
fi
