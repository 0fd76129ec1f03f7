"""Certification: drive cell endpoints through the contract with a fixed, versioned workload, record the matrix,
and keep a cell only if it beats its baseline on a gate (docs/certification.md).

    gates.py     the decision, pure           harness.py   measuring (interleaved cell / baseline)
    workload.py  what is sent                 report.py    JSON / Markdown / PNG, the status summary
    schema.py    the report's JSON Schema     client.py    the worker's HTTP API; spawn.py local workers
"""

from .gates import decide
from .harness import SCHEMA_ID, Options, Target, run
from .report import summary_for_status
from .workload import WORKLOAD_VERSION

__all__ = ["SCHEMA_ID", "WORKLOAD_VERSION", "Options", "Target", "decide", "run", "summary_for_status"]
