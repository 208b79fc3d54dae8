#!/usr/bin/env bash
# The whole test suite: builds the control plane (from cache when warm), then the
# gates (format, clippy with the workspace lints as errors, the dependency audit)
# and every unit, conformance and end-to-end test in the workspace.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
e2e/cluster build >/dev/null
# metrics-server, Prometheus and kube-state-metrics (tests/e2e_metrics.rs), the
# Python example plugin's grpcio (tests/provider_plugins.rs) and Debian's Slurm
# (the Slurm provider's test cluster) are set up beside the gates, into the cache
# the suites read (they wait on the cache's lock); the log is kept for when a
# suite's own build fails.
mkdir -p target
{ e2e/cluster build-slurm && e2e/cluster build-metrics-server && e2e/cluster build-monitoring \
    && e2e/cluster build-python-plugin; } >target/metrics-build.log 2>&1 &
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
scripts/deny.sh
cargo test --workspace --locked "$@"
