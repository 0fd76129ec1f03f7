"""In-memory indexes the handlers read instead of listing: Cells, the operator's pods and the nodes (``Caches``) and
the Sessions (``SessionCache``, filled by the Session controller), each kept current by one reflector (a paginated
LIST, then one WATCH: informer.py), so binding a Session or refreshing a Cell costs no list call against the
apiserver, and no handler's work grows with the number of objects outside its own namespace (docs/operator.md,
"Scale"). The indexers are pure functions of an object, run in the reflector's thread; what they return replaces
the object's earlier entries whole (``{}``: it is in none). They used to be kopf indexes; why they are not: ``Caches``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

import modeld_api as api
from modeld_operator import kube, placement
from modeld_operator.informer import (
    Index,
    Reflector,
    custom_lister,
    metadata_lister,
    node_lister,
    pod_lister,
)
from modeld_operator.settings import SETTINGS

log = logging.getLogger("modeld_operator.indexes")

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


def cell_index(name: str, namespace: str | None, spec: Any, status: Any, **_: Any) -> dict[Any, CellEntry]:
    """Cells by namespace (the candidates of a bind) and by (namespace, name)."""
    entry = cell_entry(name, spec, status)
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
    ``bound``, the bound ones by (namespace, cell) (a cell's load, and the bindings its status refresh checks), and
    ``pending``, the keys of those not Bound (what the retry sweep binds again). Changed only on the operator's event
    loop."""

    def __init__(self) -> None:
        self.objects: dict[SessionKey, dict[str, Any]] = {}
        self.pending: set[SessionKey] = set()
        self.bound = Index()
        self.synced = False           # the first listing is in

    @staticmethod
    def key(obj: dict[str, Any]) -> SessionKey:
        return obj["metadata"]["namespace"], obj["metadata"]["name"]

    def put(self, obj: dict[str, Any]) -> SessionKey:
        key = self.key(obj)
        self.objects[key] = obj
        st = obj["status"]
        bound = st.get("phase") == "Bound" and st.get("cell")
        self.bound.put(key, {(key[0], st["cell"]): BoundSession(key[1], st.get("endpoint"), st.get("workerInstance"))}
                       if bound else {})
        if bound or obj["metadata"].get("deletionTimestamp"):
            self.pending.discard(key)
        else:
            self.pending.add(key)
        return key

    def remove(self, key: SessionKey) -> dict[str, Any] | None:
        self.pending.discard(key)
        self.bound.remove(key)
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

    def clear(self) -> None:
        """Forget everything (the operator stopped leading: a new leader term lists again)."""
        self.objects.clear()
        self.pending.clear()
        self.bound.clear()
        self.synced = False


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


def pod_index(namespace: str | None, meta: Any, spec: Any, status: Any, labels: Any, **_: Any) -> dict[Any, dict[str, Any]]:
    """A cell's worker pods by ("cell", namespace, cell); a certification Job's pods by ("job", namespace, job)."""
    pod = slim_pod(meta, spec, status)
    if (cell := labels.get(api.LABEL_CELL)) is not None:
        return {("cell", namespace, cell): pod}
    if (job := labels.get(JOB_NAME) or labels.get("job-name")) is not None and api.LABEL_CERTIFIES in labels:
        return {("job", namespace, job): pod}
    return {}


class NodeVersions:
    """Counts changes to what placement reads of the nodes, so a Cell's placement is recomputed only when a node it
    could land on changed (kwok's and the kubelet's heartbeats change nothing placement reads): a status refresh then
    costs the same with 5 nodes or 500."""

    def __init__(self) -> None:
        self.version = 0
        self._seen: dict[str, placement.NodeView] = {}

    def saw(self, view: placement.NodeView) -> None:
        if self._seen.get(view.name) != view:
            self._seen[view.name] = view
            self.version += 1

    def forget(self, name: str) -> None:
        if self._seen.pop(name, None) is not None:
            self.version += 1


NODES = NodeVersions()


def node_index(name: str, meta: Any, spec: Any, status: Any, **_: Any) -> dict[Any, placement.NodeView]:
    """Every node, as placement reads it (all under "all", each under ("node", name))."""
    view = placement.NodeView.from_obj({
        "metadata": {"name": name, "labels": dict(meta.get("labels") or {})},
        "spec": {"unschedulable": bool(spec.get("unschedulable"))},
        "status": {"allocatable": dict(status.get("allocatable") or {}),
                   "conditions": [{"type": c.get("type"), "status": c.get("status")}
                                  for c in status.get("conditions") or []]},
    })
    return {"all": view, ("node", name): view}


def indexed(indexer: Any) -> Any:
    """A reflector's slim function from an indexer: the object's key and the entries it puts in the index (computed
    in the reflector's thread; its body is then dropped)."""
    def slim(body: dict[str, Any]) -> tuple[tuple[Any, Any], dict[Any, Any]]:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace"), meta.get("name"))
        return key, indexer(name=meta.get("name"), namespace=meta.get("namespace"), meta=meta,
                            spec=body.get("spec") or {}, status=body.get("status") or {},
                            labels=meta.get("labels") or {})
    return slim


def owned_entry(body: dict[str, Any]) -> tuple[tuple[Any, Any], dict[Any, Any]]:
    """What the operator keeps of a Deployment or Service it applies: the hash of the manifest last applied to it
    (its ``modeld.contenox.io/applied`` annotation), and whether a writer other than the operator changed its spec
    since (a ``kubectl scale`` or ``edit``: its managedFields name another manager with a spec field; the
    controllers' status and revision writes do not count)."""
    meta = body.get("metadata") or {}
    foreign = any(
        m.get("manager") != kube.FIELD_MANAGER and m.get("subresource") != "status"
        and "f:spec" in (m.get("fieldsV1") or {})
        for m in meta.get("managedFields") or [])
    key = (meta.get("namespace"), meta.get("name"))
    return key, {key: ((meta.get("annotations") or {}).get(api.ANNOTATION_APPLIED), foreign)}


class Owned:
    """The Deployments and Services of the operator (label ``app.kubernetes.io/managed-by=modeld``) as ``owned_entry``
    reads them, so a Cell's reconcile applies one only when it is not as the manifest says: at a restart every Cell's
    resume handler re-applied both, and 2,000 server-side applies at 1,000 Cells that changed nothing cost the
    apiserver as much CPU as 3,500 status patches (its CPU profile, docs/operator.md "Scale")."""

    def __init__(self) -> None:
        self.deployments, self.services = Index(), Index()

    def unchanged(self, kind: str, manifest: dict[str, Any], digest: str) -> bool:
        """The live object is the one ``manifest`` (stamped with ``digest``) would make, as far as the cache knows."""
        index = self.deployments if kind == "deployments" else self.services
        meta = manifest["metadata"]
        found = index.get((meta["namespace"], meta["name"]), [])
        return bool(found) and found[0] == (digest, False)


OWNED = Owned()


class Caches:
    """The Cells, the operator's pods and the nodes, each kept by a reflector of its own (informer.py) in an Index the
    handlers read as they read kopf's indexes. Not kopf's indexes: until every object of every indexed kind was
    indexed, kopf holds each object's worker on one condition and wakes all of them at each object's first event, so
    a restart at 1,000 Cells (their pods, 500 nodes) spent a third of the operator's time in those wake-ups
    (docs/operator.md, "Scale"). kopf runs the start-up handler, which waits for every first listing, before any
    Cell handler: those never see a half-filled cache."""

    def __init__(self) -> None:
        self.cells, self.pods, self.nodes = Index(), Index(), Index()
        self.synced = False             # every first listing is in
        self._reflectors: list[Reflector] = []

    def _on_cells_listed(self, items: list[Any]) -> None:
        for ns, name in self.cells.replace(items):
            CELL_CHANGES.forget(ns, name)
        for (ns, name), entries in items:
            CELL_CHANGES.saw(ns, entries[(ns, name)])

    def _on_cell(self, kind: str, item: Any) -> None:
        (ns, name), entries = item
        if kind == "DELETED":
            self.cells.remove((ns, name))
            CELL_CHANGES.forget(ns, name)
            return
        self.cells.put((ns, name), entries)
        CELL_CHANGES.saw(ns, entries[(ns, name)])      # after the index has it: the sweep it wakes reads the index

    def _on_nodes_listed(self, items: list[Any]) -> None:
        for _, name in self.nodes.replace(items):
            NODES.forget(name)
        for _, entries in items:
            NODES.saw(entries["all"])

    def _on_node(self, kind: str, item: Any) -> None:
        (_, name), entries = item
        if kind == "DELETED":
            self.nodes.remove((None, name))
            NODES.forget(name)
            return
        self.nodes.put((None, name), entries)
        NODES.saw(entries["all"])

    async def start(self, namespace: str | None) -> None:
        """Start the reflectors and wait for each one's first listing."""
        loop = asyncio.get_running_loop()
        self.synced = False
        listed: dict[str, asyncio.Event] = {k: asyncio.Event()
                                            for k in ("cells", "pods", "nodes", "deployments", "services")}

        def first(name: str, fn: Any) -> Any:
            def on_list(items: list[Any]) -> None:
                fn(items)
                listed[name].set()
            return on_list

        timeout = SETTINGS.watch_server_timeout
        self._reflectors = [
            Reflector("cells", custom_lister("cells", namespace), indexed(cell_index),
                      first("cells", self._on_cells_listed), self._on_cell, timeout),
            Reflector("pods", pod_lister(namespace, f"{api.LABEL_MANAGED_BY}=modeld"), indexed(pod_index),
                      first("pods", self.pods.replace), _kept(self.pods), timeout),
            Reflector("nodes", node_lister(), indexed(node_index),
                      first("nodes", self._on_nodes_listed), self._on_node, timeout),
            *(Reflector(kind, metadata_lister(kind, namespace, f"{api.LABEL_MANAGED_BY}=modeld"), owned_entry,
                        first(kind, index.replace), _kept(index), timeout)
              for kind, index in (("deployments", OWNED.deployments), ("services", OWNED.services))),
        ]
        for r in self._reflectors:
            r.start(loop)
        for begin in STARTING:
            begin(namespace)
        for name, event in listed.items():
            while not event.is_set():
                try:
                    await asyncio.wait_for(event.wait(), 30)
                except asyncio.TimeoutError:
                    log.warning("still waiting for the first listing of %s (the apiserver is slow or away)", name)
        self.synced = True

    def stop(self) -> None:
        for r in self._reflectors:
            r.stop()
        self._reflectors = []
        self.synced = False


def _kept(index: Index) -> Any:
    """A reflector's event handler that keeps ``index`` as the watch says (no other bookkeeping)."""
    def on_event(kind: str, item: Any) -> None:
        objkey, entries = item
        if kind == "DELETED":
            index.remove(objkey)
        else:
            index.put(objkey, entries)
    return on_event


CACHES = Caches()
# Called with the namespace as the caches start their reflectors, before their first listings are in: the Session
# controller (session.py) starts listing the Sessions then, alongside.
STARTING: list[Any] = []


@kopf.on.startup()
async def start_caches(memo: kopf.Memo, **_: Any) -> None:
    kube.load_config()
    await CACHES.start(memo.get("namespace") or None)


@kopf.on.cleanup()
async def stop_caches(**_: Any) -> None:
    CACHES.stop()


def store(index: kopf.Index[Any, Any] | None, key: Any) -> list[Any]:
    """The values under ``key`` (an empty list when none); a missing index is a registration bug, said loudly."""
    if index is None:
        raise kopf.PermanentError("an index was not passed to the handler (kopf registration broken)")
    return list(index.get(key, []))
