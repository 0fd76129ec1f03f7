"""Block-sparse causal prefill attention, the vertical-slash pattern estimate and the dense/sparse path choice."""
