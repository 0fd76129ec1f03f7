"""hack/gpu-bench.sh must run on a bare CUDA machine that has torch and triton but none of modeld's other
dependencies (issue: "keep the kernel and benchmark imports free of them"). Checked here on CPU by running what it
runs in a subprocess whose imports of those packages fail: the kernel modules, benchmarks/kernels.py, and the
collection of tests/kernels."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

# On CPU these prove the bare-box imports (under the interpreter, at tiny shapes); on a CUDA box hack/gpu-bench.sh is
# that proof itself, and launching benchmarks/kernels.py under the interpreter at CUDA shapes would use up its cap.
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only proof; on CUDA the "
                                 "benchmark runs for real in hack/gpu-bench.sh")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
# modeld's own dependencies (pyproject) that a bare CUDA box lacks; torch, triton, numpy and pytest stay importable.
BLOCKED = ("pydantic", "gguf", "kopf", "aiohttp", "kubernetes", "yaml", "jinja2", "tokenizers", "safetensors",
           "prometheus_client", "matplotlib", "tqdm", "modeld_operator", "modeld_api")

SITECUSTOMIZE = f'''
import sys
BLOCKED = {BLOCKED!r}
class _Bare:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed on a bare CUDA box (blocked by test_bare_cuda_box)")
        return None
sys.meta_path.insert(0, _Bare())
'''


def _run(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'cellimage'}", "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_blocker_works(tmp_path):
    r = _run(tmp_path, "-c", "import pydantic")
    assert r.returncode != 0 and "bare CUDA box" in r.stderr, r.stderr


def test_kernels_and_benchmark_import_only_torch_and_triton(tmp_path):
    families = ("merge", "paged_decode", "paged_prefill", "quant_kv", "sparse_prefill")
    mods = ["modeld_cell.kernels.dispatch", "modeld_cell.kernels.merge.sharded"] + [
        f"modeld_cell.kernels.{f}.{m}" for f in families for m in ("reference", "triton")]
    r = _run(tmp_path, "-c", f"import importlib\nfor m in {mods!r}: importlib.import_module(m)")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "kernels.json"
    r = _run(tmp_path, "benchmarks/kernels.py", "--out", str(out), "--sparse-lengths", "256", "--sparse-past", "",
             "--cpu-reps", "1", "--cpu-budget-s", "0.1")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["bench"] for row in rows} >= {"merge", "prefill"}, rows
    assert any(row["bench"].endswith("decode") for row in rows), rows


def test_kernel_tests_collect_without_the_other_dependencies(tmp_path):
    r = _run(tmp_path, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/kernels")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "test_sparse_prefill.py" in r.stdout and "test_quant_kv.py" in r.stdout
