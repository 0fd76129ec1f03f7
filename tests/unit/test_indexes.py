"""The operator's indexes (handlers/indexes.py, node_index) and what the handlers derive from them without a list
call: a bind's candidates and their load, a Cell's placement (recomputed only when a node or the spec changed), the
bindings a Cell's refresh sends back."""

from __future__ import annotations

import pytest

import modeld_api as api
from modeld_operator import placement
from modeld_operator.handlers import cell as cell_handlers
from modeld_operator.handlers.indexes import (
    Bindings,
    BoundSession,
    alive,
    cell_entry,
    cell_index,
    pod_index,
)
from modeld_operator.handlers.session import _cell_views
from modeld_operator.informer import Index

pytestmark = pytest.mark.unit


def run(indexer, **kw):
    """Each indexer is a pure function of the object (run in its reflector's thread)."""
    return indexer(**kw)

SPEC = {"model": {"family": "smollm2", "ref": "/models/smollm2"}, "runtime": {"backend": "torch"},
        "topology": {"gpus": 0, "interconnect": "none"}, "contextTier": 2048}


def ep(url: str, ready: bool = True, instance: str | None = "i1") -> dict:
    return {"pod": "p", "url": url, "ready": ready, "instance": instance}


def test_a_cell_entry_keeps_its_parsed_spec_ready_endpoints_and_certification():
    status = {"endpoints": [ep("http://127.0.0.1:1"), ep("http://127.0.0.1:2", ready=False), {"pod": "q", "ready": True}],
              "conditions": [{"type": "Certified", "status": "True"}],
              "certification": {"gate": "context", "summary": {"firstOutputP90Ms": {"2048": 10.0}}}}
    entry = cell_entry("c", SPEC, status)
    assert entry.spec == api.CellSpec.model_validate(SPEC)
    assert [e.url for e in entry.ready_endpoints] == ["http://127.0.0.1:1"]     # ready and with a URL only
    assert entry.certified is True and entry.gate == "context" and entry.summary["firstOutputP90Ms"] == {"2048": 10.0}
    assert cell_entry("c", {"contextTier": "big"}, {}).spec is None             # its own handler reports it
    assert set(run(cell_index, name="c", namespace="ns", spec=SPEC, status=status)) == {"ns", ("ns", "c")}


def test_pods_are_indexed_by_cell_or_certification_job_without_their_environment():
    meta = {"name": "cell-c-1", "labels": {}}
    spec = {"nodeName": "n1", "containers": [{"env": [{"name": "MODELD_CELL_SPEC", "value": "x" * 10_000}]}]}
    status = {"phase": "Running", "podIP": "127.30.0.5", "conditions": [{"type": "Ready", "status": "True"}]}
    worker = run(pod_index, namespace="ns", meta=meta, spec=spec, status=status, labels={api.LABEL_CELL: "c"})
    assert list(worker) == [("cell", "ns", "c")]
    slim = worker[("cell", "ns", "c")]
    assert slim["spec"] == {"nodeName": "n1"} and slim["status"]["podIP"] == "127.30.0.5"
    job = run(pod_index, namespace="ns", meta=meta, spec=spec, status=status,
                    labels={api.LABEL_CERTIFIES: "c", "batch.kubernetes.io/job-name": "certify-c-k"})
    assert list(job) == [("job", "ns", "certify-c-k")]
    assert run(pod_index, namespace="ns", meta=meta, spec=spec, status=status, labels={}) == {}


def test_a_bind_weighs_the_namespaces_cells_with_their_load_from_the_indexes():
    cells = {"ns": [cell_entry("a", SPEC, {"endpoints": [ep("http://127.0.0.1:1")]}),
                    cell_entry("b", SPEC, {"endpoints": [ep("http://127.0.0.1:2")]}),
                    cell_entry("bad", {"contextTier": "big"}, {})],
             "other": [cell_entry("z", SPEC, {})]}
    sessions = {("ns", "a"): [BoundSession("s1", "http://127.0.0.1:1", "i1"), BoundSession("s2", "http://127.0.0.1:1", "i1")]}
    views = _cell_views("ns", 1024, cells, sessions)  # type: ignore[arg-type]
    assert [(v.name, v.sessions) for v in views] == [("a", 2), ("b", 0)]
    fit = placement.choose_cell(api.SessionSpec.model_validate({"modelFamily": "smollm2", "requiredContext": 1024}),
                                views, require_certified=False)
    assert fit.cell is not None and fit.cell.name == "b"                         # the less loaded one


def test_a_binding_is_alive_while_its_endpoint_is_ready_and_the_same_process():
    eps = [api.Endpoint.model_validate(ep("http://127.0.0.1:1", instance="i1"))]
    assert alive(BoundSession("s", "http://127.0.0.1:1", "i1"), eps)
    assert alive(BoundSession("s", "http://127.0.0.1:1", None), eps)          # bound before instances
    assert not alive(BoundSession("s", "http://127.0.0.1:1", "i0"), eps)      # replaced (kill -9)
    assert not alive(BoundSession("s", "http://127.0.0.1:9", "i1"), eps)      # gone
    down = [api.Endpoint.model_validate(ep("http://127.0.0.1:1", ready=False))]
    assert not alive(BoundSession("s", "http://127.0.0.1:1", "i1"), down)     # not ready


def test_a_cells_status_names_at_most_a_few_fitting_nodes_and_counts_them_all(monkeypatch):
    monkeypatch.setattr(cell_handlers, "_PLANS", {})
    monkeypatch.setattr(cell_handlers, "_SHARED_PLANS", {})
    monkeypatch.setattr(cell_handlers.kube, "patch_status", lambda *a: None)
    monkeypatch.setattr(cell_handlers.kopf, "event", lambda *a, **kw: None)
    nodes = [placement.NodeView(f"n{i:03d}", {api.LABEL_INTERCONNECT: "none"}, 0, True) for i in range(500)]
    idx = cell_handlers.Indexes({"all": nodes}, {}, {}, {})  # type: ignore[arg-type]
    patch: dict = {}
    body = {"metadata": {"name": "c", "namespace": "ns", "generation": 1}, "status": {}}
    cell_handlers.refresh_status("c", "ns", body, api.CellSpec.model_validate(SPEC), idx, patch)  # type: ignore[arg-type]
    assert patch["status"]["nodeCount"] == 500 and patch["status"]["nodes"] == [f"n{i:03d}" for i in range(api.STATUS_NODES_MAX)]


def placements(monkeypatch) -> list[int]:
    """Empty plan caches, and the node count of each placement.place call made from here on."""
    calls: list[int] = []
    real = placement.place
    monkeypatch.setattr(placement, "place", lambda spec, nodes: calls.append(len(nodes)) or real(spec, nodes))
    monkeypatch.setattr(cell_handlers, "_PLANS", {})
    monkeypatch.setattr(cell_handlers, "_SHARED_PLANS", {})
    return calls


def test_placement_is_recomputed_only_when_a_node_or_the_spec_changed(monkeypatch):
    calls = placements(monkeypatch)
    node = placement.NodeView("n1", {"kubernetes.io/os": "linux"}, 0, True)
    nodes = {"all": [node]}
    idx = cell_handlers.Indexes(nodes, {}, {}, {})  # type: ignore[arg-type]
    spec = api.CellSpec.model_validate(SPEC)
    first = cell_handlers.planned("ns", "c", spec, idx)
    assert cell_handlers.planned("ns", "c", spec, idx) is first and len(calls) == 1      # a refresh, nothing changed
    cell_handlers.NODES.saw(placement.NodeView("n1", {"kubernetes.io/os": "linux"}, 0, False))
    cell_handlers.planned("ns", "c", spec, idx)
    assert len(calls) == 2                                                              # a node changed
    nodes["all"].append(placement.NodeView("n2", {}, 0, True))
    cell_handlers.planned("ns", "c", spec, idx)
    assert len(calls) == 3                                                              # one joined
    cell_handlers.planned("ns", "c", spec.model_copy(update={"contextTier": 4096}), idx)
    assert len(calls) == 4                                                              # the spec changed


def test_cells_of_one_spec_share_one_placement_until_a_node_changes(monkeypatch):
    calls = placements(monkeypatch)
    idx = cell_handlers.Indexes({"all": [placement.NodeView("n1", {"kubernetes.io/os": "linux"}, 0, True)]}, {}, {}, {})  # type: ignore[arg-type]
    spec = api.CellSpec.model_validate(SPEC)
    plans = [cell_handlers.planned(ns, f"c{i}", spec, idx) for ns in ("a", "b") for i in range(3)]
    assert len(calls) == 1 and all(p is plans[0] for p in plans)          # six Cells, one spec: placed once
    other = cell_handlers.planned("a", "d", spec.model_copy(update={"contextTier": 4096}), idx)
    assert len(calls) == 2 and other is not plans[0]                       # another spec is placed for itself
    cell_handlers.NODES.saw(placement.NodeView("n-shared", {}, 0, True))   # a node changed: placed again
    assert cell_handlers.planned("b", "c0", spec, idx) is not plans[0] and len(calls) == 3
    assert cell_handlers.planned("a", "c0", spec, idx) is cell_handlers.planned("b", "c0", spec, idx) and len(calls) == 3
    assert len(cell_handlers._SHARED_PLANS) == 1                           # the older version's plans were let go


def test_a_bind_made_here_is_not_made_again_from_an_older_body():
    """The watch handler and the retry sweep read bodies that predate each other's bind."""
    b = Bindings()
    assert b.lock("ns", "s") is b.lock("ns", "s")
    assert not b.ahead_of("ns", "s", {"phase": "Pending"})
    b.made("ns", "s")
    assert b.ahead_of("ns", "s", {"phase": "Pending"})         # the other one's body: skip
    assert not b.ahead_of("ns", "s", {"phase": "Bound"})       # the watch caught up
    assert not b.ahead_of("ns", "s", {"phase": "Pending"})     # so a later Pending is a real one
    b.made("ns", "s")
    b.forget("ns", "s")                                          # sent back by its cell: rebind for real
    assert not b.ahead_of("ns", "s", {"phase": "Pending"})


def test_a_bind_whose_write_never_showed_up_is_made_again():
    """The status write of a bind failed (the apiserver timed out): after the TTL the session is bound again."""
    now = [100.0]
    b = Bindings(ttl=30.0, clock=lambda: now[0])
    b.made("ns", "s")
    now[0] += 29.0
    assert b.ahead_of("ns", "s", {"phase": "Pending"})
    now[0] += 2.0
    assert not b.ahead_of("ns", "s", {"phase": "Pending"})
    assert not b.ahead_of("ns", "s", {"phase": "Pending"})     # forgotten, not asked again


def test_certification_measures_only_a_worker_of_the_spec_as_it_is_now(monkeypatch):
    """A changed spec's old pod is still ready until the Deployment replaces it: a Job against it would certify the
    old spec under the new key (it did, in the e2e run: the Job found the old worker gone and recorded a failure).
    Only a pod whose spec hash is the current spec's is measured."""
    jobs, patches, events = [], [], []
    monkeypatch.setattr(cell_handlers.kube, "create_job", lambda job: jobs.append(job) or len(jobs) == 1)  # then 409
    monkeypatch.setattr(cell_handlers.kube, "patch_status", lambda plural, ns, name, st: patches.append(st))
    monkeypatch.setattr(cell_handlers.kube, "http_json", lambda *a: (200, {"ready": True, "instance": "i1"}))
    monkeypatch.setattr(cell_handlers.kopf, "event", lambda body, type, reason, message: events.append(reason))
    monkeypatch.setattr(cell_handlers, "_PLANS", {})
    monkeypatch.setattr(cell_handlers, "_SHARED_PLANS", {})
    old_spec = api.CellSpec.model_validate(SPEC)
    spec = api.CellSpec.model_validate({**SPEC, "kvMemoryMiB": 96})

    def refresh(pod_spec: api.CellSpec) -> dict:
        meta = {"name": "cell-c-1", "annotations": {api.ANNOTATION_SPEC_HASH: placement.spec_hash(pod_spec)}}
        status = {"phase": "Running", "podIP": "127.30.0.5", "conditions": [{"type": "Ready", "status": "True"}]}
        pods = {key: [pod] for key, pod in run(pod_index, namespace="ns", meta=meta, spec={"nodeName": "n1"}, status=status,
                                                     labels={api.LABEL_CELL: "c"}).items()}
        node = placement.NodeView("n1", {"kubernetes.io/os": "linux"}, 0, True)
        idx = cell_handlers.Indexes({"all": [node], ("node", "n1"): [node]}, pods, {}, {})  # type: ignore[arg-type]
        body = {"metadata": {"name": "c", "namespace": "ns", "generation": 2}, "status": {}}
        patch: dict = {}
        cell_handlers.refresh_status("c", "ns", body, spec, idx, patch)  # type: ignore[arg-type]
        return patch["status"]

    status = refresh(old_spec)
    assert jobs == [] and patches == []                                           # nothing measured; status in kopf's patch
    assert status["readyReplicas"] == 1                                           # the old worker still serves
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Certified"] == "NotCertified"
    refresh(spec)
    refresh(spec)                       # the Job's pod is not indexed yet: asked again, it exists (409)
    job, again = jobs
    assert job == again and events.count("Certifying") == 1                      # one Event: at its creation
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--endpoint") + 1] == "http://127.30.0.5:8080"
    assert placement.deployment("c", "ns", spec)["spec"]["template"]["metadata"]["annotations"] == {
        api.ANNOTATION_SPEC_HASH: placement.spec_hash(spec)}
    assert placement.spec_hash(spec) != placement.spec_hash(old_spec)


def test_an_index_replaces_an_objects_entries_whole_and_a_listing_drops_what_it_lacks():
    """A worker pod whose cell label is taken off leaves its cell's entry (else the cell keeps counting it as its
    endpoint); an object a new listing lacks (deleted while no watch was open) leaves the index."""
    idx = Index()
    meta = {"name": "p"}
    idx.put(("ns", "p"), run(pod_index, namespace="ns", meta=meta, spec={}, status={}, labels={api.LABEL_CELL: "c"}))
    idx.put(("ns", "q"), run(pod_index, namespace="ns", meta={"name": "q"}, spec={}, status={}, labels={api.LABEL_CELL: "c"}))
    assert len(idx.get(("cell", "ns", "c"))) == 2 and len(idx) == 2
    idx.put(("ns", "p"), run(pod_index, namespace="ns", meta=meta, spec={}, status={}, labels={}))
    assert [p["metadata"]["name"] for p in idx.get(("cell", "ns", "c"))] == ["q"] and len(idx) == 1
    assert idx.replace([]) == [("ns", "q")]
    assert idx.get(("cell", "ns", "c")) is None and idx.get(("cell", "ns", "c"), []) == []


def owned(annotation, managers):
    return {"metadata": {"namespace": "ns", "name": "cell-a", "annotations": {api.ANNOTATION_APPLIED: annotation},
                         "managedFields": managers}}


OURS = {"manager": "modeld-operator", "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
STATUS = {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
          "fieldsV1": {"f:status": {}}}
REVISION = {"manager": "kube-controller-manager", "operation": "Update",
            "fieldsV1": {"f:metadata": {"f:annotations": {"f:deployment.kubernetes.io/revision": {}}}}}
SCALE = {"manager": "kubectl", "operation": "Update", "subresource": "scale", "fieldsV1": {"f:spec": {"f:replicas": {}}}}


def test_an_owned_object_is_unchanged_only_at_the_applied_hash_with_no_other_writer_of_its_spec():
    """A restart re-applies nothing that is as the manifest says; a changed manifest, a missing object, or one whose
    spec another writer changed (kubectl scale) is applied again. The controllers' status and revision writes do not
    count as changes."""
    from modeld_operator.handlers.indexes import Owned, owned_entry

    cell = api.CellSpec.model_validate(SPEC)
    manifest = placement.deployment("a", "ns", cell)
    digest = placement.stamp(manifest)
    assert manifest["metadata"]["annotations"][api.ANNOTATION_APPLIED] == digest
    again = placement.deployment("a", "ns", cell)
    assert placement.stamp(again) == digest                      # the same manifest, the same hash
    changed = placement.deployment("a", "ns", cell.model_copy(update={"replicas": 2}))
    assert placement.stamp(changed) != digest

    o = Owned()
    assert not o.unchanged("deployments", manifest, digest)     # not in the cache: applied
    o.deployments.put(*owned_entry(owned(digest, [OURS, STATUS, REVISION])))
    assert o.unchanged("deployments", manifest, digest)
    assert not o.unchanged("services", manifest, digest)        # the services are apart
    assert not o.unchanged("deployments", changed, placement.stamp(placement.deployment("a", "ns", cell.model_copy(
        update={"replicas": 2}))))
    o.deployments.put(*owned_entry(owned(digest, [OURS, STATUS, SCALE])))
    assert not o.unchanged("deployments", manifest, digest)     # scaled by hand: the operator's replicas win again
    o.deployments.put(*owned_entry(owned("older", [OURS])))
    assert not o.unchanged("deployments", manifest, digest)     # an older operator's manifest
    o.deployments.remove(("ns", "cell-a"))
    assert not o.unchanged("deployments", manifest, digest)     # deleted
