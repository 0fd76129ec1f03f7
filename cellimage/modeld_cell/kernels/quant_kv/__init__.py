"""Quantized KV-cache formats (int8, fp8 e4m3, int4) and the fused quantized-KV paged decode."""
