"""Causal prefill attention of a chunk of new tokens over the paged KV cache (past + new), torch and triton."""
