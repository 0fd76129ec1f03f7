"""What the operator makes of a replaced worker process: handlers/session.continuity asks the new process for the
session (GET, which recovers it from the cell's session store) and maps the answer to the Continuity condition."""

from __future__ import annotations

import pytest

from modeld_operator import kube
from modeld_operator.handlers import session

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("answer, expected", [
    ((200, {"session": {}, "tokens": [1, 2], "restored": {"tokens_restored": 812, "restore_ms": 950.0}}),
     (True, "Restored", "812 committed tokens restored")),
    ((200, {"session": {}, "tokens": [1, 2]}), (True, "Restored", "recovered earlier")),
    ((404, {"error": {"kind": "not_found", "message": "lost", "details": {"lost": "stored by a cell with another "
                                                                          "cache identity"}}}),
     (False, "Lost", "another cache identity")),
    ((404, {"error": {"kind": "not_found", "message": "session 'x' not found", "details": {}}}),
     (False, "NotHeld", "no session store")),
    ((0, None), (None, "Unknown", "no answer")),
    ((503, {"error": {"kind": "not_ready"}}), (None, "Unknown", "HTTP 503")),
])
def test_continuity_maps_the_new_workers_answer(monkeypatch, answer, expected):
    asked = []
    monkeypatch.setattr(kube, "http_json", lambda method, url, timeout, body=None: asked.append((method, url)) or answer)
    ok, reason, message = session.continuity("http://127.20.0.5:8080", "agents.agent-1")
    assert (ok, reason) == expected[:2] and expected[2] in message, message
    assert asked == [("GET", "http://127.20.0.5:8080/v1/sessions/agents.agent-1")]
