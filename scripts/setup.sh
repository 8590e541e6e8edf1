#!/usr/bin/env bash
# Installs what building and testing the workspace needs on a fresh Debian
# machine of this kind, then builds the workspace once (release profile).
# Sourced by demo.sh and test.sh; safe to run again.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

need_pkgs=()
command -v cc >/dev/null 2>&1 || need_pkgs+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need_pkgs+=(pkg-config)
command -v objdump >/dev/null 2>&1 || need_pkgs+=(binutils)
# The NVRTC suite's virtual environment (below).
command -v python3 >/dev/null 2>&1 || need_pkgs+=(python3)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_pkgs+=(python3-venv)
if ((${#need_pkgs[@]})); then
    echo "setup: installing ${need_pkgs[*]}" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# Device workers drop to this unprivileged user once their device is open
# (devices.worker_user in the mediator's configuration).
if [ "$(id -u)" -eq 0 ] && ! getent passwd vgpu >/dev/null; then
    echo "setup: creating the system user vgpu for device workers" >&2
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vgpu
fi

# The nested test host: QEMU 10 (bookworm-backports), busybox, cpio.
bash "$ROOT/images/nested/packages.sh"

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: cargo is missing; install a Rust toolchain (rustup) first" >&2
        exit 1
    fi
fi

# rustfmt and clippy for the test command's gates (rustup's default
# profile has them; a minimal one does not).
for c in rustfmt clippy; do
    if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then
        rustup component add "$c"
    fi
done

# One build, shared by the demo, the tests and the benchmark.
echo "setup: building the workspace (release)" >&2
cargo build --release --workspace --manifest-path "$ROOT/Cargo.toml"
# The test suite's cargo subcommands (cargo-deb for the package check,
# cargo-fuzz for the fuzz smoke) build in the background, beside the
# Python environments below, which leave a core mostly idle; setup waits
# for them at the end.
if [ "${VGPU_SETUP_FOR:-}" = tests ]; then
    "$ROOT/scripts/cargo-tools.sh" &
    tools_install=$!
fi

# The NVRTC suite (tests/nvrtc, tests/tests/nvrtc_suite.rs) and the CUDA
# stacks (tests/stacks, tests/tests/cuda_stacks.rs): NVRTC, the CUDA runtime
# and headers, numba-cuda and CuPy from PyPI, pinned in the requirements
# files, in one virtual environment (pip runs only when the
# pins changed), then the suite's CUDA C++ kernels compiled to PTX for
# compute_70/80/90 in target/nvrtc (only what changed is compiled again).
PYENV="$ROOT/target/pyenv"
REQS=("$ROOT/tests/nvrtc/requirements.txt" "$ROOT/tests/stacks/requirements.txt")
# cuBLAS for CuPy's matmul: the test suite alone needs it (test.sh sets
# VGPU_SETUP_FOR=tests).
if [ "${VGPU_SETUP_FOR:-}" = tests ]; then
    REQS+=("$ROOT/tests/stacks/requirements-cublas.txt")
fi
if [ ! -x "$PYENV/bin/python" ] || ! cat "${REQS[@]}" | cmp -s - "$PYENV/.requirements"; then
    echo "setup: installing the NVRTC suite's and the CUDA stacks' packages in target/pyenv" >&2
    [ -x "$PYENV/bin/python" ] || python3 -m venv "$PYENV"
    "$PYENV/bin/pip" install --quiet --disable-pip-version-check "${REQS[@]/#/--requirement=}"
    cat "${REQS[@]}" > "$PYENV/.requirements"
fi
# Two more environments the test suite alone needs (test.sh sets
# VGPU_SETUP_FOR=tests; the demo does without them).
if [ "${VGPU_SETUP_FOR:-}" = tests ]; then
    # CuPy for CUDA 13 in an environment of its own (both CuPy builds are the
    # `cupy` module), pinned in tests/stacks/requirements-cuda13.txt.
    PYENV13="$ROOT/target/pyenv13"
    REQS13="$ROOT/tests/stacks/requirements-cuda13.txt"
    if [ ! -x "$PYENV13/bin/python" ] || ! cmp -s "$REQS13" "$PYENV13/.requirements"; then
        echo "setup: installing CuPy for CUDA 13 in target/pyenv13" >&2
        [ -x "$PYENV13/bin/python" ] || python3 -m venv "$PYENV13"
        "$PYENV13/bin/pip" install --quiet --disable-pip-version-check -r "$REQS13"
        cp "$REQS13" "$PYENV13/.requirements"
    fi
    # PyTorch (PyPI's default wheel) in an environment of its own, pinned in
    # tests/stacks/requirements-torch.txt: about 3 GiB to fetch the first time
    # (pip's cache keeps it for the next setup), 5 GiB installed. It
    # installs in the background while the steps below run (about 2
    # minutes from pip's cache, on one core); setup waits for it at the end.
    PYENVTORCH="$ROOT/target/pyenvtorch"
    REQSTORCH="$ROOT/tests/stacks/requirements-torch.txt"
    if [ ! -x "$PYENVTORCH/bin/python" ] || ! cmp -s "$REQSTORCH" "$PYENVTORCH/.requirements"; then
        echo "setup: installing PyTorch in target/pyenvtorch (about 3 GiB to fetch the first time), beside the steps that follow" >&2
        rm -f "$PYENVTORCH/.requirements"
        (
            [ -x "$PYENVTORCH/bin/python" ] || python3 -m venv "$PYENVTORCH"
            "$PYENVTORCH/bin/pip" install --quiet --disable-pip-version-check -r "$REQSTORCH"
            cp "$REQSTORCH" "$PYENVTORCH/.requirements"
        ) &
        torch_install=$!
    fi
fi
echo "setup: compiling the NVRTC suite's kernels (target/nvrtc)" >&2
"$PYENV/bin/python" "$ROOT/scripts/nvrtc-compile.py"

# The API conformance check (tests/api/conformance.py, run by test.sh):
# schemathesis from PyPI, pinned in tests/api/requirements.txt, in a
# virtual environment of its own (pip runs only when the pins changed).
# Where it cannot be installed, setup goes on and test.sh skips the check,
# loudly; the check runs only once target/apienv/.requirements matches.
APIENV="$ROOT/target/apienv"
APIREQS="$ROOT/tests/api/requirements.txt"
if [ ! -x "$APIENV/bin/python" ] || ! cmp -s "$APIREQS" "$APIENV/.requirements"; then
    echo "setup: installing the API conformance check's packages (schemathesis) in target/apienv" >&2
    rm -f "$APIENV/.requirements"
    if { [ -x "$APIENV/bin/python" ] || python3 -m venv "$APIENV"; } \
        && "$APIENV/bin/pip" install --quiet --disable-pip-version-check -r "$APIREQS"; then
        cp "$APIREQS" "$APIENV/.requirements"
    else
        echo "setup: could not install tests/api/requirements.txt in target/apienv; scripts/test.sh will skip the API conformance check" >&2
    fi
fi

# The bare-metal KVM-tier guest: its own crate, target flags and linker script.
echo "setup: building images/test-guest" >&2
(cd "$ROOT/images/test-guest" && cargo build --release --quiet 2>/dev/null) || (cd "$ROOT/images/test-guest" && cargo build --release)

# Debian's kernel package and the L1/L2 initramfs images of the nested tier.
echo "setup: building the nested test host images" >&2
bash "$ROOT/images/nested/build.sh"

if [ -n "${tools_install:-}" ]; then
    wait "$tools_install" || { echo "setup: installing cargo-deb and cargo-fuzz failed (cargo's output is above)" >&2; exit 1; }
    unset tools_install
fi
if [ -n "${torch_install:-}" ]; then
    wait "$torch_install" || { echo "setup: installing PyTorch in target/pyenvtorch failed (its pip output is above)" >&2; exit 1; }
    unset torch_install
fi

# Programs link and load libcuda.so.1, as they would against NVIDIA's driver.
ln -sf libcuda.so "$ROOT/target/release/libcuda.so.1"
