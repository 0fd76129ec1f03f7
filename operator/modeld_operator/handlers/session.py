"""Session handlers: bind each Session to a ready cell that fits it, keep it bound, release it on delete."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any
from urllib.parse import quote

import kopf
from pydantic import ValidationError

import modeld_api as api
from modeld_operator import kube, metrics, placement
from modeld_operator.conditions import now, set_condition, spec_errors
from modeld_operator.handlers.indexes import BINDINGS, CELL_CHANGES, SESSIONS, BoundSession, CellEntry, alive, store
from modeld_operator.handlers.rejected import Reported, emit, surfaced
from modeld_operator.settings import SETTINGS

log = logging.getLogger("modeld_operator.session")


def covering(summary: dict[str, Any], required: int) -> tuple[int | None, float | None, float | None]:
    """(the smallest certified tier that covers ``required`` tokens, its first-output p90 ms, its decode p90 ms per
    token); (None, None, None) when the certification measured no such tier."""
    fo = summary.get("firstOutputP90Ms") or {}
    dec = summary.get("decodeP90MsPerToken") or {}
    try:
        tiers = sorted((int(t), float(ms)) for t, ms in fo.items() if ms is not None)
    except (AttributeError, TypeError, ValueError):
        return None, None, None
    for tier, ms in tiers:
        if tier >= required:
            d = dec.get(str(tier))
            return tier, ms, float(d) if isinstance(d, (int, float)) else None
    return None, None, None


def _cell_views(namespace: str, required: int, cells: kopf.Index[Any, CellEntry] | None,
                sessions: kopf.Index[Any, Any] | None) -> list[placement.CellView]:
    """The namespace's Cells as binding weighs them, from the indexes (no list call per bind)."""
    views = []
    for entry in store(cells, namespace):
        if entry.spec is None:
            continue  # the cell's own handler reports it
        tier, fo, dec = covering(entry.summary, required)
        views.append(
            placement.CellView(
                name=entry.name,
                spec=entry.spec,
                ready_endpoints=list(entry.ready_endpoints),
                sessions=len(store(sessions, (namespace, entry.name))),
                certified=entry.certified,
                first_output_p90_ms=fo,
                decode_p90_ms=dec,
                covering_tier=tier,
                gate=entry.gate,
            )
        )
    return views


def worker_session_id(namespace: str, name: str) -> str:
    return f"{namespace}.{name}"


RECOVER_TIMEOUT_S = 300.0   # asking a replaced worker for a session: it recovers it from its store first (a prefill)


def continuity(url: str, session_id: str) -> tuple[bool | None, str, str]:
    """After the session's worker process was replaced: ask the new one for the session (GET, which recovers it from
    the cell's session store) and say what became of it: (True, Restored, ...), (False, Lost | NotHeld, ...), or
    (None, Unknown, ...) when the worker did not answer (asked again next time)."""
    code, out = kube.http_json("GET", f"{url}/v1/sessions/{quote(session_id)}", RECOVER_TIMEOUT_S)
    out = out if isinstance(out, dict) else {}
    if code == 200:
        r = out.get("restored") or {}
        if r.get("tokens_restored") is not None:
            return True, "Restored", (f"the worker process was replaced; {r['tokens_restored']} committed tokens "
                                      f"restored from the session store in {r.get('restore_ms', 0):,.0f} ms (a request "
                                      "in flight when it stopped was not committed: retry it)")
        return True, "Restored", "the worker process was replaced; the new one holds the session (recovered earlier)"
    if code == 404:
        lost = ((out.get("error") or {}).get("details") or {}).get("lost")
        if lost:
            return False, "Lost", f"the worker process was replaced and the session's stored state is unusable: {lost}"[:900]
        return False, "NotHeld", ("the worker process was replaced and holds no state of this session: what the old one "
                                  "held in memory is lost (the cell has no session store, or nothing was committed)")
    return None, "Unknown", f"the worker process was replaced; asking it for the session gave HTTP {code or 'no answer'}"


def _bind(name: str, namespace: str, body: kopf.Body, spec: api.SessionSpec, kw: dict[str, Any]) -> None:
    """Bind to the best fitting cell; when none fits, say why on the status (written only when it changed) and
    return: the session's timer retries while it is not Bound. Raises PermanentError when no change in the cluster
    can make it fit."""
    status = dict(body.get("status") or {})
    generation = body["metadata"].get("generation")
    views = _cell_views(namespace, spec.requiredContext, kw.get("cell_index"), kw.get("session_index"))
    fit = placement.choose_cell(spec, views, SETTINGS.require_certified)
    candidates = [api.Candidate(cell=c, chosen=chosen, reason=why[:400]).model_dump(mode="json")
                  for c, chosen, why in fit.considered[:32]]
    if fit.cell is None or fit.endpoint is None:
        conditions, changed = set_condition(status.get("conditions"), "Bound", False, "NoFittingCell", fit.reason, generation)
        pending = {"phase": "Pending", "reason": fit.reason, "observedGeneration": generation,
                   "conditions": conditions, "candidates": candidates}
        if pending != {k: status.get(k) for k in pending}:
            kw["patch"]["status"] = pending
        if changed:
            emit(body, "Warning", "NoFittingCell", fit.reason)
        metrics.RECONCILES.labels("session", "waiting").inc()
        if fit.permanent:
            raise Reported(fit.reason)
        return
    # The status goes out in the caller's patch (kopf's, written when the handler returns; the sweep's, written by it):
    # one write per bind. The binding lives in the status alone (status.cell is a selectable field).
    conditions, _ = set_condition(status.get("conditions"), "Bound", True, "Bound", fit.reason, generation)
    sid, prev, instance = worker_session_id(namespace, name), status.get("workerInstance"), fit.endpoint.instance
    continued = None
    if prev and instance and prev != instance and fit.endpoint.url:   # bound before, to a process now gone
        continued = continuity(fit.endpoint.url, sid)
        conditions, _ = set_condition(conditions, "Continuity", continued[0], continued[1], continued[2], generation)
        if continued[0] is None:
            instance = prev                           # not answered: asked again at the next check
    kw["patch"]["status"] = (
        {
            "phase": "Bound",
            "cell": fit.cell.name,
            "endpoint": fit.endpoint.url,
            "pod": fit.endpoint.pod,
            "sessionId": sid,
            "workerInstance": instance,
            "boundAt": now(),
            "reason": fit.reason,
            "candidates": candidates,
            "observedGeneration": generation,
            "conditions": conditions,
        }
    )
    BINDINGS.made(namespace, name)
    emit(body, "Normal", "Bound", f"{fit.reason} at {fit.endpoint.url}")
    if continued is not None and continued[0] is not None:
        emit(body, "Normal" if continued[0] else "Warning", f"Session{continued[1]}", continued[2])
    created = dt.datetime.fromisoformat(body["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    metrics.BIND_SECONDS.observe((dt.datetime.now(dt.timezone.utc) - created).total_seconds())
    metrics.RECONCILES.labels("session", "bound").inc()


def _binding_alive(namespace: str, status: dict[str, Any], cells: kopf.Index[Any, CellEntry] | None) -> bool:
    """The bound endpoint is ready and still the same worker process (a new /readyz instance: it was replaced)."""
    found: list[CellEntry] = store(cells, (namespace, status.get("cell") or ""))
    if not found:
        return False
    bound = BoundSession("", status.get("endpoint"), status.get("workerInstance"))
    return alive(bound, list(found[0].ready_endpoints))


def parse_spec(spec: Any) -> api.SessionSpec:
    try:
        return api.SessionSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise kopf.PermanentError(f"invalid Session spec: {spec_errors(exc)}") from exc


@surfaced("sessions")
def reconcile(name: str, namespace: str | None, body: Any, spec: Any, **kw: Any) -> None:
    _bind_unless_bound(name, kube.namespaced(namespace), body, spec, kw)


def _bind_unless_bound(name: str, namespace: str, body: Any, spec: Any, kw: dict[str, Any]) -> None:
    """Bind, unless the session is bound and alive (at its generation: a changed spec binds again), or this process
    bound it after ``body`` was read (the watch handler and the retry sweep run apart; each may hold a body older
    than the other's bind)."""
    status = dict(body.get("status") or {})
    with BINDINGS.lock(namespace, name):
        if BINDINGS.ahead_of(namespace, name, status):
            return
        if (status.get("phase") == "Bound" and status.get("observedGeneration") == body["metadata"].get("generation")
                and _binding_alive(namespace, status, kw.get("cell_index"))):
            return
        _bind(name, namespace, body, parse_spec(spec), kw)


@kopf.on.event(*SESSIONS)
def session_event(type: str | None, name: str, namespace: str | None, body: kopf.Body, spec: kopf.Spec,
                  **kw: Any) -> None:
    """Level-triggered, as Kubernetes' own controllers are: each watch event of a Session (and each at start-up) binds
    it unless it is bound, alive and at its generation. A watch handler stores no state on the object: no finalizer,
    no kopf annotations, so a bind is one status write and an Event (docs/operator.md, "Scale"). What it cannot bind
    now (no fitting cell yet, a failed write) the retry sweep binds later."""
    namespace = kube.namespaced(namespace)
    if type == "DELETED":
        release(name, namespace, body)
        return
    if body["metadata"].get("deletionTimestamp"):
        return
    try:
        reconcile(name=name, namespace=namespace, body=body, spec=spec, **kw)
    except kopf.PermanentError:
        pass                      # on the status already (surfaced); a spec change is a new event
    except kopf.TemporaryError as exc:
        log.info("session %s/%s: %s; the retry sweep binds it", namespace, name, exc)


def release(name: str, namespace: str, body: kopf.Body) -> None:
    """Free a deleted session's KV on its worker; best effort, since the worker may be gone already (a worker evicts
    an unused session's blocks under pressure anyway). No finalizer holds the Session for it."""
    BINDINGS.forget(namespace, name, deleted=True)
    status = body.get("status") or {}
    endpoint, session_id = status.get("endpoint"), status.get("sessionId")
    if endpoint and session_id:
        code, _ = kube.http_json("DELETE", f"{endpoint}/v1/sessions/{quote(session_id)}", SETTINGS.probe_timeout)
        log.info("session %s/%s closed on %s: HTTP %s", namespace, name, endpoint, code or "unreachable")


def retry_one(entry: dict[str, Any], cells: Any, sessions: Any) -> bool:
    """Bind one pending Session again (the sweep, outside kopf: it writes its own status and posts its own Events).
    Returns whether it wrote anything."""
    meta = entry["metadata"]
    patch: dict[str, Any] = {}
    try:
        reconcile(name=meta["name"], namespace=meta["namespace"], body=entry, spec=entry["spec"], patch=patch,
                  cell_index=cells, session_index=sessions)
    except (kopf.PermanentError, kopf.TemporaryError):
        return False
    if patch.get("status"):
        kube.patch_status("sessions", meta["namespace"], meta["name"], patch["status"])
        return True
    return False


class RetrySweep:
    """Bind each Session that is not Bound again: one task for the operator instead of a kopf timer per Session. It
    runs when a Cell changed in what a bind reads (half a second later, so a burst of changes is one sweep) and at
    the latest every ``MODELD_RETRY_DELAY`` seconds. A Session sent back by its Cell (worker lost) is bound at once
    by its own watch event; the sweep is for those no cell fitted yet and binds whose write failed."""

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None

    async def run(self, pending: Any, cells: Any, sessions: Any) -> None:
        wake = CELL_CHANGES.event = asyncio.Event()
        while True:
            try:
                await asyncio.wait_for(wake.wait(), SETTINGS.retry_delay)
                await asyncio.sleep(0.5)
            except asyncio.TimeoutError:
                pass
            wake.clear()
            for entry in list(pending.get("pending", [])):
                try:
                    await asyncio.to_thread(retry_one, entry, cells, sessions)
                except Exception:                             # noqa: BLE001 - one session's failure stops no other
                    log.exception("retrying session %s", entry["metadata"].get("name"))


SWEEP = RetrySweep()


@kopf.on.startup()
async def start_sweep(**kw: Any) -> None:
    """kopf passes its indexes to start-up handlers too (empty until the first listing fills them)."""
    SWEEP.task = asyncio.get_running_loop().create_task(
        SWEEP.run(kw["pending_index"], kw["cell_index"], kw["session_index"]))


@kopf.on.cleanup()
async def stop_sweep(**_: Any) -> None:
    if SWEEP.task is not None:
        SWEEP.task.cancel()
        SWEEP.task = None
