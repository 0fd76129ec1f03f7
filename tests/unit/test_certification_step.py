"""certification.next_step: the operator's next certification step, decided from what the handler read (pure).
Each case constructs what was observed and asserts the one step it leads to."""

from __future__ import annotations

import dataclasses
import json

import pytest

import modeld_api as api
from modeld_operator import certification as c

from .test_certification_operator import pod, spec

pytestmark = pytest.mark.unit

SUMMARY = {"certified": True, "gate": "context-tier", "reason": "baseline cannot run 8192", "topology": "cpu",
           "measuredAt": "2026-11-29T15:00:00Z", "firstOutputP90Ms": {"1024": 300.0}, "quality": "pass",
           "contextTier": 8192, "schema": "modeld.certification/v1", "workload": "agent-v1"}


def observed(**kw) -> c.Observed:
    base = {"name": "cell", "namespace": "ns", "spec": spec(), "ready_url": "http://127.30.0.5:8080",
            "node_labels": {}, "old": None, "now": "2026-12-01T12:00:00Z"}
    return c.Observed(**{**base, **kw})


def key_of(o: c.Observed) -> tuple[str, str, str]:
    t = c.target(o)
    assert t is not None
    return t


def test_nothing_to_do_without_a_ready_worker():
    old = {"certified": True}
    assert c.next_step(observed(ready_url=None, old=old)) == c.Step(old, None)
    assert c.target(observed(ready_url=None)) is None


def test_a_verdict_for_another_spec_stops_standing_before_the_new_worker_is_ready():
    """A changed spec replaces the pods first: while no worker of the new spec is ready the old verdict is kept on
    record but the condition is Unknown (no Session binds by a measurement of another spec)."""
    bspec = spec(contextTier=2048)
    key = c.certification_key(spec(), "cpu", bspec)
    old = {"certified": True, "gate": "context", "key": key, "topology": "cpu", "measuredAt": "2026-11-30T10:00:00Z"}
    same = observed(ready_url=None, old=old, baseline=c.Baseline("base", spec=bspec))
    assert c.next_step(same) == c.Step(old, None)
    for changed in (dataclasses.replace(same, spec=spec(kvMemoryMiB=96)),              # the cell's spec
                    dataclasses.replace(same, baseline=c.Baseline("base", spec=spec()))):  # or its baseline's
        s = c.next_step(changed)
        assert s.cert == old and s.job is None and s.verdict is not None
        assert s.verdict[:2] == (None, "SpecChanged") and key in s.verdict[2]
    # nothing stored, or a baseline that is gone (said as BaselineMissing once a worker is ready): nothing to say yet
    assert c.next_step(dataclasses.replace(same, old=None)) == c.Step(None, None)
    assert c.next_step(dataclasses.replace(same, baseline=c.Baseline("base", missing=True))) == c.Step(old, None)


def test_a_missing_or_unready_baseline_is_said_and_nothing_is_measured():
    s = c.next_step(observed(baseline=c.Baseline("base", missing=True)))
    assert s == c.Step(None, (False, "BaselineMissing", "baseline cell base does not exist in ns"))
    s = c.next_step(observed(baseline=c.Baseline("base", spec=spec())))
    assert s.verdict == (None, "WaitingForBaseline", "baseline cell base has no ready worker yet") and s.job is None
    assert c.target(observed(baseline=c.Baseline("base", spec=spec()))) is None


def test_a_measurement_of_the_same_key_is_kept():
    o = observed()
    _, key, _ = key_of(o)
    old = {"certified": False, "gate": "usable-context", "reason": "1.4x < 2x", "key": key,
           "measuredAt": "2026-11-30T10:00:00Z"}
    assert c.next_step(dataclasses.replace(o, old=old)) == c.Step(old, (False, "GateUsableContext", "1.4x < 2x"))
    # another key (e.g. the spec changed): measured again, the old record kept meanwhile
    s = c.next_step(dataclasses.replace(o, old={**old, "key": "other"}))
    assert s.job is not None and s.cert == {**old, "key": "other"}


def test_no_job_yet_creates_one_against_the_ready_worker_and_its_baseline():
    bspec = spec(contextTier=2048)
    o = observed(baseline=c.Baseline("base", spec=bspec, url="http://127.30.0.6:8080"),
                 annotations={"modeld.contenox.io/certify-tiers": "512,1024"})
    topology, key, job = key_of(o)
    assert topology == "cpu" and key == c.certification_key(o.spec, "cpu", bspec)
    s = c.next_step(o)
    assert s.verdict == (None, "Certifying", f"job {job} measures the cell on cpu") and s.event == ("Certifying", s.verdict[2])
    assert s.job["metadata"]["name"] == job and s.job["metadata"]["annotations"][f"{api.GROUP}/key"] == key
    args = s.job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--endpoint") + 1] == o.ready_url and args[args.index("--tiers") + 1] == "512,1024"
    assert args[args.index("--baseline-endpoint") + 1] == "http://127.30.0.6:8080"


def test_a_bad_annotation_is_reported_not_measured():
    s = c.next_step(observed(annotations={"modeld.contenox.io/certify-tiers": "lots"}))
    assert s.job is None and s.verdict is not None and s.verdict[:2] == (False, "InvalidCertifyAnnotation")


def test_a_running_job_is_waited_for():
    o = observed(job_pods=[pod("Running")])
    _, _, job = key_of(o)
    assert c.next_step(o) == c.Step(None, (None, "Certifying", f"job {job} measures the cell on cpu"))


def test_a_failed_job_is_recorded_with_its_message():
    o = observed(job_pods=[pod("Failed", 2, "endpoint unreachable")])
    _, key, job = key_of(o)
    s = c.next_step(o)
    assert s.verdict == (False, "CertificationFailed", "endpoint unreachable") and s.job is None
    assert s.cert == {"certified": False, "gate": "CertificationFailed", "reason": "endpoint unreachable",
                      "topology": "cpu", "measuredAt": "2026-12-01T12:00:00Z", "key": key, "job": job}


def test_a_finished_job_becomes_the_certification():
    o = observed(job_pods=[pod("Succeeded", 0, json.dumps(SUMMARY))])
    _, key, job = key_of(o)
    s = c.next_step(o)
    assert s.verdict == (True, "GateContextTier", "baseline cannot run 8192")
    assert s.cert["key"] == key and s.cert["job"] == job and s.cert["certified"] is True
    assert s.cert["summary"] == SUMMARY


def test_the_handler_reads_job_pods_only_when_the_step_needs_them():
    o = observed()
    _, key, job = key_of(o)
    assert c.jobs_to_read(o) == job
    assert c.jobs_to_read(dataclasses.replace(o, old={"key": key, "measuredAt": "2026-11-30T10:00:00Z"})) is None
    assert c.jobs_to_read(observed(ready_url=None)) is None
    assert c.jobs_to_read(observed(baseline=c.Baseline("base", spec=spec()))) is None
