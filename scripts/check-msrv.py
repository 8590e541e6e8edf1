#!/usr/bin/env python3
"""Checks that the workspace's rust-version is true: every member declares
it, and no dependency in Cargo.lock needs a newer Rust. (Standard library
APIs newer than it are caught by clippy's incompatible_msrv lint, which
scripts/test.sh runs with -D warnings.)"""
import json
import subprocess
import sys


def version(v):
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


meta = json.loads(subprocess.run(["cargo", "metadata", "--format-version", "1", "--locked"], check=True, capture_output=True, text=True).stdout)
members = set(meta["workspace_members"])
ours = {p["rust_version"] for p in meta["packages"] if p["id"] in members}
bad = []
if len(ours) != 1 or None in ours:
    bad.append(f"workspace members declare different rust-versions: {sorted(map(str, ours))} (each needs rust-version.workspace = true)")
msrv = version(next(iter(ours)) or "0")
for p in meta["packages"]:
    need = p.get("rust_version")
    if p["id"] not in members and need and version(need) > msrv:
        bad.append(f"{p['name']} {p['version']} needs Rust {need}")
if bad:
    print("rust-version " + next(iter(ours)) + " is not true:", *bad, sep="\n  ", file=sys.stderr)
    sys.exit(1)
print("rust-version " + next(iter(ours)) + ": every member declares it and no locked dependency needs more")
