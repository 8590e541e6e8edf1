#!/usr/bin/env bash
# Installs the cargo subcommands the scripts use, pinned, where the one on
# PATH is missing or of another version: cargo-deb (scripts/package.sh)
# and cargo-fuzz (scripts/fuzz-smoke.sh), built from crates.io.
#   scripts/cargo-tools.sh [deb] [fuzz]      (default: both)
set -euo pipefail
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(deb fuzz)
for t in "${tools[@]}"; do
    case "$t" in
        deb) version=3.8.0 ;;
        fuzz) version=0.13.2 ;;
        *)
            echo "cargo-tools: no tool \"$t\" (deb, fuzz)" >&2
            exit 2
            ;;
    esac
    if [ "$(cargo "$t" --version 2>/dev/null)" != "cargo-$t $version" ]; then
        echo "cargo-tools: installing cargo-$t $version" >&2
        cargo install "cargo-$t" --version "$version" --locked --quiet
    fi
done
