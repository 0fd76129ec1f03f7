"""Kernel benchmarks: providers side by side, JSON out. Imports only torch, triton (CUDA) and the stdlib.

    PYTHONPATH=cellimage python benchmarks/kernels.py --out _out/kernels.json

On CUDA: paged decode achieved bandwidth (K+V bytes read / time) as a fraction of HBM peak and of the measured
device-to-device copy rate (bench "copy") at 32k and 128k context,
the fused quantized decode (int8 / fp8 / int4) against bf16, block-sparse vs dense (SDPA) prefill at 32k/64k/128k
fresh and as a chunk after a cached past (--sparse-past), and the split merge; timings are triton.testing.do_bench
medians. Every triton provider is first checked against
its torch reference (max_abs in the JSON); the script exits 1 if a check fails.
On CPU: tiny shapes, torch providers only (triton needs --interpret and TRITON_INTERPRET=1; interpreter times say
nothing about GPU speed). Best of a few time.perf_counter runs (the CPU may be shared).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cellimage"))

from modeld_cell.kernels import dispatch  # noqa: E402
from modeld_cell.kernels.merge import reference as merge_ref  # noqa: E402
from modeld_cell.kernels.paged_decode import reference as paged_ref  # noqa: E402
from modeld_cell.kernels.quant_kv import reference as quant_ref  # noqa: E402
from modeld_cell.kernels.sparse_prefill import reference as sparse_ref  # noqa: E402

# Peak HBM bandwidth in bytes/s by device-name substring (vendor datasheets); --hbm-peak-tbs overrides.
HBM_PEAK = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "B200": 8.0e12,
            "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12}  # fmt: skip

# Decode shapes: a Llama-3-8B-like layer (GQA 4) and SmolLM2-135M (GQA 3, head dim 64).
DECODE_MODELS = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}


class Runner:
    def __init__(self, device: torch.device, args: argparse.Namespace):
        self.device = device
        self.args = args
        self.rows: list[dict] = []
        self.failed: list[str] = []
        self.copy_Bps = float("nan")   # the measured device copy rate (bench_decode)

    def time_ms(self, fn) -> float:
        """Median milliseconds of fn()."""
        if self.device.type == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=25, rep=self.args.rep_ms, return_mode="median"))
        fn()  # warm-up
        times, t_end = [], time.perf_counter() + self.args.cpu_budget_s
        while len(times) < self.args.cpu_reps and (not times or time.perf_counter() < t_end):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        # Best of N on CPU: the 2 cores are shared with other jobs, and interference only ever adds time.
        return min(times)

    def check(self, name: str, ref: torch.Tensor, out: torch.Tensor, atol: float) -> float:
        err = float((ref.float() - out.float()).abs().max()) if ref.numel() else 0.0
        if not (err <= atol) or out.isnan().any():
            self.failed.append(f"{name}: max_abs {err:.3e} > {atol:g}")
        return err

    def add(self, **row) -> None:
        self.rows.append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(shown), flush=True)


def hbm_peak(device: torch.device, override_tbs: float | None) -> float | None:
    if override_tbs:
        return override_tbs * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in HBM_PEAK.items():
        if key in name:
            return peak
    return None


def make_cache(B: int, ctx: int, Hkv: int, D: int, BS: int, dtype: torch.dtype, device: torch.device):
    """Contiguous-per-sequence but shuffled block tables, every sequence ctx tokens long."""
    nblk = math.ceil(ctx / BS)
    NB = B * nblk
    bt = torch.randperm(NB, device=device).reshape(B, nblk).to(torch.int32)
    k = torch.randn(NB, BS, Hkv, D, device=device).to(dtype)
    v = torch.randn(NB, BS, Hkv, D, device=device).to(dtype)
    return k, v, bt, torch.full((B,), ctx, dtype=torch.int32, device=device)


def copy_rate_Bps(r: Runner) -> float:
    """The device-to-device copy rate this device sustains (bytes read + written per second): a 1 GiB buffer on CUDA
    (64 MiB on CPU) copied into another, median time. The decode kernels' reachable ceiling is nearer this than the
    datasheet's HBM peak."""
    n = (1 << 30) if r.device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=r.device)
    dst = torch.empty_like(src)
    ms = r.time_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)      # the buffers go when this returns


def bench_decode(r: Runner, use_triton: bool) -> None:
    r.copy_Bps = copy_rate_Bps(r)
    r.add(bench="copy", provider="torch", bytes=2 * ((1 << 30) if r.device.type == "cuda" else (64 << 20)),
          achieved_GBps=r.copy_Bps / 1e9)
    cuda = r.device.type == "cuda"
    if cuda:
        cases = [(m, ctx, B) for m, per in (("llama8b", {32768: 8, 131072: 2}), ("smollm2", {32768: 16, 131072: 4}))
                 for ctx, B in per.items()]  # fmt: skip
        if r.args.quick:
            cases = [c for c in cases if c[1] == 32768]
    else:  # the interpreter runs every program in python: keep it tiny
        cases = [("smollm2", 256, 2)] if use_triton else [("smollm2", 2048, 4)]
    for model, ctx, B in cases:
        _decode_case(r, use_triton, model, ctx, B)
        if cuda:
            torch.cuda.empty_cache()


def _decode_case(r: Runner, use_triton: bool, model: str, ctx: int, B: int) -> None:
    """bf16 (fp32 on CPU) paged decode, torch vs triton, then each quantized format at the same shape."""
    dev, cuda = r.device, r.device.type == "cuda"
    peak = hbm_peak(dev, r.args.hbm_peak_tbs)
    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 2e-2 if cuda else 1e-4
    Hq, Hkv, D = DECODE_MODELS[model]
    BS = 16
    k, v, bt, sl = make_cache(B, ctx, Hkv, D, BS, dtype, dev)
    q = torch.randn(B, Hq, D, device=dev).to(dtype)
    shape = dict(model=model, B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, BS=BS, dtype=str(dtype).split(".")[-1])
    kv_bytes = 2 * B * ctx * Hkv * D * k.element_size()  # K and V, read once per decode step

    def add(bench: str, provider: str, ms: float, nbytes: int, **extra) -> None:
        gbs = nbytes / (ms * 1e-3) / 1e9
        r.add(bench=bench, provider=provider, **shape, ms=ms, kv_bytes=nbytes, achieved_GBps=gbs,
              frac_of_hbm_peak=(gbs * 1e9 / peak) if peak else None,
              frac_of_copy_rate=gbs * 1e9 / r.copy_Bps, **extra)  # fmt: skip

    ref_out = paged_ref.paged_decode(q, k, v, bt, sl, check_tables=False)
    add("paged_decode", "torch", r.time_ms(lambda: paged_ref.paged_decode(q, k, v, bt, sl, check_tables=False)),
        kv_bytes)  # fmt: skip
    base_ms = None
    if use_triton:
        from modeld_cell.kernels.paged_decode import triton as tri

        err = r.check(f"paged_decode {shape}", ref_out, tri.paged_decode(q, k, v, bt, sl), tol)
        base_ms = r.time_ms(lambda: tri.paged_decode(q, k, v, bt, sl, check_tables=False))
        add("paged_decode", "triton", base_ms, kv_bytes, max_abs_vs_torch=err)

    # Quantized KV at the same shape; bytes read include the scales.
    for fmt in quant_ref.FORMATS:
        kq, ks = quant_ref.quantize(k, fmt)
        vq, vs = quant_ref.quantize(v, fmt)
        qbytes = B * ctx * quant_ref.bytes_per_token(fmt, 1, Hkv, D)
        args = (q, kq, vq, ks, vs, bt, sl)
        if use_triton:
            from modeld_cell.kernels.quant_kv import triton as qtri

            ref_q = quant_ref.quant_paged_decode(*args, check_tables=False)
            err = r.check(f"quant {fmt} {shape}", ref_q, qtri.quant_paged_decode(*args), tol)
            ms = r.time_ms(lambda a=args: qtri.quant_paged_decode(*a, check_tables=False))
            add("quant_decode", f"triton-{fmt}", ms, qbytes, speedup_vs_bf16=base_ms / ms, max_abs_vs_torch=err)
        else:
            ms = r.time_ms(lambda a=args: quant_ref.quant_paged_decode(*a, check_tables=False))
            add("quant_decode", f"torch-{fmt}", ms, qbytes)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def bench_sparse(r: Runner, use_triton: bool) -> None:
    dev, cuda = r.device, r.device.type == "cuda"
    # the CPU interpreter runs the triton kernel in fp32 (it cannot run every bf16 op)
    dtype = torch.bfloat16 if cuda else torch.float32 if use_triton else _cpu_sparse_dtype(r.args.cpu_sparse_dtype)
    H, Hkv, D, bs = (32, 8, 128, 64) if cuda else (9, 3, 64, 64)
    if r.args.sparse_lengths is not None:
        lengths = _int_list(r.args.sparse_lengths)
    elif cuda:
        lengths = [32768] if r.args.quick else [32768, 65536, 131072]
    else:
        lengths = [256] if use_triton else [2048, 4096, 8192]
    # (past, chunk): a chunk prefilled after cached tokens, e.g. an agent session's next turn
    if r.args.sparse_past is not None:
        with_past = [tuple(_int_list(pc.replace(":", ","))) for pc in r.args.sparse_past.split(";") if pc]
    elif cuda:
        with_past = [(24576, 8192)] if r.args.quick else [(24576, 8192), (122880, 8192)]
    else:
        with_past = [(128, 130)] if use_triton else [(6144, 2048)]
    if use_triton:  # correctness at a small length first, fresh and after a past that is not block-aligned
        from modeld_cell.kernels.sparse_prefill import triton as stri

        T = 1000 if cuda else 130
        for past in (0, 77):
            q, k, v = (
                torch.randn(n, h, D, device=dev).to(dtype) for n, h in ((T, H), (past + T, Hkv), (past + T, Hkv))
            )
            m = sparse_ref.estimate_block_mask(q, k, bs, keep_ratio=r.args.keep_ratio)
            r.check(f"sparse_prefill small past={past}", sparse_ref.block_sparse_attention(q, k, v, m, bs),
                    stri.block_sparse_attention(q, k, v, m, bs), 2e-2 if cuda else 1e-4)  # fmt: skip
    for past, T in [(0, n) for n in lengths] + with_past:
        _sparse_case(r, use_triton, T, H, Hkv, D, bs, dtype, past)
        if cuda:
            torch.cuda.empty_cache()


def _dense_with_past(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """CUDA dense baseline for a chunk after a past: SDPA with torch's lower-right causal bias (flash / efficient
    kernels, no materialised mask) on [1, H, *, D] with K/V expanded to H heads. q [T, H, D], k/v [S, Hkv, D]."""
    from torch.nn.attention.bias import causal_lower_right

    G = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh, vh = (t.transpose(0, 1).repeat_interleave(G, 0)[None] for t in (k, v))
    bias = causal_lower_right(q.shape[0], k.shape[0])
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)[0].transpose(0, 1)


def _cpu_sparse_dtype(choice: str) -> torch.dtype:
    """--cpu-sparse-dtype: bf16 (a bf16 cell's dtype) where this CPU's torch computes bf16 attention, else fp32 (the
    engine refuses bf16 cells there, so the benchmark measures what such a CPU serves)."""
    if choice != "auto":
        return getattr(torch, choice)
    return torch.float32 if dispatch.cpu_bf16_attention_error() else torch.bfloat16


def _sparse_case(r: Runner, use_triton: bool, T: int, H: int, Hkv: int, D: int, bs: int, dtype: torch.dtype,
                 past: int = 0) -> None:  # fmt: skip
    """Dense SDPA vs block-sparse prefill (vertical-slash mask at --keep-ratio) for T new tokens after past cached."""
    t0 = time.perf_counter()
    kr = r.args.keep_ratio
    S = past + T
    q = torch.randn(T, H, D, device=r.device).to(dtype)
    k, v = (torch.randn(S, Hkv, D, device=r.device).to(dtype) for _ in range(2))
    shape = dict(T=T, past=past, H=H, Hkv=Hkv, D=D, block=bs, dtype=str(dtype).split(".")[-1], keep_ratio=kr)
    mask = sparse_ref.estimate_block_mask(q, k, bs, keep_ratio=kr)
    density = sparse_ref.block_density(mask)
    est_ms = r.time_ms(lambda: sparse_ref.estimate_block_mask(q, k, bs, keep_ratio=kr))
    idx_ms = r.time_ms(lambda: sparse_ref.mask_to_kv_indices(mask))
    if past and r.device.type == "cuda":
        dense_ms = r.time_ms(lambda: _dense_with_past(q, k, v))
    else:
        dense_ms = r.time_ms(lambda: sparse_ref.dense_causal_attention(q, k, v))
    r.add(bench="prefill", provider="sdpa-dense", **shape, ms=dense_ms, density=1.0)
    if use_triton:
        from modeld_cell.kernels.sparse_prefill import triton as stri

        full = sparse_ref.mask_to_kv_indices(torch.ones_like(mask))
        ms_full = r.time_ms(lambda: stri.block_sparse_attention(q, k, v, block_size=bs, kv_indices=full))
        r.add(bench="prefill", provider="triton-all-blocks", **shape, ms=ms_full, density=1.0,
              speedup_vs_sdpa=dense_ms / ms_full)  # fmt: skip
        del full
        kvi = sparse_ref.mask_to_kv_indices(mask)
        ms = r.time_ms(lambda: stri.block_sparse_attention(q, k, v, block_size=bs, kv_indices=kvi))
    else:
        ms = r.time_ms(lambda: sparse_ref.block_sparse_attention(q, k, v, mask, bs))
    e2e = ms + est_ms + idx_ms
    r.add(bench="prefill", provider=("triton" if use_triton else "torch") + "-sparse", **shape, ms=ms,
          estimate_ms=est_ms, index_ms=idx_ms, end_to_end_ms=e2e, density=density,
          speedup_vs_sdpa=dense_ms / ms, end_to_end_speedup_vs_sdpa=dense_ms / e2e,
          choose_path=sparse_ref.choose_path(T, density, past=past), wall_s=time.perf_counter() - t0)  # fmt: skip


def bench_merge(r: Runner, use_triton: bool) -> None:
    dev = r.device
    S, B, H, D = (16, 64, 32, 128) if dev.type == "cuda" else (4, 8, 9, 64)
    outs = torch.randn(S, B, H, D, device=dev)
    lses = torch.randn(S, B, H, device=dev)
    ref_out, _ = merge_ref.merge_states_n(outs, lses)
    shape = dict(S=S, B=B, H=H, D=D)
    r.add(bench="merge", provider="torch", **shape, ms=r.time_ms(lambda: merge_ref.merge_states_n(outs, lses)))
    if use_triton:
        from modeld_cell.kernels.merge import triton as mtri

        err = r.check("merge", ref_out, mtri.merge_states_n(outs, lses)[0], 1e-4)
        r.add(bench="merge", provider="triton", **shape, ms=r.time_ms(lambda: mtri.merge_states_n(outs, lses)),
              max_abs_vs_torch=err)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--quick", action="store_true", help="CUDA: 32k only")
    p.add_argument("--only", default="decode,sparse,merge", help="comma list of decode, sparse, merge")
    p.add_argument("--interpret", action="store_true", help="CPU: also run triton under TRITON_INTERPRET=1")
    p.add_argument("--keep-ratio", type=float, default=0.1,
                   help="vertical-slash keep_ratio for sparse prefill (the worker's default; capped at the "
                        "reference's MAX_KEEP_TOKENS)")
    p.add_argument("--cpu-sparse-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="CPU sparse prefill dtype (a bf16 cell computes in bf16; auto: bf16 where the CPU's torch can)")
    p.add_argument("--sparse-lengths", default=None, help="fresh prefill lengths, comma list (default by device)")
    p.add_argument(
        "--sparse-past",
        default=None,
        help="PAST:CHUNK pairs, ';'-separated: chunks after a cached past (default by device; '' for none)",
    )
    p.add_argument("--hbm-peak-tbs", type=float, default=None, help="HBM peak in TB/s (default: by GPU name)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench rep budget per measurement (CUDA)")
    p.add_argument("--cpu-reps", type=int, default=5)
    p.add_argument("--cpu-budget-s", type=float, default=3.0)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--interpret needs TRITON_INTERPRET=1 in the environment")
    use_triton = cuda or args.interpret
    torch.manual_seed(0)
    r = Runner(device, args)
    meta = {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__ if use_triton else None,
        "triton_interpreter": (not cuda) and use_triton,
        "hbm_peak_Bps": hbm_peak(device, args.hbm_peak_tbs),
        "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv),
        "loadavg_1m_at_start": os.getloadavg()[0],  # CPU figures are only comparable on an idle machine
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "triton.testing.do_bench median" if cuda else f"best of <= {args.cpu_reps} perf_counter runs",
    }
    t0 = time.perf_counter()
    only = set(args.only.split(","))
    with torch.inference_mode():
        if "merge" in only:
            bench_merge(r, use_triton)
        if "decode" in only:
            bench_decode(r, use_triton)
        if "sparse" in only:
            bench_sparse(r, use_triton)
    meta["total_s"] = time.perf_counter() - t0
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": r.rows, "check_failures": r.failed}, indent=1) + "\n")
    print(f"wrote {out} ({len(r.rows)} rows, {meta['total_s']:.1f} s)")
    for f in r.failed:
        print("CHECK FAILED:", f, file=sys.stderr)
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
