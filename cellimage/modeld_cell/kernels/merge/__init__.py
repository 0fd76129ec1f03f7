"""Exact merge of partial attention states (out, natural-log lse)."""
