"""Pure placement and fit decisions: where a Cell's pods may run, and which Cell a Session binds to.

No cluster access here: handlers gather Nodes, Pods and Cells, these functions decide, handlers act. Everything is
unit-tested without a cluster (LWS's planner/executor split).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import modeld_api as api


@dataclass(frozen=True)
class NodeView:
    name: str
    labels: dict[str, str]
    allocatable_gpus: int
    ready: bool
    unschedulable: bool = False

    @classmethod
    def from_obj(cls, node: dict[str, Any]) -> NodeView:
        meta, status, spec = node.get("metadata", {}), node.get("status", {}), node.get("spec", {})
        alloc = (status.get("allocatable") or {}).get(api.RESOURCE_GPU, "0")
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        return cls(
            name=meta["name"],
            labels=dict(meta.get("labels") or {}),
            allocatable_gpus=_int(alloc),
            ready=conditions.get("Ready") == "True",
            unschedulable=bool(spec.get("unschedulable")),
        )


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def any_link(spec: api.CellSpec) -> bool:
    """One GPU with interconnect none: the GPU is joined to nothing, so any GPU node's interconnect serves it."""
    return spec.topology.gpus == 1 and spec.topology.interconnect == api.Interconnect.none.value


def describe_topology(spec: api.CellSpec) -> str:
    topo = spec.topology
    if topo.gpus == 0:
        return "a CPU node (interconnect none)"
    text = "1 GPU (any interconnect)" if any_link(spec) else f"{topo.gpus} GPU{'s' if topo.gpus > 1 else ''} over {topo.interconnect}"
    if topo.products:
        text += f" ({' or '.join(topo.products)})"
    if topo.minGpuMemoryMiB:
        text += f" with at least {topo.minGpuMemoryMiB} MiB each"
    return text


def node_mismatch(spec: api.CellSpec, node: NodeView) -> str | None:
    """Why this node cannot host one pod of the cell, or None when it can (ignoring what other pods use)."""
    topo = spec.topology
    link = node.labels.get(api.LABEL_INTERCONNECT)
    if not any_link(spec):
        if link is None:
            return f"no {api.LABEL_INTERCONNECT} label"
        if link != topo.interconnect:
            return f"interconnect {link}"
    if topo.gpus:
        count = _int(node.labels.get(api.LABEL_GPU_COUNT))
        if count < topo.gpus:
            return f"{count} GPUs"
        product = node.labels.get(api.LABEL_GPU_PRODUCT, "")
        if topo.products and product not in topo.products:
            return f"GPU product {product or 'unknown'}"
        memory = _int(node.labels.get(api.LABEL_GPU_MEMORY))
        if topo.minGpuMemoryMiB and memory < topo.minGpuMemoryMiB:
            return f"{memory} MiB per GPU"
        if node.allocatable_gpus < topo.gpus:
            return f"{node.allocatable_gpus} allocatable GPUs"
    if node.unschedulable:
        return "cordoned"
    if not node.ready:
        return "not Ready"
    return None


@dataclass
class Placement:
    nodes: list[str]
    reason: str  # empty when nodes exist

    @property
    def schedulable(self) -> bool:
        return bool(self.nodes)


def place(spec: api.CellSpec, nodes: list[NodeView]) -> Placement:
    """Nodes whose labels state the cell's certified topology, or a reason a person can act on."""
    fits: list[str] = []
    misses: Counter[str] = Counter()
    for node in nodes:
        why = node_mismatch(spec, node)
        if why is None:
            fits.append(node.name)
        else:
            misses[why] += 1
    if fits:
        return Placement(sorted(fits), "")
    if not nodes:
        return Placement([], "the cluster has no nodes")
    detail = ", ".join(f"{n} node{'s' if n > 1 else ''} with {why}" for why, n in sorted(misses.items()))
    return Placement([], f"no node offers {describe_topology(spec)}: {detail}")


def node_affinity(spec: api.CellSpec) -> dict[str, Any]:
    """Required node affinity on the certified topology labels: the scheduler may only bind pods there."""
    topo = spec.topology
    exprs: list[dict[str, Any]] = ([] if any_link(spec) else
                                   [{"key": api.LABEL_INTERCONNECT, "operator": "In", "values": [topo.interconnect]}])
    if topo.gpus:
        # Gt compares integers: "at least N" is "greater than N-1".
        exprs.append({"key": api.LABEL_GPU_COUNT, "operator": "Gt", "values": [str(topo.gpus - 1)]})
        if topo.products:
            exprs.append({"key": api.LABEL_GPU_PRODUCT, "operator": "In", "values": list(topo.products)})
        if topo.minGpuMemoryMiB:
            exprs.append({"key": api.LABEL_GPU_MEMORY, "operator": "Gt", "values": [str(topo.minGpuMemoryMiB - 1)]})
    return {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": exprs}]}}


def copies_of(spec: api.CellSpec) -> int:
    """Endpoints per pod: a data-parallel cell's copies each serve on spec.port + i; every other cell serves one."""
    return api.ranks_of(spec) if api.enum_value(spec.runtime.parallelism) == api.Parallelism.data.value else 1


def worker_command(spec: api.CellSpec) -> list[str]:
    """The worker's command: one process, or one per rank started by torch's own launcher (rank 0 serves HTTP, the
    others follow it; a data-parallel cell's ranks are copies, each serving on spec.port + rank; a rank that exits
    makes the launcher stop the rest and exit, so the container restarts them together). ``--standalone``: the
    ranks meet on a free local port inside the pod."""
    ranks = api.ranks_of(spec)
    if ranks == 1:
        return ["modeld-cell", "serve"]
    return ["python", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0",
            "-m", "modeld_cell", "serve"]


def spec_json(spec: api.CellSpec) -> str:
    """The cell spec as its worker reads it (MODELD_CELL_SPEC)."""
    return json.dumps(spec.model_dump(mode="json", exclude_none=True), sort_keys=True)


def spec_hash(spec: api.CellSpec) -> str:
    """Names the spec a pod's worker runs (its annotation ANNOTATION_SPEC_HASH)."""
    return hashlib.sha256(spec_json(spec).encode()).hexdigest()[:16]


def pod_template(name: str, namespace: str, spec: api.CellSpec) -> dict[str, Any]:
    """The cell pod: worker command, the cell spec in its environment (no volumes needed), GPUs, affinity."""
    labels = {api.LABEL_CELL: name, api.LABEL_MANAGED_BY: "modeld", "app.kubernetes.io/name": "modeld-cell"}
    if spec.localRun:
        labels[api.LABEL_LOCAL_RUN] = "true"
    resources: dict[str, dict[str, str]] = {
        "requests": {k: v for k, v in spec.resources.requests.model_dump().items() if v},
        "limits": {k: v for k, v in spec.resources.limits.model_dump().items() if v},
    }
    tolerations = []
    if spec.topology.gpus:
        resources["limits"][api.RESOURCE_GPU] = str(spec.topology.gpus)
        tolerations.append({"key": api.RESOURCE_GPU, "operator": "Exists", "effect": "NoSchedule"})
    env = [
        {"name": "MODELD_CELL_SPEC", "value": spec_json(spec)},
        {"name": "MODELD_CELL_NAME", "value": name},
        {"name": "MODELD_CELL_NAMESPACE", "value": namespace},
        {"name": "MODELD_CELL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MODELD_CELL_PORT", "value": str(spec.port)},
    ]
    if spec.kvMemoryMiB:
        env.append({"name": "MODELD_KV_MEMORY_MIB", "value": str(spec.kvMemoryMiB)})
    volumes, mounts = [], []
    if spec.sessionStore is not None:
        store = spec.sessionStore
        if spec.localRun:       # hack/podrunner runs the process on the host and mounts nothing: the path itself
            env.append({"name": "MODELD_SESSION_STORE", "value": store.hostPath or ""})
        else:
            source = ({"persistentVolumeClaim": {"claimName": store.claimName}} if store.claimName
                      else {"hostPath": {"path": store.hostPath, "type": "DirectoryOrCreate"}})
            volumes.append({"name": "session-store", **source})
            mounts.append({"name": "session-store", "mountPath": api.SESSION_STORE_MOUNT})
            env.append({"name": "MODELD_SESSION_STORE", "value": api.SESSION_STORE_MOUNT})
    probe = {"httpGet": {"path": "/readyz", "port": spec.port}, "periodSeconds": 5, "failureThreshold": 3}
    container = {
        "name": "worker",
        "image": spec.image,
        "command": worker_command(spec),
        "ports": [{"name": "http", "containerPort": spec.port}]
                 + [{"name": f"http-copy{i}", "containerPort": spec.port + i} for i in range(1, copies_of(spec))],
        "env": env,
        "resources": {k: v for k, v in resources.items() if v},
        "readinessProbe": probe,
        # /healthz answers as soon as the server listens (it loads the model after): a worker that refuses its spec
        # stays up, not ready, reporting why on /readyz, instead of being restarted into the same refusal
        "startupProbe": {"httpGet": {"path": "/healthz", "port": spec.port}, "periodSeconds": 2, "failureThreshold": 60},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": spec.port}, "periodSeconds": 10},
    }
    if mounts:
        container["volumeMounts"] = mounts
    return {
        "metadata": {"labels": labels, "annotations": {api.ANNOTATION_SPEC_HASH: spec_hash(spec)}},
        "spec": {
            "affinity": {"nodeAffinity": node_affinity(spec)},
            "tolerations": tolerations,
            "containers": [container],
            **({"volumes": volumes} if volumes else {}),
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 30,
        },
    }


def stamp(manifest: dict[str, Any]) -> str:
    """Put the hash of ``manifest`` (as it is before this call) on it, as the ``modeld.contenox.io/applied``
    annotation, and return the hash: the live object carries what was last applied to it (handlers/indexes.py:
    ``Owned``)."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]
    manifest.setdefault("metadata", {}).setdefault("annotations", {})[api.ANNOTATION_APPLIED] = digest
    return digest


def deployment_name(cell: str) -> str:
    return f"cell-{cell}"


def deployment(name: str, namespace: str, spec: api.CellSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(name),
            "namespace": namespace,
            "labels": {api.LABEL_CELL: name, api.LABEL_MANAGED_BY: "modeld"},
        },
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": {api.LABEL_CELL: name}},
            # A cell pod holds GPUs: replace, never surge beyond what the topology can host.
            "strategy": {"type": "Recreate"},
            "template": pod_template(name, namespace, spec),
        },
    }


def service(name: str, namespace: str, spec: api.CellSpec) -> dict[str, Any]:
    """The Cell's Service: a stable address over its ready pods for clients that need no particular pod (an
    OpenAI-style client that sends its whole conversation, or a gateway in front). A client that keeps a session on
    one worker uses the Session's own endpoint, or a gateway with session affinity (docs/operator.md, "Routing")."""
    ports = [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}]
    ports += [{"name": f"http-copy{i}", "port": spec.port + i, "targetPort": f"http-copy{i}", "protocol": "TCP"}
              for i in range(1, copies_of(spec))]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": deployment_name(name), "namespace": namespace,
                     "labels": {api.LABEL_CELL: name, api.LABEL_MANAGED_BY: "modeld"}},
        "spec": {"type": "ClusterIP", "selector": {api.LABEL_CELL: name}, "ports": ports},
    }


# --- Sessions -------------------------------------------------------------------------------------------------


@dataclass
class CellView:
    name: str
    spec: api.CellSpec
    ready_endpoints: list[api.Endpoint] = field(default_factory=list)
    sessions: int = 0
    certified: bool | None = None  # None: never certified
    first_output_p90_ms: float | None = None  # measured at the smallest certified tier covering the session
    decode_p90_ms: float | None = None        # per token, at the same tier
    covering_tier: int | None = None          # that tier; None: no certified tier covers the session
    gate: str | None = None                   # the gate its certification passed ("baseline": measured alone)


@dataclass
class Fit:
    cell: CellView | None
    endpoint: api.Endpoint | None
    reason: str
    permanent: bool = False  # no change in the cluster can make this session fit
    considered: list[tuple[str, bool, str]] = field(default_factory=list)  # (cell, chosen, why) for the status


def choose_cell(session: api.SessionSpec, cells: list[CellView], require_certified: bool = True) -> Fit:
    """Bind by capability and workload fit. A cell is considered when it serves the family at a tier that holds the
    session, is certified (unless not required), meets both latency budgets by what its certification measured at the
    smallest tier covering the session (first-output p90, decode p90 per token), and has a ready worker. Among those:
    the session's workload first, then the least loaded per ready worker, then the tightest tier. ``considered`` says
    of every cell why it was or was not chosen (the Session's status.candidates)."""
    if session.cell:
        cells = [c for c in cells if c.name == session.cell]
        if not cells:
            return Fit(None, None, f"pinned cell {session.cell} does not exist")
        pinned = cells[0]
        if pinned.spec.model.family != session.modelFamily:
            return Fit(None, None, f"pinned cell {pinned.name} serves {pinned.spec.model.family}, not {session.modelFamily}", permanent=True)
        if pinned.spec.contextTier < session.requiredContext:
            return Fit(
                None, None,
                f"pinned cell {pinned.name} has a {pinned.spec.contextTier}-token context tier; the session needs {session.requiredContext}",
                permanent=True,
            )
    rejected: Counter[str] = Counter()
    considered: list[tuple[str, bool, str]] = []
    candidates = []
    for cell in sorted(cells, key=lambda c: c.name):
        unfit = not_fitting(session, cell, require_certified)
        if unfit is None:
            candidates.append(cell)
        else:
            rejected[unfit[0]] += 1
            considered.append((cell.name, False, unfit[1]))
    if not candidates:
        if not cells:
            return Fit(None, None, f"no Cell serves model family {session.modelFamily} in this namespace")
        detail = ", ".join(f"{n} with {why}" for why, n in sorted(rejected.items()))
        return Fit(None, None, f"no cell fits {session.modelFamily} at {session.requiredContext} tokens: {detail}",
                   considered=considered)
    # The session's workload first (a cell certified on it), then a cell that beat its baseline over one certified
    # only as a baseline, then least loaded per ready worker, then the tightest context tier that fits (keeps big
    # tiers for big sessions).
    wl = api.enum_value(session.workload)

    def rank(c: CellView) -> tuple:
        return (api.enum_value(c.spec.workload) != wl, c.gate == "baseline", c.sessions / len(c.ready_endpoints),
                c.spec.contextTier, c.name)

    best = min(candidates, key=rank)
    endpoint = best.ready_endpoints[best.sessions % len(best.ready_endpoints)]
    for c in candidates:
        if c is best:
            continue
        if api.enum_value(c.spec.workload) != wl and api.enum_value(best.spec.workload) == wl:
            why = f"fits, but serves workload {api.enum_value(c.spec.workload)}; {best.name} serves {wl}"
        elif c.gate == "baseline" and best.gate != "baseline":
            why = f"fits, but is certified only as a baseline; {best.name} beat its baseline (gate {best.gate})"
        elif c.sessions / len(c.ready_endpoints) > best.sessions / len(best.ready_endpoints):
            why = (f"fits, but holds {c.sessions} session(s) on {len(c.ready_endpoints)} worker(s); {best.name} is "
                   "less loaded")
        else:
            why = f"fits, but its {c.spec.contextTier}-token tier is larger than {best.name}'s {best.spec.contextTier}"
        considered.append((c.name, False, why))
    measured = []
    if best.first_output_p90_ms is not None:
        measured.append(f"first output p90 {best.first_output_p90_ms:,.0f} ms")
    if best.decode_p90_ms is not None:
        measured.append(f"decode p90 {best.decode_p90_ms:,.1f} ms/token")
    at = f" (certified at tier {best.covering_tier}: {', '.join(measured)})" if best.covering_tier and measured else ""
    reason = (f"bound to {best.name}: {best.spec.model.family}, {best.spec.contextTier}-token tier, workload "
              f"{api.enum_value(best.spec.workload)}{at}")
    considered.append((best.name, True, reason))
    # best first: the chosen cell, the others that fit in the order they ranked, then those that did not, by name
    order = {c.name: i for i, c in enumerate(sorted(candidates, key=rank))}
    considered.sort(key=lambda x: (not x[1], order.get(x[0], len(order)), x[0]))
    return Fit(best, endpoint, reason, considered=considered)


def not_fitting(session: api.SessionSpec, cell: CellView, require_certified: bool) -> tuple[str, str] | None:
    """Why ``cell`` cannot take ``session`` (a short class for the summary, then the cell's own words), or None."""
    budget = session.latencyBudget
    if cell.spec.model.family != session.modelFamily:
        return "another model family", f"serves {cell.spec.model.family}, not {session.modelFamily}"
    if cell.spec.contextTier < session.requiredContext:
        return ("a smaller context tier",
                f"its {cell.spec.contextTier}-token tier is below the {session.requiredContext} tokens needed")
    if require_certified and not cell.certified:
        return "no certification", ("its certification failed" if cell.certified is False
                                    else "not certified yet")
    if budget is not None:
        if cell.covering_tier is None:
            return ("no latency measured at a covering tier",
                    f"its certification measured no tier of {session.requiredContext}+ tokens to hold the budget to")
        fo = cell.first_output_p90_ms
        if fo is not None and fo > budget.firstOutputMs:
            return ("first-output p90 over the budget",
                    f"first output p90 {fo:,.0f} ms at tier {cell.covering_tier} > the budget's {budget.firstOutputMs:,} ms")
        dec = cell.decode_p90_ms
        if budget.perTokenMs is not None:
            if dec is None:
                return ("no per-token latency measured",
                        f"its certification has no decode p90 at tier {cell.covering_tier} for the per-token budget")
            if dec > budget.perTokenMs:
                return ("per-token p90 over the budget",
                        f"decode p90 {dec:,.1f} ms/token at tier {cell.covering_tier} > the budget's "
                        f"{budget.perTokenMs:,} ms")
    if not cell.ready_endpoints:
        return "no ready worker", "no worker answers /readyz"
    return None
