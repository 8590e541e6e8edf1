#!/usr/bin/env bash
# Runs the README's "Using it by hand" block exactly as written (from the
# repository root, as a new user would) and checks that the sample passed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
block="$(awk '/^## Using it by hand/{f=1; next} f && /^```sh/{g=1; next} g && /^```/{exit} g' README.md)"
[ -n "$block" ] || { echo "check-readme: no sh block under 'Using it by hand' in README.md" >&2; exit 1; }
pkill -f "vgpu-mediatord --run-dir /tmp/vgpu( |$)" 2>/dev/null || true
# A new user's machine has no /tmp/vgpu: drop what an earlier run left
# (its state directory would bring alice back and the create would fail).
for _ in 1 2 3 4 5 6 7 8 9 10; do pgrep -f "vgpu-mediatord --run-dir /tmp/vgpu( |$)" >/dev/null || break; sleep 0.5; done
rm -rf /tmp/vgpu
out="$(mktemp)"
trap 'rm -f "$out" vectorAdd; pkill -f "vgpu-mediatord --run-dir /tmp/vgpu( |$)" 2>/dev/null || true' EXIT
if ! bash -euo pipefail -c "$block" >"$out" 2>&1; then
    cat "$out" >&2
    echo "check-readme: the README's by-hand steps failed" >&2
    exit 1
fi
if ! grep -q "vectorAdd: PASSED" "$out"; then
    cat "$out" >&2
    echo "check-readme: the by-hand steps ran, but vectorAdd did not pass" >&2
    exit 1
fi
echo "check-readme: the README's by-hand steps work as written"
