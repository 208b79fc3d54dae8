#!/usr/bin/env bash
# The whole test suite: builds the control plane (from cache when warm), then runs
# every unit, conformance and end-to-end test in the workspace.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
e2e/cluster build >/dev/null
cargo fmt --all -- --check
cargo test --workspace --locked "$@"
