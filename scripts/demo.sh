#!/usr/bin/env bash
# The main job: a local control plane, vkd on the default (process) provider, and
# the demo workload of manifests/examples/process-web.yaml: an HTTP server with a
# readiness probe, run as a host process, with its logs and an exec shown.
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

# Pods run as host processes, as nobody when this runs as root: their state goes
# under the temp dir, which every user can traverse (a checkout in a private home
# directory would not be).
state=$(mktemp -d "${TMPDIR:-/tmp}/vkd-demo-state.XXXXXX")
chmod 755 "$state"
target/debug/vkd run --node-name "$node" --provider process \
  --provider-config testdata/process/e2e.yaml --state-dir "$state" \
  --node-label platform.example.com/execution=process \
  --node-taint platform.example.com/execution=process:NoSchedule \
  --allowed-namespace process-demo \
  --client-ca-file "$VKD_E2E_KUBELET_CLIENT_CA" \
  >"$dir/logs/vkd.log" 2>&1 &
vkd_pid=$!
cleanup() {
  # Delete the workload while vkd runs, so it stops the processes it started.
  "$VKD_E2E_KUBECTL" delete namespace process-demo --wait=true --timeout=60s >/dev/null 2>&1 || true
  kill "$vkd_pid" 2>/dev/null || true
  wait "$vkd_pid" 2>/dev/null || true
  e2e/cluster down --dir "$dir"
  rm -rf "$state"
}
trap cleanup EXIT

for _ in $(seq 60); do kubectl get node "$node" >/dev/null 2>&1 && break; sleep 0.5; done
kubectl wait --for=condition=Ready "node/$node" --timeout=60s
kubectl apply -f manifests/examples/process-web.yaml
kubectl -n process-demo rollout status deployment/web --timeout=120s
echo
kubectl get nodes -o wide
echo
kubectl -n process-demo get pods -o wide
echo
pod=$(kubectl -n process-demo get pods -o name | head -1)
echo "# kubectl exec $pod -- sh -c '...'   (who runs it, and the page it serves)"
kubectl -n process-demo exec "$pod" -- sh -c 'echo "running as $(id -un) in $PWD"; python3 -c "import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:18480/\").read().decode(), end=\"\")"'
echo "# kubectl logs $pod --tail=3   (the readiness probe's requests)"
kubectl -n process-demo logs "$pod" --tail=3
echo
echo "# what the backend runs (vkd process list):"
target/debug/vkd process list --state-dir "$state" --node "$node"
echo
if $check; then
  running=$(target/debug/vkd process list --json --state-dir "$state" --node "$node" \
    | python3 -c 'import json,sys; print(sum(len(r["processes"]) for r in json.load(sys.stdin)))')
  [[ $running == 1 ]] || { echo "demo: expected 1 running process, found $running" >&2; exit 1; }
  page=$(kubectl -n process-demo exec "$pod" -- python3 -c 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:18480/").read().decode())')
  [[ $page == *"hello from a process Pod"* ]] || { echo "demo: exec/http failed: $page" >&2; exit 1; }
  kubectl -n process-demo logs "$pod" --tail=5 | grep -q '"GET / HTTP/1.1" 200' || { echo "demo: logs failed" >&2; exit 1; }
  echo "demo: ok"
  exit 0
fi
cat <<MSG
The demo is up. In another shell:
  export KUBECONFIG=$dir/kubeconfig
  $VKD_E2E_KUBECTL -n process-demo get pods
  $VKD_E2E_KUBECTL -n process-demo exec deploy/web -- sh -c 'ls -l \$VKD_POD_ROOT/srv/www'
  target/debug/vkd process list --state-dir $state
vkd's log: $dir/logs/vkd.log. Press Ctrl-C to stop everything.
MSG
wait "$vkd_pid"
