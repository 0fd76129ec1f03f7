"""One kind watched as Kubernetes' own controllers watch it: a paginated LIST, then one WATCH from its
resourceVersion (bookmarks on; a 410 Gone lists again), each event applied on the operator's event loop in order,
and a work queue of object keys that never runs one key twice at once and runs a key changed meanwhile once more
(client-go's reflector and workqueue, docs/operator.md "Scale").

The operator watches Sessions this way instead of through kopf: kopf gives each object a worker task holding its
last body, and at start-up holds every handler until its initial listing is done by waking all of those tasks at
each object's first event (its ``operator_indexed`` barrier, O(N²)): an operator restarted at 10,000 Sessions bound
about 3 a second (py-spy: 65% of its time in ``Condition.notify_all``). Here an object is one slim dict, and a
restart is one LIST and one pass of the queue."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

import modeld_api as api

from . import kube

log = logging.getLogger("modeld_operator.informer")

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """Keys to process, each at most once in the queue and never by two workers at once; a key added while it is
    processed is queued again when that ends (client-go's workqueue). Used from the event loop only."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()

    def add(self, key: K) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.put_nowait(key)

    async def get(self) -> K:
        key = await self._queue.get()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.put_nowait(key)

    def __len__(self) -> int:
        return len(self._dirty)


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


Lister = Callable[..., Any]
"""(**query) -> the apiserver's raw response (urllib3's, not read): a LIST page, or a WATCH stream with watch=True."""


def custom_lister(plural: str, namespace: str | None) -> Lister:
    def call(**kw: Any) -> Any:
        custom = kube.custom()
        if namespace:
            return custom.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, plural,
                                                        _preload_content=False, **kw)
        return custom.list_cluster_custom_object(api.GROUP, api.VERSION, plural, _preload_content=False, **kw)
    return call


def pod_lister(namespace: str | None, label_selector: str) -> Lister:
    def call(**kw: Any) -> Any:
        core = kube.core()
        if namespace:
            return core.list_namespaced_pod(namespace, label_selector=label_selector, _preload_content=False, **kw)
        return core.list_pod_for_all_namespaces(label_selector=label_selector, _preload_content=False, **kw)
    return call


def metadata_only(watch: bool) -> dict[str, str]:
    """The Accept header asking the apiserver for the objects' metadata alone (PartialObjectMetadata, as client-go's
    metadata informers ask): a Deployment's listing without its pod template is a tenth of the bytes to parse."""
    kind = "PartialObjectMetadata" if watch else "PartialObjectMetadataList"
    return {"Accept": f"application/json;as={kind};g=meta.k8s.io;v=v1"}


# kind -> (the API group's client, its namespaced list call, its all-namespaces list call)
_METADATA_LISTS: dict[str, tuple[Callable[[], Any], str, str]] = {
    "deployments": (kube.apps, "list_namespaced_deployment", "list_deployment_for_all_namespaces"),
    "services": (kube.core, "list_namespaced_service", "list_service_for_all_namespaces"),
}


def metadata_lister(kind: str, namespace: str | None, label_selector: str) -> Lister:
    """The metadata (metadata_only) of one kind of ``_METADATA_LISTS``."""
    group, namespaced, everywhere = _METADATA_LISTS[kind]

    def call(**kw: Any) -> Any:
        api_, headers = group(), metadata_only(bool(kw.get("watch")))
        args = (namespace,) if namespace else ()
        return getattr(api_, namespaced if namespace else everywhere)(
            *args, label_selector=label_selector, _preload_content=False, _headers=headers, **kw)
    return call


def node_lister() -> Lister:
    def call(**kw: Any) -> Any:
        return kube.core().list_node(_preload_content=False, **kw)
    return call


def unblock(resp: Any) -> None:
    """End a read another thread is blocked in on ``resp`` (a watch stream), at once: shut its socket down for
    reading (urllib3's ``HTTPResponse.shutdown``, 2.3 and later; else the socket's own). Closing the response
    instead waited for that read to return, which a quiet watch does only at its server timeout: an operator took
    43 s to stop after SIGTERM, its event loop blocked meanwhile (measured on the local cluster; a pod's default
    grace period is 30 s)."""
    try:
        if hasattr(resp, "shutdown"):
            resp.shutdown()
            return
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            sock.shutdown(socket.SHUT_RD)
    except (OSError, RuntimeError, ValueError):   # already closed or released: nothing is blocked on it
        pass


class Reflector:
    """LIST then WATCH one kind, in a thread of its own (the kubernetes client is synchronous), handing the whole
    listing to ``on_list`` (once per LIST) and each watch event to ``on_event``, on ``loop``, in order. ``slim`` turns
    each object (a plain dict: the response is parsed here, not into the client's models) into what the cache keeps,
    in this thread."""

    PAGE = 500

    def __init__(self, name: str, lister: Lister, slim: Callable[[dict[str, Any]], Any],
                 on_list: Callable[[list[Any]], None], on_event: Callable[[str, Any], None],
                 timeout_s: int = 300) -> None:
        self.name, self.lister, self.slim = name, lister, slim
        self.on_list, self.on_event, self.timeout_s = on_list, on_event, timeout_s
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread: threading.Thread | None = None
        self.lists = 0                  # how many LISTs it made (a relist after 410 counts too)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=f"reflector-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            unblock(resp)             # ends the blocked read of the stream; the reflector's thread releases it

    def list_all(self) -> tuple[list[Any], str]:
        """Every object, a page at a time (each page slimmed before the next is read), and the list's version."""
        items: list[Any] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"limit": self.PAGE, "_request_timeout": kube.TIMEOUT}
            if token:
                kw["_continue"] = token
            resp = self.lister(**kw)
            try:
                page = json.loads(resp.read())
            finally:
                resp.release_conn()
            items.extend(self.slim(o) for o in page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                self.lists += 1
                return items, str(meta.get("resourceVersion") or "")

    def watch(self, rv: str) -> str:
        """One WATCH from ``rv`` until the server ends it; returns the last version seen. Raises Gone on 410."""
        self._resp = resp = self.lister(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                                        timeout_seconds=self.timeout_s,
                                        _request_timeout=(kube.TIMEOUT[0], self.timeout_s + 30))
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message"))
                    raise ApiException(status=obj.get("code") or 500, reason=obj.get("message"))
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._deliver(self.on_event, kind, self.slim(obj))
        finally:
            self._resp = None
            resp.release_conn()
        return rv

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        rv: str | None = None
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if rv is None:
                    items, rv = self.list_all()
                    self._deliver(self.on_list, items)
                rv = self.watch(rv)
                backoff = 0.5
            except Gone:
                log.info("%s: watch version too old; listing again", self.name)
                rv = None
            except Exception as exc:  # noqa: BLE001 - the apiserver away or a broken stream: wait, watch again
                if self._stop.is_set():
                    break
                if isinstance(exc, ApiException) and exc.status == 410:
                    rv = None
                    continue
                log.warning("%s: watch failed (%s); again in %.1f s", self.name, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)


class Index:
    """What a kopf index was to the handlers, kept by a reflector: each object puts values under keys (its indexer's
    mapping), and ``get(key, default)`` gives the values under a key as a list (``store(index, key)`` in the
    handlers). Changed on the event loop only; read from handler threads."""

    def __init__(self) -> None:
        self._by_key: dict[Any, dict[Any, Any]] = {}
        self._keys_of: dict[Any, list[Any]] = {}

    def put(self, objkey: Any, entries: dict[Any, Any]) -> None:
        self.remove(objkey)
        for key, value in entries.items():
            self._by_key.setdefault(key, {})[objkey] = value
        if entries:
            self._keys_of[objkey] = list(entries)

    def remove(self, objkey: Any) -> None:
        for key in self._keys_of.pop(objkey, ()):
            values = self._by_key.get(key)
            if values is not None:
                values.pop(objkey, None)
                if not values:
                    del self._by_key[key]

    def replace(self, items: list[tuple[Any, dict[Any, Any]]]) -> list[Any]:
        """A new listing: returns the object keys it no longer has."""
        listed = {objkey for objkey, _ in items}
        gone = [k for k in self._keys_of if k not in listed]
        for objkey in gone:
            self.remove(objkey)
        for objkey, entries in items:
            self.put(objkey, entries)
        return gone

    def get(self, key: Any, default: Any = None) -> Any:
        values = self._by_key.get(key)
        return list(values.values()) if values is not None else default

    def clear(self) -> None:
        self._by_key.clear()
        self._keys_of.clear()

    def __len__(self) -> int:
        return len(self._keys_of)
