"""Attention kernels for the cell worker, one folder per family.

Each family has ``reference.py`` (plain torch, fp32 accumulation; the CPU production path and the ground truth) and
``triton.py`` (the CUDA path; runs on CPU only under ``TRITON_INTERPRET=1``). Callers go through
``modeld_cell.kernels.dispatch``, the single seam that picks a backend.

Families:
  merge/          exact merge of partial attention states (out, lse); natural-log LSE throughout
  paged_decode/   paged (vLLM "NHD") GQA decode attention, split-KV flash-decoding on triton; cpu.c / cpu.py: one
                  row on the CPU read in place, built at start with the machine's C compiler
  quant_kv/       int8 / fp8 e4m3 / int4 KV formats and the fused quantized-KV paged decode
  sparse_prefill/ block-sparse causal prefill, vertical-slash pattern estimate, dense/sparse path choice

Importing this package never imports triton; only the ``triton.py`` modules do.
"""
