"""Cell phase and conditions from hand-built observations (modeld_operator.cellstatus.derive)."""

from __future__ import annotations

import pytest

import modeld_api as api
from modeld_api.served import Unserved
from modeld_operator.cellstatus import Observed, derive

pytestmark = pytest.mark.unit


def ep(pod: str, node: str | None = "n0", ready: bool = False, refusal: str | None = None) -> api.Endpoint:
    return api.Endpoint(pod=pod, node=node, url="http://127.30.0.1:8080" if node else None, ready=ready,
                        refusal=refusal)


def test_an_unserved_value_refuses_the_cell_and_names_the_field():
    u = Unserved("runtime.backend", "triton", "no triton runtime yet")
    d = derive(Observed(2, True, "", [], [], [u]))
    assert d.phase == "Refused"
    assert d.served == (False, "ValueNotServed", "spec.runtime.backend 'triton' is not served: no triton runtime yet")
    assert d.scheduled[:2] == (False, "NotServed") and d.ready[:2] == (False, "NotServed")
    assert "no pods are created" in d.scheduled[2] and d.scheduled[2].endswith("fits the nodes in status.nodes")
    d = derive(Observed(1, False, "no node offers 16 GPUs over nvswitch", [], [], [u]))
    assert d.phase == "Refused" and d.scheduled[2].endswith("placement: no node offers 16 GPUs over nvswitch")


def test_a_worker_refusal_fails_the_cell_with_its_words():
    d = derive(Observed(1, True, "", [ep("p0", refusal="spec.profile.kv: int4 smoke fails")]))
    assert d.phase == "Failed" and d.served[0] is True
    assert d.ready == (False, "WorkerRefusedSpec", "spec.profile.kv: int4 smoke fails")


@pytest.mark.parametrize("obs, phase, sched, ready", [
    (Observed(2, True, "", [ep("a", ready=True), ep("b", "n1", ready=True)]), "Ready", True, True),
    (Observed(2, True, "", [ep("a", ready=True), ep("b", "n1")]), "Scheduled", True, False),
    (Observed(2, True, "", [ep("a"), ep("b", None)], ["0/3 nodes: Insufficient nvidia.com/gpu"]), "Pending",
     False, False),
    (Observed(1, True, "", [ep("a", None)], ["0/3 nodes: Insufficient cpu"]), "Unschedulable", False, False),
    (Observed(1, False, "no node offers 16 GPUs", []), "Unschedulable", False, False),
    (Observed(0, True, "", []), "Stopped", None, False),
], ids=["ready", "scheduled", "pending", "unschedulable-pods", "no-nodes", "stopped"])
def test_phase_and_conditions(obs, phase, sched, ready):
    d = derive(obs)
    assert (d.phase, d.scheduled[0], d.ready[0], d.served[0]) == (phase, sched, ready, True), d
    if phase == "Pending":
        assert d.scheduled[2] == "1/2 pods scheduled: 0/3 nodes: Insufficient nvidia.com/gpu"
    if phase == "Unschedulable" and not obs.schedulable:
        assert d.scheduled == (False, "NoMatchingNodes", "no node offers 16 GPUs")


def test_a_data_parallel_pod_is_ready_when_every_copy_answers():
    def copy(i: int, ready: bool) -> api.Endpoint:
        return api.Endpoint(pod="p0", node="n0", url=f"http://127.30.0.1:{8080 + i}", ready=ready, copyIndex=i)

    d = derive(Observed(1, True, "", [copy(0, True), copy(1, False)]))
    assert d.phase == "Scheduled" and d.ready == (False, "WorkersNotReady", "1/2 data-parallel copies answer /readyz "
                                                  "(0/1 pods with every copy ready)")
    assert d.scheduled == (True, "Scheduled", "1 pod(s) on n0")
    d = derive(Observed(1, True, "", [copy(0, True), copy(1, True)]))
    assert d.phase == "Ready" and d.ready[0] is True
