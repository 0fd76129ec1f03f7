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


class Reflector:
    """LIST then WATCH one custom resource (all namespaces, or one), in a thread of its own (the kubernetes client is
    synchronous), handing each object to ``on_list`` (the whole listing, once per LIST) and ``on_event`` (each watch
    event) on ``loop``, in order. ``slim`` turns each object into what the cache keeps, in this thread."""

    PAGE = 500

    def __init__(self, plural: str, namespace: str | None, slim: Callable[[dict[str, Any]], Any],
                 on_list: Callable[[list[Any]], None], on_event: Callable[[str, Any], None],
                 timeout_s: int = 300) -> None:
        self.plural, self.namespace, self.slim = plural, namespace, slim
        self.on_list, self.on_event, self.timeout_s = on_list, on_event, timeout_s
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread: threading.Thread | None = None
        self.lists = 0                  # how many LISTs it made (a relist after 410 counts too)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._thread = threading.Thread(target=self._run, args=(loop,), name=f"reflector-{self.plural}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            try:
                resp.close()          # ends the blocked read of the stream
            except Exception:         # noqa: BLE001 - closing a stream already closed
                pass

    def _call(self, **kw: Any) -> Any:
        custom = kube.custom()
        if self.namespace:
            return custom.list_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, self.plural, **kw)
        return custom.list_cluster_custom_object(api.GROUP, api.VERSION, self.plural, **kw)

    def list_all(self) -> tuple[list[Any], str]:
        """Every object, a page at a time (each page slimmed before the next is read), and the list's version."""
        items: list[Any] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"limit": self.PAGE, "_request_timeout": kube.TIMEOUT}
            if token:
                kw["_continue"] = token
            page = self._call(**kw)
            items.extend(self.slim(o) for o in page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                self.lists += 1
                return items, str(meta.get("resourceVersion") or "")

    def watch(self, rv: str) -> str:
        """One WATCH from ``rv`` until the server ends it; returns the last version seen. Raises Gone on 410."""
        self._resp = resp = self._call(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                                       timeout_seconds=self.timeout_s, _preload_content=False,
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

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
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
                log.info("%s: watch version too old; listing again", self.plural)
                rv = None
            except Exception as exc:  # noqa: BLE001 - the apiserver away or a broken stream: wait, watch again
                if self._stop.is_set():
                    break
                if isinstance(exc, ApiException) and exc.status == 410:
                    rv = None
                    continue
                log.warning("%s: watch failed (%s); again in %.1f s", self.plural, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)


