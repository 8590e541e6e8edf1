#!/usr/bin/env bash
# Runs every test in the workspace: unit tests, the decoder property tests,
# the end-to-end tests that start vgpu-mediatord and run the C samples
# through libcuda.so.1, the API conformance check (tests/api/conformance.py)
# and the fuzz smoke (scripts/fuzz-smoke.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Disk: a first run on a fresh clone took about 13 GiB on 2026-11-29 (the
# Python environments 9, PyTorch's 5.4 of them; the build 1.4; the fuzz
# build 0.9; the nested test host's images 1; pip's and cargo's caches)
# and a run after it much less. Too little shows up late and obscurely ("No space left on device",
# a linker's "Bus error"), so it is said here first.
need_gib=15
[ -x "$ROOT/target/pyenvtorch/bin/python" ] && need_gib=6
free_gib=$(df -Pk "$ROOT" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "${free_gib:-0}" -lt "$need_gib" ]; then
    echo "*** test: only ${free_gib} GiB free on the disk that holds $ROOT; this run needs about ${need_gib} GiB. Expect build and test failures such as 'No space left on device' or ld's 'Bus error' (df -h $ROOT)." >&2
fi
# The suite's own Python environments too (CuPy for CUDA 13, PyTorch).
export VGPU_SETUP_FOR=tests
setup_started=$SECONDS
source "$ROOT/scripts/setup.sh"
setup_took=$((SECONDS - setup_started))
cd "$ROOT"
# Tests start many short-lived daemons; 2 test threads fit the 2-core machines.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
SKIPS="$ROOT/target/release/skipped-tests.txt"
rm -f "$SKIPS"
status=0
# Each step's wall time, printed at the end: where the suite's time goes.
TIMES=()
step() {
    local name="$1" t=$SECONDS rc=0
    shift
    "$@" || rc=$?
    TIMES+=("$(printf '%6d s  %s%s' $((SECONDS - t)) "$name" "$([ $rc -eq 0 ] || echo "  (failed: exit $rc)")")")
    [ $rc -eq 0 ] || status=$rc
}
# The gates: formatting, clippy with warnings as errors (which also holds
# the code to the workspace's rust-version), and that rust-version against
# the locked dependencies.
TIMES+=("$(printf '%6d s  %s' "$setup_took" "setup (scripts/setup.sh)")")
echo "test: cargo fmt --check" >&2
step "cargo fmt --check" cargo fmt --all -- --check
echo "test: cargo clippy -D warnings" >&2
step "cargo clippy" cargo clippy --release --workspace --all-targets -- -D warnings
step "rust-version check" python3 scripts/check-msrv.py
step "cargo test" cargo test --release --workspace --no-fail-fast
# The API conformance check: the served APIs against docs/api/*.yaml, with
# schemathesis (docs/api/README.md). Skipped, loudly, only where setup.sh
# could not install schemathesis.
if cmp -s tests/api/requirements.txt target/apienv/.requirements; then
    echo "test: API conformance (tests/api/conformance.py)" >&2
    step "API conformance" target/apienv/bin/python tests/api/conformance.py
else
    echo "SKIPPED API conformance check (tests/api/conformance.py): schemathesis could not be installed in target/apienv (see setup's output)" | tee -a "$SKIPS" >&2
fi
# The README's by-hand steps, exactly as written.
step "README steps" ./scripts/check-readme.sh
# The Debian package: built, unpacked into a clean root, and the README's
# steps run from its files (docs/install.md).
step "Debian package" ./scripts/check-package.sh
# The fuzz smoke: every cargo-fuzz target for 60 s from its committed corpus.
step "fuzz smoke" ./scripts/fuzz-smoke.sh
echo
echo "*** where the time went (wall clock, $((SECONDS / 60)) min in all):"
printf '***   %s\n' "${TIMES[@]}"
if [ -s "$SKIPS" ]; then
    echo
    echo "*** $(wc -l < "$SKIPS") test(s) skipped on this machine, and why:"
    sort "$SKIPS" | sed 's/^/***   /'
fi
exit $status
