"""The model runner of the triton backend (``runtime.backend: triton``): the model's matmuls, norms and RoPE run in
torch on the device, and every attention runs in the Triton kernels over the paged cache:

    prefill, dense          kernels/paged_prefill    flash attention of the chunk over past + new, read in place
    prefill, block-sparse   kernels/sparse_prefill   the vertical-slash estimate, then the block-sparse kernel
    decode                  kernels/paged_decode     split-KV flash-decoding, merged by kernels/merge
    decode, int8 / fp8 KV   kernels/quant_kv         the fused dequantizing split-KV decode

On CUDA the kernels are compiled; on the CPU they run under the Triton interpreter (``TRITON_INTERPRET=1``), which
is how CI proves this backend without a GPU (tests/cell/test_triton_backend.py). A packed int4 cache is not read
by the prefill kernel: modeld_api.served refuses ``profile.kv: int4`` on this backend.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import errors
from .kernels import dispatch
from .kernels.paged_prefill import reference as prefill_ref
from .kernels.quant_kv import reference as quant_ref
from .kv_cache import PagedKVCache
from .model import AttnMetadata, Transformer
from .runner import TorchRunner

# Logits of the start-up forward vs the torch path on the same device, fp32 (max abs): both compute the same sums in
# another order; 1e-3 is ~50x what the interpreter proof measures at fp32 and far below a wrong kernel's error (O(1)).
STARTUP_ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


def triton_device_error(device: torch.device) -> str | None:
    """Why the triton backend cannot run on ``device``, or None: CUDA needs triton; the CPU needs the interpreter."""
    if not dispatch.triton_available():
        return "triton does not import in this process"
    if device.type == "cuda" or (device.type == "cpu" and dispatch.interpreter_enabled()):
        return None
    return f"no CUDA device ({device.type}, and TRITON_INTERPRET is not set)"


class TritonRunner(TorchRunner):
    name = "triton"

    def __init__(self, model: Transformer, kv: PagedKVCache) -> None:
        super().__init__(model, kv)
        if kv.fmt.quant == "int4":
            raise errors.Unsupported("profile.kv int4 is not served by the triton backend: its prefill kernel reads "
                                     "int8 / fp8 caches, not packed rotated int4", field="profile.kv", value="int4")
        if (why := triton_device_error(kv.k.device)) is not None:
            raise errors.Unsupported(f"runtime.backend triton cannot run here: {why}", field="runtime.backend")
        self.calls = {"paged_prefill": 0, "sparse_prefill": 0, "paged_decode": 0, "quant_paged_decode": 0}
        self.decode_kernel = ("triton quant_kv.quant_paged_decode (fused dequantizing split-KV)" if kv.fmt.quantized
                              else "triton paged_decode (split-KV flash-decoding + merge)")

    @property
    def chunking_invariant(self) -> bool:
        return False     # tiles and splits depend on the shapes: reuse is exact to a tolerance, not bitwise

    def kernels(self) -> dict[str, str]:
        mode = "compiled" if self.kv.k.device.type == "cuda" else "interpreter (TRITON_INTERPRET=1)"
        return {"prefill": f"triton paged_prefill ({mode})", "decode": f"{self.decode_kernel} ({mode})",
                "sparse_prefill": f"triton sparse_prefill block-sparse ({mode})", "device": str(self.kv.k.device),
                "calls": dict(self.calls)}       # type: ignore[dict-item]

    def choose_decode_kernel(self, mode: str) -> None:
        if mode == "torch":
            raise errors.Unsupported("MODELD_DECODE_ATTENTION=torch asks for the torch decode path, but this cell's "
                                     "runtime.backend is triton", field="runtime.backend")

    def attend(self, q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata,
               scales: tuple[Tensor, Tensor] | None) -> Tensor:
        """model.paged_attention on the triton kernels (shapes as there)."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        ks, vs = scales if scales is not None else (None, None)
        if meta.kind == "decode":
            if ks is not None and vs is not None:
                self.calls["quant_paged_decode"] += 1
                return dispatch.quant_paged_decode(q, k_cache, v_cache, ks, vs, meta.block_tables, meta.seq_lens,
                                                   sm_scale=scale, check_tables=False, force="triton")
            self.calls["paged_decode"] += 1
            return dispatch.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, sm_scale=scale,
                                         check_tables=False, force="triton")
        t = q.shape[0]
        past = meta.seq_lens_list[0] - t
        table = meta.block_tables[0]
        if meta.sparse is not None:
            sp = meta.sparse
            ka = prefill_ref.gather(k_cache, table, past + t)         # [past + T, Hkv, D]: the estimate reads all keys
            va = prefill_ref.gather(v_cache, table, past + t)
            if ks is not None and vs is not None:
                ka = quant_ref.dequantize(ka, prefill_ref.gather(ks, table, past + t)).to(q.dtype)
                va = quant_ref.dequantize(va, prefill_ref.gather(vs, table, past + t)).to(q.dtype)
            o, info = dispatch.sparse_prefill(q, ka, va, block_size=sp["block_size"], sm_scale=scale,
                                              keep_ratio=sp["keep_ratio"], max_keep_tokens=sp["max_keep_tokens"],
                                              min_tokens=sp["min_tokens"], max_density=sp["max_density"],
                                              return_info=True, force="triton")
            meta.sparse_log.append(info)
            self.calls["sparse_prefill"] += 1
            return o
        self.calls["paged_prefill"] += 1
        return dispatch.paged_prefill(q, k_cache, v_cache, table, past, sm_scale=scale, k_scale=ks, v_scale=vs,
                                      force="triton")

    @torch.no_grad()
    def startup_check(self) -> dict:
        """One real forward on the device before the cell reports ready: 37 tokens (three pages) through the loaded
        weights, on the triton kernels and on the torch path, into scratch blocks of this cache that are then
        freed. Raises Fatal naming the gap when the logits disagree beyond STARTUP_ATOL; returns what it measured."""
        dev = self.kv.k.device
        n = 37
        blocks = self.kv.allocate(self.kv.blocks_for(n))
        try:
            toks = [(i * 7919) % self.model.args.vocab_size for i in range(n)]
            got = self.prefill(toks, 0, blocks)[0]
            want = TorchRunner(self.model, self.kv).prefill(toks, 0, blocks)[0]
        finally:
            self.kv.free(blocks[::-1])
        err = float((got - want).abs().max())
        tol = STARTUP_ATOL.get(self.model.compute_dtype, 0.25)
        if not err <= tol:      # NaN fails too
            raise errors.Fatal(f"the triton backend's start-up forward on {dev} disagrees with the torch path: logits "
                               f"max abs diff {err:.3g} > {tol}")
        return {"device": str(dev), "tokens": n, "max_abs_diff": err, "atol": tol}
