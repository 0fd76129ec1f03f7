"""The Grafana dashboard in the chart (charts/modeld/dashboards/modeld.json) plots only metrics that exist: every
name in its queries is one the worker (modeld_cell.metrics.NAMES) or the operator (modeld_operator.metrics)
exports, so no panel stays empty because it names a metric nobody serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from modeld_cell.metrics import NAMES, P
from modeld_operator import metrics as operator_metrics  # noqa: F401  (registers the operator's metrics)

pytestmark = pytest.mark.unit
DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "modeld" / "dashboards" / "modeld.json"


def _served() -> set[str]:
    worker = {P + n for n in NAMES}
    # every sample name a registered collector can expose (a labelled gauge has no sample until a cell exists)
    operator = {n for n in REGISTRY._names_to_collectors if n.startswith("modeld_operator_")}
    histograms = {n + suffix for n in worker for suffix in ("_bucket", "_sum", "_count")}
    return worker | histograms | operator


def test_every_metric_the_dashboard_plots_is_exported():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\b(modeld(?::|_operator_)[a-z_]+)", e)}
    assert named and named <= _served(), sorted(named - _served())
    # every panel has a query, a unique id and a place on the grid
    assert all(p["targets"] for p in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
