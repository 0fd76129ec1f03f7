"""Every environment variable a program reads is documented, and every documented one is read.

The worker's variables are the ``MODELD_*`` names its code spells (Settings' field docstrings, EngineSettings,
models/fetch.py, kernels/dispatch.py, the certification CLI); they must equal the names in the tables of
docs/worker.md and docs/certification.md. The operator's are its Settings fields (``MODELD_`` + the field name); they
must equal docs/operator.md's table. What the operator puts in a cell pod's environment, the worker must read.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

import modeld_api as api
from modeld_operator import placement
from modeld_operator.settings import Settings as OperatorSettings

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bMODELD_[A-Z][A-Z_]*[A-Z]\b")


def documented(*docs: str) -> set[str]:
    """Names in the first column of the docs' tables (rows starting with '|')."""
    out: set[str] = set()
    for doc in docs:
        for line in (ROOT / "docs" / doc).read_text().splitlines():
            if line.startswith("| "):
                out |= set(NAME.findall(line.split("|")[1] + line.split("|")[2]))
    return out


def worker_reads() -> set[str]:
    out: set[str] = set()
    for path in (ROOT / "cellimage" / "modeld_cell").rglob("*.py"):
        text = path.read_text()
        out |= set(re.findall(r"[\"'](MODELD_[A-Z][A-Z_]*[A-Z])[\"']", text))      # string literals: env lookups
        out |= set(re.findall(r'"""(MODELD_[A-Z][A-Z_]*[A-Z]):', text))             # Settings field docstrings
    return out


def test_worker_variables_match_its_docs():
    assert worker_reads() == documented("worker.md", "certification.md")


def test_operator_variables_match_its_docs():
    assert {"MODELD_" + f.name.upper() for f in fields(OperatorSettings)} == documented("operator.md")


def test_what_the_operator_sets_in_a_pod_the_worker_reads():
    spec = api.parse_cell_spec({"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
                                "model": {"family": "smollm2", "ref": "x"}, "contextTier": 1024, "kvMemoryMiB": 64})
    env = placement.pod_template("c", "ns", spec)["spec"]["containers"][0]["env"]
    assert {e["name"] for e in env} <= worker_reads()
