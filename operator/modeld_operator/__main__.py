"""Runs the operator: ``modeld-operator`` or ``python -m modeld_operator``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

import kopf

import modeld_api as api

from . import kube, metrics
from .settings import SETTINGS


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    tune(settings)
    kube.load_config()
    metrics.serve(SETTINGS.metrics_port)


def tune(settings: kopf.OperatorSettings) -> None:
    """kopf's settings as the operator needs them (tests/unit/test_operator_settings.py)."""
    # A silent watch must not hang the operator (kopf #585, #860): bounded server and client timeouts.
    settings.watching.server_timeout = SETTINGS.watch_server_timeout
    settings.watching.client_timeout = SETTINGS.watch_client_timeout
    settings.watching.connect_timeout = 10
    settings.persistence.finalizer = api.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    # Only spec changes run update handlers (field="spec"), so the stored essence leaves labels and annotations out:
    # with them, the binding's own cell label changed the essence and kopf wrote it a second time per bind.
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, ignored_fields=["metadata.labels", "metadata.annotations"])
    settings.posting.level = logging.INFO
    settings.execution.max_workers = 8
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
    from . import handlers  # noqa: F401  (registers the handlers)

    async def lead(stop: asyncio.Event | None = None) -> None:
        await kopf.operator(
            clusterwide=not args.namespace,
            namespaces=[args.namespace] if args.namespace else [],
            standalone=True,          # no kopf peering: replicas are kept apart by the Lease (leader.py)
            stop_flag=stop,
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
