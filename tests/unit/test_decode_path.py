"""The decode step's cheaper path computes what the general one does (#18): the one-row attention, the cached causal
mask, oneDNN-packed weights and the decode thread count. Inputs are random tensors and a tiny random model: these
check mechanisms (the same flash calls on the same inputs give the same bits; a packed model that fails the
exactness probe is unpacked; the thread choice never takes a count whose logits differ), not speeds."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from modeld_cell import loader
from modeld_cell import model as M
from modeld_cell.config import EngineSettings
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.runner import TorchRunner

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit
needs_flash = pytest.mark.skipif(M._FLASH_CPU is None, reason="this torch has no CPU flash attention with LSE")


@needs_flash
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q0", [0, 1, 7, 31, 32, 33, 63, 64, 100, 127])
def test_one_row_path_is_the_general_path(dtype: torch.dtype, q0: int) -> None:
    """_segmented_row makes the flash calls _segmented_attention makes for one row, and merges in the same order:
    equal bits (seg 32 so that a few rows span several segments, whole and open)."""
    g = torch.Generator().manual_seed(q0)
    q = torch.randn(1, 6, 16, generator=g).to(dtype)
    k = torch.randn(q0 + 1, 2, 16, generator=g).to(dtype)
    v = torch.randn(q0 + 1, 2, 16, generator=g).to(dtype)
    fast = M._segmented_attention(q, k, v, q0, 0.25, seg=32)
    general = M._segmented_attention(q, k, v, q0, 0.25, seg=32, row_path=False)
    assert fast.shape == general.shape == (1, 6, 16)
    assert torch.equal(fast, general)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_table_rows_are_the_built_masks(dtype: torch.dtype) -> None:
    seg = 16
    table = M._causal_rows(seg, dtype, torch.device("cpu"))
    assert M._causal_rows(seg, dtype, torch.device("cpu")) is table          # built once
    for off in range(seg):
        vis = torch.arange(seg) <= off
        want = torch.zeros(seg, dtype=dtype).masked_fill_(~vis, -math.inf)
        assert torch.equal(table[off], want)


def _tiny() -> M.Transformer:
    args = M.ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       intermediate_size=64, max_seq_len=256)
    torch.manual_seed(0)
    return M.Transformer(args)


needs_pack = pytest.mark.skipif(not M.can_pack(torch.float32), reason=str(M.pack_refused(torch.float32)))


@needs_pack
def test_pack_holds_no_plain_copy_and_unpack_restores_it() -> None:
    lin = M.RowLinear(32, 48, bias=False)
    w = lin.weight.detach().clone()
    x = torch.randn(5, 32)
    plain = lin(x)
    assert lin.pack() and lin.weight is None and lin.packed is not None
    assert not lin.pack()                                    # once
    torch.testing.assert_close(lin(x), plain)                # the same product (bits may round differently in fp32)
    assert lin(x[:1]).shape == (1, 48)                       # one row: still multiplied as two
    assert torch.equal(lin.state_dict()["weight"], w)         # state_dict: the weight, plain
    lin.unpack()
    assert lin.packed is None and torch.equal(lin.weight, w)


@needs_pack
def test_pack_linears_names_the_layout_and_leaves_the_head_plain() -> None:
    m = _tiny()
    n = M.pack_linears(m)
    assert n == 2 * 4 and m.weights_layout == "dense; oneDNN-packed: 8"
    assert m.output.packed is None and m.output.weight is not None             # the head: plain
    M.unpack_linears(m)
    assert m.weights_layout == "dense"
    assert all(lin.packed is None for lin in m.modules() if isinstance(lin, M.RowLinear))


def test_a_dtype_onednn_refuses_is_tried_once_and_stays_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN packs bf16 only with AVX-512 or AVX-NE-CONVERT and raises otherwise: the refusal is measured once per
    dtype, the model stays plain (no crash at load), and pack_and_probe says why (the capability report's
    ``weights_pack_refused``)."""
    calls = []

    def refuse(w: torch.Tensor, batch: int) -> torch.Tensor:
        calls.append(w.dtype)
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert\nmore")

    monkeypatch.setattr(M, "_PACK_REFUSED", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    why = M.pack_refused(torch.bfloat16)
    assert why == ("bfloat16: oneDNN cannot pack on this CPU (mkldnn_reorder_linear_weight: bf16 path needs the cpu "
                   "support avx_ne_convert)")
    m = _tiny().to(torch.bfloat16)
    assert not m.layers[0].attention.wqkv.pack() and m.layers[0].attention.wqkv.weight is not None
    loader.pack_and_probe(m)
    assert calls == [torch.bfloat16]                          # measured once, then read
    assert m.pack_refused == why and getattr(m, "weights_layout", "dense") == "dense"
    assert all(lin.packed is None for lin in m.modules() if isinstance(lin, M.RowLinear))
    assert M.pack_refused(torch.float16) == "float16: oneDNN packing is tried for fp32 and bf16 only"


@needs_pack
def test_a_packed_model_that_fails_the_probe_untiled_and_tiled_is_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def probe(model: M.Transformer) -> str | None:
        wqkv = model.layers[0].attention.wqkv
        calls.append((wqkv.packed is not None, wqkv.tile))
        return "feed_forward.w2 (torch.float32): rows differ" if wqkv.packed is not None else None

    monkeypatch.setattr(loader, "probe_chunking_invariance", probe)
    m = _tiny()
    loader.pack_and_probe(m)
    assert calls == [(True, 0), (True, M.ROW_TILE), (False, 0)]
    assert m.pack_refused.startswith("feed_forward.w2") and f"in {M.ROW_TILE}-row tiles" in m.pack_refused
    assert m.chunking_probe is None and not hasattr(m, "row_tile_reason")
    assert all(lin.packed is None and lin.tile == 0 for lin in m.modules() if isinstance(lin, M.RowLinear))
    assert getattr(m, "weights_layout", "dense") == "dense"


@needs_pack
def test_a_packed_model_whose_rows_differ_only_untiled_multiplies_fixed_row_tiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 with AMX: oneDNN's kernel rounds a row by its call's row count, packed or plain. Calls of exactly
    ROW_TILE rows give every row one kernel: the loader keeps the packed weights in tiles when the probe says the
    tiles are invariant, names the tile in the layout (part of the cache identity) and says why."""
    calls = []

    def probe(model: M.Transformer) -> str | None:
        wqkv = model.layers[0].attention.wqkv
        calls.append((wqkv.packed is not None, wqkv.tile))
        return None if wqkv.tile else "attention.wqkv (torch.float32): the rows of a 33-row matmul differ"

    monkeypatch.setattr(loader, "probe_chunking_invariance", probe)
    m = _tiny()
    loader.pack_and_probe(m)
    assert calls == [(True, 0), (True, M.ROW_TILE)]
    assert m.chunking_probe is None and getattr(m, "pack_refused", None) is None
    assert m.row_tile_reason.startswith("attention.wqkv") and m.weights_layout.endswith(f"; row tile {M.ROW_TILE}")
    assert all(lin.packed is not None and lin.tile == M.ROW_TILE for layer in m.layers
               for lin in layer.modules() if isinstance(lin, M.RowLinear))
    assert m.output.tile == 0                                                  # the head: untouched


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_tile_multiplies_fixed_size_calls_zero_padded(packed: bool, dtype: torch.dtype) -> None:
    """row_linear with a tile: every call is exactly ``tile`` rows (the last block padded with zero rows), so each
    row's bits are those of the same row in a tile-row call, whatever the size or offset of the call it came in."""
    if packed and not M.can_pack(dtype):
        pytest.skip(str(M.pack_refused(dtype)))
    g = torch.Generator().manual_seed(0)
    lin = M.RowLinear(48, 40, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 48, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    if packed:
        assert lin.pack()
    lin.tile = 8
    x = torch.randn(37, 48, generator=g).to(dtype)
    w = lin.packed if packed else lin.weight
    for rows in (1, 3, 8, 9, 37):
        got = lin(x[:rows])
        assert got.shape == (rows, 40)
        for i in range(0, rows, 8):                                            # tile by tile, as the call made them
            blk = x[i : min(i + 8, rows)]
            ref = M._mm(torch.cat([blk, blk.new_zeros(8 - blk.shape[0], 48)]), w, lin.bias, packed)
            assert torch.equal(got[i : i + blk.shape[0]], ref[: blk.shape[0]])
    full = lin(x)
    torch.testing.assert_close(full.float(), F.linear(x.float(), lin.packed.to_dense().float() if packed
                                                      else lin.weight.float(), lin.bias.float()),
                               rtol=2e-2, atol=0.1)


class _Timed(TorchRunner):
    """A runner whose decode takes a stated time per thread count and returns stated logits (the choice's logic).
    ``at``: (threads, position) -> (ms, logit) for steps at positions past the start-up's 64-token one."""

    def __init__(self, ms: dict[int, float], logits: dict[int, float], head_saves_ms: float = 0.0,
                 at: Any = None, max_seq_len: int = 256) -> None:
        m = _tiny()
        m.args.max_seq_len = max_seq_len
        super().__init__(m, PagedKVCache(2, 2, 8, kv_format("fp32"), 4 << 20, 16))
        self.ms, self.logits, self.head_saves_ms, self.at = ms, logits, head_saves_ms, at

    def prefill(self, *a, **kw):  # type: ignore[no-untyped-def]
        return torch.zeros(4), 0.0, []

    def decode(self, toks, positions, tables):  # type: ignore[no-untyped-def]
        import time
        n = torch.get_num_threads()
        ms, logit = (self.ms[n], self.logits[n]) if positions[0] <= 64 or self.at is None else \
            self.at(n, positions[0])
        time.sleep((ms - (self.head_saves_ms if self.model.head_threads else 0.0)) / 1e3)
        return torch.full((1, 4), logit)


@pytest.fixture
def two_threads():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_decode_threads_takes_one_thread_when_faster_and_equal(two_threads: None) -> None:
    r = _Timed({2: 12.0, 1: 4.0}, {2: 1.0, 1: 1.0})
    rep = r.choose_decode_threads(None, reps=3)
    assert r.decode_threads == 1 and rep["threads"] == 1 and rep["bitwise_equal"] is True
    assert float(rep["median_ms"]["1"]) < float(rep["median_ms"]["2"])
    assert torch.get_num_threads() == 2                      # the process count is restored
    assert r.kv.used_blocks == 0                             # the scratch blocks went back


def test_decode_threads_runs_the_head_at_the_process_count_when_that_is_faster(two_threads: None) -> None:
    """A one-thread step whose head at the process count saves time takes that split; one where it saves nothing
    keeps the head on the step's thread (the test's own times: 12 ms at two threads, 8 at one, 4 with the split)."""
    r = _Timed({2: 12.0, 1: 8.0}, {2: 1.0, 1: 1.0}, head_saves_ms=4.0)
    rep = r.choose_decode_threads(None, reps=3)
    assert r.decode_threads == 1 and r.model.head_threads == 2 and rep["head_threads"] == 2
    assert set(rep["median_ms"]) == {"2", "1", "1, head at 2"} and rep["reason"].endswith("with the head at 2")
    r = _Timed({2: 12.0, 1: 4.0}, {2: 1.0, 1: 1.0}, head_saves_ms=-6.0)
    rep = r.choose_decode_threads(None, reps=3)
    assert r.decode_threads == 1 and r.model.head_threads is None and rep["head_threads"] is None
    r.choose_decode_threads(1)                               # a fixed count runs the head with it
    assert r.model.head_threads is None


def test_the_head_runs_at_head_threads_and_the_step_count_is_restored(two_threads: None) -> None:
    """Transformer.logits sets the intra-op count for the head alone (what it multiplies with is recorded by a
    forward hook) and puts the step's count back; without head_threads it leaves the count alone."""
    m = _tiny()
    seen: list[int] = []
    m.output.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    x = torch.randn(1, m.args.dim)
    torch.set_num_threads(1)
    m.head_threads = 2
    got = m.logits(x)
    assert seen == [2] and torch.get_num_threads() == 1 and got.dtype == torch.float32
    m.head_threads = None
    m.logits(x)
    assert seen == [2, 1] and torch.get_num_threads() == 1


def test_decode_threads_never_takes_a_count_whose_logits_differ(two_threads: None) -> None:
    r = _Timed({2: 12.0, 1: 4.0}, {2: 1.0, 1: 1.5})
    rep = r.choose_decode_threads(None, reps=3)
    assert r.decode_threads is None and rep["threads"] == 2 and rep["bitwise_equal"] is False
    assert "not taken" in rep["reason"]


def test_decode_threads_keeps_the_process_count_when_not_faster(two_threads: None) -> None:
    r = _Timed({2: 4.0, 1: 12.0}, {2: 1.0, 1: 1.0})
    assert r.choose_decode_threads(None, reps=3)["threads"] == 2 and r.decode_threads is None


def test_decode_threads_setting_wins(two_threads: None) -> None:
    r = _Timed({2: 4.0, 1: 12.0}, {2: 1.0, 1: 1.0})
    rep = r.choose_decode_threads(1)
    assert r.decode_threads == 1 and rep["reason"] == "MODELD_DECODE_THREADS"
    assert r.choose_decode_wide(reps=3) is None and "wide" not in rep      # a fixed count holds at every length
    assert r.decode_wide_from is None
    r = _Timed({2: 4.0, 1: 12.0}, {2: 1.0, 1: 1.0})
    r.choose_decode_threads(None, reps=3)                                  # the process count: nothing to widen
    assert r.choose_decode_wide(reps=3) is None


def _linear_in_context(n: int, pos: int) -> tuple[float, float]:
    """The test's own step times: one thread 4 ms + 4 ms per 1k tokens, two threads 12 ms + 2 ms per 1k tokens,
    so two threads are 10 % faster from about 4k tokens (4096: 20.0 against 20.2; 8191: 36.0 against 28.0)."""
    return (4.0 + 4.0 * pos / 1024, 1.0) if n == 1 else (12.0 + 2.0 * pos / 1024, 1.0)


def test_a_long_context_runs_at_the_process_count_where_that_is_faster(two_threads: None) -> None:
    """Where the short measurement takes one thread, longer contexts are timed too, longest first, until the
    process count stops winning by 10 %: a one-session step from the shortest context it won then runs at the
    process count. Contexts beyond the cell's tier are measured at its last position."""
    r = _Timed({2: 12.0, 1: 4.0}, {2: 1.0, 1: 1.0}, at=_linear_in_context, max_seq_len=8192)
    r.choose_decode_threads(None, reps=3)
    rep = r.choose_decode_wide(reps=3)
    assert rep is r.decode_threads_report["wide"]
    assert r.decode_threads == 1 and r.decode_wide_from == 8191 and rep["from"] == 8191
    assert list(rep["median_ms"]) == ["8191", "4096"] and rep["reason"].endswith("(not at 4096)")
    assert r.kv.used_blocks == 0 and torch.get_num_threads() == 2
    rep = r.choose_decode_wide(3000, reps=3)                                       # a 3,000-token tier
    assert r.decode_wide_from is None and list(rep["median_ms"]) == ["2999"]
    assert "not 10 % faster than one at 2999 tokens" in rep["reason"]


def test_a_long_context_count_whose_bits_differ_is_never_taken(two_threads: None) -> None:
    r = _Timed({2: 12.0, 1: 4.0}, {2: 1.0, 1: 1.0}, max_seq_len=8192,
               at=lambda n, pos: (4.0 + 8.0 * pos / 1024, 1.0) if n == 1 else (12.0, 2.0))
    r.choose_decode_threads(None, reps=3)
    rep = r.choose_decode_wide(reps=3)
    assert r.decode_threads == 1 and r.decode_wide_from is None and rep["from"] is None
    assert rep["bitwise_equal"] is False and "not taken" in rep["reason"]


def test_a_cell_that_holds_no_long_context_measures_none(two_threads: None) -> None:
    r = _Timed({2: 12.0, 1: 4.0}, {2: 1.0, 1: 1.0}, at=_linear_in_context)          # max_seq_len 256
    r.choose_decode_threads(None, reps=3)
    rep = r.choose_decode_wide(reps=3)
    assert r.decode_wide_from is None and rep["median_ms"] == {} and rep["reason"].startswith("not measured")


def test_a_one_session_step_takes_its_count_by_the_tokens_cached(two_threads: None) -> None:
    """runner.decode: a step at a position from decode_wide_from on runs at the process count, one before it at
    decode_threads; the process count is back after either."""
    r = TorchRunner(_tiny(), PagedKVCache(2, 2, 8, kv_format("fp32"), 1 << 20, 16))
    seen: list[int] = []
    r.decode_step = lambda tok, pos, table: seen.append(torch.get_num_threads()) or torch.zeros(1, 64)
    r.decode_threads, r.decode_wide_from = 1, 100
    for pos in (98, 99, 100, 180):
        r.decode([1], [pos], [list(range(12))])
        assert torch.get_num_threads() == 2
    assert seen == [1, 1, 2, 2]
    r.decode_wide_from = None
    r.decode([1], [180], [list(range(12))])
    assert seen[-1] == 1


def test_decode_threads_and_pack_settings_are_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    s = EngineSettings.from_env()
    assert s.decode_threads is None and s.pack_weights is True and s.int8_head is True
    monkeypatch.setenv("MODELD_DECODE_THREADS", "1")
    monkeypatch.setenv("MODELD_PACK_WEIGHTS", "0")
    monkeypatch.setenv("MODELD_INT8_HEAD", "off")
    s = EngineSettings.from_env()
    assert s.decode_threads == 1 and s.pack_weights is False and s.int8_head is False
    monkeypatch.setenv("MODELD_INT8_HEAD", "2")
    with pytest.raises(ValueError, match="MODELD_INT8_HEAD must be 1 or 0"):
        EngineSettings.from_env()
    monkeypatch.delenv("MODELD_INT8_HEAD")
    monkeypatch.setenv("MODELD_DECODE_THREADS", "0")
    with pytest.raises(ValueError, match="MODELD_DECODE_THREADS"):
        EngineSettings.from_env()
    monkeypatch.setenv("MODELD_DECODE_THREADS", "auto")
    monkeypatch.setenv("MODELD_PACK_WEIGHTS", "maybe")
    with pytest.raises(ValueError, match="MODELD_PACK_WEIGHTS"):
        EngineSettings.from_env()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_is_apply_rope(dtype: torch.dtype) -> None:
    """rope_rotate (q and k in one call, the sign folded into the sin table) gives apply_rope's bits."""
    args = M.ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=4096)
    ang = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), M.rope_frequencies(args))
    ang = torch.cat([ang, ang], -1)
    pos = torch.tensor([0, 1, 17, 511, 4095])
    x = torch.randn(5, 6, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    cos, ssin = M.rope_rows(ang.cos()[pos], ang.sin()[pos])
    assert torch.equal(M.rope_rotate(x, cos, ssin), M.apply_rope(x, ang.cos()[pos], ang.sin()[pos]))


def test_a_model_built_on_meta_materialises_without_torchs_meta_kernels() -> None:
    """models.materialize (and the meta-built embedding, which skips its init): no dynamo, inductor or sympy import
    at a model build (seconds a process), tied weights still one tensor, every tensor on the CPU with its shape."""
    code = """
import sys, torch
from modeld_cell import model as M
from modeld_cell.models import materialize
args = M.ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                   max_seq_len=256, tie_embeddings=True)
with torch.device("meta"):
    m = M.Transformer(args)
materialize(m, "cpu")
assert m.output.weight is m.tok_embeddings.weight
assert all(t.device.type == "cpu" for t in [*m.parameters(), *m.buffers()])
assert m.layers[1].feed_forward.w13.weight.shape == (128, 32) and m.rope_cos.shape == (0,)
print(sorted(x for x in ("torch._dynamo", "torch._inductor", "sympy") if x in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "cellimage"),
                                                                         os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


@needs_pack
def test_plain_weights_whose_rows_differ_are_packed_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    """loader.settle_plain: a plain-weights verdict (the layer step measured faster on them) stands only where the
    plain rows are invariant; where they round by the call's row count the weights are packed and probed as usual,
    and the model says why (bitwise reuse before the decode step's speed)."""
    monkeypatch.setattr(M, "linears_row_invariant", lambda named, dtype, g, rows=512: None)   # rows invariant
    m = _tiny()
    loader.settle_plain(m, "kept plain for the layer step (the test says so)")
    assert m.pack_refused == "kept plain for the layer step (the test says so)"
    assert all(lin.packed is None for lin in m.modules() if isinstance(lin, M.RowLinear))
    assert getattr(m, "plain_refused", None) is None
    monkeypatch.setattr(M, "linears_row_invariant",
                        lambda named, dtype, g, rows=512: "attention.wqkv (torch.float32): rows differ (the test)")
    monkeypatch.setattr(loader, "probe_chunking_invariance", lambda model: None)
    m = _tiny()
    loader.settle_plain(m, "kept plain for the layer step (the test says so)")
    assert m.plain_refused == ("kept plain for the layer step (the test says so); not kept: attention.wqkv "
                               "(torch.float32): rows differ (the test)")
    assert getattr(m, "pack_refused", None) is None and "oneDNN-packed" in m.weights_layout
    assert all(lin.packed is not None for layer in m.layers for lin in layer.modules() if isinstance(lin, M.RowLinear))
    m = _tiny()                                        # MODELD_CPU_KERNELS=on asked for the layer step: plain as asked
    loader.settle_plain(m, "kept plain (MODELD_CPU_KERNELS=on)", forced=True)
    assert m.pack_refused == "kept plain (MODELD_CPU_KERNELS=on)" and getattr(m, "plain_refused", None) is None
