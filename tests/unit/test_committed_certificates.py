"""Every certificate committed under docs/certification/<cell>/ is a valid modeld.certification/v1 report whose
decision is what the gates decide from its own measurements (the verdict is the measurement read by the rules, not
an edited result), and whose summary is the one the operator would store."""

from __future__ import annotations

import json
import pathlib

import pytest

from modeld_cell.certify import gates, schema, summary_for_status

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "certification"
REPORTS = sorted(ROOT.glob("*/certification.json"))


def test_there_are_committed_certificates():
    assert REPORTS, "docs/certification/<cell>/certification.json"


@pytest.mark.parametrize("path", REPORTS, ids=[p.parent.name for p in REPORTS])
def test_a_committed_certificate_is_the_gates_reading_of_its_measurements(path):
    report = json.loads(path.read_text())
    assert schema.errors(report) == [], schema.errors(report)[:5]
    cell = gates.measurements_from_report(report["cell"])
    base = gates.measurements_from_report(report["baseline"]) if report.get("baseline") else None
    budget = report["decision"]["thresholds"]["latency_budget_ms"]
    d = gates.decide(cell, base, budget)
    assert (d.certified, d.gate, d.reason) == (report["decision"]["certified"], report["decision"]["gate"],
                                               report["decision"]["reason"])
    summary = json.loads((path.parent / "summary.json").read_text())
    assert summary == summary_for_status(report)
    assert (path.parent / "certification.md").exists() and (path.parent / "command.txt").read_text().strip()
