"""Weight-only quantized linears (modeld_cell/quantize.py) against their torch reference, and the measured choice of
a CPU cell's weights path (modeld_cell/autotune.py) as a mechanism: candidates, a forced path, a cached measurement.

Tolerances: an fp32-activation kernel matches x @ dequant(w)^T to fp32 rounding of a K-term sum (~1e-4 relative);
bf16 activations round the inputs and the output to 8 bits of mantissa (~1e-2 relative). No test here asserts a
timing: the choice is tested on figures the test writes into the cache itself.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from modeld_cell import autotune, errors
from modeld_cell.model import ModelArgs, Transformer
from modeld_cell.quantize import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    QuantEmbedding,
    dequantize_q4_1,
    head_kernel,
    quantize_int8,
    quantize_model,
    quantize_q4_1,
    weights_bytes,
)

pytestmark = pytest.mark.unit

TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}          # relative RMS error bound per activation dtype
SHAPES = [(1, 64, 32), (2, 96, 64), (17, 128, 160), (63, 576, 96)]   # (M, K, N): K a multiple of the q4 group


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def ids(shape: tuple[int, int, int]) -> str:
    return "M{}-K{}-N{}".format(*shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_int8_linear_matches_reference(shape, dtype):
    m, k, n = shape
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, k, generator=g)
    lin = Int8WeightOnlyLinear(w, b, dtype)
    q, s = quantize_int8(w)
    assert lin.qweight.dtype == torch.int8 and q.abs().max() <= 127
    ref = x.to(dtype).float() @ (q.float() * s[:, None]).T + b
    assert rel_rms(lin(x.to(dtype)), ref) < TOL[dtype]
    # each weight within half a step of its row's scale
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()
    rows = torch.tensor([0, n - 1, n // 2])
    assert torch.allclose(lin.rows(rows, torch.float32), (q.float() * lin.scales.float()[:, None])[rows], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_int4_linear_matches_reference(shape, dtype):
    m, k, n = shape
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    lin = Int4WeightOnlyLinear(w, None, dtype, keep_codes=True)
    q, d, mn = quantize_q4_1(w)
    wdq = dequantize_q4_1(q, d, mn)
    assert q.max() <= 15 and ((wdq - w).abs() <= d.repeat_interleave(32, 1) / 2 + 1e-5).all()
    assert rel_rms(lin(x.to(dtype)), x.to(dtype).float() @ wdq.T) < TOL[dtype]
    rows = torch.tensor([n - 1, 0])
    assert torch.allclose(lin.rows(rows, torch.float32), wdq[rows], atol=1e-6)


def test_q4_1_blocks_requantize_to_themselves():
    """Weights that are Q4_1 blocks (w = d q + m, each block using codes 0 and 15, as llama.cpp's quantizer makes
    them) come back as the same codes: the GGUF's own blocks are what the int4 kernel multiplies."""
    g = torch.Generator().manual_seed(3)
    n, k = 48, 128
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes.view(n, k // 32, 32)[..., 0], codes.view(n, k // 32, 32)[..., 1] = 0, 15
    d = torch.rand(n, k // 32, generator=g, dtype=torch.float64).float().half().float() * 0.1 + 1e-3
    m = -torch.rand(n, k // 32, generator=g).half().float()
    w = dequantize_q4_1(codes, d, m)
    q, d2, m2 = quantize_q4_1(w)
    assert torch.equal(q, codes)
    assert torch.allclose(d2, d, rtol=1e-6) and torch.equal(m2, m)


def test_q4_1_refuses_a_ragged_input():
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        quantize_q4_1(torch.randn(4, 40))


TINY = ModelArgs(arch="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 intermediate_size=96, max_seq_len=128, tie_embeddings=True)


def tiny_model() -> Transformer:
    torch.manual_seed(4)
    m = Transformer(TINY)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    return m.eval()


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_quantize_model_swaps_every_linear(fmt):
    """Every transformer Linear and the head become the format's modules, the tied embedding reads the head's rows,
    no fp32 weight stays behind, and the layers compute what the dequantized weights compute."""
    model = tiny_model()
    dense = {n: mod.weight.detach().clone() for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    before = weights_bytes(model)
    quantize_model(model, fmt, torch.float32)
    cls = Int8WeightOnlyLinear if fmt == "int8" else Int4WeightOnlyLinear
    for name in dense:
        assert isinstance(model.get_submodule(name), cls), name
    assert isinstance(model.tok_embeddings, QuantEmbedding) and model.compute_dtype == torch.float32
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())
    assert weights_bytes(model) < before / 3
    tokens = torch.tensor([3, 7, 255])
    emb = model.tok_embeddings(tokens)
    w = dense["output"]
    assert emb.shape == (3, TINY.dim) and rel_rms(emb, w[tokens]) < 0.1      # one quantization step of error
    lin = model.layers[1].feed_forward.w2
    x = torch.randn(5, lin.in_features)
    assert rel_rms(lin(x), x @ dense["layers.1.feed_forward.w2"].T) < 0.1


def test_the_head_kernel_follows_what_the_file_keeps():
    """A Q4_1 file's head in Q4_1 takes the layers' kernel; one kept in Q8_0 takes the int8 kernel unless told
    dense; any other type stays dense; a checkpoint that names no types, or a format with no file type, takes the
    format's own."""
    layers = {f"model.layers.{i}.self_attn.q_proj.weight": "Q4_1" for i in range(TINY.n_layers)}
    head = "model.embed_tokens.weight" if TINY.tie_embeddings else "lm_head.weight"
    assert head_kernel(TINY, "q4_1", {**layers, head: "Q4_1"}) == "q4_1"
    assert head_kernel(TINY, "q4_1", {**layers, head: "Q8_0"}) == "int8"
    assert head_kernel(TINY, "q4_1", {**layers, head: "Q8_0"}, int8_head=False) == "dense"
    assert head_kernel(TINY, "q4_1", {**layers, head: "F16"}) == "dense"
    assert head_kernel(TINY, "q4_1", None) == "q4_1"
    assert head_kernel(TINY, "int8", {**layers, head: "Q8_0"}) == "int8"


@pytest.mark.parametrize("head", ["int8", "dense"])
def test_a_q4_1_model_serves_its_head_by_the_kernel_it_is_given(head):
    """q4_1 layers with an int8 head: the head and the tied embedding read int8 rows (per-row scales), and the layout
    says so; with a dense head, the head stays the embedding table, tied, in the compute dtype."""
    model = tiny_model()
    w = model.output.weight.detach().clone()
    quantize_model(model, "q4_1", torch.float32, head=head)
    assert isinstance(model.layers[0].attention.wqkv, Int4WeightOnlyLinear)
    tokens = torch.tensor([3, 7, 255])
    x = torch.randn(2, TINY.dim)
    if head == "int8":
        assert isinstance(model.output, Int8WeightOnlyLinear) and isinstance(model.tok_embeddings, QuantEmbedding)
        assert model.weights_layout == "q4_1 v2; head int8"
        q, sc = quantize_int8(w)
        assert torch.equal(model.tok_embeddings(tokens), q[tokens].float() * sc[tokens, None])
        assert rel_rms(model.output(x), x @ w.T) < 0.02
    else:
        assert model.output.weight is model.tok_embeddings.weight and model.output.weight.dtype == torch.float32
        assert model.weights_layout == "q4_1 v2; dense: output"
        assert torch.equal(model.tok_embeddings(tokens), w[tokens])


def test_quantize_model_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="not quantized-served"):
        quantize_model(tiny_model(), "q8_0", torch.float32)


# ---- autotune: the candidates and the choice


def test_candidates_per_format():
    assert autotune.candidates("fp32", True) == [("dense", "fp32")]
    assert autotune.candidates("bf16", True) == [("dense", "bf16")]
    assert autotune.candidates("int8", True) == [("int8", "fp32"), ("int8", "bf16")]
    assert autotune.candidates("int8", False) == [("int8", "fp32")]
    assert autotune.candidates("q4_1", True) == [("dense", "fp32"), ("dense", "bf16"), ("q4_1", "fp32"),
                                                 ("q4_1", "bf16")]
    assert autotune.candidates("q8_0", False) == [("dense", "fp32")]


def test_a_pinned_format_is_not_measured(tmp_path):
    c = autotune.choose(TINY, "fp32", str(tmp_path))
    assert (c.name, c.candidates) == ("dense-fp32", []) and "pins" in c.reason
    assert not (tmp_path / "autotune").exists()


def test_a_forced_path_is_taken_or_refused(tmp_path):
    c = autotune.choose(TINY, "q4_1", str(tmp_path), forced="q4_1-fp32")
    assert (c.kernel, c.dtype, c.candidates) == ("q4_1", "fp32", []) and "MODELD_WEIGHTS_PATH" in c.reason
    with pytest.raises(errors.BadRequest, match="does not serve profile.weights 'int8'") as e:
        autotune.choose(TINY, "int8", str(tmp_path), forced="dense-fp32")
    assert e.value.details["field"] == "profile.weights"


def test_the_choice_is_the_fastest_turn_and_cached(tmp_path, monkeypatch):
    """The measurement runs once and is written under <cache>/autotune; the choice minimises the turn time. The
    figures are the test's own (written into the measurement), so the choice is known in advance. Pruning is off
    here: whether a candidate's decode alone outlasts another's turn depends on this CPU (the test below covers it)."""
    monkeypatch.setattr(autotune, "bf16_computes", lambda: False)
    monkeypatch.setattr(autotune, "other_busy_cores", lambda *a: 0.0)     # a quiet machine, whatever runs beside
    real = autotune.measure
    monkeypatch.setattr(autotune, "measure", lambda *a, **k: real(*a, **dict(k, best_turn_ms=None)))
    first = autotune.choose(TINY, "q4_1", str(tmp_path))
    assert not first.cached and {r["name"] for r in first.candidates} == {"dense-fp32", "q4_1-fp32"}
    for r in first.candidates:
        assert r["decode_ms"] > 0 and r["prefill_ms_per_token"] > 0
        assert r["turn_ms"] == pytest.approx(autotune.TURN_PREFILL * r["prefill_ms_per_token"]
                                             + autotune.TURN_DECODE * r["decode_ms"], abs=0.1)
    path = tmp_path / "autotune" / f"{first.key}.json"
    rec = json.loads(path.read_text())
    figures = {"dense-fp32": (10.0, 1.0), "q4_1-fp32": (5.0, 0.5)}       # (decode ms, prefill ms per token)
    for r in rec["candidates"]:
        r["decode_ms"], r["prefill_ms_per_token"] = figures[r["name"]]
        r["turn_ms"] = autotune.TURN_PREFILL * r["prefill_ms_per_token"] + autotune.TURN_DECODE * r["decode_ms"]
        r["decode_ms_by_threads"] = {c: r["decode_ms"] for c in r["decode_ms_by_threads"]}
        r["turn_ms_by_threads"] = {c: r["turn_ms"] for c in r["turn_ms_by_threads"]}
    path.write_text(json.dumps(rec))
    again = autotune.choose(TINY, "q4_1", str(tmp_path))
    assert again.cached and again.name == "q4_1-fp32" and "dense-fp32 1020.0 ms" in again.reason
    os.remove(path)
    assert not autotune.choose(TINY, "q4_1", str(tmp_path)).cached


def test_a_candidate_whose_decode_alone_outlasts_the_best_turn_gets_no_prefill_figure(tmp_path, monkeypatch):
    """measure times the decode step first and stops there when TURN_DECODE steps already take another candidate's
    whole turn; choose passes the best turn so far, ranks the rest, and names the pruned one in its reason. The
    bound is the test's own (a turn of 1 microsecond prunes anything; none prunes nothing)."""
    r = autotune.measure(TINY, "q4_1", "fp32", reps=1, best_turn_ms=0.001)
    assert (r["prefill_ms_per_token"], r["turn_ms"]) == (None, None) and r["decode_ms"] > 0
    assert r["pruned"].startswith(f"its {autotune.TURN_DECODE} decoded tokens alone take")
    r = autotune.measure(TINY, "q4_1", "fp32", reps=1, best_turn_ms=None)
    assert r["pruned"] is None and r["turn_ms"] > 0
    monkeypatch.setattr(autotune, "bf16_computes", lambda: False)
    monkeypatch.setattr(autotune, "other_busy_cores", lambda *a: 0.0)
    seen: list[float | None] = []
    real = autotune.measure

    def spy(*a, **k):
        seen.append(k.get("best_turn_ms"))
        return real(*a, **dict(k, best_turn_ms=0.001 if seen[1:] else None))   # the second is pruned
    monkeypatch.setattr(autotune, "measure", spy)
    c = autotune.choose(TINY, "q4_1", str(tmp_path))
    assert seen[0] is None and seen[1] == min(c.candidates[0]["turn_ms_by_threads"].values())  # its faster count
    assert c.name == "dense-fp32" and c.candidates[1]["turn_ms"] is None
    assert "q4_1-fp32 over" in c.reason and "(decode alone)" in c.reason


def test_a_measurement_made_while_the_machine_was_busy_is_measured_again_once_quiet(tmp_path, monkeypatch):
    """Other processes' load ranks the paths by their load: such a measurement says so, is cached (a busy node's
    every start would measure again otherwise), and is measured again by the first start that finds the machine
    quiet."""
    monkeypatch.setattr(autotune, "bf16_computes", lambda: False)
    monkeypatch.setattr(autotune, "other_busy_cores", lambda *a: 1.5)
    monkeypatch.setattr(autotune, "quiet_now", lambda: False)
    first = autotune.choose(TINY, "q4_1", str(tmp_path))
    assert not first.cached and "1.50 cores busy" in first.reason and "machine quiet" in first.reason
    rec = json.loads((tmp_path / "autotune" / f"{first.key}.json").read_text())
    assert rec["others_busy_cores"] == 1.5
    assert autotune.choose(TINY, "q4_1", str(tmp_path)).cached              # still busy: the record serves
    monkeypatch.setattr(autotune, "quiet_now", lambda: True)
    monkeypatch.setattr(autotune, "other_busy_cores", lambda *a: 0.0)
    again = autotune.choose(TINY, "q4_1", str(tmp_path))                    # quiet now: measured again
    assert not again.cached and "cores busy" not in again.reason
    assert autotune.choose(TINY, "q4_1", str(tmp_path)).cached


def test_other_busy_cores_leaves_out_this_process(monkeypatch):
    """(machine busy - own CPU) / wall: 3 CPU-seconds busy on the machine, 1 of them this process's, over 2 s of
    wall time is 1 core kept busy by others."""
    import time
    monkeypatch.setattr(autotune, "machine_busy_s", lambda: 103.0)
    got = autotune.other_busy_cores(100.0, time.process_time() - 1.0, time.monotonic() - 2.0)
    assert got == pytest.approx(1.0, abs=0.05)
    monkeypatch.setattr(autotune, "machine_busy_s", lambda: None)
    assert autotune.other_busy_cores(100.0, time.process_time(), time.monotonic() - 1.0) is None


def test_the_decode_figure_goes_through_a_copy_of_the_layer_per_model_layer_up_to_a_byte_cap(monkeypatch):
    """A served decode step reads every layer's weights from memory; one layer timed again and again stays in the
    CPU's cache. So the decode figure goes through distinct copies: as many as the model has layers, fewer when
    their bytes would pass COLD_BYTES, never none."""
    args = dataclasses.replace(TINY, n_layers=6)
    g = torch.Generator().manual_seed(0)
    linears, head = autotune._layer_modules(args, "dense", torch.float32, g, head=False)
    assert head is None and len(linears) == 4
    per_layer = sum(lin.weight.numel() * 4 for lin in linears)
    assert autotune.layer_copies(args, linears) == args.n_layers
    monkeypatch.setattr(autotune, "COLD_BYTES", per_layer * (args.n_layers - 1) + 1)
    assert autotune.layer_copies(args, linears) == args.n_layers - 1
    monkeypatch.setattr(autotune, "COLD_BYTES", 1)
    assert autotune.layer_copies(args, linears) == 1
    monkeypatch.setattr(autotune, "COLD_BYTES", per_layer * 2)
    r = autotune.measure(args, "dense", "fp32", reps=1)
    assert r["decode_layer_copies"] == 2 and r["decode_ms"] > 0


def test_packed_weights_whose_rows_differ_by_call_size_are_measured_as_served(monkeypatch):
    """The loader serves packed weights in fixed row tiles where untiled rows are not chunking-invariant and the
    tiles are, else plain (loader.pack_and_probe): the measurement times them the same way, and says why."""
    from modeld_cell import model as model_mod
    if not model_mod.can_pack(torch.float32):
        pytest.skip("this torch cannot pack fp32 weights on this CPU")
    r = autotune.measure(TINY, "dense", "fp32", reps=1, pack=True)
    assert r["packed"] and r["pack_refused"] is None

    def differ_untiled(named, *a, **k):
        named = list(named)
        return None if all(lin.tile for _, lin in named) else "wqkv: rows differ untiled (the test says so)"
    monkeypatch.setattr(model_mod, "linears_row_invariant", differ_untiled)
    r = autotune.measure(TINY, "dense", "fp32", reps=1, pack=True)
    assert (r["packed"], r["row_tile"], r["pack_refused"]) == (True, model_mod.ROW_TILE, None)

    monkeypatch.setattr(model_mod, "linears_row_invariant", lambda *a, **k: "wqkv: rows differ (the test says so)")
    r = autotune.measure(TINY, "dense", "fp32", reps=1, pack=True)
    assert (r["packed"], r["row_tile"]) == (False, 0)
    assert r["pack_refused"] == (f"wqkv: rows differ (the test says so); in {model_mod.ROW_TILE}-row tiles: "
                                 "wqkv: rows differ (the test says so)")
    r = autotune.measure(TINY, "q4_1", "fp32", reps=1, pack=True)
    assert (r["packed"], r["pack_refused"]) == (False, None)       # a quantized kernel's codes are not oneDNN-packed


def test_a_dense_candidate_is_also_timed_as_the_whole_layer_step_where_it_may_serve(monkeypatch):
    """layer_step: a dense candidate's decode is timed through cpu.c's layer step too (its figures recorded), and
    each thread count's decode figure is the faster of the torch step's and that one (the test's own price for the
    C step: far slower, then far faster than the torch step); a quantized candidate is not timed so. The key
    of a measurement that may take the layer step is another one."""
    from modeld_cell.kernels.paged_decode import cpu
    if cpu._compiler() is None:
        pytest.skip("no C compiler on PATH: the CPU kernels are off")
    assert cpu.load(None)["loaded"]
    r = autotune.measure(TINY, "dense", "fp32", reps=1, layer_step=True)
    assert set(r["layer_step_ms"]) == {"layers", "head", "step"} and r["layer_step_ms"]["step"] > 0
    assert all(v <= r["layer_step_ms"]["step"] for v in r["decode_ms_by_threads"].values())
    assert autotune.measure(TINY, "q4_1", "fp32", reps=1, layer_step=True)["layer_step_ms"] is None
    monkeypatch.setattr(autotune, "_layer_step_ms", lambda *a: {"layers": 1e6, "head": 0.0, "step": 1e6})
    slow = autotune.measure(TINY, "dense", "fp32", reps=1, layer_step=True)
    assert all(v < 1e6 for v in slow["decode_ms_by_threads"].values())
    monkeypatch.setattr(autotune, "_layer_step_ms", lambda *a: {"layers": 0.0, "head": 0.001, "step": 0.001})
    fast = autotune.measure(TINY, "dense", "fp32", reps=1, layer_step=True)
    assert set(fast["decode_ms_by_threads"].values()) == {0.001}
    cands = [("dense", "fp32"), ("dense", "bf16")]
    assert autotune._key(TINY, cands, 2, None) != autotune._key(TINY, cands, 2, None, layer_step=True)
    # a file that stores its layers in Q4_1 (and its head in Q8_0): the step is timed reading those blocks, under
    # another key
    monkeypatch.undo()
    for blocks in ("q4_1", "q4_1+q8_0"):
        r = autotune.measure(TINY, "dense", "fp32", reps=1, layer_step=True, blocks=blocks)
        assert r["layer_step_ms"]["step"] > 0
        assert autotune._key(TINY, cands, 2, None, layer_step=True, blocks=blocks) != \
            autotune._key(TINY, cands, 2, None, layer_step=True)


def test_a_quantized_candidate_times_the_head_it_will_serve():
    """The head a q4_1 candidate is timed with is the loader's (quantize.head_kernel): int8 or dense as told, the
    format's own by default; a dense candidate's head is dense whatever the quantized one's."""
    g = torch.Generator().manual_seed(0)
    for want, cls in (("int8", Int8WeightOnlyLinear), ("q4_1", Int4WeightOnlyLinear)):
        _, head = autotune._layer_modules(TINY, "q4_1", torch.float32, g, None if want == "q4_1" else want)
        assert type(head) is cls
    _, head = autotune._layer_modules(TINY, "q4_1", torch.float32, g, "dense")
    assert type(head).__name__ == "RowLinear" and head.weight.dtype == torch.float32
    assert autotune.measure(TINY, "q4_1", "fp32", reps=1, head="int8")["head"] == "int8"
    assert autotune.measure(TINY, "dense", "fp32", reps=1, head="int8")["head"] == "dense"


def test_a_failed_quality_smoke_falls_back_to_a_dense_head_then_to_the_fastest_dense_path():
    """loader.load_engine's answer to a quantized kernel whose quality smoke fails (Unsupported naming
    profile.weights): with an int8 head, the same kernel again with the head dense; else the measurement's fastest
    dense candidate; a forced path with no candidates, or a refusal of another field, stands."""
    from modeld_cell import cli
    from modeld_cell.config import CellConfig, EngineSettings
    from modeld_cell.loader import _fallback
    from modeld_cell.settings import Settings

    cfg = CellConfig.from_spec(cli.load_spec(None, Settings()))
    cfg.weights_kernel, cfg.weights, cfg.weights_head = "q4_1", "bf16", "int8"
    cfg.weights_choice = {"candidates": [{"name": "dense-fp32", "kernel": "dense", "turn_ms": 30.0},
                                         {"name": "dense-bf16", "kernel": "dense", "turn_ms": 20.0},
                                         {"name": "q4_1-bf16", "kernel": "q4_1", "turn_ms": 10.0}]}
    failed = errors.Unsupported("weights-q4_1 failed its quality smoke (the test says so)", field="profile.weights",
                                value="q4_1")
    first = _fallback(cfg, failed, EngineSettings())
    assert first is not None and first.int8_head is False and first.weights_path == "auto"
    cfg.weights_head = "dense"                                       # the rebuild's head: failed again
    second = _fallback(cfg, failed, first)
    assert second is not None and second.weights_path == "dense-bf16" and second.int8_head is False
    cfg.weights_head = "int8"
    assert _fallback(cfg, errors.Unsupported("no", field="profile.kv", value="int4"), EngineSettings()) is None
    cfg.weights_head, cfg.weights_choice = "dense", {"candidates": []}          # forced: nothing measured
    assert _fallback(cfg, failed, first) is None


def test_the_decode_step_is_timed_at_one_thread_and_at_the_process_count():
    """A one-session step may be served at one thread (runner.choose_decode_threads) while prefill keeps the
    process count: the measurement times the decode step at both and gives the turn at each, the process count's
    being decode_ms / turn_ms; the process count is restored after."""
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        r = autotune.measure(TINY, "q4_1", "fp32", reps=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(was)
    assert set(r["decode_ms_by_threads"]) == set(r["turn_ms_by_threads"]) == {"1", "2"}
    assert (r["decode_ms"], r["turn_ms"]) == (r["decode_ms_by_threads"]["2"], r["turn_ms_by_threads"]["2"])
    for c, d in r["decode_ms_by_threads"].items():
        assert d > 0 and r["turn_ms_by_threads"][c] == pytest.approx(
            autotune.TURN_PREFILL * r["prefill_ms_per_token"] + autotune.TURN_DECODE * d, abs=0.1)


def _figures(turns: dict[str, dict[str, float]], threads: int) -> list[dict]:
    """Measurement rows with the test's own turns per decode count (prefill 1 ms a token for all)."""
    return [{"name": n, "kernel": n.split("-")[0], "dtype": n.split("-")[1], "prefill_ms_per_token": 1.0,
             "decode_ms": (t[str(threads)] - 700) / 32, "turn_ms": t[str(threads)],
             "decode_ms_by_threads": {c: (v - 700) / 32 for c, v in t.items()}, "turn_ms_by_threads": dict(t)}
            for n, t in turns.items()]


# dense-fp32 has the shorter turn when a step decodes at two threads, q4_1-fp32 at one
TURNS = {"dense-fp32": {"2": 1000.0, "1": 1500.0}, "q4_1-fp32": {"2": 1100.0, "1": 1200.0}}


def test_the_ranking_takes_the_count_a_one_session_step_decodes_at(tmp_path, monkeypatch):
    """The candidates are ranked at MODELD_DECODE_THREADS' count where it names one that was measured, else at the
    count a loaded step took at an earlier start (record_decode_threads), else at the process count; the reason
    says which. The figures are the test's own."""
    monkeypatch.setattr(autotune, "bf16_computes", lambda: False)
    monkeypatch.setattr(autotune, "other_busy_cores", lambda *a: 0.0)
    monkeypatch.setattr(autotune, "measure", lambda args, k, d, **kw: next(
        r for r in _figures(TURNS, 2) if r["name"] == f"{k}-{d}"))
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = autotune.choose(TINY, "q4_1", str(tmp_path))
        assert (first.name, first.decode_threads) == ("dense-fp32", 2)
        assert "decoding at 2, the process count" in first.reason and "q4_1-fp32 1100.0 ms" in first.reason
        assert autotune.choose(TINY, "q4_1", str(tmp_path), decode_threads=1).name == "q4_1-fp32"
        three = autotune.choose(TINY, "q4_1", str(tmp_path), decode_threads=3)
        assert three.name == "dense-fp32" and "MODELD_DECODE_THREADS=3 is not measured" in three.reason
        assert autotune.record_decode_threads(str(tmp_path), first.key, 1)
        again = autotune.choose(TINY, "q4_1", str(tmp_path))
        assert again.cached and (again.name, again.decode_threads) == ("q4_1-fp32", 1)
        assert "measured it at a start here" in again.reason and "dense-fp32 1500.0 ms" in again.reason
        assert autotune.choose(TINY, "q4_1", str(tmp_path), decode_threads=2).name == "dense-fp32"
    finally:
        torch.set_num_threads(was)
    assert not autotune.record_decode_threads(None, first.key, 1)
    assert not autotune.record_decode_threads(str(tmp_path), "no-such-key", 1)


def test_a_start_whose_step_decodes_at_another_count_ranks_again(tmp_path):
    """loader._rank_at_served_threads, after a measurement-chosen build: the loaded step's count is kept in the
    record; a ranking at that count which names another path is returned (load_engine builds again, once), one
    that names the same path becomes the engine's weights_choice; a count MODELD_DECODE_THREADS set, a forced
    path, or no cache to keep the count in builds nothing again."""
    import types

    from modeld_cell.loader import _rank_at_served_threads
    from modeld_cell.profile_gate import write_measurement

    rec = {"key": "k1", "candidates": _figures(TURNS, 2), "threads": 2}
    write_measurement(str(tmp_path / "autotune" / "k1.json"), rec)
    chosen = autotune.rank(rec, 2, "the process count").to_dict()

    def eng(choice, threads=1, reason="one thread decodes faster here"):
        return types.SimpleNamespace(
            config=types.SimpleNamespace(weights_choice=dict(choice)),
            runner=types.SimpleNamespace(decode_threads_report={"threads": threads, "process_threads": 2,
                                                                "reason": reason}))

    e = eng(chosen)
    first = _rank_at_served_threads(e, str(tmp_path))
    assert first == {"name": "dense-fp32", "decode_threads": 2, "reason": chosen["reason"],
                     "served_decode_threads": 1}
    assert json.loads((tmp_path / "autotune" / "k1.json").read_text())["decode_threads"] == 1
    assert _rank_at_served_threads(eng(chosen, 2), str(tmp_path)) is None          # ranked at the served count
    assert _rank_at_served_threads(eng(chosen, 1, "MODELD_DECODE_THREADS"), str(tmp_path)) is None
    assert _rank_at_served_threads(eng({**chosen, "candidates": []}), str(tmp_path)) is None
    e = eng(chosen)
    assert _rank_at_served_threads(e, None) is None                                # no cache: serves what it built
    assert e.config.weights_choice["name"] == "dense-fp32"
    assert e.config.weights_choice["decode_threads"] == 2                          # the count it ranked at
    assert "q4_1-fp32 would rank first" in e.config.weights_choice["reason"]
    same = {"key": "k1", "candidates": _figures({"dense-fp32": {"2": 1000.0, "1": 1100.0},
                                                  "q4_1-fp32": {"2": 1100.0, "1": 1200.0}}, 2), "threads": 2}
    e = eng(autotune.rank(same, 2, "the process count").to_dict())
    assert _rank_at_served_threads(e, str(tmp_path)) is None
    assert e.config.weights_choice["decode_threads"] == 1 and e.config.weights_choice["name"] == "dense-fp32"
    busy = {**same, "others_busy_cores": 1.5}                   # measured while the machine was busy: still said
    e = eng(autotune.rank(busy, 2, "the process count").to_dict())
    assert _rank_at_served_threads(e, str(tmp_path)) is None
    assert e.config.weights_choice["decode_threads"] == 1 and "kept 1.50 cores busy" in e.config.weights_choice["reason"]
