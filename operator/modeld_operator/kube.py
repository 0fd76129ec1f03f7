"""The few Kubernetes API calls the handlers make, with errors typed for kopf's retry semantics."""

from __future__ import annotations

import datetime as dt
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import kopf
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

import modeld_api as api

from . import metrics

_client: client.ApiClient | None = None
# Every apiserver call is bounded: a stalled connection must not hold one of kopf's handler threads (or a timer a
# Cell's deletion waits for) forever. (connect, read) seconds; a timeout is retried like a 5xx.
TIMEOUT = (10, 30)


def load_config() -> None:
    """Load the kube config once and make the one ApiClient every call shares: its connection pool keeps connections
    alive, where a client per call paid a TCP and TLS handshake per request (the apiserver's CPU, under load)."""
    global _client
    if _client is not None:
        return
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    conf = client.Configuration.get_default_copy()
    conf.connection_pool_maxsize = 32     # kopf's handler threads and the leader's renewals share it
    _client = client.ApiClient(conf)


def api_client() -> client.ApiClient:
    load_config()
    assert _client is not None
    return _client


def _raise(exc: ApiException, what: str) -> None:
    # 4xx other than conflict/throttling is our fault and will not heal by retrying; the rest might.
    if exc.status in (409, 429) or exc.status >= 500:
        raise kopf.TemporaryError(f"{what}: {exc.status} {exc.reason}", delay=5) from exc
    raise kopf.PermanentError(f"{what}: {exc.status} {exc.reason}: {exc.body}") from exc


def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())


def core() -> client.CoreV1Api:
    return client.CoreV1Api(api_client())


def apps() -> client.AppsV1Api:
    return client.AppsV1Api(api_client())


def _plain(obj: Any) -> Any:
    return api_client().sanitize_for_serialization(obj)


def _drained(resp: Any) -> None:
    """A write whose answer nothing reads, asked with ``_preload_content=False``: read the raw body and hand the
    connection back, but build no objects from it. The client turns every answer into its typed models (a Deployment's
    or an Event's, thousands of Python objects): at 10,000 binds that was operator CPU spent on answers thrown away.
    A non-2xx answer still raises ApiException."""
    try:
        resp.read()
    finally:
        resp.release_conn()


def namespaced(namespace: str | None) -> str:
    """Cells and Sessions are namespaced; kopf types the namespace as optional for cluster-scoped kinds."""
    if not namespace:
        raise kopf.PermanentError("modeld objects are namespaced, but this one has no namespace")
    return namespace


def patch_status(plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
    try:
        _drained(custom().patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, namespace, plural, name, {"status": status}, _request_timeout=TIMEOUT,
            _preload_content=False))
    except ApiException as exc:
        if exc.status == 404:
            return  # deleted meanwhile: nothing to report on
        _raise(exc, f"patching status of {plural}/{name}")


def patch_labels(plural: str, namespace: str, name: str, labels: dict[str, str | None]) -> None:
    try:
        custom().patch_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, plural, name, {"metadata": {"labels": labels}}, _request_timeout=TIMEOUT
        )
    except ApiException as exc:
        if exc.status != 404:
            _raise(exc, f"labelling {plural}/{name}")


def list_objects(plural: str, namespace: str, label_selector: str = "", field_selector: str = "") -> list[dict[str, Any]]:
    try:
        res: Any = custom().list_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, plural, label_selector=label_selector, field_selector=field_selector,
            _request_timeout=TIMEOUT)
    except ApiException as exc:
        _raise(exc, f"listing {plural}")
    return list(res.get("items", []))


def get_object(plural: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = custom().get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, plural, name,
                                                                      _request_timeout=TIMEOUT)  # type: ignore[assignment]
        return obj
    except ApiException as exc:
        if exc.status == 404:
            return None
        _raise(exc, f"reading {plural}/{name}")
    return None


def post_event(body: Any, type: str, reason: str, message: str) -> None:
    """An Event on ``body``'s object, posted at once (kopf.event queues it, but only from inside a kopf handler).
    Best effort, as kopf's: an Event that cannot be posted is not worth failing the work it reports."""
    meta = body.get("metadata") or {}
    stamp = dt.datetime.now(dt.timezone.utc).isoformat()
    event = {
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "name": meta.get("name"),
                           "namespace": meta.get("namespace"), "uid": meta.get("uid")},
        "type": type, "reason": reason, "message": message[:1024], "count": 1,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "source": {"component": "modeld-operator"},
    }
    try:
        _drained(core().create_namespaced_event(meta.get("namespace"), event,  # type: ignore[arg-type]
                                                _request_timeout=TIMEOUT, _preload_content=False))
    except (ApiException, OSError, urllib3.exceptions.HTTPError):
        pass


class BindBacklog:
    """Whether Sessions wait in the bind queue (``waiting``, set by the Session controller while it runs). What only
    reports on binds (a Normal Event, a Cell's count of bound Sessions) waits behind them: the apiserver's time goes
    to the binds first."""

    def __init__(self) -> None:
        self.waiting: Callable[[], bool] = lambda: False


BINDS = BindBacklog()


class EventSink:
    """Normal Events posted behind the work they report, as client-go's recorder posts every Event: from a queue, by
    a thread of their own, so a burst of binds is not slowed by an Event each (at 10,000 Sessions the Event was half
    of the apiserver writes a bind made). The queue holds ``size`` Events; one more is dropped and counted
    (``modeld_operator_events_dropped_total``), as client-go drops, since a Normal Event only repeats what the status
    says. Warning Events never come here: they are posted at once (nothing accepted is dropped without one)."""

    BUSY_GAP_S = 0.1      # while binds wait: at most 10 Events a second, so they take little of the apiserver's time

    def __init__(self, size: int = 10_000) -> None:
        self._queue: queue.Queue[tuple[dict[str, Any], str, str, str]] = queue.Queue(maxsize=size)
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()
        # Whether work the Events report on is still queued (BINDS): the Events then trickle (a restart at 10,000
        # Sessions posted 2,600 of them while binds waited), and go at full speed once it is done
        self.busy: Callable[[], bool] = lambda: BINDS.waiting()

    def post(self, body: Any, type: str, reason: str, message: str) -> None:
        meta = body.get("metadata") or {}
        slim = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid")}}
        try:
            self._queue.put_nowait((slim, type, reason, message))
        except queue.Full:
            metrics.EVENTS_DROPPED.inc()
            return
        with self._guard:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="events", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        while True:
            body, type_, reason, message = self._queue.get()
            if self.busy():
                time.sleep(self.BUSY_GAP_S)
            try:
                post_event(body, type_, reason, message)
            finally:
                self._queue.task_done()

    def join(self, timeout: float) -> bool:
        """Wait until every queued Event was posted (tests); whether it got there in time."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks


EVENTS = EventSink()


def list_nodes() -> list[dict[str, Any]]:
    try:
        res = core().list_node(_request_timeout=TIMEOUT)
    except ApiException as exc:
        _raise(exc, "listing nodes")
    return [_plain(n) for n in res.items]


def list_pods(namespace: str, label_selector: str) -> list[dict[str, Any]]:
    try:
        res = core().list_namespaced_pod(namespace, label_selector=label_selector, _request_timeout=TIMEOUT)
    except ApiException as exc:
        _raise(exc, "listing pods")
    return [_plain(p) for p in res.items]


FIELD_MANAGER = "modeld-operator"


def apply_deployment(manifest: dict[str, Any]) -> None:
    """Server-side apply: one request, and no write at all when the Deployment already is as ``manifest`` says (an
    operator restart re-applies every Cell's: create, 409, read and replace were four requests and a write each)."""
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        _drained(apps().patch_namespaced_deployment(name, namespace, manifest, field_manager=FIELD_MANAGER, force=True,
                                                    _content_type="application/apply-patch+yaml",
                                                    _request_timeout=TIMEOUT, _preload_content=False))
    except ApiException as exc:
        _raise(exc, f"applying deployment {name}")


def apply_service(manifest: dict[str, Any]) -> None:
    """Server-side apply of the fields the operator owns (selector, ports, labels): the clusterIP stays as the
    apiserver gave it."""
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        _drained(core().patch_namespaced_service(name, namespace, manifest, field_manager=FIELD_MANAGER, force=True,
                                                 _content_type="application/apply-patch+yaml",
                                                 _request_timeout=TIMEOUT, _preload_content=False))
    except ApiException as exc:
        _raise(exc, f"applying service {name}")


def stop_deployment(namespace: str, name: str) -> None:
    """Scale a Deployment to no pods; absent is fine (nothing to stop, nothing written). The operator never deletes:
    its RBAC has no delete verb (tests/e2e/test_chart.py), and the Deployment goes with its Cell by owner reference.
    It used to delete here, and the apiserver's 403 reached only the operator's log."""
    try:
        apps().patch_namespaced_deployment(name, namespace, {"spec": {"replicas": 0}}, _request_timeout=TIMEOUT)
    except ApiException as exc:
        if exc.status != 404:
            _raise(exc, f"stopping deployment {name}")


def create_job(manifest: dict[str, Any]) -> bool:
    """Create once; an existing Job of that name is the same measurement. Returns whether this call created it."""
    try:
        client.BatchV1Api(api_client()).create_namespaced_job(
            manifest["metadata"]["namespace"], manifest, _request_timeout=TIMEOUT)  # type: ignore[arg-type]
    except ApiException as exc:
        if exc.status != 409:
            _raise(exc, f"creating job {manifest['metadata']['name']}")
        return False
    return True


def http_json(method: str, url: str, timeout: float, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """One small request to a worker. Returns (status, parsed body); status 0 when it could not be reached."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - worker URLs come from pod IPs
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        try:  # the worker's typed error body ({"error": {"kind", "message", "details"}}), when it sent one
            raw = exc.read()
            return exc.code, json.loads(raw) if raw else None
        except (OSError, ValueError):
            return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None
