"""A cell whose one-session decode runs the recomputing step (MODELD_DECODED_KV=recompute, runner.choose_decoded_kv):
the K/V it writes are not a prefill's bits, so the engine never names them in the prefix index, never reuses them
for a plan, and computes those tokens again before anything is appended after them or a snapshot is written. What
a later request reuses is then still a prefill's K/V: the real model, fp32, each continuation held to a cold
prefill of the same tokens (bit for bit where this CPU's probe says reuse is bitwise, else within LOGIT_ATOL)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from modeld_cell import errors
from modeld_cell.engine import Engine, EngineSettings
from modeld_cell.kernels.paged_decode import cpu as cpu_attention

from .cellutil import LOGIT_ATOL, full_logits, generate
from .conftest import SPEC

pytestmark = pytest.mark.cell

TEXT = ("The lighthouse keeper counted the ships every night and wrote their names in a blue book. "
        "One winter a ship without a name came into the harbour, and nobody on board would say where from. ")


# the recomputing step's attention: the CPU paged-decode kernel wherever this machine can build it (untimed, so
# these tests run it), else torch's flash call
KERNELS = "on" if cpu_attention._compiler() is not None else "off"


def _recomputing(make_engine, kv_mib: int = 16) -> Engine:
    eng = make_engine(kv_mib=kv_mib, settings=EngineSettings(threads=torch.get_num_threads(), decoded_kv="recompute",
                                                             cpu_kernels=KERNELS))
    assert eng.runner.decoded_kv == "recompute", eng.runner.decoded_kv_report
    assert eng.runner.recompute_step.kernel == (KERNELS == "on")
    return eng


def _prompt(eng: Engine, n: int) -> list[int]:
    ids = eng.tokenizer.encode(TEXT * 8)[:n]
    assert len(ids) == n
    return ids


async def _assert_cold(eng: Engine, sid: str, salt: str) -> None:
    """The session's next-token logits against a cold prefill of its tokens in a cache scope of their own (nothing
    reused), and against the one-pass reference."""
    toks = eng.session_tokens(sid)
    got = eng.next_token_logits(sid)
    assert got is not None
    cold_sid = f"cold-{salt}"
    tr = await eng.ensure_prefix(cold_sid, toks, cache_salt=salt)
    assert tr.tokens_reused == 0
    cold = eng.next_token_logits(cold_sid)
    if eng.reuse_exactness() == "bitwise":
        assert torch.equal(got, cold)
    else:
        torch.testing.assert_close(got, cold, atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(got, full_logits(eng, toks)[-1], atol=LOGIT_ATOL, rtol=0)
    eng.close_session(cold_sid)


async def test_decoded_tokens_are_never_named_and_are_recomputed_with_the_append(engine, make_engine):
    eng = _recomputing(make_engine)
    rep = eng.capability()
    assert rep["runtime"]["decoded_kv"]["decoded_kv"] == "recompute"
    assert rep["reuse"]["decoded_tokens"] == "recomputed before reuse"
    served = "kernel" if KERNELS == "on" else "flash"
    assert rep["runtime"]["decoded_kv"]["attention"]["served"] == served
    # the report's headline names the step one-session decode runs, and what batched steps run
    words = rep["attention"]["decode"]
    assert words.startswith(f"one-session steps: the recomputing step '{served}'"), words
    assert words.endswith(f"batched steps: {eng.runner.decode_kernel}") and rep["attention"]["kernels"]["decode"] == words
    p = _prompt(eng, 45)
    await eng.ensure_prefix("a", p)
    ids, _, _ = await generate(eng, "a", 20, ignore_eos=True)
    assert len(ids) == 20
    s = eng._sessions["a"]
    # 45 prefilled, 19 decoded into the cache, the 20th token pending
    assert (s.kv_len, len(s.tokens), s.recompute_from, s.exact_len) == (64, 65, 45, 45)
    assert len(s.hashes) == 2 and len(eng.kv.index) == 2          # the blocks of decoded K/V are never named
    assert [x["kv_exact_tokens"] for x in eng.sessions() if x["session_id"] == "a"] == [45]

    before = eng.metrics()["decoded_tokens_recomputed_total"]
    suffix = _prompt(eng, 52)[45:]
    tr = await eng.prefill_suffix("a", suffix)
    assert (tr.prompt_tokens, tr.tokens_computed) == (7, 20 + 7)     # 19 decoded + the pending one + the suffix
    assert eng.metrics()["decoded_tokens_recomputed_total"] - before == 19
    assert s.recompute_from is None and s.exact_len == s.kv_len == len(s.tokens) == 72
    assert len(s.hashes) == 72 // 16
    await _assert_cold(eng, "a", "after-suffix")


async def test_ensure_prefix_and_another_session_reuse_only_the_prefilled_tokens(engine, make_engine):
    eng = _recomputing(make_engine)
    p = _prompt(eng, 45)
    await eng.ensure_prefix("a", p)
    await generate(eng, "a", 12, ignore_eos=True)
    toks = eng.session_tokens("a")
    # the session itself, asked for what it holds: the decoded tokens run again
    before = eng.metrics()["decoded_tokens_recomputed_total"]
    tr = await eng.ensure_prefix("a", toks)
    assert (tr.tokens_reused, tr.tokens_computed) == (45, len(toks) - 45) and tr.reuse["source"] == "session"
    assert eng.metrics()["decoded_tokens_recomputed_total"] - before == len(toks) - 1 - 45
    s = eng._sessions["a"]
    assert s.recompute_from is None and s.exact_len == len(toks)
    await _assert_cold(eng, "a", "a")
    # decoded again; another session asking for all of it gets the prefilled tokens from the index and the live
    # session, no more
    await generate(eng, "a", 8, ignore_eos=True)
    assert s.recompute_from == len(toks)
    tr = await eng.ensure_prefix("b", eng.session_tokens("a"))
    assert tr.tokens_reused == len(toks) and tr.reuse["source"] == "prefix-cache"
    await _assert_cold(eng, "b", "b")


async def test_a_decode_after_a_decode_continues_as_a_session_restored_from_its_tokens(engine, make_engine):
    """The second of two decode requests in a row first gives the first one's tokens, and the pending one, a
    prefill's K/V and logits (counted in its trace and in decoded_tokens_recomputed_total): what it decodes is then
    what a session prefilled from the same tokens decodes (as a worker restarted from its session store does), bit
    for bit where this CPU's probe says reuse is bitwise."""
    eng = _recomputing(make_engine)
    p = _prompt(eng, 45)
    await eng.ensure_prefix("a", p)
    await generate(eng, "a", 8, ignore_eos=True)
    held = eng.session_tokens("a")                  # 45 + 8, the 8th pending
    assert eng._sessions["a"].recompute_from == 45 and len(held) == 53
    before = eng.metrics()["decoded_tokens_recomputed_total"]
    ids_a, _, last = await generate(eng, "a", 12, ignore_eos=True)
    assert last.trace.tokens_computed == 8                      # 7 decoded into the cache + the pending one
    assert eng.metrics()["decoded_tokens_recomputed_total"] - before == 7
    await eng.ensure_prefix("b", held)
    ids_b, _, _ = await generate(eng, "b", 12, ignore_eos=True)
    if eng.reuse_exactness() == "bitwise":
        assert ids_a == ids_b


async def test_a_snapshot_holds_prefill_bits_only(engine, make_engine, tmp_path):
    eng = _recomputing(make_engine)
    p = _prompt(eng, 30)
    await eng.ensure_prefix("a", p)
    await generate(eng, "a", 10, ignore_eos=True)
    assert eng._sessions["a"].recompute_from == 30
    info = await eng.snapshot("a", str(tmp_path / "a.snap"))
    s = eng._sessions["a"]
    assert s.recompute_from is None and info["kv_tokens"] == s.kv_len == len(s.tokens) - 1 == 39
    await eng.restore("r", str(tmp_path / "a.snap"))
    suffix = _prompt(eng, 36)[30:]
    await eng.prefill_suffix("r", suffix)
    await eng.prefill_suffix("a", suffix)
    assert torch.equal(eng.next_token_logits("r"), eng.next_token_logits("a"))
    await _assert_cold(eng, "r", "r")


async def test_a_refused_append_keeps_the_decoded_tokens_to_recompute(engine, make_engine):
    eng = _recomputing(make_engine)
    p = _prompt(eng, 20)
    await eng.ensure_prefix("a", p)
    await generate(eng, "a", 8, ignore_eos=True)
    s = eng._sessions["a"]
    held = (list(s.tokens), s.kv_len, s.recompute_from)
    with pytest.raises(errors.Timeout):
        await eng.prefill_suffix("a", [11, 12, 13], deadline=time.monotonic() - 1)
    assert (s.tokens, s.kv_len, s.recompute_from) == held
    with pytest.raises(errors.Overflow):
        await eng.prefill_suffix("a", [11] * (eng.context_tier - len(s.tokens) + 1))
    assert (s.tokens, s.kv_len, s.recompute_from) == held
    tr = await eng.prefill_suffix("a", [11, 12, 13])
    assert tr.tokens_computed == 8 + 3 and s.recompute_from is None
    await _assert_cold(eng, "a", "a")


async def test_an_exact_cell_keeps_decoded_tokens(engine, make_engine):
    """MODELD_DECODED_KV=exact: decoded K/V are a prefill's bits, named and reused as they are."""
    eng = make_engine(kv_mib=16, settings=EngineSettings(threads=torch.get_num_threads(), decoded_kv="exact"))
    assert eng.runner.decoded_kv == "exact" and eng.reuse_report()["decoded_tokens"] == "exact"
    words = eng.capability()["attention"]["decode"]
    assert words == eng.runner.decode_kernel and "recomputing" not in words
    if eng.runner.rows_attention:          # a decode row attends as a prefill's row does, and the report says so
        assert words.startswith(f"{eng.runner.rows_attention}: the row a prefill computes"), words
    p = _prompt(eng, 45)
    await eng.ensure_prefix("a", p)
    await generate(eng, "a", 20, ignore_eos=True)
    s = eng._sessions["a"]
    assert s.recompute_from is None and s.exact_len == s.kv_len == 64 and len(s.hashes) == 4
    tr = await eng.prefill_suffix("a", [11, 12])
    assert tr.tokens_computed == 1 + 2


async def _decode_then_append(eng: Engine) -> None:
    """45 tokens prefilled, 12 decoded by the served step, 5 appended: the decoded ones are recomputed with the
    append, and the continuation is held to a cold prefill."""
    await eng.ensure_prefix("a", _prompt(eng, 45))
    ids, _, _ = await generate(eng, "a", 12, ignore_eos=True)
    assert len(ids) == 12 and eng._sessions["a"].recompute_from == 45
    tr = await eng.prefill_suffix("a", _prompt(eng, 50)[45:])
    assert tr.tokens_computed == 12 + 5
    await _assert_cold(eng, "a", "after-suffix")


@pytest.mark.skipif(KERNELS == "off", reason="no C compiler on PATH: the CPU kernels are off")
async def test_the_whole_layer_step_serves_a_cell_whose_loader_kept_the_weights_plain(smollm2_path):
    """A cell loaded with MODELD_CPU_KERNELS=on and MODELD_DECODED_KV=recompute: the loader keeps the dense layer
    weights plain (loader.keep_plain_for_kernels, before the identity), and the one-session step is the C layer step
    (decode_step.KernelDecode). Its decoded tokens are recomputed with the append like any recomputing step's, and
    the continuation is held to a cold prefill and to the one-pass reference."""
    from modeld_cell import decode_step as DS

    settings = dataclasses.replace(EngineSettings.from_env(), threads=torch.get_num_threads(),
                                   decoded_kv="recompute", cpu_kernels="on")
    eng = Engine.from_cell(SPEC, model_path=smollm2_path, settings=settings)
    try:
        rep = eng.capability()
        assert "oneDNN-packed" not in eng.identity["weights_kernel"]
        assert rep["runtime"]["weights_pack_refused"] == ("kept plain for the CPU kernels' whole-layer decode step "
                                                          "(MODELD_CPU_KERNELS=on)")
        assert isinstance(eng.runner.recompute_step, DS.KernelDecode)
        assert rep["runtime"]["decoded_kv"]["attention"]["served"] == "layers"
        await _decode_then_append(eng)
    finally:
        eng.shutdown()


@pytest.mark.skipif(KERNELS == "off", reason="no C compiler on PATH: the CPU kernels are off")
async def test_the_q4_layer_step_serves_a_q4_1_cell_computed_dense(smollm2_path):
    """profile.weights q4_1 computed by the dense fp32 path (MODELD_WEIGHTS_PATH=dense-fp32), with the kernels on:
    the loader gives the layer step the file's Q4_1 blocks (decode_step.q4_blocks) and its Q8_0 head, so the dense
    weights are oneDNN-packed for prefill instead of kept plain, and the one-session step reads the blocks. Its
    decoded tokens are recomputed with the append, and the continuation is held to a cold prefill and to the
    one-pass reference."""
    from modeld_cell import decode_step as DS

    spec = {**SPEC, "profile": {**SPEC["profile"], "weights": "q4_1"}}
    settings = dataclasses.replace(EngineSettings.from_env(), threads=torch.get_num_threads(),
                                   decoded_kv="recompute", cpu_kernels="on", weights_path="dense-fp32")
    eng = Engine.from_cell(spec, model_path=smollm2_path, settings=settings)
    try:
        rt = eng.capability()["runtime"]
        assert (rt["weights_kernel"], rt["weights_dtype"]) == ("dense", "fp32")
        assert rt["weights_pack_refused"] is None or "kept plain" not in rt["weights_pack_refused"]
        step = eng.runner.recompute_step
        assert isinstance(step, DS.KernelDecode) and step.blocks is not None
        assert step.blocks is eng.model.decode_blocks and rt["decoded_kv"]["attention"]["served"] == "layers-q4"
        assert step.head_blocks is not None          # the file keeps its tied embedding table (the head) in Q8_0
        words = eng.capability()["attention"]["decode"]
        assert words.startswith("one-session steps: the recomputing step 'layers-q4'") and "Q4_1" in words, words
        assert "Q8_0" in words
        await _decode_then_append(eng)
    finally:
        eng.shutdown()
