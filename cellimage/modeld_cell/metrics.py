"""Prometheus metrics of one worker, named like vLLM's (``vllm:`` becomes ``modeld:``) wherever the meaning matches,
so routers and dashboards that already scrape vLLM (the llm-d scheduler reads num_requests_waiting,
num_requests_running, kv_cache_usage_perc and cache_config_info) read modeld unchanged.

Counters and histograms are fed from the traces of finished requests; gauges are read from the engine at scrape time,
so they are never stale. Each worker owns its registry (no global state: tests run several apps in one process).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .errors import HTTP_STATUS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = "modeld:"

# vLLM's buckets, so the same dashboards' quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
IO_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# (name, help) of every metric, for docs/worker.md and the test that scrapes /metrics.
NAMES = {
    "num_requests_running": "Requests the engine is running now (prefill or decode).",
    "num_requests_waiting": "Requests queued for the engine.",
    "kv_cache_usage_perc": "Fraction of the KV budget in use, 0..1 (1 = full), as vLLM reports it.",
    "cache_config_info": "KV-cache configuration as labels (block_size, cache_dtype, num_gpu_blocks); value 1.",
    "prompt_tokens_total": "Prompt tokens received (prefix, suffix, restore).",
    "generation_tokens_total": "Tokens generated.",
    "prefix_cache_queries_total": "Prompt tokens looked up in the KV already held (vLLM counts tokens, not requests).",
    "prefix_cache_hits_total": "Prompt tokens found in KV already held and so not recomputed.",
    "prefix_cache_blocks": "KV blocks the cross-session prefix index names (shared or cached unreferenced).",
    "prefix_cache_evictions_total": "Cached unreferenced KV blocks evicted (LRU) to make room.",
    "time_to_first_token_seconds": "Decode request arrival to its first token.",
    "inter_token_latency_seconds": "Time between consecutive generated tokens.",
    "e2e_request_latency_seconds": "Whole session request (prefix, suffix, decode, restore), arrival to last byte.",
    "tokens_reused_total": "Prompt tokens served from KV already present (= prefix_cache_hits_total).",
    "tokens_computed_total": "Prompt tokens that ran through prefill.",
    "errors_total": "Requests that ended in a typed error, by kind.",
    "sessions_active": "Sessions holding KV now.",
    "snapshot_seconds": "Time to write a session snapshot.",
    "restore_seconds": "Time to restore a session from a snapshot.",
    "http_requests_total": "HTTP requests by route and status.",
}


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        m = ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", NAMES["prompt_tokens_total"], m, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", NAMES["generation_tokens_total"], m, registry=r)
        self.prefix_cache_queries = Counter(P + "prefix_cache_queries", NAMES["prefix_cache_queries_total"], m,
                                            registry=r)
        self.prefix_cache_hits = Counter(P + "prefix_cache_hits", NAMES["prefix_cache_hits_total"], m, registry=r)
        self.tokens_reused = Counter(P + "tokens_reused", NAMES["tokens_reused_total"], m, registry=r)
        self.tokens_computed = Counter(P + "tokens_computed", NAMES["tokens_computed_total"], m, registry=r)
        self.errors = Counter(P + "errors", NAMES["errors_total"], m + ["kind"], registry=r)
        self.http_requests = Counter(P + "http_requests", NAMES["http_requests_total"], ["route", "status"],
                                     registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", NAMES["time_to_first_token_seconds"], m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", NAMES["inter_token_latency_seconds"], m,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", NAMES["e2e_request_latency_seconds"], m,
                             buckets=E2E_BUCKETS, registry=r)
        self.snapshot_seconds = Histogram(P + "snapshot_seconds", NAMES["snapshot_seconds"], m, buckets=IO_BUCKETS,
                                          registry=r)
        self.restore_seconds = Histogram(P + "restore_seconds", NAMES["restore_seconds"], m, buckets=IO_BUCKETS,
                                         registry=r)
        # Create every series up front: a name a dashboard queries exists from the first scrape, and rate() over
        # it starts at 0 instead of at the first event.
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.tokens_reused, self.tokens_computed, self.ttft, self.itl, self.e2e, self.snapshot_seconds,
                       self.restore_seconds):
            metric.labels(model_name)
        for kind in HTTP_STATUS:
            if kind not in ("clamp", "fallback"):
                self.errors.labels(model_name, kind)
        self._gauges: _EngineGauges | None = None

    def bind_engine(self, read_engine: Callable[[], Mapping[str, Any] | None],
                    read_cache_config: Callable[[], Mapping[str, Any] | None]) -> None:
        """Gauges come from these callables at every scrape; each returns None while no engine is loaded."""
        if self._gauges is None:
            self._gauges = _EngineGauges(self.model_name, read_engine, read_cache_config)
            self.registry.register(self._gauges)

    def observe_trace(self, trace: Mapping[str, Any]) -> None:
        """Counts what a finished engine request did; every request type reports through the same trace fields."""
        mn = self.model_name
        prompt = int(trace.get("prompt_tokens") or 0)
        reused = int(trace.get("tokens_reused") or 0)
        computed = int(trace.get("tokens_computed") or 0)
        generated = int(trace.get("completion_tokens") or 0)
        if prompt:
            self.prompt_tokens.labels(mn).inc(prompt)
            self.prefix_cache_queries.labels(mn).inc(prompt)
        if reused:
            self.prefix_cache_hits.labels(mn).inc(reused)
            self.tokens_reused.labels(mn).inc(reused)
        if computed:
            self.tokens_computed.labels(mn).inc(computed)
        if generated:
            self.generation_tokens.labels(mn).inc(generated)
        first = trace.get("first_output_ms")
        if first is not None:
            self.ttft.labels(mn).observe(float(first) / 1e3)
        # The engine records one entry per token after the first: the gap since the previous token.
        for ms in trace.get("decode_ms_per_token") or ():
            self.itl.labels(mn).observe(float(ms) / 1e3)

    def observe_error(self, kind: str) -> None:
        self.errors.labels(self.model_name, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineGauges(Collector):
    def __init__(self, model_name: str, read_engine: Callable[[], Mapping[str, Any] | None],
                 read_cache_config: Callable[[], Mapping[str, Any] | None]) -> None:
        self.model_name = model_name
        self.read_engine = read_engine
        self.read_cache_config = read_cache_config

    def describe(self) -> Iterable[Metric]:
        # Nothing to describe up front: the values exist only once an engine is loaded.
        return []

    def collect(self) -> Iterable[Metric]:
        m = self.read_engine() or {}
        for name, value in (
            ("num_requests_running", m.get("num_requests_running", 0)),
            ("num_requests_waiting", m.get("num_requests_waiting", 0)),
            ("kv_cache_usage_perc", m.get("kv_cache_usage_perc", 0.0)),
            ("sessions_active", m.get("sessions_active", 0)),
        ):
            g = GaugeMetricFamily(P + name, NAMES[name], labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g
        g = GaugeMetricFamily(P + "prefix_cache_blocks", NAMES["prefix_cache_blocks"], labels=["model_name"])
        g.add_metric([self.model_name], float(m.get("prefix_cache_blocks", 0)))
        yield g
        c = CounterMetricFamily(P + "prefix_cache_evictions", NAMES["prefix_cache_evictions_total"],
                                labels=["model_name"])
        c.add_metric([self.model_name], float(m.get("prefix_cache_evictions", 0)))
        yield c
        cfg = self.read_cache_config()
        if cfg:
            labels = {k: str(v) for k, v in sorted(cfg.items())}
            g = GaugeMetricFamily(P + "cache_config_info", NAMES["cache_config_info"], labels=list(labels))
            g.add_metric(list(labels.values()), 1.0)
            yield g
