"""The operator's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("modeld_operator_reconciles_total", "Reconciles by kind and result", ["kind", "result"])
# A Cell's namespace is cell_namespace: a scrape adds the operator pod's own `namespace` label, which would clash.
CELL_LABELS = ["cell_namespace", "cell"]
CELL_READY_REPLICAS = Gauge("modeld_operator_cell_ready_replicas", "Ready worker pods per cell", CELL_LABELS)
CELL_CERTIFIED = Gauge("modeld_operator_cell_certified",
                       "A cell's Certified condition: 1 True, 0 False, -1 Unknown (being measured, not yet)", CELL_LABELS)
EVENTS_DROPPED = Counter("modeld_operator_events_dropped_total",
                         "Normal Events not posted: their queue was full (a burst; the status says the same)")
BIND_SECONDS = Histogram(
    "modeld_operator_session_bind_seconds",
    "Seconds from Session creation to binding",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)


def forget_cell(namespace: str, cell: str) -> None:
    """A deleted Cell's series go with it."""
    for gauge in (CELL_READY_REPLICAS, CELL_CERTIFIED):
        try:
            gauge.remove(namespace, cell)
        except KeyError:
            pass


def serve(port: int) -> None:
    if port:
        start_http_server(port)
