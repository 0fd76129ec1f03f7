"""Nothing accepted and then dropped (handlers/rejected.py): a permanent failure of a handler reaches the object as
a condition and a Warning Event naming the field, never only the operator's log; a later success clears it."""

from __future__ import annotations

import kopf
import pytest
from pydantic import ValidationError

import modeld_api as api
from modeld_operator.conditions import spec_errors
from modeld_operator.handlers import rejected
from modeld_operator.handlers.session import parse_spec

pytestmark = pytest.mark.unit


@pytest.fixture
def calls(monkeypatch):
    out: dict[str, list] = {"status": [], "events": []}
    monkeypatch.setattr(rejected.kube, "patch_status", lambda plural, ns, name, st: out["status"].append((plural, name, st)))
    monkeypatch.setattr(rejected.kopf, "event", lambda body, type, reason, message: out["events"].append((type, reason, message)))
    return out


def body(conditions=None, generation=3) -> dict:
    return {"metadata": {"name": "c", "namespace": "ns", "generation": generation},
            "status": {"conditions": conditions or []}}


def test_a_permanent_failure_becomes_a_condition_and_a_warning_event_and_is_still_raised(calls):
    @rejected.surfaced("cells")
    def reconcile(**_):
        raise kopf.PermanentError("creating deployment cell-c: 422 Unprocessable Entity: spec.template.metadata.labels: Invalid value")

    with pytest.raises(kopf.PermanentError):
        reconcile(name="c", namespace="ns", body=body())
    ((plural, name, status),) = calls["status"]
    (cond,) = status["conditions"]
    assert (plural, name, status["phase"]) == ("cells", "c", "Failed")
    assert (cond["type"], cond["status"], cond["reason"], cond["observedGeneration"]) == ("Reconciled", "False", "Rejected", 3)
    assert "spec.template.metadata.labels" in cond["message"]
    assert calls["events"] == [("Warning", "Rejected", cond["message"])]
    assert rejected.holds(status, 3) and not rejected.holds(status, 4)       # a new generation is tried afresh


def test_the_same_rejection_again_writes_nothing_and_a_success_clears_it(calls):
    msg = "invalid Session spec: spec.requiredContext: Input should be greater than 0"
    old = [{"type": "Reconciled", "status": "False", "reason": "Rejected", "message": msg, "observedGeneration": 3,
            "lastTransitionTime": "t"}]

    @rejected.surfaced("sessions")
    def bind(fail: bool, **_):
        if fail:
            raise kopf.PermanentError(msg)

    with pytest.raises(kopf.PermanentError):
        bind(True, name="s", namespace="ns", body=body(old))
    assert calls == {"status": [], "events": []}                              # already said
    bind(False, name="s", namespace="ns", body=body(old))
    ((_, _, status),) = calls["status"]
    assert status["conditions"][0]["status"] == "True" and not calls["events"]


def test_a_reason_the_handler_already_reported_is_not_reported_twice(calls):
    @rejected.surfaced("sessions")
    def bind(**_):
        raise rejected.Reported("pinned cell big serves llama3, not smollm2")

    with pytest.raises(rejected.Reported):
        bind(name="s", namespace="ns", body=body())
    assert calls == {"status": [], "events": []}


def test_a_timers_success_does_not_clear_what_its_reconcile_was_refused(calls):
    old = [{"type": "Reconciled", "status": "False", "reason": "Rejected", "message": "x", "observedGeneration": 3}]

    @rejected.surfaced("cells", clears=False)
    def watch_status(**_):
        return None

    watch_status(name="c", namespace="ns", body=body(old))
    assert calls["status"] == []


def test_an_invalid_spec_names_its_fields():
    with pytest.raises(ValidationError) as info:
        api.SessionSpec.model_validate({"modelFamily": "smollm2", "requiredContext": "lots"})
    assert spec_errors(info.value).startswith("spec.requiredContext: ")
    with pytest.raises(kopf.PermanentError, match=r"invalid Session spec: spec\.requiredContext: "):
        parse_spec({"modelFamily": "smollm2", "requiredContext": "lots"})


def test_a_success_clears_the_rejection_inside_kopfs_patch_when_the_handler_wrote_its_status_there(calls):
    """A handler whose status goes out in kopf's patch: the Reconciled condition is set in that patch's list (a list
    in a merge patch replaces the stored one whole, so a separate write would be undone by it)."""
    old = [{"type": "Reconciled", "status": "False", "reason": "Rejected", "message": "x", "observedGeneration": 3,
            "lastTransitionTime": "t"},
           {"type": "Ready", "status": "False", "reason": "NoPods", "message": "", "observedGeneration": 3}]

    @rejected.surfaced("cells")
    def reconcile(patch, **_):
        ready = {**old[1], "status": "True", "reason": "Ready"}
        patch["status"] = {"phase": "Ready", "conditions": [old[0], ready]}

    patch: dict = {}
    reconcile(name="c", namespace="ns", body=body(old), patch=patch)
    assert calls["status"] == []                                              # nothing written apart
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conds["Reconciled"]["status"] == "True" and conds["Ready"]["status"] == "True"
    assert patch["status"]["phase"] == "Ready"

    patch = {}                                                                # a handler that wrote no status
    rejected.surfaced("cells")(lambda **_: None)(name="c", namespace="ns", body=body(old), patch=patch)
    assert [c["status"] for c in patch["status"]["conditions"]] == ["True", "False"] and calls["status"] == []
