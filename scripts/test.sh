#!/usr/bin/env bash
# Runs every test in the workspace: unit tests, the decoder property tests
# (the fuzz target's CI form), and the end-to-end tests that start
# vgpu-mediatord and run the C samples through libcuda.so.1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
# Tests start many short-lived daemons; 2 test threads fit the 2-core machines.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
SKIPS="$ROOT/target/release/skipped-tests.txt"
rm -f "$SKIPS"
status=0
cargo test --release --workspace --no-fail-fast || status=$?
if [ -s "$SKIPS" ]; then
    echo
    echo "*** $(wc -l < "$SKIPS") test(s) skipped on this machine, and why:"
    sort "$SKIPS" | sed 's/^/***   /'
fi
exit $status
