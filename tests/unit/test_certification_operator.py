"""The operator's side of certification: when to measure again, the Job it launches, reading the verdict back."""

from __future__ import annotations

import json

import pytest

import modeld_api as api
from modeld_operator import certification
from modeld_operator.handlers.session import covering

pytestmark = pytest.mark.unit


def spec(**kw) -> api.CellSpec:
    base = {
        "runtime": {"backend": "torch"},
        "topology": {"gpus": 0, "interconnect": "none"},
        "model": {"family": "smollm2", "ref": "x", "digest": "sha256:" + "a" * 64},
        "contextTier": 8192,
    }
    base.update(kw)
    return api.CellSpec.model_validate(base)


def test_key_changes_with_what_is_measured_only():
    s = spec()
    key = certification.certification_key(s, "cpu", None)
    assert certification.certification_key(spec(replicas=3, localRun=True), "cpu", None) == key
    changed = [
        spec(image="other:1"),
        spec(model={"family": "smollm2", "ref": "x", "digest": "sha256:" + "b" * 64}),
        spec(profile={"kv": "int8"}),
        spec(contextTier=4096),
    ]
    for other in changed:
        assert certification.certification_key(other, "cpu", None) != key
    assert certification.certification_key(s, "8x NVIDIA-H100-80GB-HBM3 nvswitch", None) != key
    assert certification.certification_key(s, "cpu", spec(contextTier=2048)) != key


def test_topology_string():
    gpu = spec(runtime={"backend": "triton"}, topology={"gpus": 4, "interconnect": "pcie"})
    assert certification.topology_of(gpu, {api.LABEL_GPU_PRODUCT: "NVIDIA-L40S"}) == "4x NVIDIA-L40S pcie"
    assert certification.topology_of(spec(), {}) == "cpu"
    ranks = api.CellSpec.model_validate({**spec().model_dump(mode="json", exclude_none=True),
                                         "runtime": {"backend": "torch", "parallelism": "sharded-kv", "ranks": 2}})
    assert certification.topology_of(ranks, {}) == "cpu x2 ranks"


def test_tiers():
    assert certification.tiers_for(spec(), {}) == [1024, 4096, 8192]
    assert certification.tiers_for(spec(contextTier=100000), {}) == [1024, 4096, 8192, 32768, 100000]
    assert certification.tiers_for(spec(), {api.ANNOTATION_CERTIFY_TIERS: "512, 256"}) == [256, 512]
    with pytest.raises(ValueError, match="comma-separated integers"):
        certification.tiers_for(spec(), {api.ANNOTATION_CERTIFY_TIERS: "big"})


def test_extra_args_are_whitelisted():
    ann = api.ANNOTATION_CERTIFY_ARGS
    assert certification.extra_args({}) == []
    assert certification.extra_args({ann: "--repeats 1 --agent-turns 2"}) == ["--repeats", "1", "--agent-turns", "2"]
    assert certification.extra_args({ann: "--agent-sessions turn --agent-decode-tokens 8"}) == [
        "--agent-sessions", "turn", "--agent-decode-tokens", "8"]
    for bad, message in [("--repeats", "pairs"), ("--out /etc", "not one of"), ("--repeats -1", "positive number"),
                         ("--agent-sessions forever", "takes one of run, turn")]:
        with pytest.raises(ValueError, match=message):
            certification.extra_args({ann: bad})


def test_job_manifest():
    s = spec(localRun=True, baseline="base")
    job = certification.job_manifest("cand", "ns", s, "http://127.1.0.2:8080", "cpu", "k" * 16, [256], ("base", spec(), "http://127.1.0.3:8080"))
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[:3] == ["certify", "--endpoint", "http://127.1.0.2:8080"]
    assert args[args.index("--summary") + 1] == pod["containers"][0]["terminationMessagePath"]
    assert args[args.index("--baseline-endpoint") + 1] == "http://127.1.0.3:8080"
    env = {e["name"]: json.loads(e["value"]) for e in pod["containers"][0]["env"]}
    assert env["MODELD_CELL_SPEC"]["baseline"] == "base" and env["MODELD_BASELINE_SPEC"]["contextTier"] == 8192
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert job["metadata"]["labels"][api.LABEL_LOCAL_RUN] == "true"
    assert len(job["metadata"]["name"]) <= 63


def pod(phase, code=0, message=""):
    state = {"terminated": {"exitCode": code, "message": message}} if phase in ("Succeeded", "Failed") else {"running": {}}
    return {"status": {"phase": phase, "containerStatuses": [{"state": state}]}}


def test_verdicts():
    assert certification.verdict_from_pod(pod("Running"))[0] == "running"
    summary = {"certified": True, "gate": "context-tier", "reason": "baseline cannot run 8192", "topology": "cpu",
               "measuredAt": "2026-11-29T15:00:00Z", "firstOutputP90Ms": {"1024": 300.0}, "quality": "pass",
               "contextTier": 8192, "schema": "modeld.certification/v1", "workload": "agent-v1"}
    state, cert, _ = certification.verdict_from_pod(pod("Succeeded", 0, json.dumps(summary)))
    assert state == "done" and cert.certified and cert.gate == "context-tier" and cert.summary == summary
    # the summary is one typed model (modeld_api.CertificationSummary): a field missing is refused by name
    state, cert, message = certification.verdict_from_pod(
        pod("Succeeded", 0, json.dumps({k: v for k, v in summary.items() if k != "quality"})))
    assert state == "failed" and cert is None and "quality" in message and "unreadable certification summary" in message
    state, cert, message = certification.verdict_from_pod(pod("Failed", 2, "endpoint unreachable"))
    assert (state, cert, message) == ("failed", None, "endpoint unreachable")
    state, cert, message = certification.verdict_from_pod(pod("Succeeded", 0, "not json"))
    assert state == "failed" and "unreadable certification summary" in message


def test_latency_budget_uses_the_covering_tier():
    summary = {"firstOutputP90Ms": {"1024": 100.0, "4096": 900.0, "8192": 2500.0},
               "decodeP90MsPerToken": {"1024": 40.0, "4096": 55.5, "8192": None}}
    assert covering(summary, 1000) == (1024, 100.0, 40.0)
    assert covering(summary, 4000) == (4096, 900.0, 55.5)
    assert covering(summary, 8000) == (8192, 2500.0, None)
    assert covering(summary, 9000) == (None, None, None)
    assert covering({}, 10) == (None, None, None)
    assert covering({"firstOutputP90Ms": {"1024": None, "4096": 50.0}}, 512) == (4096, 50.0, None)  # refused tier
    assert covering({"firstOutputP90Ms": "garbage"}, 10) == (None, None, None)
