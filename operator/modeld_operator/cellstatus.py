"""A Cell's phase and its Served / Scheduled / Ready conditions, derived from what the handler observed.

Pure: the Cell handler reads the cluster, calls ``derive`` and writes what it returns (tests/unit/test_cellstatus.py
builds the observations by hand). Certification is decided separately (handlers/cell.certify).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import modeld_api as api
from modeld_api.served import Unserved

# (status, reason, message) of one condition; status None is Unknown.
Verdict = tuple[bool | None, str, str]


@dataclass
class Observed:
    replicas: int                                           # spec.replicas
    schedulable: bool                                       # placement found nodes for the topology
    plan_reason: str                                        # placement's words when it did not
    endpoints: list[api.Endpoint] = field(default_factory=list)
    unschedulable: list[str] = field(default_factory=list)  # the scheduler's reasons for pods it could not place
    unserved: list[Unserved] = field(default_factory=list)  # spec values this worker version does not serve


@dataclass
class Derived:
    phase: str
    served: Verdict
    scheduled: Verdict
    ready: Verdict


def ready_pods(endpoints: list[api.Endpoint]) -> int:
    """Pods whose every endpoint answers (a data-parallel pod lists one per copy)."""
    pods: dict[str, bool] = {}
    for e in endpoints:
        pods[e.pod] = pods.get(e.pod, True) and e.ready
    return sum(pods.values())


def derive(o: Observed) -> Derived:
    """Phase and conditions. A Cell with an unserved value is Refused (no pods are made for it); a worker that
    refused its spec at start makes the Cell Failed with the worker's words; otherwise placement and readiness."""
    if o.unserved:
        why = "; ".join(u.message() for u in o.unserved)
        where = "the topology fits the nodes in status.nodes" if o.schedulable else f"placement: {o.plan_reason}"
        no_pods = f"no pods are created: {why}; {where}"
        return Derived("Refused", (False, "ValueNotServed", why), (False, "NotServed", no_pods),
                       (False, "NotServed", no_pods))
    served: Verdict = (True, "Served", "every spec value is served by this worker version")
    ready = ready_pods(o.endpoints)
    scheduled = len({e.pod for e in o.endpoints if e.node})
    refusals = sorted({e.refusal for e in o.endpoints if e.refusal})
    sched: Verdict
    if o.replicas == 0:
        phase, sched = "Stopped", (None, "ScaledToZero", "spec.replicas is 0")
    elif not o.schedulable:
        phase, sched = "Unschedulable", (False, "NoMatchingNodes", o.plan_reason)
    elif o.unschedulable and not scheduled:
        phase, sched = "Unschedulable", (False, "Unschedulable", o.unschedulable[0])
    elif scheduled >= o.replicas:
        phase = "Ready" if ready >= o.replicas else "Scheduled"
        nodes = ", ".join(sorted({e.node or "" for e in o.endpoints if e.node}))
        sched = (True, "Scheduled", f"{scheduled} pod(s) on {nodes}")
    else:
        phase = "Ready" if ready else "Pending"
        sched = (False, "Pending", f"{scheduled}/{o.replicas} pods scheduled"
                 + (f": {o.unschedulable[0]}" if o.unschedulable else ""))
    if refusals:
        return Derived("Failed", served, sched, (False, "WorkerRefusedSpec", "; ".join(refusals)))
    ok = ready >= o.replicas > 0
    copies = len(o.endpoints) // max(1, len({e.pod for e in o.endpoints}))
    answering = (f"{sum(1 for e in o.endpoints if e.ready)}/{len(o.endpoints)} data-parallel copies answer /readyz "
                 f"({ready}/{o.replicas} pods with every copy ready)" if copies > 1
                 else f"{ready}/{o.replicas} workers answer /readyz")
    return Derived(phase, served, sched, (ok, "WorkersReady" if ok else "WorkersNotReady", answering))
