"""Cell handlers: own a Deployment of worker pods pinned to the certified topology, and report what happened."""

from __future__ import annotations

from typing import Any

import kopf
from pydantic import ValidationError

from modeld_operator import api, kube, metrics, placement
from modeld_operator.conditions import get_condition, set_condition
from modeld_operator.settings import SETTINGS

CELLS = (api.GROUP, api.VERSION, "cells")


def parse_spec(spec: Any) -> api.CellSpec:
    try:
        return api.CellSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise kopf.PermanentError(f"invalid Cell spec: {exc}") from exc


def _pod_endpoint(pod: dict[str, Any], port: int) -> tuple[api.Endpoint | None, str | None]:
    """The pod's worker endpoint, or why the scheduler could not place it."""
    status, meta, spec = pod.get("status") or {}, pod["metadata"], pod.get("spec") or {}
    conds = {c["type"]: c for c in status.get("conditions") or []}
    sched = conds.get("PodScheduled")
    if sched and sched.get("status") == "False":
        return None, sched.get("message") or sched.get("reason") or "unschedulable"
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
        return api.Endpoint(pod=meta["name"], node=spec.get("nodeName")), None
    url = f"http://{ip}:{port}"
    ready = conds.get("Ready", {}).get("status") == "True"
    if ready and SETTINGS.probe_endpoints:
        code, _ = kube.http_json("GET", f"{url}/readyz", SETTINGS.probe_timeout)
        ready = code == 200
    return api.Endpoint(pod=meta["name"], node=spec.get("nodeName"), url=url, ready=ready), None


def refresh_status(name: str, namespace: str, body: kopf.Body, spec: api.CellSpec) -> placement.Placement:
    """Derive the Cell's status from nodes, pods, workers and bound sessions; patch it if anything changed."""
    nodes = [placement.NodeView.from_obj(n) for n in kube.list_nodes()]
    plan = placement.place(spec, nodes)
    pods = kube.list_pods(namespace, f"{api.LABEL_CELL}={name}")
    endpoints: list[api.Endpoint] = []
    unschedulable: list[str] = []
    for pod in pods:
        endpoint, why = _pod_endpoint(pod, spec.port)
        if endpoint:
            endpoints.append(endpoint)
        if why:
            unschedulable.append(why)
    ready = sum(1 for e in endpoints if e.ready)
    scheduled = sum(1 for e in endpoints if e.node)
    sessions = len(kube.list_objects("sessions", namespace, f"{api.LABEL_CELL}={name}"))
    generation = body.get("metadata", {}).get("generation")
    old = dict(body.get("status") or {})

    sched: tuple[bool | None, str, str]
    if spec.replicas == 0:
        phase, sched = "Stopped", (None, "ScaledToZero", "spec.replicas is 0")
    elif not plan.schedulable:
        phase, sched = "Unschedulable", (False, "NoMatchingNodes", plan.reason)
    elif unschedulable and not scheduled:
        phase, sched = "Unschedulable", (False, "Unschedulable", unschedulable[0])
    elif scheduled >= spec.replicas:
        phase = "Ready" if ready >= spec.replicas else "Scheduled"
        sched = (True, "Scheduled", f"{scheduled} pod(s) on {', '.join(sorted({e.node or '' for e in endpoints if e.node}))}")
    else:
        phase = "Ready" if ready else "Pending"
        sched = (False, "Pending", f"{scheduled}/{spec.replicas} pods scheduled" + (f": {unschedulable[0]}" if unschedulable else ""))
    ready_cond = (
        (ready >= spec.replicas > 0),
        "WorkersReady" if ready >= spec.replicas > 0 else "WorkersNotReady",
        f"{ready}/{spec.replicas} workers answer /readyz",
    )

    conditions, changed_sched = set_condition(old.get("conditions"), "Scheduled", sched[0], sched[1], sched[2], generation)
    conditions, changed_ready = set_condition(conditions, "Ready", ready_cond[0], ready_cond[1], ready_cond[2], generation)
    if get_condition(conditions, "Certified") is None:
        conditions, _changed = set_condition(conditions, "Certified", None, "NotCertified", "not measured yet", generation)

    status = api.CellStatus(
        phase=phase,
        observedGeneration=generation,
        replicas=len(pods),
        readyReplicas=ready,
        endpoints=endpoints,
        nodes=plan.nodes,
        sessions=sessions,
        certification=old.get("certification"),
        conditions=[api.Condition.model_validate(c) for c in conditions],
    ).model_dump(mode="json", exclude_none=True)
    if status != {k: v for k, v in old.items() if k in status}:
        kube.patch_status("cells", namespace, name, status)
    if changed_sched:
        kopf.event(body, type="Normal" if sched[0] else "Warning", reason=sched[1], message=sched[2])
    if changed_ready and ready_cond[0]:
        kopf.event(body, type="Normal", reason="Ready", message=ready_cond[2])
    metrics.CELL_READY_REPLICAS.labels(namespace, name).set(ready)
    return plan


@kopf.on.resume(*CELLS)
@kopf.on.create(*CELLS)
@kopf.on.update(*CELLS, field="spec")
def reconcile(name: str, namespace: str | None, body: kopf.Body, spec: kopf.Spec, logger: Any, **_: Any) -> None:
    namespace = kube.namespaced(namespace)
    cell = parse_spec(spec)
    manifest = placement.deployment(name, namespace, cell)
    kopf.append_owner_reference(manifest, owner=body)
    kube.apply_deployment(manifest)
    plan = refresh_status(name, namespace, body, cell)
    metrics.RECONCILES.labels("cell", "ok" if plan.schedulable else "waiting").inc()
    if not plan.schedulable and cell.replicas:
        # Nodes may still join: wait for capacity instead of failing, and never crash-loop.
        raise kopf.TemporaryError(plan.reason, delay=SETTINGS.retry_delay)
    logger.info("cell %s reconciled: %d candidate node(s)", name, len(plan.nodes))


@kopf.timer(*CELLS, interval=SETTINGS.status_interval, initial_delay=1.0)
def watch_status(name: str, namespace: str | None, body: kopf.Body, spec: kopf.Spec, **_: Any) -> None:
    namespace = kube.namespaced(namespace)
    refresh_status(name, namespace, body, parse_spec(spec))


@kopf.on.delete(*CELLS)
def release_sessions(name: str, namespace: str | None, logger: Any, **_: Any) -> None:
    """The Deployment goes with its owner; sessions bound here go back to Pending and get rebound."""
    namespace = kube.namespaced(namespace)
    for sess in kube.list_objects("sessions", namespace, f"{api.LABEL_CELL}={name}"):
        sname = sess["metadata"]["name"]
        kube.patch_labels("sessions", namespace, sname, {api.LABEL_CELL: None})
        old = sess.get("status") or {}
        conditions, _changed = set_condition(
            old.get("conditions"), "Bound", False, "CellDeleted", f"cell {name} was deleted", sess["metadata"].get("generation")
        )
        kube.patch_status(
            "sessions", namespace, sname,
            {"phase": "Pending", "cell": None, "endpoint": None, "pod": None, "reason": f"cell {name} was deleted", "conditions": conditions},
        )
        logger.info("session %s released from deleted cell %s", sname, name)
