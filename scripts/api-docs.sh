#!/bin/sh
# Writes docs/api/mediator.yaml and docs/api/vmm.yaml from the daemons' API
# types and routes (the tests that check them write them instead when
# VGPU_WRITE_API_DOCS is set). Commit the result with the change that made it.
set -e
cd "$(dirname "$0")/.."
VGPU_WRITE_API_DOCS=1 cargo test --release -p vgpu-mediator --lib -- document::
VGPU_WRITE_API_DOCS=1 cargo test --release -p vmm --lib -- document::
git --no-pager diff --stat -- docs/api
