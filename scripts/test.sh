#!/usr/bin/env bash
# The whole test suite: builds the control plane (from cache when warm), then the
# gates (format, clippy with the workspace lints as errors, the dependency audit)
# and every unit, conformance and end-to-end test in the workspace.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
e2e/cluster build >/dev/null
# metrics-server (tests/e2e_metrics.rs) compiles beside the gates, into the same
# cache the suite reads; its log is kept for when the suite's own build fails.
mkdir -p target
e2e/cluster build-metrics-server >target/metrics-server-build.log 2>&1 &
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
scripts/deny.sh
cargo test --workspace --locked "$@"
