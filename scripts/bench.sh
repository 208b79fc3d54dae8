#!/usr/bin/env bash
# The scale benchmark (not part of scripts/test.sh): builds the control plane
# (from cache when warm) and release binaries, then runs vkd-bench, which starts
# its own cluster, runs vkd on the zero-latency sim and prints one line of
# figures per target. Arguments go to vkd-bench (`--pods 10000`, `--help`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
e2e/cluster build >/dev/null
cargo build --release --locked -p vkd -p vkd-bench
exec target/release/vkd-bench "$@"
