#!/usr/bin/env bash
# The main job: a local control plane, vkd on the default provider, and the demo
# workload (the Deployment of manifests/examples/external-http.yaml).
#
#   scripts/demo.sh           run it and keep it up until Ctrl-C
#   scripts/demo.sh --check   run it, show the result, and tear it down (exit 0 on success)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
check=false
[[ ${1:-} == --check ]] && check=true

dir=${VKD_DEMO_DIR:-$PWD/.demo}
node=vk-demo
e2e/cluster build >/dev/null
cargo build --locked --bin vkd
[[ -f $dir/env ]] && e2e/cluster down --dir "$dir" >/dev/null 2>&1 || true
rm -rf "$dir"
e2e/cluster up --dir "$dir"
eval "$(e2e/cluster env --dir "$dir")"
kubectl() { "$VKD_E2E_KUBECTL" "$@"; }

target/debug/vkd run --node-name "$node" --provider sim \
  --provider-config testdata/fleets/demo.yaml --state-dir "$dir/state" \
  --node-label platform.example.com/execution=external \
  --node-taint platform.example.com/execution=external:NoSchedule \
  --client-ca-file "$VKD_E2E_KUBELET_CLIENT_CA" \
  >"$dir/logs/vkd.log" 2>&1 &
vkd_pid=$!
cleanup() {
  kill "$vkd_pid" 2>/dev/null || true
  wait "$vkd_pid" 2>/dev/null || true
  e2e/cluster down --dir "$dir"
}
trap cleanup EXIT

for _ in $(seq 60); do kubectl get node "$node" >/dev/null 2>&1 && break; sleep 0.5; done
kubectl wait --for=condition=Ready "node/$node" --timeout=60s
kubectl apply -f manifests/examples/external-http.yaml
kubectl -n platform-demo rollout status deployment/external-http --timeout=120s
echo
kubectl get nodes -o wide
echo
kubectl -n platform-demo get pods -o wide
echo
pod=$(kubectl -n platform-demo get pods -o name | head -1)
echo "# kubectl logs $pod --tail=3"
kubectl -n platform-demo logs "$pod" --tail=3
echo "# kubectl exec $pod -- echo hello from the virtual node"
kubectl -n platform-demo exec "$pod" -- echo hello from the virtual node
echo
echo "# what the backend runs (vkd sim list):"
target/debug/vkd sim list --state-dir "$dir/state" --node "$node"
echo
if $check; then
  running=$(target/debug/vkd sim list --json --state-dir "$dir/state" --node "$node" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')
  [[ $running == 6 ]] || { echo "demo: expected 6 instances, found $running" >&2; exit 1; }
  [[ $(kubectl -n platform-demo exec "$pod" -- echo ok) == ok ]] || { echo "demo: exec failed" >&2; exit 1; }
  kubectl -n platform-demo logs "$pod" --tail=1 | grep -q "line" || { echo "demo: logs failed" >&2; exit 1; }
  echo "demo: ok"
  exit 0
fi
cat <<MSG
The demo is up. In another shell:
  export KUBECONFIG=$dir/kubeconfig
  $VKD_E2E_KUBECTL -n platform-demo get pods
  target/debug/vkd sim list --state-dir $dir/state
vkd's log: $dir/logs/vkd.log. Press Ctrl-C to stop everything.
MSG
wait "$vkd_pid"
