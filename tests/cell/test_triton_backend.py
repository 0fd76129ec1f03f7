"""The triton backend (``runtime.backend: triton``) against the torch path, on the real SmolLM2 weights.

Without a GPU the triton kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is imported), which is slow: both engines run the same stated prefix of the model, its first LAYERS
layers, so the comparison fits in CI. ``benchmarks/triton_cpu_proof.py`` runs the full model once and writes its
result down (docs/kernels.md). On a CUDA machine the same tests run the compiled kernels on the GPU.

What is compared, per scenario: the greedy tokens (8 each, identical) and the next-token logits (within
LOGIT_ATOL). Scenarios: a prompt across page boundaries, a suffix after a cached past, a branch that reuses cached
blocks, int8 and fp8-e4m3 KV, a block-sparse chunk.
"""

from __future__ import annotations

import pytest
import torch

from modeld_cell import errors
from modeld_cell.engine import Engine, EngineSettings

from .cellutil import generate
from .conftest import SPEC

pytestmark = pytest.mark.cell
triton = pytest.importorskip("triton")

LAYERS = 2            # the stated prefix of SmolLM2's 30 layers both paths run under the interpreter
# fp32 both ways; the two paths sum attention in another order (tiles vs segments). Measured here: ~1e-5; a wrong
# kernel is off by O(1). 1e-3 leaves two orders of margin on each side.
LOGIT_ATOL = 1e-3
N_TOKENS = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_SPEC = {**SPEC, "runtime": {"backend": "triton"}, "topology": {"gpus": 1, "interconnect": "none"}}
TEXT = ("The harbour master wrote every ship's name in a blue book, and the tide tables beside them. "
        "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n")


@pytest.fixture(scope="module")
def pair(smollm2_path):
    """(torch engine, triton engine) over the first LAYERS layers of the same weights, fp32 weights and KV. Both
    multiply the weights plain: a packed fp32 weight rounds differently (docs/reuse.md), and a quantized KV format
    turns that 1e-6 into a flipped code (measured: int8 KV logits 2.7e-3 apart with the torch side packed)."""
    st = EngineSettings(threads=torch.get_num_threads(), pack_weights=False, decoded_kv="exact")
    ref = Engine.from_cell(SPEC, model_path=smollm2_path, settings=st, layers=LAYERS)
    tri = Engine.from_cell(TRITON_SPEC, model_path=smollm2_path, settings=EngineSettings(threads=st.threads),
                           device=DEVICE, layers=LAYERS)
    yield ref, tri
    ref.shutdown()
    tri.shutdown()


def prompt(eng: Engine, n: int) -> list[int]:
    return eng.tokenizer.encode(TEXT * 20)[:n]


async def same(ref: Engine, tri: Engine, sid: str, what: str) -> list[int]:
    """The next-token logits agree; then 8 greedy tokens are identical on both."""
    lr, lt = ref.next_token_logits(sid), tri.next_token_logits(sid)
    assert lr is not None and lt is not None
    err = float((lr - lt.cpu()).abs().max())
    assert err <= LOGIT_ATOL, f"{what}: logits max abs diff {err:.3g} > {LOGIT_ATOL}"
    a, _, _ = await generate(ref, sid, N_TOKENS)
    b, _, _ = await generate(tri, sid, N_TOKENS)
    assert a == b and len(a) == N_TOKENS, f"{what}: torch {a} vs triton {b}"
    return a


def test_startup_forward_ran_on_the_device_and_the_report_names_the_kernels(pair):
    _, tri = pair
    assert tri.startup is not None and tri.startup["device"].startswith(DEVICE)
    assert tri.startup["max_abs_diff"] <= tri.startup["atol"]
    cap = tri.capability()
    assert cap["runtime"]["runner"] == "triton" and cap["runtime"]["backend"] == f"triton-{DEVICE}"
    assert cap["runtime"]["device"].startswith(DEVICE)
    assert cap["attention"]["prefill"].startswith("triton paged_prefill")
    assert cap["attention"]["decode"].startswith("triton paged_decode")
    assert cap["reuse"]["exactness"] == "tolerance"
    assert "triton" in tri.identity["backend_version"]


async def test_prompt_suffix_and_branch_match_the_torch_path(pair):
    ref, tri = pair
    toks = prompt(ref, 37)                                  # 2 full pages of 16 and 5 tokens
    for e in pair:
        await e.ensure_prefix("s", toks)
    cont = await same(ref, tri, "s", "prompt across page boundaries")
    suffix = prompt(ref, 60)[37:57]
    for e in pair:
        tr = await e.prefill_suffix("s", suffix)           # a chunk after a cached past (and the pending token)
        assert tr.tokens_computed == len(suffix) + 1
    await same(ref, tri, "s", "suffix after a cached past")
    branch = toks[:33] + prompt(ref, 80)[60:75]             # 33 tokens in common with "s": 2 full blocks and 1 more
    for e in pair:
        tr = await e.ensure_prefix("b", branch)
        # two blocks shared, the third copied (copy-on-write) and written past its shared token
        assert (tr.tokens_reused, tr.reuse["blocks_shared"], tr.reuse["blocks_copied"]) == (33, 2, 1)
    await same(ref, tri, "b", "branch over cached blocks")
    calls = tri.runner.calls
    assert calls["paged_prefill"] > 0 and calls["paged_decode"] > 0 and calls["quant_paged_decode"] == 0
    assert cont
    for e in pair:
        e.close_session("s")
        e.close_session("b")


async def test_snapshot_and_restore_continue_as_the_torch_path(pair, tmp_path):
    """The rest of the contract on the triton backend: a snapshot written by one triton engine, restored into
    another, continues with the tokens the torch path generates."""
    ref, tri = pair
    toks = prompt(ref, 45)
    for e in pair:
        await e.ensure_prefix("snap", toks)
    info = await tri.snapshot("snap", str(tmp_path / "s.snap"))
    assert info["identity"]["backend"] == f"triton-{DEVICE}"
    other = tri.sibling(kv_mib=16)
    try:
        tr = await other.restore("snap", str(tmp_path / "s.snap"))
        assert tr.session_tokens == len(toks)
        await same(ref, other, "snap", "restored from a snapshot")
    finally:
        other.shutdown()
        for e in pair:
            e.close_session("snap")


@pytest.mark.parametrize("kv", ["int8", "fp8-e4m3"])
async def test_quantized_kv_matches_the_torch_path(pair, kv):
    ref, tri = pair
    r, t = ref.sibling(kv=kv, kv_mib=16), tri.sibling(kv=kv, kv_mib=16)
    try:
        toks = prompt(ref, 41)
        for e in (r, t):
            await e.ensure_prefix("q", toks)
        await same(r, t, "q", f"{kv} KV")
        assert t.runner.calls["quant_paged_decode"] > 0 and t.runner.calls["paged_prefill"] > 0
        assert t.capability()["attention"]["decode"].startswith("triton quant_kv")
    finally:
        r.shutdown()
        t.shutdown()


async def test_block_sparse_chunk_matches_the_torch_path(pair):
    ref, tri = pair
    st = EngineSettings(threads=torch.get_num_threads(), sparse_min_tokens=64, sparse_max_density=1.0)
    r = ref.sibling(attention="block-sparse", kv_mib=16, settings=st)
    t = tri.sibling(attention="block-sparse", kv_mib=16, settings=EngineSettings(**vars(st)))
    try:
        toks = prompt(ref, 300)                             # >= 256 new tokens: the chunk qualifies for sparse
        trs = [await e.ensure_prefix("p", toks) for e in (r, t)]
        for tr in trs:
            assert tr.fallback is None                      # every layer ran the block-sparse path
        await same(r, t, "p", "block-sparse chunk")
        assert t.runner.calls["sparse_prefill"] == LAYERS
    finally:
        r.shutdown()
        t.shutdown()


def test_a_triton_cell_refuses_to_start_without_its_device(smollm2_path, monkeypatch):
    """The worker never asks for the CPU: without a visible GPU a triton cell refuses, naming runtime.backend,
    rather than computing on the CPU while holding GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(errors.Unsupported) as ei:
        Engine.from_cell(TRITON_SPEC, model_path=smollm2_path, layers=1)
    assert ei.value.details["field"] == "runtime.backend"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(errors.Unsupported) as ei:
        Engine.from_cell(TRITON_SPEC, model_path=smollm2_path, device="cpu", layers=1)
    assert ei.value.details["field"] == "runtime.backend"
