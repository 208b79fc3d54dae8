#!/usr/bin/env bash
# Kubelet API benchmark through the real apiserver and kubectl (not part of the
# test run): logs throughput, exec stdout throughput and exec round-trip latency,
# over WebSocket (kubectl's default, translated to SPDY by the apiserver) and SPDY.
#
#   scripts/bench-kubelet-api.sh [ROUNDS]     (default 20 exec round trips per protocol)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-20}
dir=$(mktemp -d /tmp/vkd-bench-kapi.XXXX)
e2e/cluster build >/dev/null
cargo build --release --locked --bin vkd 2>&1 | tail -1
e2e/cluster up --dir "$dir" >/dev/null
eval "$(e2e/cluster env --dir "$dir")"
k() { "$VKD_E2E_KUBECTL" "$@"; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
target/release/vkd run --node-name vk-bench --provider-config testdata/fleets/demo.yaml \
  --state-dir "$dir/state" --kubelet-port "$port" --admin-port 0 \
  --client-ca-file "$VKD_E2E_KUBELET_CLIENT_CA" >"$dir/logs/vkd.log" 2>&1 &
vkd=$!
trap 'kill $vkd 2>/dev/null; e2e/cluster down --dir "$dir" >/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 60); do k get node vk-bench >/dev/null 2>&1 && break; sleep 0.5; done
k wait --for=condition=Ready node/vk-bench --timeout=60s >/dev/null
cat <<YAML | k apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: bench, annotations: {sim.vkd.io/log-interval: 100us}}
spec:
  tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
  containers: [{name: main, image: example/bench:1}]
YAML
k wait --for=condition=Ready pod/bench --timeout=60s >/dev/null
sleep 11   # 100k lines of history at 100us each (the sim keeps the newest 100k)

now() { python3 -c 'import time; print(time.monotonic())'; }
t0=$(now); bytes=$(k logs bench | wc -c); t1=$(now)
python3 -c "b=$bytes; t=$t1-$t0; print(f'logs: {b} bytes in {t:.2f}s = {b/t/1e6:.1f} MB/s through kubectl logs')"
for proto in websocket spdy; do
  [[ $proto == spdy ]] && export KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false || unset KUBECTL_REMOTE_COMMAND_WEBSOCKETS
  t0=$(now); out=$(k exec bench -- yes 5000000 | wc -c); t1=$(now)
  python3 -c "b=$out; t=$t1-$t0; print(f'exec stdout ($proto): {b} bytes in {t:.2f}s = {b/t/1e6:.1f} MB/s')"
  t0=$(now); for _ in $(seq "$rounds"); do k exec bench -- true; done; t1=$(now)
  python3 -c "t=($t1-$t0)/$rounds; print(f'exec round trip ($proto): {t*1000:.0f} ms mean over $rounds runs of kubectl exec -- true (includes kubectl start-up)')"
done
