#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (seconds, default 60 each).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../fuzz"
secs=${1:-60}
for target in spdy_frame spdy_headers websocket_channel logs_query; do
  echo "== $target (${secs}s)"
  cargo +nightly fuzz run "$target" -- -max_total_time="$secs" -rss_limit_mb=2048 2>&1 | grep -E "^(#[0-9]+ +DONE|Done|SUMMARY|==[0-9]+==ERROR)|panicked" || true
done
