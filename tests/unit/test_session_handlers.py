"""The Session controller without a cluster: a watch event queues the Session and a worker binds it with one status
write and then one Event; a bound and alive session at its generation costs nothing; a changed spec binds again; a
deletion (seen by the watch, or by a new listing) frees the worker's session; the work queue never runs one key twice
at once; the reflector delivers events in order and lists again on 410 Gone."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest

import modeld_api as api
from modeld_operator.handlers import indexes, session
from modeld_operator.handlers.indexes import BoundSession, cell_entry
from modeld_operator.informer import Gone, Reflector, WorkQueue

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


class Recorder:
    """The Normal-Event queue, recording in the order the bind hands Events to it."""

    def __init__(self, writes: list) -> None:
        self.writes = writes

    def post(self, b, type, reason, message) -> None:
        self.writes.append(("event", reason))


@pytest.fixture
def world(monkeypatch):
    """Records what the controller writes, in order: status patches and Events (("status", phase) and ("event",
    reason)), and worker calls."""
    out: dict[str, list] = {"writes": [], "statuses": [], "http": []}
    monkeypatch.setattr(indexes, "BINDINGS", indexes.Bindings())
    monkeypatch.setattr(session, "BINDINGS", indexes.BINDINGS)
    monkeypatch.setattr(session.kube, "patch_status", lambda plural, ns, name, st: (
        out["writes"].append(("status", st.get("phase"))), out["statuses"].append(st)))
    monkeypatch.setattr(session.kube, "post_event", lambda b, type, reason, message: out["writes"].append(("event", reason)))
    monkeypatch.setattr(session.kube, "EVENTS", Recorder(out["writes"]))
    monkeypatch.setattr(session.kube, "http_json", lambda method, url, timeout, body=None: out["http"].append(
        (method, url)) or (200, None))
    return out


def bind(b: dict, idx: dict | None = None, cache: indexes.SessionCache | None = None) -> bool:
    """One worker's pass over a Session as the cache holds it (slim)."""
    cache = cache or indexes.SessionCache()
    return session.bind_one(indexes.slim_session(b), cells() if idx is None else idx, cache.bound)


def bound_status(world: dict) -> dict:
    """The status a bind writes."""
    bind(body())
    return world["statuses"][-1]


def test_a_session_binds_with_one_status_write_then_one_event(world):
    assert bind(body())
    assert world["writes"] == [("status", "Bound"), ("event", "Bound")]     # the Event never runs ahead of the status


def test_the_written_status_names_the_cell_endpoint_and_worker_session(world):
    st = bound_status(world)
    assert (st["phase"], st["cell"], st["endpoint"], st["sessionId"], st["observedGeneration"], st["workerInstance"]) == (
        "Bound", "c", URL, "ns.s", 1, "i1")


def test_a_bound_alive_session_at_its_generation_costs_nothing_and_a_spec_change_binds_again(world):
    st = bound_status(world)
    world["writes"].clear()
    assert not bind(body(status=st))                     # its own write's watch event, or a new operator's listing
    assert world["writes"] == []
    assert bind(body(generation=2, status=st))
    assert world["writes"] == [("status", "Bound"), ("event", "Bound")]


def test_a_body_older_than_this_processs_bind_does_not_bind_twice(world):
    """The sweep queued a Session whose cached body predates the bind a worker just wrote: one bind, one write."""
    assert bind(body())
    assert not bind(body())
    assert world["writes"] == [("status", "Bound"), ("event", "Bound")]


def test_no_fitting_cell_says_why_once_and_binds_when_one_is_ready(world):
    bind(body(), idx=cells(ready=False))
    assert world["writes"] == [("status", "Pending"), ("event", "NoFittingCell")]
    st = world["statuses"][0]
    world["writes"].clear()
    assert not bind(body(status=st), idx=cells(ready=False))   # as the watch brings it back: nothing changed
    assert world["writes"] == []
    assert bind(body(status=st))                               # a cell is ready now (the sweep queued it)
    assert world["writes"] == [("status", "Bound"), ("event", "Bound")]


def test_a_session_bound_to_a_replaced_worker_is_bound_again(world):
    """Its Cell's refresh sends it back (Pending); a binding whose endpoint is gone binds again at once."""
    gone = body(status={"phase": "Bound", "cell": "c", "endpoint": "http://127.0.0.1:9", "sessionId": "ns.s",
                        "observedGeneration": 1})
    assert bind(gone)
    sessions = {("ns", "c"): [BoundSession("other", URL, "i1")]}
    assert [v.sessions for v in session._cell_views("ns", 1024, cells(), sessions)] == [1]  # type: ignore[arg-type]


def test_the_cache_indexes_bound_sessions_by_cell_and_keeps_the_rest_pending():
    cache = indexes.SessionCache()
    st = {"phase": "Bound", "cell": "c", "endpoint": URL, "workerInstance": "i1", "candidates": [{"cell": "c"}] * 32}
    key = cache.put(indexes.slim_session(body(status=st)))
    assert key == ("ns", "s") and cache.pending == set()
    assert cache.bound.get(("ns", "c")) == [BoundSession("s", URL, "i1")]
    assert "candidates" not in cache.objects[key]["status"]            # read only while it waits
    cache.put(indexes.slim_session(body(status={"phase": "Pending"})))   # sent back by its cell
    assert cache.bound.get(("ns", "c"), []) == [] and cache.pending == {key}
    going = body()
    going["metadata"]["deletionTimestamp"] = "t"
    cache.put(indexes.slim_session(going))
    assert cache.pending == set()                                       # being deleted: nothing to bind
    cache.put(indexes.slim_session(body(status=st)))
    assert cache.remove(key) is not None and cache.bound.get(("ns", "c"), []) == [] and cache.objects == {}


def test_a_slim_session_drops_managed_fields_and_annotations():
    b = body()
    b["metadata"].update(managedFields=[{"manager": "kubectl"}] * 50, annotations={"big": "x" * 10_000})
    slim = indexes.slim_session(b)
    assert slim["metadata"] == {"name": "s", "namespace": "ns", "uid": "u1", "generation": 1,
                                "creationTimestamp": "2026-12-02T00:00:00Z", "deletionTimestamp": None}
    assert slim["spec"] == b["spec"] and slim["apiVersion"] == b["apiVersion"]


def controller(monkeypatch, cache: indexes.SessionCache) -> tuple[session.SessionController, list]:
    """A controller whose binds and releases are recorded instead of made (run on the loop, no threads)."""
    c = session.SessionController(cache)
    c.queue = WorkQueue()
    done: list = []
    monkeypatch.setattr(session, "release", lambda name, ns, b: done.append(("release", name)))
    monkeypatch.setattr(session, "bind_one", lambda obj, cells, sessions: done.append(("bind", obj["metadata"]["name"])))
    return c, done


def test_the_watch_queues_what_it_touches_and_a_deletion_or_a_relisting_releases(monkeypatch):
    async def scenario() -> None:
        cache = indexes.SessionCache()
        c, done = controller(monkeypatch, cache)
        bound = indexes.slim_session(body(status={"phase": "Bound", "cell": "c", "endpoint": URL, "sessionId": "ns.s"}))
        c.listed([bound, indexes.slim_session({**body(), "metadata": {**body()["metadata"], "name": "t"}})])
        assert len(c.queue) == 2 and cache.synced
        c.event("MODIFIED", bound)                        # already queued: once
        assert len(c.queue) == 2
        for _ in range(2):
            key = await c.queue.get()
            await c.process(key)
            c.queue.done(key)
        assert sorted(done) == [("bind", "s"), ("bind", "t")]
        done.clear()
        c.event("DELETED", bound)
        c.listed([])                                      # t was deleted while no watch was open
        await asyncio.sleep(0.1)
        assert sorted(done) == [("release", "s"), ("release", "t")] and cache.objects == {}

    asyncio.run(scenario())


def test_the_work_queue_never_runs_a_key_twice_at_once_and_runs_a_key_changed_meanwhile_again():
    async def scenario() -> None:
        q: WorkQueue[str] = WorkQueue()
        q.add("a")
        q.add("a")
        assert await q.get() == "a"
        q.add("a")                                        # changed while a worker holds it: not handed out now
        assert q._queue.empty()
        q.done("a")                                       # ... but once the worker is done
        assert await q.get() == "a"
        q.done("a")
        assert q._queue.empty() and len(q) == 0

    asyncio.run(scenario())


def test_the_sweep_queues_pending_sessions_when_a_cell_changes_not_only_on_its_interval(monkeypatch):
    """A Session waiting for a cell binds as soon as the cell's entry changes (ready, certified), not a whole
    MODELD_RETRY_DELAY later; an unchanged cell (its refresh wrote the same status) wakes nothing."""
    monkeypatch.setattr(session, "SETTINGS", dataclasses.replace(session.SETTINGS, retry_delay=600.0))
    changes = indexes.CellChanges()
    monkeypatch.setattr(session, "CELL_CHANGES", changes)

    async def scenario() -> None:
        cache = indexes.SessionCache()
        cache.put(indexes.slim_session(body()))
        c = session.SessionController(cache)
        c.queue = queue = WorkQueue()
        task = asyncio.get_running_loop().create_task(c._sweep())
        await asyncio.sleep(0.1)

        async def swept() -> int:
            n = 0
            while not queue._queue.empty():
                key = await queue.get()
                queue.done(key)
                n += 1
            return n

        changes.saw("ns", cell_entry("c", CELL_SPEC, {}))
        await asyncio.sleep(1.0)
        assert await swept() == 1
        changes.saw("ns", cell_entry("c", CELL_SPEC, {}))             # the same entry again: no sweep
        await asyncio.sleep(1.0)
        assert await swept() == 0
        changes.saw("ns", cells()["ns"][0])                            # ready now
        await asyncio.sleep(1.0)
        assert await swept() == 1
        task.cancel()

    asyncio.run(scenario())


class FakeStream:
    """A response as urllib3 gives it unread: a watch's chunks split lines anywhere."""

    def __init__(self, lines: list[dict]) -> None:
        self.raw = "".join(json.dumps(x) + "\n" for x in lines).encode()
        self.chunks = [self.raw[i:i + 7] for i in range(0, len(self.raw), 7)]
        self.released = False

    def stream(self, amt=None, decode_content=False):
        yield from self.chunks

    def read(self) -> bytes:
        return self.raw

    def release_conn(self) -> None:
        self.released = True


def test_the_reflector_delivers_watch_events_in_order_and_lists_again_on_410():
    delivered: list = []
    calls: list = []
    stream: FakeStream | None = None
    r = Reflector("sessions", lambda **kw: calls.append(kw) or stream, lambda o: o["metadata"]["name"],
                  lambda objs: delivered.append(("list", objs)), lambda kind, name: delivered.append((kind, name)))
    r._deliver = lambda fn, *args: fn(*args)  # type: ignore[method-assign]
    ev = [{"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "5"}}},
          {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}},
          {"type": "MODIFIED", "object": {"metadata": {"name": "a", "resourceVersion": "9"}}},
          {"type": "DELETED", "object": {"metadata": {"name": "a", "resourceVersion": "10"}}}]
    stream = FakeStream(ev)
    assert r.watch("4") == "10"
    assert delivered == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")] and stream.released
    assert calls[0]["resource_version"] == "4" and calls[0]["allow_watch_bookmarks"]
    stream = FakeStream([{"type": "ERROR", "object": {"code": 410, "message": "too old"}}])
    with pytest.raises(Gone):
        r.watch("10")


def test_the_reflector_lists_a_page_at_a_time():
    pages = {None: {"items": [{"metadata": {"name": "a"}}], "metadata": {"continue": "p2"}},
             "p2": {"items": [{"metadata": {"name": "b"}}], "metadata": {"resourceVersion": "42"}}}
    asked: list = []
    r = Reflector("sessions", lambda **kw: asked.append(kw) or FakeStream([pages[kw.get("_continue")]]),
                  lambda o: o["metadata"]["name"], lambda _: None, lambda *_: None)
    assert r.list_all() == (["a", "b"], "42")
    assert [kw["limit"] for kw in asked] == [Reflector.PAGE] * 2


def test_normal_events_are_posted_behind_the_binds_in_order_and_a_full_queue_drops_and_counts(monkeypatch):
    """client-go's recorder semantics: the bind does not wait for its Event; a burst beyond the queue drops Normal
    Events (counted), never the work they report."""
    from modeld_operator import kube, metrics

    posted: list = []
    gate = threading.Event()
    monkeypatch.setattr(kube, "post_event", lambda b, type, reason, message: gate.wait(5) and posted.append(message))
    sink = kube.EventSink(size=3)
    dropped = metrics.EVENTS_DROPPED._value.get()
    b = body()
    for i in range(5):                     # the poster takes the first at once and blocks on it: 3 more fit
        sink.post(b, "Normal", "Bound", str(i))
        time.sleep(0.05)
    assert metrics.EVENTS_DROPPED._value.get() - dropped == 1
    gate.set()
    assert sink.join(5)
    assert posted == ["0", "1", "2", "3"]


def test_events_trickle_while_binds_wait_and_go_at_full_speed_once_none_do(monkeypatch):
    """While the Session controller still has work queued, the Event poster waits BUSY_GAP_S before each post (the
    apiserver's time goes to the binds); with nothing queued it does not wait."""
    from modeld_operator import kube

    posted: list = []
    waits: list = []
    monkeypatch.setattr(kube, "post_event", lambda b, type, reason, message: posted.append(message))
    real_sleep = time.sleep
    monkeypatch.setattr(kube.time, "sleep",          # the poster's waits are recorded; join's polls really sleep
                        lambda s: waits.append(s) if s == kube.EventSink.BUSY_GAP_S else real_sleep(s))
    sink = kube.EventSink(size=10)
    busy = [True]
    sink.busy = lambda: busy[0]
    b = body()
    sink.post(b, "Normal", "Bound", "a")
    assert sink.join(5)
    assert waits == [kube.EventSink.BUSY_GAP_S] and posted == ["a"]
    busy[0] = False
    sink.post(b, "Normal", "Bound", "b")
    assert sink.join(5)
    assert waits == [kube.EventSink.BUSY_GAP_S] and posted == ["a", "b"]


def test_a_bound_session_lists_the_chosen_cell_and_the_next_best_and_says_how_many_were_considered(world):
    """Every Cell of a namespace in every bound Session's status made each bind's write (and its watch event) grow
    with the namespace; waiting, every cell's reason is listed (up to api.CANDIDATES_MAX)."""
    entries = [cell_entry(f"c{i:02d}", CELL_SPEC, {"endpoints": [{"pod": f"p{i}", "url": f"{URL}{i}", "ready": True}],
                                                     "conditions": [{"type": "Certified", "status": "True"}]})
               for i in range(20)]
    idx = {"ns": entries, **{("ns", e.name): [e] for e in entries}}
    assert bind(body(), idx)
    st = world["statuses"][-1]
    assert len(st["candidates"]) == session.BOUND_CANDIDATES
    assert st["candidates"][0]["chosen"] and st["candidates"][0]["cell"] == st["cell"]
    assert st["candidates"][0]["reason"].endswith(f"the best {session.BOUND_CANDIDATES} of the 20 cells considered are listed")
    assert not any(c["chosen"] for c in st["candidates"][1:])
    # none ready: Pending, and every cell says why (up to 32)
    for e in entries:
        idx[("ns", e.name)] = [dataclasses.replace(e, ready_endpoints=())]
    idx["ns"] = [v[0] for k, v in idx.items() if k != "ns"]
    world["statuses"].clear()
    session.BINDINGS.forget("ns", "s")                  # another Session, as far as this process knows
    bind(body(), idx)
    st = world["statuses"][-1]
    assert st["phase"] == "Pending" and len(st["candidates"]) == 20


def test_stopping_a_reflector_ends_its_blocked_watch_at_once():
    """A quiet watch blocks its thread in a read until the server's timeout; stop() must end that read, not wait for
    it (closing the response waited: an operator took 43 s to stop after SIGTERM). A real stream on loopback."""
    import http.server

    import urllib3

    hold = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            line = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "5"}}}) + "\n"
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(f"{len(line):x}\r\n{line}\r\n".encode())
            self.wfile.flush()
            hold.wait(30)                      # a quiet watch: nothing more until the server's timeout

        def log_message(self, *a) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pool = urllib3.PoolManager()
    url = f"http://127.0.0.1:{server.server_address[1]}/watch"
    seen = threading.Event()
    r = Reflector("cells", lambda **kw: pool.request("GET", url, preload_content=False), lambda o: o,
                  lambda _: None, lambda kind, obj: seen.set())
    r._deliver = lambda fn, *args: fn(*args)  # type: ignore[method-assign]
    ended: list = []

    def watch() -> None:
        try:
            r.watch("4")
        except Exception as exc:  # noqa: BLE001 - the stream cut under it (as _run sees it, and stops)
            ended.append(exc)

    t = threading.Thread(target=watch, daemon=True)
    try:
        t.start()
        assert seen.wait(10)                   # the watch is open and blocked in its next read
        stopper = threading.Thread(target=r.stop, daemon=True)   # stop() itself must not block either
        stopper.start()
        stopper.join(10)
        t.join(10)
        assert not stopper.is_alive() and not t.is_alive()       # the server would have held the read 30 s
    finally:
        hold.set()
        server.shutdown()


def test_the_sessions_list_as_the_caches_start_and_binding_takes_that_listing(monkeypatch):
    """begin() (indexes.STARTING) starts the one Session reflector; run() binds from it and ends it when stopped."""
    started: list = []

    class FakeReflector:
        def __init__(self, name, lister, slim, on_list, on_event, timeout_s=0) -> None:
            self.on_list, self.stopped = on_list, False
            started.append(self)

        def start(self, loop) -> None:
            loop.call_soon(self.on_list, [indexes.slim_session(body())])

        def stop(self) -> None:
            self.stopped = True

    monkeypatch.setattr(session, "Reflector", FakeReflector)
    assert session.CONTROLLER.begin in indexes.STARTING

    async def scenario() -> None:
        cache = indexes.SessionCache()
        c, done = controller(monkeypatch, cache)
        c.begin(None)
        await asyncio.sleep(0.05)
        assert cache.synced and len(c.queue) == 1 and done == []    # listed and queued; nothing bound before run
        task = asyncio.get_running_loop().create_task(c.run({}, None))
        for _ in range(100):
            if done:
                break
            await asyncio.sleep(0.01)
        assert done == [("bind", "s")] and len(started) == 1          # run took begin's listing: one reflector
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert started[0].stopped and c._reflector is None

    asyncio.run(scenario())
