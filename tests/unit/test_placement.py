"""Placement and fit are pure functions: tested here without a cluster."""

from __future__ import annotations

import copy

import pytest

import modeld_api as api
from modeld_operator import placement

pytestmark = pytest.mark.unit


def cell_spec(**overrides) -> api.CellSpec:
    spec = {
        "runtime": {"backend": "triton"},
        "topology": {"gpus": 8, "interconnect": "nvlink"},
        "model": {"family": "llama3", "ref": "/models/llama3"},
        "contextTier": 32768,
    }
    for key, value in overrides.items():
        spec[key] = value
    return api.CellSpec.model_validate(spec)


def node(name, link, gpus=0, product="", memory=0, ready=True, alloc=None) -> placement.NodeView:
    labels = {api.LABEL_INTERCONNECT: link}
    if gpus:
        labels |= {api.LABEL_GPU_COUNT: str(gpus), api.LABEL_GPU_PRODUCT: product, api.LABEL_GPU_MEMORY: str(memory)}
    return placement.NodeView(name, labels, gpus if alloc is None else alloc, ready)


NODES = [
    node("hgx-0", "nvswitch", 8, "NVIDIA-H100-80GB-HBM3", 81559),
    node("a100-0", "nvlink", 4, "NVIDIA-A100-SXM4-80GB", 81920),
    node("a100x8-0", "nvlink", 8, "NVIDIA-A100-SXM4-80GB", 81920),
    node("l40s-0", "pcie", 4, "NVIDIA-L40S", 46068),
    node("ws-0", "pcie", 2, "NVIDIA-GeForce-RTX-4090", 24564),
    node("cpu-0", "none"),
]


@pytest.mark.parametrize(
    "topology, expected",
    [
        ({"gpus": 8, "interconnect": "nvlink"}, ["a100x8-0"]),
        ({"gpus": 4, "interconnect": "nvlink"}, ["a100-0", "a100x8-0"]),
        ({"gpus": 8, "interconnect": "nvswitch"}, ["hgx-0"]),
        ({"gpus": 2, "interconnect": "pcie"}, ["l40s-0", "ws-0"]),
        ({"gpus": 2, "interconnect": "pcie", "minGpuMemoryMiB": 40000}, ["l40s-0"]),
        # one GPU with interconnect none is joined to nothing: any GPU node's link serves it (the CRD's "none (CPU
        # or one GPU)"); a stated link still has to match
        ({"gpus": 1, "interconnect": "none", "products": ["NVIDIA-L40S"]}, ["l40s-0"]),
        ({"gpus": 1, "interconnect": "none"}, ["a100-0", "a100x8-0", "hgx-0", "l40s-0", "ws-0"]),
        ({"gpus": 1, "interconnect": "pcie"}, ["l40s-0", "ws-0"]),
        ({"gpus": 4, "interconnect": "pcie", "products": ["NVIDIA-L40S"]}, ["l40s-0"]),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None,
)
def test_place_matches_labels_exactly(topology, expected):
    assert placement.place(cell_spec(topology=topology), NODES).nodes == expected


def test_cpu_cell_goes_to_cpu_nodes_only():
    spec = cell_spec(runtime={"backend": "torch"}, topology={"gpus": 0, "interconnect": "none"})
    assert placement.place(spec, NODES).nodes == ["cpu-0"]


def test_impossible_cell_says_why():
    spec = cell_spec(topology={"gpus": 16, "interconnect": "nvswitch"})
    plan = placement.place(spec, NODES)
    assert not plan.schedulable
    assert plan.reason.startswith("no node offers 16 GPUs over nvswitch")
    assert "1 node with 8 GPUs" in plan.reason
    assert "2 nodes with interconnect pcie" in plan.reason


def test_not_ready_and_exhausted_nodes_are_excluded():
    nodes = [node("a", "nvlink", 8, "X", 1, ready=False), node("b", "nvlink", 8, "X", 1, alloc=4)]
    plan = placement.place(cell_spec(), nodes)
    assert plan.nodes == []
    assert "not Ready" in plan.reason and "4 allocatable GPUs" in plan.reason


def test_empty_cluster():
    assert placement.place(cell_spec(), []).reason == "the cluster has no nodes"


def test_a_one_gpu_cell_with_no_link_asks_for_a_gpu_not_an_interconnect():
    spec = cell_spec(topology={"gpus": 1, "interconnect": "none"})
    exprs = placement.node_affinity(spec)["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"]
    assert [e["key"] for e in exprs] == [api.LABEL_GPU_COUNT] and exprs[0]["values"] == ["0"]
    assert placement.place(spec, [node("cpu-0", "none")]).reason == (
        "no node offers 1 GPU (any interconnect): 1 node with 0 GPUs")


def test_node_affinity_states_topology():
    spec = cell_spec(topology={"gpus": 4, "interconnect": "pcie", "products": ["NVIDIA-L40S"], "minGpuMemoryMiB": 40000})
    exprs = placement.node_affinity(spec)["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ]
    assert {"key": api.LABEL_INTERCONNECT, "operator": "In", "values": ["pcie"]} in exprs
    assert {"key": api.LABEL_GPU_COUNT, "operator": "Gt", "values": ["3"]} in exprs
    assert {"key": api.LABEL_GPU_PRODUCT, "operator": "In", "values": ["NVIDIA-L40S"]} in exprs
    assert {"key": api.LABEL_GPU_MEMORY, "operator": "Gt", "values": ["39999"]} in exprs


def test_deployment_requests_gpus_and_carries_spec():
    spec = cell_spec(localRun=True, kvMemoryMiB=512)
    dep = placement.deployment("big", "ns", spec)
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"][api.RESOURCE_GPU] == "8"
    assert pod["metadata"]["labels"][api.LABEL_LOCAL_RUN] == "true"
    assert pod["spec"]["tolerations"] == [{"key": api.RESOURCE_GPU, "operator": "Exists", "effect": "NoSchedule"}]
    env = {e["name"]: e for e in container["env"]}
    carried = api.CellSpec.model_validate_json(env["MODELD_CELL_SPEC"]["value"])
    assert carried == spec  # the worker gets the whole tuple with no volume
    assert env["MODELD_CELL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["MODELD_KV_MEMORY_MIB"]["value"] == "512"
    assert dep["spec"]["selector"]["matchLabels"] == {api.LABEL_CELL: "big"}


def test_a_cells_service_selects_its_pods_on_every_port_they_serve():
    svc = placement.service("big", "ns", cell_spec(port=9000))
    pods = placement.deployment("big", "ns", cell_spec(port=9000))["spec"]["template"]
    assert svc["metadata"]["name"] == "cell-big" and svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"].items() <= pods["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    data = cell_spec(runtime={"backend": "torch", "parallelism": "data", "ranks": 3},
                     topology={"gpus": 0, "interconnect": "none"})
    named = {p["name"] for p in placement.pod_template("d", "ns", data)["spec"]["containers"][0]["ports"]}
    ports = placement.service("d", "ns", data)["spec"]["ports"]
    assert [p["port"] for p in ports] == [8080, 8081, 8082] and {p["targetPort"] for p in ports} == named


def test_cpu_cell_pod_has_no_gpu_or_toleration():
    spec = cell_spec(runtime={"backend": "torch"}, topology={"gpus": 0, "interconnect": "none"})
    pod = placement.pod_template("c", "ns", spec)
    assert pod["spec"]["tolerations"] == []
    assert api.RESOURCE_GPU not in pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
    assert api.LABEL_LOCAL_RUN not in pod["metadata"]["labels"]


@pytest.mark.parametrize("runtime, topology, want", [
    ({"backend": "torch"}, {"gpus": 0, "interconnect": "none"}, ["modeld-cell", "serve"]),
    ({"backend": "torch", "parallelism": "sharded-kv", "ranks": 3}, {"gpus": 0, "interconnect": "none"}, 3),
    ({"backend": "triton", "parallelism": "sharded-kv"}, {"gpus": 4, "interconnect": "nvswitch"}, 4),
], ids=["single", "cpu-ranks", "gpu-ranks"])
def test_a_multi_rank_cell_runs_one_process_per_rank_under_torchs_launcher(runtime, topology, want):
    cmd = placement.pod_template("c", "ns", cell_spec(runtime=runtime, topology=topology))["spec"]["containers"][0]["command"]
    if isinstance(want, list):
        assert cmd == want
    else:
        assert cmd[:3] == ["python", "-m", "torch.distributed.run"] and f"--nproc-per-node={want}" in cmd
        assert cmd[-3:] == ["-m", "modeld_cell", "serve"] and "--max-restarts=0" in cmd


def test_a_data_parallel_pod_runs_its_copies_under_the_launcher_and_exposes_a_port_per_copy():
    spec = cell_spec(runtime={"backend": "torch", "parallelism": "data", "ranks": 3},
                     topology={"gpus": 0, "interconnect": "none"}, port=9000)
    container = placement.pod_template("c", "ns", spec)["spec"]["containers"][0]
    assert container["command"][:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=3" in container["command"]
    assert [p["containerPort"] for p in container["ports"]] == [9000, 9001, 9002]
    assert len({p["name"] for p in container["ports"]}) == 3 and all(len(p["name"]) <= 15 for p in container["ports"])
    assert placement.copies_of(spec) == 3
    sharded = cell_spec(runtime={"backend": "torch", "parallelism": "sharded-kv", "ranks": 3},
                        topology={"gpus": 0, "interconnect": "none"})
    assert placement.copies_of(sharded) == 1       # its ranks serve one endpoint together (rank 0)
    assert len(placement.pod_template("c", "ns", sharded)["spec"]["containers"][0]["ports"]) == 1


# --- sessions -----------------------------------------------------------------------------------------------------

EP = [api.Endpoint(pod="p0", url="http://127.20.0.2:8080", ready=True)]


def view(name, family="smollm2", tier=8192, endpoints=EP, sessions=0, certified=True, p90=None, decode=None,
         workload="agent", covering=None, gate=None):
    """A cell as the binding sees it; with a measured p90 its certification covers the session at its own tier."""
    spec = cell_spec(
        runtime={"backend": "torch"},
        topology={"gpus": 0, "interconnect": "none"},
        model={"family": family, "ref": "x"},
        contextTier=tier,
        workload=workload,
    )
    measured = p90 is not None or decode is not None
    return placement.CellView(name, spec, list(endpoints), sessions, certified, p90, decode,
                              covering if covering is not None else (tier if measured else None), gate)


def session(**kw) -> api.SessionSpec:
    return api.SessionSpec.model_validate({"modelFamily": "smollm2", "requiredContext": 4000} | kw)


def test_binds_tightest_fitting_least_loaded():
    cells = [view("big", tier=32768), view("small", tier=4096), view("mid", tier=8192), view("tiny", tier=2048)]
    assert placement.choose_cell(session(), cells).cell.name == "small"
    cells[1].sessions = 3
    assert placement.choose_cell(session(), cells).cell.name == "mid"


def test_sessions_spread_over_a_data_parallel_cells_copies():
    """The binding's round robin over ready endpoints is what spreads sessions over the copies."""
    copies = [api.Endpoint(pod="p0", url=f"http://127.20.0.2:{8080 + i}", ready=True, copyIndex=i) for i in range(2)]
    cell = view("dp", endpoints=copies)
    urls = []
    for n in range(4):
        cell.sessions = n
        urls.append(placement.choose_cell(session(), [cell]).endpoint.url)
    assert urls == ["http://127.20.0.2:8080", "http://127.20.0.2:8081"] * 2


def test_no_fit_reasons():
    cells = [view("other", family="llama3"), view("short", tier=2048), view("down", endpoints=[])]
    fit = placement.choose_cell(session(), cells)
    assert fit.cell is None and not fit.permanent
    assert "1 with a smaller context tier" in fit.reason
    assert "1 with another model family" in fit.reason
    assert "1 with no ready worker" in fit.reason


def test_latency_budget_and_certification():
    cells = [view("slow", p90=900.0, certified=True), view("fast", tier=16384, p90=100.0, certified=False)]
    s = session(latencyBudget={"firstOutputMs": 500})
    assert placement.choose_cell(s, cells, require_certified=False).cell.name == "fast"
    fit = placement.choose_cell(s, cells)  # certified cells only, by default
    assert fit.cell is None and "no certification" in fit.reason and "over the budget" in fit.reason


def test_the_per_token_budget_is_held_to_the_measured_decode_p90_at_the_covering_tier():
    cells = [view("slow-decode", p90=100.0, decode=80.0), view("fast-decode", tier=16384, p90=300.0, decode=20.0)]
    s = session(latencyBudget={"firstOutputMs": 500, "perTokenMs": 50})
    fit = placement.choose_cell(s, cells)
    assert fit.cell.name == "fast-decode"
    why = dict((c, r) for c, chosen, r in fit.considered if not chosen)
    assert why["slow-decode"] == "decode p90 80.0 ms/token at tier 8192 > the budget's 50 ms"
    assert "decode p90 20.0 ms/token" in fit.reason and "certified at tier 16384" in fit.reason
    # no decode measured where the session needs one: not promised
    fit = placement.choose_cell(s, [view("unmeasured", p90=100.0, decode=None)])
    assert fit.cell is None and "no per-token latency measured" in fit.reason
    # a budget needs a certified tier covering the session at all
    fit = placement.choose_cell(session(latencyBudget={"firstOutputMs": 500}), [view("short-cert", p90=10.0, covering=None)])
    assert fit.cell is not None                                           # view() covers at its own tier
    uncovered = view("short-cert", p90=None)
    fit = placement.choose_cell(session(latencyBudget={"firstOutputMs": 500}), [uncovered])
    assert fit.cell is None and "no latency measured at a covering tier" in fit.reason


def test_the_sessions_workload_comes_first_and_every_cell_considered_says_why():
    cells = [view("chatty", workload="chat"), view("agentic", tier=32768, sessions=2), view("other", family="llama3"),
             view("small", tier=2048)]
    fit = placement.choose_cell(session(workload="agent"), cells)
    assert fit.cell.name == "agentic"            # the agent cell, though busier and larger than the chat one
    assert [c for c, chosen, _ in fit.considered if chosen] == ["agentic"] and fit.considered[0][0] == "agentic"
    why = {c: r for c, chosen, r in fit.considered if not chosen}
    assert why == {"chatty": "fits, but serves workload chat; agentic serves agent",
                   "other": "serves llama3, not smollm2",
                   "small": "its 2048-token tier is below the 4000 tokens needed"}
    assert placement.choose_cell(session(workload="chat"), cells).cell.name == "chatty"
    # no cell of the workload: the others still serve it
    assert placement.choose_cell(session(workload="batch"), cells).cell.name == "chatty"   # less loaded


def test_a_cell_that_beat_its_baseline_comes_before_the_baseline():
    cells = [view("a-baseline", gate="baseline"), view("winner", gate="agent-turn", sessions=3)]
    fit = placement.choose_cell(session(), cells)
    assert fit.cell.name == "winner"
    assert dict((c, r) for c, _, r in fit.considered)["a-baseline"] == (
        "fits, but is certified only as a baseline; winner beat its baseline (gate agent-turn)")


def test_uncertified_cells_are_not_bound_by_default():
    cells = [view("new", certified=None), view("failed", certified=False)]
    fit = placement.choose_cell(session(), cells)
    assert fit.cell is None and "2 with no certification" in fit.reason
    assert placement.choose_cell(session(), cells, require_certified=False).cell is not None


def test_pinned_cell():
    cells = [view("a"), view("b", tier=2048), view("c", family="llama3")]
    assert placement.choose_cell(session(cell="a"), cells).cell.name == "a"
    assert placement.choose_cell(session(cell="b"), cells).permanent
    assert placement.choose_cell(session(cell="c"), cells).permanent
    missing = placement.choose_cell(session(cell="zzz"), cells)
    assert missing.cell is None and not missing.permanent


def test_spec_roundtrip_is_stable():
    spec = cell_spec()
    assert api.CellSpec.model_validate(copy.deepcopy(spec.model_dump(mode="json"))) == spec


def test_node_index_keeps_what_placement_reads():
    """The operator's node index (one watch instead of a list per Cell per tick) holds exactly what NodeView reads,
    all nodes under "all" and each under its name; a change placement reads counts, a heartbeat does not, and the
    count moves only once the index holds the change (a plan cached under the new count reads the new node)."""
    from modeld_operator.handlers.indexes import NODES, Caches, indexed, node_index

    node = {"metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                     "modeld.contenox.io/interconnect": "nvswitch"},
                         "annotations": {"big": "x" * 1000}},
            "spec": {"unschedulable": True, "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "96"},
                       "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "t"}],
                       "images": [{"names": ["a"]}]}}
    caches = Caches()
    before = NODES.version
    key, entry = indexed(node_index)(node)
    assert key == (None, "gpu-1") and list(entry) == ["all", ("node", "gpu-1")] and entry["all"] is entry[("node", "gpu-1")]
    assert entry["all"] == placement.NodeView.from_obj(node)
    assert NODES.version == before                                                       # not indexed yet
    caches._on_node("ADDED", (key, entry))
    assert NODES.version == before + 1 and caches.nodes.get("all") == [entry["all"]]
    node["status"]["conditions"][0]["lastHeartbeatTime"] = "t2"                         # a heartbeat
    caches._on_node("MODIFIED", indexed(node_index)(node))
    assert NODES.version == before + 1
    node["metadata"]["labels"]["modeld.contenox.io/interconnect"] = "pcie"              # what placement reads
    caches._on_node("MODIFIED", indexed(node_index)(node))
    assert NODES.version == before + 2
    caches._on_node("DELETED", indexed(node_index)(node))
    assert NODES.version == before + 3 and caches.nodes.get("all", []) == []


# spec.sessionStore: where the worker commits sessions (docs/worker.md "Session store")
def _pod(**store) -> dict:
    spec = cell_spec(runtime={"backend": "torch"}, topology={"gpus": 0, "interconnect": "none"}, contextTier=4096,
                     **store)
    return placement.pod_template("c", "ns", spec)["spec"]


def _env(pod: dict) -> dict:
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


def test_a_session_store_claim_is_mounted_and_named_to_the_worker():
    pod = _pod(sessionStore={"claimName": "sessions"})
    assert pod["volumes"] == [{"name": "session-store", "persistentVolumeClaim": {"claimName": "sessions"}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "session-store", "mountPath": api.SESSION_STORE_MOUNT}]
    assert _env(pod)["MODELD_SESSION_STORE"] == api.SESSION_STORE_MOUNT


def test_a_host_path_store_is_mounted_or_for_a_local_run_pod_named_directly():
    pod = _pod(sessionStore={"hostPath": "/srv/modeld"})
    assert pod["volumes"][0]["hostPath"] == {"path": "/srv/modeld", "type": "DirectoryOrCreate"}
    local = _pod(sessionStore={"hostPath": "/srv/modeld"}, localRun=True)
    assert "volumes" not in local and "volumeMounts" not in local["containers"][0]
    assert _env(local)["MODELD_SESSION_STORE"] == "/srv/modeld"
    none = _pod()
    assert "volumes" not in none and "MODELD_SESSION_STORE" not in _env(none)


def test_the_cells_considered_come_best_first_those_that_fit_in_rank_order_then_the_rest_by_name():
    """A bound Session lists only the first few (handlers/session.py: BOUND_CANDIDATES): the order must put the
    runners-up before the cells that did not fit."""
    cells = [view("z-unfit", family="llama3"), view("busy", sessions=5), view("b-best"), view("a-unfit", tier=2048),
             view("bigger", tier=32768), view("c-busier", sessions=9)]
    fit = placement.choose_cell(session(), cells)
    assert [c for c, _, _ in fit.considered] == ["b-best", "bigger", "busy", "c-busier", "a-unfit", "z-unfit"]
