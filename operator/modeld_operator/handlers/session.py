"""Session handlers: bind each Session to a ready cell that fits it, keep it bound, release it on delete."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
from typing import Any
from urllib.parse import quote

import kopf
from pydantic import ValidationError

import modeld_api as api
from modeld_operator import kube, metrics, placement
from modeld_operator.conditions import now, set_condition, spec_errors
from modeld_operator.handlers.indexes import (
    BINDINGS,
    CACHES,
    CELL_CHANGES,
    SESSION_CACHE,
    STARTING,
    BoundSession,
    CellEntry,
    SessionCache,
    SessionKey,
    alive,
    slim_session,
    store,
)
from modeld_operator.handlers.rejected import Reported, surfaced
from modeld_operator.informer import Reflector, WorkQueue, custom_lister
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


# Once bound, a Session's status lists the chosen cell and the next best (placement.choose_cell orders them): every
# Cell of a namespace of 20 was three quarters of the status, and each bind's status write costs the apiserver by its
# size (decode, merge, schema validation, managedFields, encode, the watch event). Waiting, it lists up to
# api.CANDIDATES_MAX, each with why it does not fit.
BOUND_CANDIDATES = 8


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
    return: the retry sweep binds it later. The status goes into ``kw["patch"]`` and the Events into ``kw["events"]``:
    the caller writes the status, then posts the Events (an Event never says Bound before the status does). Raises
    PermanentError when no change in the cluster can make it fit."""
    status = dict(body.get("status") or {})
    generation = body["metadata"].get("generation")
    views = _cell_views(namespace, spec.requiredContext, kw.get("cell_index"), kw.get("session_index"))
    fit = placement.choose_cell(spec, views, SETTINGS.require_certified)
    listed = fit.considered[:BOUND_CANDIDATES if fit.cell is not None else api.CANDIDATES_MAX]
    candidates = [api.Candidate(cell=c, chosen=chosen, reason=why[:400]).model_dump(mode="json")
                  for c, chosen, why in listed]
    if len(listed) < len(fit.considered) and fit.cell is not None:
        candidates[0]["reason"] = (f"{candidates[0]['reason']}; the best {len(listed)} of the "
                                   f"{len(fit.considered)} cells considered are listed")[:400]
    if fit.cell is None or fit.endpoint is None:
        conditions, changed = set_condition(status.get("conditions"), "Bound", False, "NoFittingCell", fit.reason, generation)
        pending = {"phase": "Pending", "reason": fit.reason, "observedGeneration": generation,
                   "conditions": conditions, "candidates": candidates}
        if pending != {k: status.get(k) for k in pending}:
            kw["patch"]["status"] = pending
        if changed:
            kw["events"].append(("Warning", "NoFittingCell", fit.reason))
        metrics.RECONCILES.labels("session", "waiting").inc()
        if fit.permanent:
            raise Reported(fit.reason)
        return
    # One status write per bind, made by the caller. The binding lives in the status alone (status.cell is a
    # selectable field).
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
    kw["events"].append(("Normal", "Bound", f"{fit.reason} at {fit.endpoint.url}"))
    if continued is not None and continued[0] is not None:
        kw["events"].append(("Normal" if continued[0] else "Warning", f"Session{continued[1]}", continued[2]))
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


def bind_one(obj: dict[str, Any], cells: Any, sessions: Any) -> bool:
    """Bind one Session from the cache unless it is bound, alive and at its generation: write its status, then post
    its Events. Returns whether it wrote the status. Runs in a bind thread (the kubernetes client is synchronous)."""
    meta = obj["metadata"]
    if meta.get("deletionTimestamp"):
        return False
    patch: dict[str, Any] = {}
    events: list[tuple[str, str, str]] = []
    try:
        reconcile(name=meta["name"], namespace=meta["namespace"], body=obj, spec=obj["spec"], patch=patch,
                  events=events, cell_index=cells, session_index=sessions)
    except kopf.PermanentError:
        return False                  # on the status already (surfaced); a spec change is a new event
    except kopf.TemporaryError as exc:
        log.info("session %s/%s: %s; the retry sweep binds it", meta["namespace"], meta["name"], exc)
        return False
    if patch.get("status"):
        kube.patch_status("sessions", meta["namespace"], meta["name"], patch["status"])
    for type_, reason, message in events:       # a Warning at once; a Normal one behind the binds (kube.EventSink)
        (kube.post_event if type_ == "Warning" else kube.EVENTS.post)(obj, type_, reason, message)
    return bool(patch.get("status"))


def release(name: str, namespace: str, body: dict[str, Any]) -> None:
    """Free a deleted session's KV on its worker; best effort, since the worker may be gone already (a worker evicts
    an unused session's blocks under pressure anyway). No finalizer holds the Session for it."""
    BINDINGS.forget(namespace, name, deleted=True)
    status = body.get("status") or {}
    endpoint, session_id = status.get("endpoint"), status.get("sessionId")
    if endpoint and session_id:
        code, _ = kube.http_json("DELETE", f"{endpoint}/v1/sessions/{quote(session_id)}", SETTINGS.probe_timeout)
        log.info("session %s/%s closed on %s: HTTP %s", namespace, name, endpoint, code or "unreachable")


class SessionController:
    """Binds Sessions, outside kopf (informer.py says why). Its reflector keeps SESSION_CACHE current and queues the
    key of each Session an event touches; ``MODELD_BIND_WORKERS`` workers take keys off the queue and bind each one
    unless it is bound, alive and at its generation (level-triggered, as Kubernetes' own controllers are); the retry
    sweep queues every Session not Bound when a Cell changed in what a bind reads (half a second later, so a burst is
    one sweep) and at the latest every ``MODELD_RETRY_DELAY`` seconds. A bind is one status write and an Event; the
    Session carries no finalizer, annotation or label of the operator's (docs/operator.md, "Scale")."""

    def __init__(self, cache: SessionCache = SESSION_CACHE) -> None:
        self.cache = cache
        self.queue: WorkQueue[SessionKey] | None = None
        self.cells: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._reflector: Reflector | None = None
        self._releases: set[asyncio.Future[None]] = set()

    def begin(self, namespace: str | None) -> None:
        """Start listing and watching the Sessions; their keys queue up, and ``run`` binds them. Called as the
        caches start their reflectors (indexes.STARTING), so the Sessions list while the Cells, pods and nodes do;
        they listed after those, which took until 6.2 s after a restarted operator's launch at 1,000 Cells."""
        self.end()
        self.queue = WorkQueue[SessionKey]()
        self.cache.clear()
        self._pool = concurrent.futures.ThreadPoolExecutor(SETTINGS.bind_workers, thread_name_prefix="bind")
        self._reflector = Reflector("sessions", custom_lister("sessions", namespace), slim_session, self.listed,
                                    self.event, timeout_s=SETTINGS.watch_server_timeout)
        self._reflector.start(asyncio.get_running_loop())

    def end(self) -> None:
        if self._reflector is not None:
            self._reflector.stop()
            self._reflector = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- events from the reflector, on the loop --------------------------------------------------------------------
    def listed(self, objs: list[dict[str, Any]]) -> None:
        for gone in self.cache.replace(objs):
            self._release(gone)
        assert self.queue is not None
        for key in self.cache.objects:
            self.queue.add(key)

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        key = self.cache.key(obj)
        if kind == "DELETED":
            self.cache.remove(key)
            self._release(obj)
            return
        self.cache.put(obj)
        assert self.queue is not None
        self.queue.add(key)

    def _release(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        fut = asyncio.get_running_loop().run_in_executor(self._pool, release, meta["name"], meta["namespace"], obj)
        self._releases.add(fut)
        fut.add_done_callback(self._releases.discard)

    # -- the work --------------------------------------------------------------------------------------------------
    async def process(self, key: SessionKey) -> None:
        obj = self.cache.objects.get(key)
        if obj is None:
            return                                    # deleted meanwhile
        await asyncio.get_running_loop().run_in_executor(self._pool, bind_one, obj, self.cells, self.cache.bound)

    async def _worker(self) -> None:
        assert self.queue is not None
        while True:
            key = await self.queue.get()
            try:
                await self.process(key)
            except Exception:                         # noqa: BLE001 - one session's failure stops no other
                log.exception("binding session %s/%s", *key)
            finally:
                self.queue.done(key)

    async def _sweep(self) -> None:
        wake = CELL_CHANGES.event = asyncio.Event()
        while True:
            try:
                await asyncio.wait_for(wake.wait(), SETTINGS.retry_delay)
                await asyncio.sleep(0.5)
            except asyncio.TimeoutError:
                pass
            wake.clear()
            assert self.queue is not None
            for key in list(self.cache.pending):
                self.queue.add(key)

    async def run(self, cells: Any, namespace: str | None) -> None:
        """Bind until cancelled (listing first unless ``begin`` started it)."""
        loop = asyncio.get_running_loop()
        if self._reflector is None:
            self.begin(namespace)
        self.cells = cells
        kube.BINDS.waiting = lambda: self.queue is not None and len(self.queue) > 0
        tasks: list[asyncio.Task[None]] = []
        try:
            tasks = [loop.create_task(self._worker()) for _ in range(SETTINGS.bind_workers)]
            tasks.append(loop.create_task(self._sweep()))
            await asyncio.gather(*tasks)
        finally:
            self.end()
            for t in tasks:
                t.cancel()
            CELL_CHANGES.event = None
            kube.BINDS.waiting = lambda: False


CONTROLLER = SessionController()
STARTING.append(CONTROLLER.begin)
_RUNNING: asyncio.Task[None] | None = None


@kopf.on.startup()
async def start_sessions(memo: kopf.Memo, **_: Any) -> None:
    """After the caches' start-up (registered before this one): the Cells are indexed, so no bind writes
    NoFittingCell on a Session whose cell is not indexed yet."""
    global _RUNNING
    kube.load_config()
    while not CACHES.synced:
        await asyncio.sleep(0.1)
    _RUNNING = asyncio.get_running_loop().create_task(CONTROLLER.run(CACHES.cells, memo.get("namespace") or None))


@kopf.on.cleanup()
async def stop_sessions(**_: Any) -> None:
    global _RUNNING
    if _RUNNING is not None:
        _RUNNING.cancel()
        _RUNNING = None
    CONTROLLER.end()                  # begun with the caches, whether or not binding had started
