"""In-memory indexes the handlers read instead of listing: kopf keeps each current from one watch per kind, so
binding a Session or refreshing a Cell costs no list call against the apiserver, and no handler's work grows with
the number of objects outside its own namespace (docs/operator.md, "Scale"). kopf fills every index before any
handler runs, and passes each to every handler by its function's name.

The indexers kopf calls are ``async``: a sync one runs in kopf's thread pool, a thread hop per watch event of every
pod, node, Cell and Session; each is a pure function of the object, so nothing blocks. An object an index no longer
holds gets ``{}`` from its indexer, never ``None``: kopf takes None as "no change" and keeps the object's old values
(a Session sent back to Pending stayed counted on its old Cell, and a bound one stayed in the pending index, where
the retry sweep would have bound it again from its stale body)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

import modeld_api as api

CELLS = (api.GROUP, api.VERSION, "cells")           # what the handlers of cell.py and session.py watch too
SESSIONS = (api.GROUP, api.VERSION, "sessions")
JOB_NAME = "batch.kubernetes.io/job-name"


@dataclass(frozen=True)
class CellEntry:
    """What binding reads of a Cell: its parsed spec (None when it does not parse: its own handler reports that),
    the endpoints its status lists as ready, and its certification."""
    name: str
    spec: api.CellSpec | None
    ready_endpoints: tuple[api.Endpoint, ...] = ()
    certified: bool | None = None       # the Certified condition: True / False; None while Unknown or absent
    summary: dict[str, Any] = field(default_factory=dict)
    gate: str | None = None


@dataclass(frozen=True)
class BoundSession:
    """A Session the status says is bound: where, and to which worker process."""
    name: str
    endpoint: str | None
    instance: str | None


def cell_entry(name: str, spec: Any, status: Any) -> CellEntry:
    try:
        parsed: api.CellSpec | None = api.CellSpec.model_validate(dict(spec or {}))
    except ValidationError:
        parsed = None
    status = dict(status or {})
    ready = tuple(api.Endpoint.model_validate(e) for e in status.get("endpoints") or [] if e.get("ready") and e.get("url"))
    certified = next(({"True": True, "False": False}.get(c.get("status") or "")
                      for c in status.get("conditions") or [] if c.get("type") == "Certified"), None)
    cert = status.get("certification") or {}
    return CellEntry(name, parsed, ready, certified, dict(cert.get("summary") or {}), cert.get("gate"))


class CellChanges:
    """Set when what a bind reads of some Cell changed (its spec, ready endpoints or certification): the Session
    retry sweep wakes on it instead of waiting out its interval, so a Session that waited for a cell binds as soon
    as the cell is ready."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, str], CellEntry] = {}
        self.event: asyncio.Event | None = None     # made in the operator's loop (the sweep's start)

    def saw(self, namespace: Any, entry: CellEntry) -> None:
        if self._seen.get((namespace, entry.name)) != entry:
            self._seen[(namespace, entry.name)] = entry
            if self.event is not None:
                self.event.set()

    def forget(self, namespace: str, name: str) -> None:
        """The Cell was deleted (kopf calls no indexer then)."""
        self._seen.pop((namespace, name), None)


CELL_CHANGES = CellChanges()


@kopf.index(*CELLS)
async def cell_index(name: str, namespace: str | None, spec: kopf.Spec, status: kopf.Status,
                     **_: Any) -> dict[Any, CellEntry]:
    """Cells by namespace (the candidates of a bind) and by (namespace, name)."""
    entry = cell_entry(name, spec, status)
    CELL_CHANGES.saw(namespace, entry)
    return {namespace: entry, (namespace, name): entry}


def slim_session(body: Any) -> dict[str, Any]:
    """What a bind reads of a Session (and what its Event names): not its managedFields or annotations, and of a
    bound one's status not the candidates it weighed (up to 32 reasons, read only while it waits)."""
    meta = body.get("metadata") or {}
    status = dict(body.get("status") or {})
    if status.get("phase") == "Bound":
        status.pop("candidates", None)
    return {
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "generation", "creationTimestamp",
                                              "deletionTimestamp")},
        "spec": dict(body.get("spec") or {}),
        "status": status,
    }


SessionKey = tuple[str, str]


class SessionCache:
    """Every Session the operator watches (slim, from its own reflector: informer.py), and two indexes kept with it:
    the bound ones by (namespace, cell) (a cell's load, and the bindings its status refresh checks) and the keys of
    those not Bound (what the retry sweep binds again). Changed only on the operator's event loop."""

    def __init__(self) -> None:
        self.objects: dict[SessionKey, dict[str, Any]] = {}
        self.pending: set[SessionKey] = set()
        self._bound: dict[tuple[str, str], dict[str, BoundSession]] = {}
        self._cell_of: dict[SessionKey, tuple[str, str]] = {}
        self.synced = False           # the first listing is in

    @staticmethod
    def key(obj: dict[str, Any]) -> SessionKey:
        return obj["metadata"]["namespace"], obj["metadata"]["name"]

    def put(self, obj: dict[str, Any]) -> SessionKey:
        key = self.key(obj)
        self._unindex(key)
        self.objects[key] = obj
        st = obj["status"]
        if st.get("phase") == "Bound" and st.get("cell"):
            where = (key[0], st["cell"])
            self._bound.setdefault(where, {})[key[1]] = BoundSession(key[1], st.get("endpoint"), st.get("workerInstance"))
            self._cell_of[key] = where
        elif not obj["metadata"].get("deletionTimestamp"):
            self.pending.add(key)
        return key

    def remove(self, key: SessionKey) -> dict[str, Any] | None:
        self._unindex(key)
        return self.objects.pop(key, None)

    def replace(self, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A new listing: returns the objects it no longer holds (deleted while no watch was open)."""
        listed = {self.key(o) for o in objs}
        gone = [o for k, o in self.objects.items() if k not in listed]
        for o in gone:
            self.remove(self.key(o))
        for o in objs:
            self.put(o)
        self.synced = True
        return gone

    def _unindex(self, key: SessionKey) -> None:
        self.pending.discard(key)
        where = self._cell_of.pop(key, None)
        if where is not None:
            on_cell = self._bound.get(where, {})
            on_cell.pop(key[1], None)
            if not on_cell:
                self._bound.pop(where, None)

    def clear(self) -> None:
        """Forget everything (the operator stopped leading: a new leader term lists again)."""
        self.objects.clear()
        self.pending.clear()
        self._bound.clear()
        self._cell_of.clear()
        self.synced = False

    @property
    def bound(self) -> BoundIndex:
        return BoundIndex(self._bound)


class BoundIndex:
    """The bound Sessions by (namespace, cell), read as the handlers read a kopf index (``store(index, key)``)."""

    def __init__(self, by_cell: dict[tuple[str, str], dict[str, BoundSession]]) -> None:
        self._by_cell = by_cell

    def get(self, key: Any, default: Any = None) -> list[BoundSession] | Any:
        found = self._by_cell.get(key)
        return list(found.values()) if found is not None else default


SESSION_CACHE = SessionCache()


def alive(session: BoundSession, endpoints: list[api.Endpoint]) -> bool:
    """The session's endpoint is ready and still the worker process it was bound to (a new /readyz instance: the
    process was replaced, and the session must be asked for again)."""
    return any(e.url == session.endpoint and e.ready and not (session.instance and e.instance
                                                               and e.instance != session.instance)
               for e in endpoints)


class Bindings:
    """One bind at a time per Session, and what this process bound before the watch shows it. A Session's watch
    handler and the retry sweep run apart; both read a body that may predate a bind the other just made, so without
    this both bind it (two status writes and Events, maybe two cells): the scale benchmark measured 1.9 status writes
    per bind before. A bind not seen within ``ttl`` seconds is taken as lost (its status write failed), and the
    session is bound again."""

    def __init__(self, ttl: float = 30.0, clock: Any = time.monotonic) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._bound: dict[tuple[str, str], float] = {}     # when this process bound it
        self.ttl, self._clock = ttl, clock

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def made(self, namespace: str, name: str) -> None:
        self._bound[(namespace, name)] = self._clock()

    def ahead_of(self, namespace: str, name: str, status: dict[str, Any]) -> bool:
        """This process bound the session and ``status`` (from an older body) does not show it yet."""
        key = (namespace, name)
        if status.get("phase") == "Bound":
            self._bound.pop(key, None)     # the watch caught up
            return False
        made = self._bound.get(key)
        if made is not None and self._clock() - made > self.ttl:
            self._bound.pop(key, None)     # never showed up: the write was lost
            return False
        return made is not None

    def forget(self, namespace: str, name: str, deleted: bool = False) -> None:
        """Sent back to Pending (its next bind is real), or deleted."""
        self._bound.pop((namespace, name), None)
        if deleted:
            with self._guard:
                self._locks.pop((namespace, name), None)


BINDINGS = Bindings()


def slim_pod(meta: Any, spec: Any, status: Any) -> dict[str, Any]:
    """What the Cell handlers read of a pod (its endpoints, the hash of the spec it runs, a certification Job's
    verdict): not its spec's environment, which carries the whole Cell spec."""
    status = dict(status or {})
    spec_hash = (meta.get("annotations") or {}).get(api.ANNOTATION_SPEC_HASH)
    return {
        "metadata": {"name": meta.get("name"), "deletionTimestamp": meta.get("deletionTimestamp"),
                     "annotations": {api.ANNOTATION_SPEC_HASH: spec_hash} if spec_hash else {}},
        "spec": {"nodeName": (spec or {}).get("nodeName")},
        "status": {k: status[k] for k in ("phase", "podIP", "conditions", "containerStatuses") if k in status},
    }


@kopf.index("", "v1", "pods", labels={api.LABEL_MANAGED_BY: "modeld"})
async def pod_index(namespace: str | None, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, labels: kopf.Labels,
                    **_: Any) -> dict[Any, dict[str, Any]]:
    """A cell's worker pods by ("cell", namespace, cell); a certification Job's pods by ("job", namespace, job)."""
    pod = slim_pod(meta, spec, status)
    if (cell := labels.get(api.LABEL_CELL)) is not None:
        return {("cell", namespace, cell): pod}
    if (job := labels.get(JOB_NAME) or labels.get("job-name")) is not None and api.LABEL_CERTIFIES in labels:
        return {("job", namespace, job): pod}
    return {}


def store(index: kopf.Index[Any, Any] | None, key: Any) -> list[Any]:
    """The values under ``key`` (an empty list when none); a missing index is a registration bug, said loudly."""
    if index is None:
        raise kopf.PermanentError("an index was not passed to the handler (kopf registration broken)")
    return list(index.get(key, []))
