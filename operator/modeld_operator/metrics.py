"""The operator's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("modeld_operator_reconciles_total", "Reconciles by kind and result", ["kind", "result"])
CELLS = Gauge("modeld_operator_cells", "Cells by phase", ["phase"])
CELL_READY_REPLICAS = Gauge("modeld_operator_cell_ready_replicas", "Ready worker pods per cell", ["namespace", "cell"])
SESSIONS = Gauge("modeld_operator_sessions", "Sessions by phase", ["phase"])
BIND_SECONDS = Histogram(
    "modeld_operator_session_bind_seconds",
    "Seconds from Session creation to binding",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)


def serve(port: int) -> None:
    if port:
        start_http_server(port)
