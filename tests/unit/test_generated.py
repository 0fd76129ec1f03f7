"""Generated artefacts match their single sources; settings parse; the operator never imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from modeld_operator import crdgen
from modeld_operator.settings import Settings

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_committed_crds_match_generator():
    assert crdgen.main(["--check"]) == 0, "run `make generate` and commit crds/ and charts/modeld/crds/"


def test_crds_are_structural():
    for name, crd in crdgen.crds().items():
        text = crdgen.render(crd)
        assert "$ref" not in text and "anyOf" not in text and "title:" not in text, name
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

        def walk(node, path):
            if isinstance(node, dict):
                if "properties" in node or node.get("type") == "object":
                    assert node.get("type") == "object", path
                for key, value in node.items():
                    walk(value, f"{path}.{key}")
            elif isinstance(node, list):
                for i, value in enumerate(node):
                    walk(value, f"{path}[{i}]")

        walk(schema, name)


def test_operator_never_imports_torch_or_worker():
    for path in (ROOT / "operator" / "modeld_operator").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("torch", "triton", "modeld_cell"), f"{path}: imports {name}"


def test_settings_from_env():
    s = Settings.from_env({"MODELD_STATUS_INTERVAL": "2.5", "MODELD_PROBE_ENDPOINTS": "false", "MODELD_NAMESPACE": "x"})
    assert (s.status_interval, s.probe_endpoints, s.namespace) == (2.5, False, "x")
    with pytest.raises(ValueError, match="MODELD_METRICS_PORT='eighty'"):
        Settings.from_env({"MODELD_METRICS_PORT": "eighty"})
    with pytest.raises(ValueError, match="MODELD_LOG_FORMAT"):
        Settings.from_env({"MODELD_LOG_FORMAT": "xml"})


def test_inventory_has_every_topology():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nodes", ROOT / "hack" / "nodes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    nodes = mod.nodes(yaml.safe_load((ROOT / "hack" / "inventory.yaml").read_text()))
    links = {n["metadata"]["labels"]["modeld.contenox.io/interconnect"] for n in nodes}
    assert links == {"none", "pcie", "nvlink", "nvswitch"}
    for n in nodes:
        gpus = int(n["status"]["capacity"].get("nvidia.com/gpu", 0))
        assert n["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
        if gpus:
            assert n["metadata"]["labels"]["nvidia.com/gpu.count"] == str(gpus)
            assert n["spec"]["taints"][0]["key"] == "nvidia.com/gpu"
