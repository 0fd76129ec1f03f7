"""Runs the operator: ``modeld-operator`` or ``python -m modeld_operator``."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import sys
from typing import Any

import aiohttp
import kopf

import modeld_api as api

from . import kube, metrics
from .settings import SETTINGS


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    tune(settings)
    kube.load_config()
    metrics.serve(SETTINGS.metrics_port)
    global _TRIMMER
    if _TRIMMER is None or _TRIMMER.done():      # once per process (a re-elected leader runs start-up again)
        _TRIMMER = asyncio.get_running_loop().create_task(return_freed_memory())


TRIM_INTERVAL_S = 10.0
_TRIMMER: asyncio.Task[None] | None = None


async def return_freed_memory() -> None:
    """Every TRIM_INTERVAL_S, hand the heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere).
    A burst of reconciles (kopf's handler threads parse and build whole objects) leaves its freed memory in malloc's
    arenas: measured at 100 Cells, 190 MiB resident before a trim and 120 after (docs/operator.md, "Scale")."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    while True:
        await asyncio.sleep(TRIM_INTERVAL_S)
        trim(0)


@kopf.on.login()
async def login(**kw: Any) -> kopf.AiohttpSession | None:
    """kopf's own login (in-cluster or kubeconfig, through the kubernetes client), on an aiohttp session whose pool
    holds at most MODELD_API_CONNECTIONS connections. kopf's own session has no limit: each burst of patches and
    Events opened a TLS connection per request in flight and kept it alive, 226 of them at 1,000 Sessions, each with
    a 128 KiB read buffer and OpenSSL's state (docs/operator.md, "Scale")."""
    info = kopf.login_via_client(**kw)
    if info is None:
        return None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=SETTINGS.api_connections, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(), auth=info.as_aiohttp_basic_auth(), proxy=info.proxy_url,
        trust_env=info.trust_env)
    return kopf.AiohttpSession(server=info.server, default_namespace=info.default_namespace, priority=info.priority,
                               expiration=info.expiration, aiohttp_session=session)


class TimerSuccess(logging.Filter):
    """Drops kopf's "Timer '...' succeeded." lines: each Cell's status refresh is a timer, so at 1,000 Cells and
    MODELD_STATUS_INTERVAL=5 they were 200 lines a second of the operator's log, saying nothing a failure would not
    (a failing timer still logs, at WARNING or ERROR, and a refresh that changes something writes the Cell's status
    and an Event)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not (record.levelno == logging.INFO and msg.startswith("Timer ") and msg.endswith(" succeeded."))


def quiet_timers() -> None:
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, TimerSuccess) for f in handler.filters):
            handler.addFilter(TimerSuccess())


def tune(settings: kopf.OperatorSettings) -> None:
    """kopf's settings as the operator needs them (tests/unit/test_operator_settings.py)."""
    # A silent watch must not hang the operator (kopf #585, #860): bounded server and client timeouts.
    settings.watching.server_timeout = SETTINGS.watch_server_timeout
    settings.watching.client_timeout = SETTINGS.watch_client_timeout
    settings.watching.connect_timeout = 10
    settings.persistence.finalizer = api.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    # Only spec changes run update handlers (field="spec"), so the stored essence leaves labels and annotations out:
    # with them, a label written on a Cell changed its essence and kopf stored it again (Sessions have no kopf
    # create/update handlers, so nothing is stored on them).
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, ignored_fields=["metadata.labels", "metadata.annotations"])
    settings.posting.level = logging.INFO
    settings.execution.max_workers = 8
    # kopf keeps a worker task per object for this long after its last event, holding that event's whole body (its
    # managedFields too): at 170 binds a second, 5 s (kopf's default) kept ~850 Session bodies alive, ~35 MiB.
    settings.queueing.idle_timeout = 1.0
    # A deleted object's finalizer goes only once its timers have stopped. A timer caught mid-call (a sync status
    # refresh in a thread) is polled again after cancellation_polling, 60 s by default: one deletion in a few then
    # took a minute more (an e2e `kubectl delete cell --timeout=60s` failed on it). Poll every second instead.
    settings.background.cancellation_polling = 1.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="modeld operator: Cells and Sessions")
    parser.add_argument("--namespace", default=SETTINGS.namespace, help="watch one namespace (default: all)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if SETTINGS.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    quiet_timers()
    from . import handlers  # noqa: F401  (registers the handlers)

    async def lead(stop: asyncio.Event | None = None) -> None:
        await kopf.operator(
            clusterwide=not args.namespace,
            namespaces=[args.namespace] if args.namespace else [],
            standalone=True,          # no kopf peering: replicas are kept apart by the Lease (leader.py)
            stop_flag=stop,
            memo=kopf.Memo(namespace=args.namespace),   # the Session controller's watch (handlers/session.py)
        )

    if not SETTINGS.leader_election:
        asyncio.run(lead())
        return
    from . import leader

    kube.load_config()
    elector = leader.Elector(SETTINGS.lease_namespace, SETTINGS.lease_name, SETTINGS.lease_duration)
    sys.exit(asyncio.run(leader.run(elector, lead, retry_s=SETTINGS.lease_duration / 6)))


if __name__ == "__main__":
    main()
