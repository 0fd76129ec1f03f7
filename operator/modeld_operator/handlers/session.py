"""Session handlers: bind each Session to a ready cell that fits it, keep it bound, release it on delete."""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import quote

import kopf
from pydantic import ValidationError

import modeld_api as api
from modeld_operator import kube, metrics, placement
from modeld_operator.conditions import now, set_condition
from modeld_operator.settings import SETTINGS

SESSIONS = (api.GROUP, api.VERSION, "sessions")


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


def _cell_views(namespace: str, required: int) -> list[placement.CellView]:
    counts: dict[str, int] = {}
    for sess in kube.list_objects("sessions", namespace):
        cell = (sess["metadata"].get("labels") or {}).get(api.LABEL_CELL)
        if cell:
            counts[cell] = counts.get(cell, 0) + 1
    views = []
    for obj in kube.list_objects("cells", namespace):
        try:
            spec = api.CellSpec.model_validate(obj.get("spec") or {})
        except ValidationError:
            continue  # the cell's own handler reports it
        status = obj.get("status") or {}
        # True / False as the Certified condition says; None while it is Unknown (being measured) or absent
        certified = next(({"True": True, "False": False}.get(c.get("status") or "")
                          for c in status.get("conditions") or [] if c.get("type") == "Certified"), None)
        summary = (status.get("certification") or {}).get("summary") or {}
        tier, fo, dec = covering(summary, required)
        views.append(
            placement.CellView(
                name=obj["metadata"]["name"],
                spec=spec,
                ready_endpoints=[api.Endpoint.model_validate(e) for e in status.get("endpoints") or [] if e.get("ready") and e.get("url")],
                sessions=counts.get(obj["metadata"]["name"], 0),
                certified=certified,
                first_output_p90_ms=fo,
                decode_p90_ms=dec,
                covering_tier=tier,
                gate=(status.get("certification") or {}).get("gate"),
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


def _bind(name: str, namespace: str, body: kopf.Body, spec: api.SessionSpec) -> None:
    status = dict(body.get("status") or {})
    generation = body["metadata"].get("generation")
    fit = placement.choose_cell(spec, _cell_views(namespace, spec.requiredContext), SETTINGS.require_certified)
    candidates = [api.Candidate(cell=c, chosen=chosen, reason=why[:400]).model_dump(mode="json")
                  for c, chosen, why in fit.considered[:32]]
    if fit.cell is None or fit.endpoint is None:
        conditions, changed = set_condition(status.get("conditions"), "Bound", False, "NoFittingCell", fit.reason, generation)
        kube.patch_status("sessions", namespace, name, {"phase": "Pending", "reason": fit.reason, "observedGeneration": generation,
                                                        "conditions": conditions, "candidates": candidates})
        if changed:
            kopf.event(body, type="Warning", reason="NoFittingCell", message=fit.reason)
        metrics.RECONCILES.labels("session", "waiting").inc()
        if fit.permanent:
            raise kopf.PermanentError(fit.reason)
        raise kopf.TemporaryError(fit.reason, delay=SETTINGS.retry_delay)
    kube.patch_labels("sessions", namespace, name, {api.LABEL_CELL: fit.cell.name})
    conditions, _ = set_condition(status.get("conditions"), "Bound", True, "Bound", fit.reason, generation)
    sid, prev, instance = worker_session_id(namespace, name), status.get("workerInstance"), fit.endpoint.instance
    continued = None
    if prev and instance and prev != instance and fit.endpoint.url:   # bound before, to a process now gone
        continued = continuity(fit.endpoint.url, sid)
        conditions, _ = set_condition(conditions, "Continuity", continued[0], continued[1], continued[2], generation)
        if continued[0] is None:
            instance = prev                           # not answered: asked again at the next check
    kube.patch_status(
        "sessions",
        namespace,
        name,
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
        },
    )
    kopf.event(body, type="Normal", reason="Bound", message=f"{fit.reason} at {fit.endpoint.url}")
    if continued is not None and continued[0] is not None:
        kopf.event(body, type="Normal" if continued[0] else "Warning", reason=f"Session{continued[1]}",
                   message=continued[2])
    created = dt.datetime.fromisoformat(body["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    metrics.BIND_SECONDS.observe((dt.datetime.now(dt.timezone.utc) - created).total_seconds())
    metrics.RECONCILES.labels("session", "bound").inc()


def _binding_alive(namespace: str, status: dict[str, Any]) -> bool:
    """The bound endpoint is ready and still the same worker process (a new /readyz instance: it was replaced)."""
    cell = kube.get_object("cells", namespace, status.get("cell") or "")
    if cell is None:
        return False
    endpoints = (cell.get("status") or {}).get("endpoints") or []
    known = status.get("workerInstance")
    return any(e.get("url") == status.get("endpoint") and e.get("ready")
               and not (known and e.get("instance") and e["instance"] != known) for e in endpoints)


def parse_spec(spec: Any) -> api.SessionSpec:
    try:
        return api.SessionSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise kopf.PermanentError(f"invalid Session spec: {exc}") from exc


@kopf.on.resume(*SESSIONS)
@kopf.on.create(*SESSIONS)
@kopf.on.update(*SESSIONS, field="spec")
def bind(name: str, namespace: str | None, body: kopf.Body, spec: kopf.Spec, **_: Any) -> None:
    namespace = kube.namespaced(namespace)
    status = body.get("status") or {}
    if status.get("phase") == "Bound" and _binding_alive(namespace, status):
        return
    _bind(name, namespace, body, parse_spec(spec))


@kopf.timer(*SESSIONS, interval=SETTINGS.status_interval, initial_delay=2.0)
def keep_bound(name: str, namespace: str | None, body: kopf.Body, spec: kopf.Spec, logger: Any, **_: Any) -> None:
    """A bound session whose worker went away is rebound; a pending one is retried."""
    namespace = kube.namespaced(namespace)
    status = body.get("status") or {}
    if status.get("phase") == "Bound":
        if _binding_alive(namespace, status):
            return
        logger.warning("session %s lost its worker at %s (gone, not ready or replaced); rebinding", name,
                       status.get("endpoint"))
        kube.patch_labels("sessions", namespace, name, {api.LABEL_CELL: None})
    try:
        _bind(name, namespace, body, parse_spec(spec))
    except (kopf.TemporaryError, kopf.PermanentError):
        pass  # status already says why; the timer comes back


@kopf.on.delete(*SESSIONS)
def unbind(name: str, namespace: str | None, body: kopf.Body, logger: Any, **_: Any) -> None:
    """Free the session's KV on its worker; best effort, since the worker may be gone already."""
    namespace = kube.namespaced(namespace)
    status = body.get("status") or {}
    endpoint, session_id = status.get("endpoint"), status.get("sessionId")
    if endpoint and session_id:
        code, _ = kube.http_json("DELETE", f"{endpoint}/v1/sessions/{quote(session_id)}", SETTINGS.probe_timeout)
        logger.info("session %s closed on %s: HTTP %s", name, endpoint, code or "unreachable")
