"""Paged GQA decode attention over a vLLM "NHD" block cache."""
