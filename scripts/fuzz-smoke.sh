#!/usr/bin/env bash
# The fuzz smoke CI runs: each cargo-fuzz target for FUZZ_SECS seconds
# (default 60), starting from the committed corpus in fuzz/seeds/TARGET.
# New inputs go to target/fuzz-corpus/TARGET (not committed); a crash
# leaves its input in fuzz/artifacts/TARGET and fails the run.
#   ./scripts/fuzz-smoke.sh [TARGET...]       (default: every target)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${FUZZ_SECS:-60}"
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "fuzz: the nightly toolchain is missing (rustup toolchain install nightly); cannot run the fuzz smoke" >&2
    exit 1
fi
scripts/cargo-tools.sh fuzz

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(decode ptx fatbin virtio_gpu)
echo "fuzz: building ${targets[*]} (nightly, AddressSanitizer)" >&2
cargo +nightly fuzz build -O
# libFuzzer runs on one thread: the targets run side by side, one a core
# (FUZZ_JOBS, default the core count), each still for SECS seconds.
jobs="${FUZZ_JOBS:-$(nproc)}"
[ "$jobs" -ge 1 ] 2>/dev/null || jobs=1
status=0
run_one() {
    local t="$1" work="$ROOT/target/fuzz-corpus/$1"
    mkdir -p "$work" "fuzz/seeds/$t"
    cargo +nightly fuzz run -O "$t" "$work" "fuzz/seeds/$t" -- -max_total_time="$SECS" -rss_limit_mb=4096 >"$ROOT/target/fuzz-$t.log" 2>&1
}
report() {
    local t="$1" rc="$2" log="$ROOT/target/fuzz-$1.log"
    if [ "$rc" -eq 0 ]; then
        echo "fuzz: $t: $(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1), no crash"
    else
        echo "fuzz: $t FAILED; the end of its log ($log):"
        tail -40 "$log"
        status=1
    fi
}
for ((i = 0; i < ${#targets[@]}; i += jobs)); do
    batch=("${targets[@]:i:jobs}")
    pids=()
    for t in "${batch[@]}"; do
        run_one "$t" &
        pids+=($!)
    done
    for k in "${!batch[@]}"; do
        rc=0
        wait "${pids[$k]}" || rc=$?
        report "${batch[$k]}" "$rc"
    done
done
exit $status
