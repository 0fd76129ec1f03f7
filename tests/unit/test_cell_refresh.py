"""A Cell's timer refresh (handlers/cell.refresh_status without kopf's patch): it stops early when it reads what the
last one read, refreshes whole when an input changed or FULL_REFRESH_S passed, and holds a change of the bound
Sessions' count alone while binds wait (docs/operator.md, "Scale")."""

from __future__ import annotations

from typing import Any

import pytest

import modeld_api as api
from modeld_operator import cellstatus, placement
from modeld_operator.handlers import cell as cell_handlers
from modeld_operator.handlers.indexes import NODES, BoundSession, pod_index

pytestmark = pytest.mark.unit

SPEC = {"model": {"family": "smollm2", "ref": "/models/smollm2"}, "runtime": {"backend": "torch"},
        "topology": {"gpus": 0, "interconnect": "none"}, "contextTier": 2048}


class World:
    """One Cell with one ready worker, its indexes, and the apiserver's side: a status patch lands in the body with
    a new resourceVersion, as the Cell's watch event would bring it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.patches: list[dict[str, Any]] = []
        self.derived = 0
        self.probes = 0
        self.now = 1000.0
        self.waiting = False
        self.spec = api.CellSpec.model_validate(SPEC)
        self.body: dict[str, Any] = {"metadata": {"name": "c", "namespace": "ns", "generation": 1,
                                                  "resourceVersion": "1"}, "status": {}}
        self.sessions: dict[Any, list[BoundSession]] = {}
        real = cellstatus.derive

        def derive(o: Any) -> Any:
            self.derived += 1
            return real(o)

        def patch_status(plural: str, ns: str, name: str, status: dict[str, Any]) -> None:
            self.patches.append(status)
            self.body = {**self.body, "metadata": {**self.body["metadata"],
                                                   "resourceVersion": str(int(self.body["metadata"]["resourceVersion"]) + 1)},
                         "status": {**self.body["status"], **status}}

        def http_json(*a: Any) -> tuple[int, Any]:
            self.probes += 1
            return 200, {"ready": True, "instance": "i1"}

        monkeypatch.setattr(cellstatus, "derive", derive)
        monkeypatch.setattr(cell_handlers.kube, "patch_status", patch_status)
        monkeypatch.setattr(cell_handlers.kube, "http_json", http_json)
        monkeypatch.setattr(cell_handlers.kube, "create_job", lambda job: True)
        monkeypatch.setattr(cell_handlers.kopf, "event", lambda *a, **kw: None)
        monkeypatch.setattr(cell_handlers.kopf, "append_owner_reference", lambda *a, **kw: None)
        self.sent_back: list[str] = []
        monkeypatch.setattr(cell_handlers, "send_back", lambda ns, name, reason, message: self.sent_back.append(name))
        monkeypatch.setattr(cell_handlers, "_PLANS", {})
        monkeypatch.setattr(cell_handlers, "_SHARED_PLANS", {})
        monkeypatch.setattr(cell_handlers, "_REFRESHED", {})
        monkeypatch.setattr(cell_handlers.kube.BINDS, "waiting", lambda: self.waiting)
        self.set_pod(ready=True)
        node = placement.NodeView("n1", {"kubernetes.io/os": "linux"}, 0, True)
        self.nodes = {"all": [node], ("node", "n1"): [node]}

    def set_pod(self, ready: bool) -> None:
        meta = {"name": "cell-c-1", "annotations": {api.ANNOTATION_SPEC_HASH: placement.spec_hash(api.CellSpec.model_validate(SPEC))}}
        status = {"phase": "Running", "podIP": "127.30.0.5",
                  "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        self.pods = {key: [pod] for key, pod in pod_index(namespace="ns", meta=meta, spec={"nodeName": "n1"},
                                                          status=status, labels={api.LABEL_CELL: "c"}).items()}

    def bind(self, n: int) -> None:
        self.sessions[("ns", "c")] = [BoundSession(f"s{i}", "http://127.30.0.5:8080", "i1") for i in range(n)]

    def refresh(self, seconds: float = 5.0) -> None:
        self.now += seconds
        idx = cell_handlers.Indexes(self.nodes, self.pods, {}, self.sessions)  # type: ignore[arg-type]
        cell_handlers.refresh_status("c", "ns", self.body, self.spec, idx, clock=lambda: self.now)  # type: ignore[arg-type]


def test_a_refresh_that_reads_what_the_last_one_read_stops_early(monkeypatch):
    w = World(monkeypatch)
    w.refresh()
    w.refresh()                                   # its own write came back with a new resourceVersion: whole again
    assert len(w.patches) == 1 and w.derived == 2
    for _ in range(5):
        w.refresh()
    assert w.derived == 2 and len(w.patches) == 1  # nothing new: derived nothing, wrote nothing
    assert w.probes == 7                           # each worker is still asked every time (its answer is an input)


@pytest.mark.parametrize("change", ["pod", "node", "cell", "worker answer", "bound elsewhere"])
def test_any_changed_input_refreshes_whole(monkeypatch, change):
    w = World(monkeypatch)
    w.refresh()
    w.refresh()
    derived = w.derived
    if change == "pod":
        w.set_pod(ready=False)
    elif change == "node":
        NODES.saw(placement.NodeView("n-other", {}, 0, True))
    elif change == "cell":
        w.body = {**w.body, "metadata": {**w.body["metadata"], "resourceVersion": "99"}}
    elif change == "worker answer":
        monkeypatch.setattr(cell_handlers.kube, "http_json", lambda *a: (503, {"ready": False}))
    else:
        w.sessions[("ns", "c")] = [BoundSession("s0", "http://127.30.0.9:8080", "i0")]   # its worker is gone
    w.refresh()
    assert w.derived == derived + 1
    assert w.sent_back == (["s0"] if change == "bound elsewhere" else [])


def test_a_cell_is_refreshed_whole_at_least_every_full_refresh_interval(monkeypatch):
    w = World(monkeypatch)
    w.refresh()
    w.refresh()
    derived = w.derived
    w.refresh(cell_handlers.FULL_REFRESH_S - 5.0)
    assert w.derived == derived
    w.refresh(10.0)
    assert w.derived == derived + 1


def test_while_binds_wait_the_bound_count_alone_is_held_then_written(monkeypatch):
    w = World(monkeypatch)
    w.refresh()
    w.refresh()
    assert w.patches[-1]["sessions"] == 0
    w.waiting = True
    w.bind(3)
    w.refresh()
    w.bind(5)
    w.refresh()
    assert len(w.patches) == 1                    # held: only the count changed
    w.set_pod(ready=False)                        # something else changed: written at once, the count with it
    w.refresh()
    assert len(w.patches) == 2 and w.patches[-1]["readyReplicas"] == 0 and w.patches[-1]["sessions"] == 5
    assert w.sent_back == [f"s{i}" for i in range(5)]      # their worker is not ready: sent back to be rebound
    w.set_pod(ready=True)
    w.refresh()
    w.bind(7)
    w.refresh()
    w.refresh()
    assert len(w.patches) == 3 and w.body["status"]["sessions"] == 5
    w.waiting = False                              # the queue is empty: the count goes out
    w.refresh()
    assert len(w.patches) == 4 and w.body["status"]["sessions"] == 7


def test_a_reconcile_refreshes_whole_every_time(monkeypatch):
    w = World(monkeypatch)
    idx = cell_handlers.Indexes(w.nodes, w.pods, {}, w.sessions)  # type: ignore[arg-type]
    for _ in range(3):
        patch: dict[str, Any] = {}
        cell_handlers.refresh_status("c", "ns", w.body, w.spec, idx, patch, clock=lambda: w.now)  # type: ignore[arg-type]
    assert w.derived == 3


def test_a_queue_that_never_empties_holds_the_count_at_most_full_refresh_interval(monkeypatch):
    w = World(monkeypatch)
    w.refresh()
    w.refresh()
    w.waiting = True
    for n in range(1, 13):                        # a new bind every refresh, 5 s apart, the queue never empty
        w.bind(n)
        w.refresh()
    assert len(w.patches) == 1                    # held since the first of them, 55 s ago
    w.bind(13)
    w.refresh()                                   # 60 s: written all the same
    assert len(w.patches) == 2 and w.body["status"]["sessions"] == 13
    w.bind(14)
    w.refresh()
    w.refresh()
    assert len(w.patches) == 2                    # and held again from there
