"""Cell handlers: own a Deployment of worker pods pinned to the certified topology, and report what happened."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import kopf
from pydantic import ValidationError

import modeld_api as api
from modeld_api.served import unserved
from modeld_operator import cellstatus, certification, kube, metrics, placement
from modeld_operator.conditions import get_condition, set_condition, spec_errors
from modeld_operator.conditions import now as conditions_now
from modeld_operator.handlers.indexes import (  # noqa: F401  (NODES, node_index: re-exported for their tests)
    BINDINGS,
    CACHES,
    CELL_CHANGES,
    CELLS,
    NODES,
    OWNED,
    SESSION_CACHE,
    BoundSession,
    CellEntry,
    alive,
    node_index,
    store,
)
from modeld_operator.handlers.rejected import holds, surfaced
from modeld_operator.settings import SETTINGS

log = logging.getLogger("modeld_operator.cell")


def parse_spec(spec: Any) -> api.CellSpec:
    try:
        return api.CellSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise kopf.PermanentError(f"invalid Cell spec: {spec_errors(exc)}") from exc


def _pod_endpoints(pod: dict[str, Any], port: int, copies: int = 1) -> tuple[list[api.Endpoint], str | None]:
    """The pod's worker endpoints (one; a data-parallel pod's copies, copy i on port + i), or why the scheduler
    could not place it."""
    status, meta, spec = pod.get("status") or {}, pod["metadata"], pod.get("spec") or {}
    conds = {c["type"]: c for c in status.get("conditions") or []}
    sched = conds.get("PodScheduled")
    if sched and sched.get("status") == "False":
        return [], sched.get("message") or sched.get("reason") or "unschedulable"
    index = (lambda i: i) if copies > 1 else (lambda i: None)
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
        return [api.Endpoint(pod=meta["name"], node=spec.get("nodeName"), copyIndex=index(i))
                for i in range(copies)], None
    kubelet_ready = conds.get("Ready", {}).get("status") == "True"   # it probes copy 0's port only
    out = []
    for i in range(copies):
        url = f"http://{ip}:{port + i}"
        ready, refusal, instance = kubelet_ready, None, None          # every copy answers its own /readyz below
        if SETTINGS.probe_endpoints:
            # asked even when the kubelet says not ready: a worker that refused its spec says why on /readyz
            code, body = kube.http_json("GET", f"{url}/readyz", SETTINGS.probe_timeout)
            ready = ready and code == 200
            refusal = worker_refusal(code, body)
            if code == 200 and isinstance(body, dict) and isinstance(body.get("instance"), str):
                instance = body["instance"][:64]
        out.append(api.Endpoint(pod=meta["name"], node=spec.get("nodeName"), url=url, ready=ready, refusal=refusal,
                                copyIndex=index(i), instance=instance))
    return out, None


def runs_spec(pod: dict[str, Any], spec: api.CellSpec) -> bool:
    """The pod's worker runs ``spec`` as it is now (the pod template's spec hash)."""
    annotations = pod["metadata"].get("annotations") or {}
    return annotations.get(api.ANNOTATION_SPEC_HASH) == placement.spec_hash(spec)


def worker_refusal(code: int, body: Any) -> str | None:
    """The refusal a worker's /readyz reports (kind unsupported or bad_request, naming the field), else None."""
    err = body.get("error") if isinstance(body, dict) else None
    if code in (400, 501) and isinstance(err, dict) and (err.get("details") or {}).get("refused"):
        field = (err.get("details") or {}).get("field")
        return (f"spec.{field}: " if field else "") + str(err.get("message", ""))[:900]
    return None


def certify(
    name: str, namespace: str, body: kopf.Body, spec: api.CellSpec, endpoints: list[api.Endpoint],
    idx: Indexes, old: dict[str, Any] | None,
) -> tuple[dict[str, Any] | None, certification.Verdict | None, str | None]:
    """Read what certification.next_step needs (from the indexes), call it, act on its Step. Returns the
    status.certification to store, the Certified condition (None: leave both as they are) and the certification Job
    whose pods it read (None: none). ``endpoints``: those
    of pods running the spec as it is now (a changed spec's old pod is still ready until the Deployment replaces
    it: measured, it would certify the old spec under the new key)."""
    ready = [e for e in endpoints if e.ready and e.url]
    baseline = None
    if spec.baseline:
        found: list[CellEntry] = store(idx.cells, (namespace, spec.baseline))
        bentry = found[0] if found else None
        baseline = certification.Baseline(
            spec.baseline, missing=bentry is None, spec=bentry.spec if bentry is not None else None,
            url=bentry.ready_endpoints[0].url if bentry is not None and bentry.ready_endpoints else None)
    node = store(idx.nodes, ("node", ready[0].node)) if ready and ready[0].node else []
    o = certification.Observed(
        name=name, namespace=namespace, spec=spec, ready_url=ready[0].url if ready else None,
        node_labels=dict(node[0].labels) if node else {}, old=old,
        annotations=dict(body.get("metadata", {}).get("annotations") or {}), baseline=baseline, now=conditions_now())
    if (job := certification.jobs_to_read(o)) is not None:
        o = dataclasses.replace(o, job_pods=store(idx.pods, ("job", namespace, job)))
    step = certification.next_step(o)
    created = False
    if step.job is not None:
        kopf.append_owner_reference(step.job, owner=body)
        created = kube.create_job(step.job)
    # The step asks for the Job until its pod is indexed (a second or so, a refresh each): one Event, at its creation
    if step.event is not None and (created or step.job is None):
        kopf.event(body, type="Normal", reason=step.event[0], message=step.event[1])
    return step.cert, step.verdict, job


@dataclasses.dataclass(frozen=True)
class Indexes:
    """The indexes a Cell handler reads (indexes.py: ``CACHES``; the bound Sessions from the Session controller's
    cache, session.py)."""
    nodes: Any                       # each an informer.Index, read by .get(key, default) (store())
    pods: Any
    cells: Any
    sessions: Any

    @classmethod
    def of(cls, kw: dict[str, Any]) -> Indexes:
        return cls(CACHES.nodes, CACHES.pods, CACHES.cells, SESSION_CACHE.bound)


_PLANS: dict[tuple[str, str], tuple[tuple[int, int], str, placement.Placement]] = {}
# The same placement for every Cell of the same spec over the same nodes (place is a pure function of the two): an
# operator's start reconciled 1,000 Cells of one spec, placing each over 500 nodes, a tenth of its CPU in its first
# 25 s (py-spy). Emptied whenever the nodes changed, and kept to SHARED_PLANS_MAX specs.
_SHARED_PLANS: dict[str, tuple[tuple[int, int], placement.Placement]] = {}
SHARED_PLANS_MAX = 256


def planned(namespace: str, name: str, spec: api.CellSpec, idx: Indexes) -> placement.Placement:
    """placement.place over the indexed nodes, recomputed only when the spec or a node changed."""
    nodes: list[placement.NodeView] = store(idx.nodes, "all")
    seen, key = (NODES.version, len(nodes)), spec.model_dump_json()
    hit = _PLANS.get((namespace, name))
    if hit is not None and hit[0] == seen and hit[1] == key:
        return hit[2]
    shared = _SHARED_PLANS.get(key)
    if shared is not None and shared[0] == seen:
        plan = shared[1]
    else:
        plan = placement.place(spec, nodes)
        if len(_SHARED_PLANS) >= SHARED_PLANS_MAX or any(v[0] != seen for v in _SHARED_PLANS.values()):
            _SHARED_PLANS.clear()
        _SHARED_PLANS[key] = (seen, plan)
    _PLANS[(namespace, name)] = (seen, key, plan)
    return plan


@dataclasses.dataclass(frozen=True)
class Refreshed:
    """What a Cell's last whole refresh read (``inputs``), when, the certification Job whose pods it read, the count
    of bound Sessions its status holds, and since when a newer count is held back (None: none is)."""
    at: float
    inputs: tuple[Any, ...]
    job: str | None
    sessions: int | None
    held_since: float | None = None


def _held_from(last: Refreshed | None, now: float) -> float:
    """Since when a newer count is held back, if it is held from ``now`` on."""
    return last.held_since if last is not None and last.held_since is not None else now


# A timer refresh that reads what the last one read derives the same status, Events and releases, so it stops there:
# at 1,000 Cells kopf's timers make 200 refreshes a second, and nearly all find nothing new. A Cell is refreshed whole
# at least every FULL_REFRESH_S all the same, so an input this misses cannot keep a status stale for longer.
FULL_REFRESH_S = 60.0
_REFRESHED: dict[tuple[str, str], Refreshed] = {}


def _inputs(body: kopf.Body, spec: api.CellSpec, idx: Indexes, namespace: str, pods: list[Any],
            endpoints: list[api.Endpoint], bound: list[BoundSession], job: str | None) -> tuple[Any, ...] | None:
    """Everything a refresh derives from but the count of bound Sessions (None: not known well enough to skip one).
    The Cell itself by its resourceVersion (spec, status, annotations); the nodes by what placement reads of them; its
    pods and their endpoints (a worker's /readyz answer included when probed); the workers its Sessions are bound to
    (a Session bound to a live worker is not sent back, so more of them change only the count); the baseline Cell;
    the pods of the certification Job the last refresh read."""
    rv = (body.get("metadata") or {}).get("resourceVersion")
    if rv is None:
        return None
    baseline = store(idx.cells, (namespace, spec.baseline)) if spec.baseline else None
    job_pods = store(idx.pods, ("job", namespace, job)) if job else None
    return (rv, NODES.version, pods, endpoints, frozenset((s.endpoint, s.instance) for s in bound), baseline,
            job_pods)


def refresh_status(name: str, namespace: str, body: kopf.Body, spec: api.CellSpec, idx: Indexes,
                   patch: kopf.Patch | None = None, clock: Any = time.monotonic) -> placement.Placement:
    """Derive the Cell's status from nodes, pods and bound sessions (all from the indexes: no list call) and its
    workers; patch it if anything changed: into kopf's ``patch`` when given (a reconcile handler's: it goes out with
    kopf's own annotations; written apart, its watch event reached kopf before them and kopf ran the create handler
    again on it), else at once (the timer). Sessions bound to a worker that is gone, not ready or replaced are sent
    back to be rebound.

    The timer's refresh stops early when it reads what the last one read (``_inputs``), and, while Sessions wait in
    the bind queue, when only the count of bound Sessions changed: that count is written once the queue is empty
    (at 10,000 Sessions those writes were a tenth of the apiserver's status patches while binds waited)."""
    plan = planned(namespace, name, spec, idx)
    pods = store(idx.pods, ("cell", namespace, name))
    endpoints: list[api.Endpoint] = []
    unschedulable: list[str] = []
    for pod in pods:
        eps, why = _pod_endpoints(pod, spec.port, placement.copies_of(spec))
        endpoints += eps
        if why:
            unschedulable.append(why)
    bound = store(idx.sessions, (namespace, name))
    key, now = (namespace, name), clock()
    last = _REFRESHED.get(key)
    if patch is None and last is not None and now - last.at < FULL_REFRESH_S:
        inputs = _inputs(body, spec, idx, namespace, pods, endpoints, bound, last.job)
        if inputs is not None and inputs == last.inputs:
            if last.sessions == len(bound):
                return plan
            if kube.BINDS.waiting() and now - _held_from(last, now) < FULL_REFRESH_S:   # the count alone: held
                if last.held_since is None:
                    _REFRESHED[key] = dataclasses.replace(last, held_since=now)
                return plan
    release_lost(namespace, name, bound, endpoints)
    ready = cellstatus.ready_pods(endpoints)
    sessions = len(bound)
    generation = body.get("metadata", {}).get("generation")
    old = dict(body.get("status") or {})
    d = cellstatus.derive(cellstatus.Observed(spec.replicas, plan.schedulable, plan.reason, endpoints, unschedulable,
                                              unserved(spec)))
    phase, sched, ready_cond = d.phase, d.scheduled, d.ready
    if holds(old, generation):
        phase = "Failed"             # its reconcile was refused (the Reconciled condition says what and why)

    conditions, changed_served = set_condition(old.get("conditions"), "Served", d.served[0], d.served[1],
                                               d.served[2], generation)
    conditions, changed_sched = set_condition(conditions, "Scheduled", sched[0], sched[1], sched[2], generation)
    conditions, changed_ready = set_condition(conditions, "Ready", ready_cond[0], ready_cond[1], ready_cond[2], generation)
    current = {p["metadata"]["name"] for p in pods if runs_spec(p, spec)}
    cert, verdict, job = (certify(name, namespace, body, spec, [e for e in endpoints if e.pod in current], idx,
                                  old.get("certification"))
                          if d.served[0] else (old.get("certification"), None, None))
    changed_cert = False
    if not d.served[0]:
        conditions, changed_cert = set_condition(conditions, "Certified", False, "NotServed", d.served[2], generation)
    elif verdict is not None:
        conditions, changed_cert = set_condition(conditions, "Certified", verdict[0], verdict[1], verdict[2], generation)
    elif get_condition(conditions, "Certified") is None:
        conditions, _changed = set_condition(conditions, "Certified", None, "NotCertified", "no ready worker to measure yet", generation)

    status = api.CellStatus(
        phase=phase,
        observedGeneration=generation,
        replicas=len(pods),
        readyReplicas=ready,
        endpoints=endpoints,
        nodes=plan.nodes[:api.STATUS_NODES_MAX],
        nodeCount=len(plan.nodes),
        service=placement.deployment_name(name) if d.served[0] else None,
        sessions=sessions,
        certification=api.Certification.model_validate(cert) if cert else None,
        conditions=[api.Condition.model_validate(c) for c in conditions],
    ).model_dump(mode="json", exclude_none=True)
    held, held_since = {k: v for k, v in old.items() if k in status}, None
    if status != held and kube.BINDS.waiting() and {k: v for k, v in status.items() if k != "sessions"} == {
            k: v for k, v in held.items() if k != "sessions"}:
        # only the count changed, and binds wait: written once they are done, or once it has waited FULL_REFRESH_S
        # (a queue that never empties cannot hold it for ever)
        held_since = _held_from(last, now)
        if now - held_since < FULL_REFRESH_S:
            status = held
        else:
            held_since = None
    if status != held:
        if patch is not None:
            patch["status"] = status
        else:
            kube.patch_status("cells", namespace, name, status)
    _REFRESHED[key] = Refreshed(now, _inputs(body, spec, idx, namespace, pods, endpoints, bound, job) or (),
                                job, status.get("sessions"), held_since if status is held else None)
    if changed_served and not d.served[0]:
        kopf.event(body, type="Warning", reason=d.served[1], message=d.served[2][:1000])
    if changed_sched and d.served[0]:
        kopf.event(body, type="Normal" if sched[0] else "Warning", reason=sched[1], message=sched[2])
    if changed_ready and ready_cond[1] == "WorkerRefusedSpec":
        kopf.event(body, type="Warning", reason=ready_cond[1], message=ready_cond[2][:1000])
    if changed_cert and verdict is not None and verdict[0] is not None:
        kopf.event(body, type="Normal" if verdict[0] else "Warning", reason=verdict[1], message=verdict[2][:1000])
    if changed_ready and ready_cond[0]:
        kopf.event(body, type="Normal", reason="Ready", message=ready_cond[2])
    metrics.CELL_READY_REPLICAS.labels(namespace, name).set(ready)
    certified = (get_condition(conditions, "Certified") or {}).get("status")
    metrics.CELL_CERTIFIED.labels(namespace, name).set({"True": 1, "False": 0}.get(str(certified), -1))
    return plan


@kopf.on.resume(*CELLS)
@kopf.on.create(*CELLS)
@kopf.on.update(*CELLS, field="spec")
@surfaced("cells")
def reconcile(name: str, namespace: str | None, body: kopf.Body, spec: kopf.Spec, logger: Any, **kw: Any) -> None:
    namespace = kube.namespaced(namespace)
    cell, idx = parse_spec(spec), Indexes.of(kw)
    if refused := unserved(cell):
        # nothing would serve it: no pods (none hold GPUs or crash-loop); status says which field and why
        kube.stop_deployment(namespace, placement.deployment_name(name))
        refresh_status(name, namespace, body, cell, idx, kw["patch"])
        metrics.RECONCILES.labels("cell", "refused").inc()
        logger.info("cell %s refused: %s", name, "; ".join(u.message() for u in refused))
        return
    # Applied only when the live object is not as the manifest says (or another writer changed its spec): a restart
    # re-applied every Cell's two, changing nothing (OWNED says why that mattered)
    manifest = placement.deployment(name, namespace, cell)
    kopf.append_owner_reference(manifest, owner=body)
    if not OWNED.unchanged("deployments", manifest, placement.stamp(manifest)):
        kube.apply_deployment(manifest)
    svc = placement.service(name, namespace, cell)
    kopf.append_owner_reference(svc, owner=body)
    if not OWNED.unchanged("services", svc, placement.stamp(svc)):
        kube.apply_service(svc)
    plan = refresh_status(name, namespace, body, cell, idx, kw["patch"])
    metrics.RECONCILES.labels("cell", "ok" if plan.schedulable else "waiting").inc()
    if not plan.schedulable and cell.replicas:
        # Nodes may still join: wait for capacity instead of failing, and never crash-loop.
        raise kopf.TemporaryError(plan.reason, delay=SETTINGS.retry_delay)
    logger.info("cell %s reconciled: %d candidate node(s)", name, len(plan.nodes))


@kopf.timer(*CELLS, interval=SETTINGS.status_interval, initial_delay=1.0)
@surfaced("cells", clears=False)
def watch_status(name: str, namespace: str | None, body: kopf.Body, spec: kopf.Spec, **kw: Any) -> None:
    namespace = kube.namespaced(namespace)
    refresh_status(name, namespace, body, parse_spec(spec), Indexes.of(kw))


def release_lost(namespace: str, cell: str, bound: list[BoundSession], endpoints: list[api.Endpoint]) -> None:
    """Send the sessions bound to a worker that is gone, not ready or replaced back to be rebound (their own timer
    runs while they are not Bound); the worker instance they knew stays, so the rebind can tell a replaced process
    and ask it for the session."""
    for s in bound:
        if not alive(s, endpoints):
            send_back(namespace, s.name, "WorkerLost",
                      f"its worker at {s.endpoint} is gone, not ready or was replaced; rebinding")


def send_back(namespace: str, session: str, reason: str, message: str) -> None:
    obj = kube.get_object("sessions", namespace, session)
    if obj is None:
        return
    BINDINGS.forget(namespace, session)
    if api.LABEL_CELL in (obj["metadata"].get("labels") or {}):   # an older operator labelled its bindings
        kube.patch_labels("sessions", namespace, session, {api.LABEL_CELL: None})
    old = obj.get("status") or {}
    conditions, _changed = set_condition(old.get("conditions"), "Bound", False, reason, message,
                                         obj["metadata"].get("generation"))
    kube.patch_status("sessions", namespace, session, {"phase": "Pending", "cell": None, "endpoint": None, "pod": None,
                                                       "reason": message, "conditions": conditions})
    log.info("session %s/%s: %s", namespace, session, message)


@kopf.on.delete(*CELLS, backoff=5)
def release_sessions(name: str, namespace: str | None, **kw: Any) -> None:
    """The Deployment goes with its owner; sessions bound here go back to Pending and get rebound."""
    namespace = kube.namespaced(namespace)
    _PLANS.pop((namespace, name), None)
    _REFRESHED.pop((namespace, name), None)
    CELL_CHANGES.forget(namespace, name)
    metrics.forget_cell(namespace, name)
    # the index, and the apiserver (one list per deleted Cell, by the selectable field status.cell): a session whose
    # bind landed as the Cell went may be in only one of them yet, and nothing would ever check a binding to a Cell
    # that is gone
    names = {s.name for s in store(Indexes.of(kw).sessions, (namespace, name))}
    names |= {o["metadata"]["name"] for o in kube.list_objects("sessions", namespace, field_selector=f"status.cell={name}")}
    for session in sorted(names):
        send_back(namespace, session, "CellDeleted", f"cell {name} was deleted")
