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


@kopf.index(*SESSIONS)
async def session_index(name: str, namespace: str | None, status: kopf.Status, **_: Any) -> dict[Any, BoundSession]:
    """Bound Sessions by (namespace, cell): a cell's load, and the bindings its status refresh checks."""
    st = dict(status or {})
    if st.get("phase") != "Bound" or not st.get("cell"):
        return {}
    return {(namespace, st["cell"]): BoundSession(name, st.get("endpoint"), st.get("workerInstance"))}


def slim_session(body: Any) -> dict[str, Any]:
    """What a retried bind reads of a Session (and what its Event names): not its managedFields or annotations."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "generation", "creationTimestamp")},
        "spec": dict(body.get("spec") or {}),
        "status": dict(body.get("status") or {}),
    }


@kopf.index(*SESSIONS)
async def pending_index(body: kopf.Body, status: kopf.Status, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    """Sessions not Bound (and not being deleted), all under "pending": what the retry sweep binds again
    (session.py). A Session has no timer of its own: a kopf timer holds a finalizer on its object, two more writes
    per Session, and a task per Session."""
    if dict(status or {}).get("phase") == "Bound" or meta.get("deletionTimestamp"):
        return {}
    return {"pending": slim_session(body)}


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
