"""kopf's settings as the operator sets them at startup (modeld_operator.__main__.tune)."""

from __future__ import annotations

import kopf
import pytest

import modeld_api as api
from modeld_operator.__main__ import tune
from modeld_operator.settings import SETTINGS

pytestmark = pytest.mark.unit


def test_a_deleted_object_waits_at_most_a_second_for_its_timers_to_stop():
    """A finalizer goes once the object's timers stopped; one caught mid-call is polled again after
    cancellation_polling (kopf's default: 60 s, so a Cell deleted while its status refresh ran took a minute more)."""
    settings = kopf.OperatorSettings()
    assert settings.background.cancellation_polling == 60       # the default this guards against
    tune(settings)
    assert settings.background.cancellation_polling <= 1.0


def test_watches_are_bounded_and_state_is_kept_under_the_groups_names():
    settings = kopf.OperatorSettings()
    tune(settings)
    assert settings.watching.server_timeout == SETTINGS.watch_server_timeout
    assert settings.watching.client_timeout == SETTINGS.watch_client_timeout
    assert settings.persistence.finalizer == api.FINALIZER


def test_the_stored_essence_is_the_spec_not_the_labels_a_bind_sets():
    """Update handlers filter on spec; a label the operator writes must not make kopf store the essence again."""
    settings = kopf.OperatorSettings()
    tune(settings)
    body = kopf.Body({"apiVersion": "modeld.contenox.io/v1alpha1", "kind": "Session",
                      "metadata": {"name": "s", "labels": {api.LABEL_CELL: "c"}, "annotations": {"a": "b"}},
                      "spec": {"modelFamily": "smollm2"}})
    essence = settings.persistence.diffbase_storage.build(body=body)
    assert essence["spec"] == {"modelFamily": "smollm2"}
    assert "labels" not in (essence.get("metadata") or {}) and "annotations" not in (essence.get("metadata") or {})


def test_kopf_does_not_watch_sessions_so_it_writes_no_finalizer_or_annotations_on_them():
    """A kopf create/update/delete handler stores its progress in annotations, and a timer or a delete handler holds
    a finalizer: each is a write per Session at 10,000 Sessions; and kopf's per-object workers made a restart at
    10,000 Sessions O(N²) (docs/operator.md, "Scale"). The Session controller watches them itself. Cells keep
    kopf's handlers."""
    from kopf._cogs.structs.references import Resource

    from modeld_operator import handlers  # noqa: F401  (registers them)

    registry = kopf.get_default_registry()
    sessions = Resource(api.GROUP, api.VERSION, "sessions")
    cells = Resource(api.GROUP, api.VERSION, "cells")

    def ids(registered: list) -> set[str]:
        return {str(h.id) for h in registered if h.selector is not None and h.selector.check(sessions)}

    assert ids(registry._changing._handlers) == set() and ids(registry._spawning._handlers) == set()
    assert ids(registry._watching._handlers) == set() and ids(registry._indexing._handlers) == set()
    # no kopf index at all: kopf holds every object's worker until all indexed kinds are listed, waking all of them at
    # each object's first event (O(N^2) at a restart); the operator's own reflectors fill its indexes instead
    assert list(registry._indexing._handlers) == []
    assert any(h.selector is not None and h.selector.check(cells) for h in registry._spawning._handlers)


def test_the_operator_logs_in_on_a_bounded_connection_pool(monkeypatch):
    """kopf's own session has no connection limit (226 kept-alive TLS connections were measured at 1,000 Sessions)."""
    import asyncio

    from modeld_operator import __main__ as entry

    info = kopf.ConnectionInfo(server="https://127.0.0.1:6443", insecure=True, token="t", default_namespace="ns")
    monkeypatch.setattr(entry.kopf, "login_via_client", lambda **_: info)

    async def login() -> tuple[kopf.AiohttpSession, int]:
        out = await entry.login(logger=None, settings=kopf.OperatorSettings())
        assert out is not None and out.aiohttp_session.connector is not None
        limit = out.aiohttp_session.connector.limit
        await out.aiohttp_session.close()
        return out, limit

    out, limit = asyncio.run(login())
    assert out.server == info.server and out.default_namespace == "ns" and limit == SETTINGS.api_connections


def test_timer_successes_stay_out_of_the_log_and_everything_else_stays_in():
    """At 1,000 Cells each one's status timer said "succeeded" every 5 s: 200 log lines a second."""
    import logging

    from modeld_operator.__main__ import TimerSuccess

    f = TimerSuccess()

    def rec(level: int, msg: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)

    assert not f.filter(rec(logging.INFO, "Timer 'watch_status' succeeded."))
    assert f.filter(rec(logging.ERROR, "Timer 'watch_status' failed with an exception. Will retry."))
    assert f.filter(rec(logging.INFO, "Handler 'reconcile' succeeded."))
    assert f.filter(rec(logging.WARNING, "Timer 'watch_status' succeeded."))
