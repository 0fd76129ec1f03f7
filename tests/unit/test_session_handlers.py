"""The Session handlers without a cluster: a watch event binds with one status write (in kopf's patch) and one Event,
a bound and alive session at its generation costs nothing, a changed spec binds again, a deletion frees the worker's
session, and the retry sweep writes its own status and posts its own Events (kopf does not run it)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import modeld_api as api
from modeld_operator.handlers import indexes, rejected, session
from modeld_operator.handlers.indexes import BoundSession, cell_entry

pytestmark = pytest.mark.unit

CELL_SPEC = {"model": {"family": "smollm2", "ref": "/models/smollm2"}, "runtime": {"backend": "torch"},
             "topology": {"gpus": 0, "interconnect": "none"}, "contextTier": 2048}
URL = "http://127.0.0.1:18080"


def cells(ready: bool = True) -> dict:
    status = {"endpoints": [{"pod": "p", "url": URL, "ready": ready, "instance": "i1"}],
              "conditions": [{"type": "Certified", "status": "True"}]}
    entry = cell_entry("c", CELL_SPEC, status)
    return {"ns": [entry], ("ns", "c"): [entry]}


def body(generation: int = 1, status: dict | None = None) -> dict:
    return {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": "Session",
            "metadata": {"name": "s", "namespace": "ns", "uid": "u1", "generation": generation,
                         "creationTimestamp": "2026-12-02T00:00:00Z"},
            "spec": {"modelFamily": "smollm2", "requiredContext": 1024}, "status": status or {}}


@pytest.fixture
def world(monkeypatch):
    """Records what the handlers write: kopf's Events, direct status patches, direct Events, worker calls."""
    out: dict[str, list] = {"events": [], "patched": [], "posted": [], "http": []}
    monkeypatch.setattr(indexes, "BINDINGS", indexes.Bindings())
    monkeypatch.setattr(session, "BINDINGS", indexes.BINDINGS)
    monkeypatch.setattr(rejected.kopf, "event", lambda b, type, reason, message: out["events"].append(reason))
    monkeypatch.setattr(session.kube, "patch_status", lambda plural, ns, name, st: out["patched"].append((name, st)))
    monkeypatch.setattr(session.kube, "post_event", lambda b, type, reason, message: out["posted"].append(reason))
    monkeypatch.setattr(session.kube, "http_json", lambda method, url, timeout, body=None: out["http"].append(
        (method, url)) or (200, None))
    return out


def event(kind: str | None, b: dict, patch: dict, idx: dict | None = None) -> None:
    session.session_event(type=kind, name="s", namespace="ns", body=b, spec=b["spec"], patch=patch,
                          cell_index=cells() if idx is None else idx, session_index={})


def test_a_watch_event_binds_with_one_status_write_and_one_event(world):
    patch: dict = {}
    event("ADDED", body(), patch)
    assert set(patch) == {"status"}                       # no label, no annotations: the status alone
    st = patch["status"]
    assert (st["phase"], st["cell"], st["endpoint"], st["sessionId"], st["observedGeneration"]) == (
        "Bound", "c", URL, "ns.s", 1)
    assert world["events"] == ["Bound"] and world["patched"] == [] and world["posted"] == []


def test_a_bound_alive_session_at_its_generation_costs_nothing_and_a_spec_change_binds_again(world):
    first: dict = {}
    event("ADDED", body(), first)
    bound = body(status=first["status"])
    world["events"].clear()
    again: dict = {}
    event("MODIFIED", bound, again)                     # its own status write's event
    event(None, bound, again)                           # the operator restarted: the initial listing
    assert again == {} and world["events"] == []
    changed: dict = {}
    event("MODIFIED", {**bound, "metadata": {**bound["metadata"], "generation": 2}}, changed)
    assert changed["status"]["observedGeneration"] == 2 and world["events"] == ["Bound"]


def test_an_older_body_does_not_bind_twice(world):
    """The sweep's body predates the watch handler's bind (or the other way round): one bind, one write."""
    patch: dict = {}
    event("ADDED", body(), patch)
    stale: dict = {}
    event("MODIFIED", body(), stale)
    assert stale == {} and world["events"] == ["Bound"]


def test_no_fitting_cell_says_why_once_and_the_sweep_binds_when_one_is_ready(world, monkeypatch):
    pending: dict = {}
    event("ADDED", body(), pending, idx=cells(ready=False))
    assert pending["status"]["phase"] == "Pending" and world["events"] == ["NoFittingCell"]
    entry = indexes.slim_session(body(status=pending["status"]))
    assert not session.retry_one(entry, cells(ready=False), {})       # nothing changed: nothing written
    assert world["patched"] == [] and world["posted"] == []
    # outside kopf's handlers kopf.event has no queue (LookupError): the sweep posts its Events itself
    monkeypatch.setattr(rejected.kopf, "event", _no_queue)
    assert session.retry_one(entry, cells(), {})
    ((name, st),) = world["patched"]
    assert name == "s" and st["phase"] == "Bound" and world["posted"] == ["Bound"]


def _no_queue(*_a, **_kw):
    raise LookupError("event_queue_var")


def test_a_deleted_session_is_closed_on_its_worker(world):
    bound = body(status={"phase": "Bound", "cell": "c", "endpoint": URL, "sessionId": "ns.s", "observedGeneration": 1})
    patch: dict = {}
    event("DELETED", bound, patch)
    assert world["http"] == [("DELETE", f"{URL}/v1/sessions/ns.s")] and patch == {}
    event("DELETED", body(), patch)                                  # never bound: nothing to close
    assert len(world["http"]) == 1


def test_a_session_bound_to_a_replaced_worker_is_bound_again(world):
    """Its Cell's refresh sends it back (Pending): the watch event of that write binds it again at once."""
    gone = body(status={"phase": "Bound", "cell": "c", "endpoint": "http://127.0.0.1:9", "sessionId": "ns.s",
                        "observedGeneration": 1})
    patch: dict = {}
    event("MODIFIED", gone, patch, idx=cells())
    assert patch["status"]["endpoint"] == URL
    sessions = {("ns", "c"): [BoundSession("other", URL, "i1")]}
    assert [v.sessions for v in session._cell_views("ns", 1024, cells(), sessions)] == [1]  # type: ignore[arg-type]


def test_the_sweep_runs_when_a_cell_changes_not_only_on_its_interval(monkeypatch):
    """A Session waiting for a cell binds as soon as the cell's entry changes (ready, certified), not a whole
    MODELD_RETRY_DELAY later; an unchanged cell (its refresh wrote the same status) wakes nothing."""
    monkeypatch.setattr(session, "SETTINGS", dataclasses.replace(session.SETTINGS, retry_delay=600.0))
    changes = indexes.CellChanges()
    monkeypatch.setattr(session, "CELL_CHANGES", changes)
    tried: list[str] = []
    monkeypatch.setattr(session, "retry_one", lambda entry, c, s: tried.append(entry["metadata"]["name"]))
    pending = {"pending": [indexes.slim_session(body())]}

    async def scenario() -> None:
        sweep = session.RetrySweep()
        task = asyncio.get_running_loop().create_task(sweep.run(pending, {}, {}))
        await asyncio.sleep(0.1)
        not_ready = cell_entry("c", CELL_SPEC, {})
        changes.saw("ns", not_ready)
        await asyncio.sleep(1.0)
        assert tried == ["s"]
        changes.saw("ns", cell_entry("c", CELL_SPEC, {}))             # the same entry again: no sweep
        await asyncio.sleep(1.0)
        assert tried == ["s"]
        changes.saw("ns", cells()["ns"][0])                            # ready now
        await asyncio.sleep(1.0)
        assert tried == ["s", "s"]
        task.cancel()

    asyncio.run(scenario())
