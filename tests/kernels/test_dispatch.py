"""The dispatch seam: backend resolution, forcing each branch, and a machine without triton."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from modeld_cell.kernels import dispatch
from modeld_cell.kernels.merge import reference as merge_ref
from modeld_cell.kernels.paged_decode import reference as paged_ref
from modeld_cell.kernels.quant_kv import reference as quant_ref
from modeld_cell.kernels.sparse_prefill import reference as sparse_ref

from .utils import assert_close, make_paged

pytestmark = pytest.mark.kernels


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


def test_auto_resolution():
    assert dispatch.get_backend("cpu") == "torch"
    assert dispatch.get_backend(torch.device("cuda")) == "triton"  # device type only; no GPU needed


def test_env_var_and_force(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.get_backend("cuda") == "torch"
    assert dispatch.get_backend("cuda", force="triton") == "triton"  # force beats the env var
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda-graphs")
    with pytest.raises(ValueError, match="MODELD_KERNEL_BACKEND"):
        dispatch.get_backend("cpu")
    with pytest.raises(ValueError, match="force"):
        dispatch.get_backend("cpu", force="tritonn")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(dispatch.BackendUnavailable, match="TRITON_INTERPRET=1"):
        dispatch.get_backend("cpu", force="triton")
    assert dispatch.available_backends("cpu") == ["torch"]


def _inputs(device):
    """One of every kernel's inputs, on device."""
    kc, vc, bt, sl = make_paged([0, 9, 40], 3, 32, 16)
    q = torch.randn(3, 9, 32)
    kq, ks = quant_ref.quantize(kc, "int8")
    vq, vs = quant_ref.quantize(vc, "int8")
    sq, sk, sv = torch.randn(70, 9, 32), torch.randn(70, 3, 32), torch.randn(70, 3, 32)
    mask = sparse_ref.estimate_block_mask(sq, sk, 16, keep_ratio=0.3)
    outs, lses = torch.randn(3, 2, 9, 32), torch.randn(3, 2, 9)
    lses[:, 0] = float("-inf")
    t = dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, kq=kq, vq=vq, ks=ks, vs=vs, sq=sq, sk=sk, sv=sv, mask=mask,
             outs=outs, lses=lses)  # fmt: skip
    return {name: x.to(device) for name, x in t.items()}


def _call_all(t, force):
    return {
        "paged": dispatch.paged_decode(t["q"], t["kc"], t["vc"], t["bt"], t["sl"], force=force),
        "quant": dispatch.quant_paged_decode(t["q"], t["kq"], t["vq"], t["ks"], t["vs"], t["bt"], t["sl"], force=force),
        "sparse": dispatch.sparse_prefill(t["sq"], t["sk"], t["sv"], t["mask"], block_size=16, force=force),
        "merge_n": dispatch.merge_states_n(t["outs"], t["lses"], force=force)[0],
        "merge_2": dispatch.merge_states(t["outs"][0], t["lses"][0], t["outs"][1], t["lses"][1], force=force)[0],
    }


@pytest.mark.parametrize("force", ["torch", "triton"])
def test_forced_branch_matches_reference(force, device, monkeypatch):
    calls = []
    if force == "triton":  # prove the triton modules are the ones called
        import importlib

        for fam, fn in (("paged_decode", "paged_decode"), ("quant_kv", "quant_paged_decode"),
                        ("sparse_prefill", "block_sparse_attention"), ("merge", "merge_states_n"),
                        ("merge", "merge_states")):  # fmt: skip
            mod = importlib.import_module(f"modeld_cell.kernels.{fam}.triton")
            real = getattr(mod, fn)
            monkeypatch.setattr(mod, fn, lambda *a, _r=real, _n=fn, **kw: (calls.append(_n), _r(*a, **kw))[1])
    c = _inputs("cpu")
    got = _call_all({k: v.to(device) for k, v in c.items()}, force)
    want = {
        "paged": paged_ref.paged_decode(c["q"], c["kc"], c["vc"], c["bt"], c["sl"]),
        "quant": quant_ref.quant_paged_decode(c["q"], c["kq"], c["vq"], c["ks"], c["vs"], c["bt"], c["sl"]),
        "sparse": sparse_ref.block_sparse_attention(c["sq"], c["sk"], c["sv"], c["mask"], 16),
        "merge_n": merge_ref.merge_states_n(c["outs"], c["lses"])[0],
        "merge_2": merge_ref.merge_states(c["outs"][0], c["lses"][0], c["outs"][1], c["lses"][1])[0],
    }
    for name in want:
        assert_close(f"{force} {name}", want[name], got[name], 1e-4, 1e-4)
    if force == "triton":
        assert sorted(calls) == sorted(["paged_decode", "quant_paged_decode", "block_sparse_attention",
                                        "merge_states_n", "merge_states"])  # fmt: skip


def test_sparse_prefill_path_choice():
    q, k, v = torch.randn(800, 4, 16), torch.randn(800, 2, 16), torch.randn(800, 2, 16)
    out, info = dispatch.sparse_prefill(q, k, v, return_info=True)
    assert info["path"] == "dense" and info["backend"] == "torch"
    assert_close("dense", sparse_ref.dense_causal_attention(q, k, v), out, 1e-6, 1e-6)
    out, info = dispatch.sparse_prefill(q, k, v, block_size=16, keep_ratio=0.04, min_tokens=0, return_info=True)
    assert info["path"] == "sparse" and 0 < info["density"] <= 0.6
    mask = sparse_ref.estimate_block_mask(q, k, 16, keep_ratio=0.04)
    assert_close("sparse", sparse_ref.block_sparse_attention(q, k, v, mask, 16), out, 1e-6, 1e-6)
    _, info = dispatch.sparse_prefill(q, k, v, block_size=16, keep_ratio=1.0, min_tokens=0, return_info=True)
    assert info["path"] == "dense" and info["density"] == 1.0


def test_without_triton_only_torch_is_offered():
    """A machine with no triton: the dispatch module imports and offers the torch backend alone."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from modeld_cell.kernels import dispatch as d\n"
        "assert d.available_backends('cuda') == ['torch'], d.available_backends('cuda')\n"
        "assert d.get_backend('cuda') == 'torch'\n"
        "try:\n"
        "    d.get_backend('cuda', force='triton')\n"
        "except d.BackendUnavailable as e:\n"
        "    assert 'does not import' in str(e)\n"
        "else:\n"
        "    raise AssertionError('forcing triton without triton did not raise')\n"
        "q = torch.randn(1, 2, 16); kc = torch.randn(2, 4, 1, 16); bt = torch.tensor([[0, 1]], dtype=torch.int32)\n"
        "d.paged_decode(q, kc, kc, bt, torch.tensor([6], dtype=torch.int32))\n"
        "print('ok')\n"
    )
    cellimage = pathlib.Path(__file__).resolve().parents[2] / "cellimage"
    env = dict(os.environ, PYTHONPATH=str(cellimage))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
