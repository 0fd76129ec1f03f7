#!/usr/bin/env bash
# The main job on one machine: a real local control plane with fake GPU nodes, the chart installed, the operator
# running as the chart's ServiceAccount, three real CPU cells on SmolLM2-135M-Instruct (a narrow cell with prefix
# reuse, its real baseline without it, and a cell the gates reject), each certified by the operator's Jobs against its
# baseline, Sessions bound to the certified winner and (pinned) to the baseline, then a real multi-turn agent exchange
# through each bound endpoint, with each cell's end-to-end turn p50 / p90 / p95.
# The cluster stays up afterwards for exploring: `export KUBECONFIG=$(MODELD_CLUSTER=demo hack/cluster env ...)`;
# stop it with `MODELD_CLUSTER=demo hack/cluster down`.
set -o errexit -o nounset -o pipefail
cd "$(dirname "$0")/.."
export MODELD_CLUSTER=${MODELD_CLUSTER:-demo} MODELD_PORT_BASE=${MODELD_PORT_BASE:-28440}
export MODELD_POD_CIDR=${MODELD_POD_CIDR:-127.40.0.0/16}
NS=${MODELD_DEMO_NAMESPACE:-agents}

hack/setup.sh
hack/cluster up
bin=$(hack/build-tools.sh | tail -1)
dir=$HOME/.cache/modeld/clusters/$MODELD_CLUSTER
export KUBECONFIG=$dir/kubeconfig
k() { "$bin/kubectl" "$@"; }

echo "== helm install modeld"
"$bin/helm" upgrade --install modeld charts/modeld -n modeld-system --create-namespace \
  --set operator.statusIntervalSeconds=2 >/dev/null
k wait --for=condition=Established crd/cells.modeld.contenox.io crd/sessions.modeld.contenox.io --timeout=60s >/dev/null

echo "== the operator, as the chart's ServiceAccount (its RBAC and no more)"
operator_kubeconfig=$(hack/cluster sa-kubeconfig modeld-system modeld)
if ! { [[ -f $dir/operator.pid ]] && kill -0 "$(cat "$dir/operator.pid")" 2>/dev/null; }; then
  # Sessions bind only to certified cells (the default): the session waits for certification, then goes to the winner.
  KUBECONFIG=$operator_kubeconfig MODELD_STATUS_INTERVAL=2 MODELD_METRICS_PORT=0 MODELD_LOG_FORMAT=plain \
    setsid .venv/bin/python -m modeld_operator >"$dir/operator.log" 2>&1 < /dev/null &
  echo $! > "$dir/operator.pid"
fi

echo "== a narrow CPU cell (prefix reuse), its real baseline (no reuse) and a cell the gates reject, in namespace $NS"
k create namespace "$NS" --dry-run=client -o yaml | k apply -f - >/dev/null
k apply -n "$NS" -f examples/cell-cpu-noreuse.yaml -f examples/cell-cpu.yaml -f examples/cell-cpu-fp16kv.yaml
# The HGX and L40S cells are accepted but not served by this worker version (multi-rank shapes): they show Refused with
# the field and the nodes their topology fits, and get no pods (kubectl get cells -o wide shows the reason).
k apply -n "$NS" -f examples/cell-h100-nvswitch.yaml -f examples/cell-l40s-pcie.yaml
CELLS="cell/smollm2-cpu cell/smollm2-cpu-noreuse cell/smollm2-cpu-fp16kv"
k wait -n "$NS" --for=jsonpath='{.status.phase}'=Ready $CELLS --timeout=600s >/dev/null
echo "== certification Jobs measure each cell against its baseline (a few minutes on 2 cores)"
k wait -n "$NS" --for=jsonpath='{.status.certification.measuredAt}' $CELLS --timeout=1800s >/dev/null
echo "== agent Sessions, once every verdict is in: the operator binds agent-1 to the certified winner, and"
echo "   agent-baseline (pinned) to the baseline, to compare the two end to end"
k apply -n "$NS" -f examples/session.yaml -f examples/session-baseline.yaml
k wait -n "$NS" --for=jsonpath='{.status.phase}'=Bound session/agent-1 session/agent-baseline --timeout=120s >/dev/null
k get -n "$NS" cells,sessions -o wide
echo
echo "== the certification matrix"
.venv/bin/python hack/matrix.py --kubectl "$bin/kubectl" --namespace "$NS"
echo
echo "== why session/agent-1 is where it is (every cell the binding considered)"
k get -n "$NS" session/agent-1 -o jsonpath='{range .status.candidates[*]}{.cell}{"\t"}{.chosen}{"\t"}{.reason}{"\n"}{end}'
echo
echo "== a real multi-turn agent exchange through each bound session"
.venv/bin/python hack/demo.py --kubectl "$bin/kubectl" --namespace "$NS" --session agent-1 --session agent-baseline --stateless
echo
echo "cluster left running: export KUBECONFIG=$KUBECONFIG; stop it with: MODELD_CLUSTER=$MODELD_CLUSTER hack/cluster down"
