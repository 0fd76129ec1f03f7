"""Generated artefacts match their single sources; settings parse; import boundaries: the operator never imports
torch or the worker, the worker never imports the operator, and the API package both share imports pydantic only."""

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


def _imports(package: Path) -> list[tuple[Path, str]]:
    """(file, top-level module) for every absolute import under ``package``."""
    out = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(path, a.name.split(".")[0]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.append((path, node.module.split(".")[0]))
    return out


def test_operator_never_imports_torch_or_worker():
    for path, name in _imports(ROOT / "operator" / "modeld_operator"):
        assert name not in ("torch", "triton", "modeld_cell"), f"{path}: imports {name}"


def test_worker_never_imports_the_operator():
    """Both programs share the API package; the worker image needs nothing of the operator's."""
    for path, name in _imports(ROOT / "cellimage" / "modeld_cell"):
        assert name != "modeld_operator", f"{path}: imports {name}"


def test_api_package_imports_pydantic_only():
    import sys

    allowed = {"pydantic", "__future__", *sys.stdlib_module_names}
    for path, name in _imports(ROOT / "api" / "modeld_api"):
        assert name in allowed, f"{path}: imports {name}; the API package is pydantic only (no kopf, no torch)"


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
