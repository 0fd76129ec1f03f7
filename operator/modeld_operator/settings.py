"""The operator's settings, read once from the environment (documented in docs/operator.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


_PARSERS: dict[type, Callable[[str], Any]] = {int: int, float: float, str: str}


@dataclass(frozen=True)
class Settings:
    namespace: str = ""
    """MODELD_NAMESPACE: the namespace to watch; empty watches all namespaces (cluster-wide)."""
    metrics_port: int = 8000
    """MODELD_METRICS_PORT: Prometheus metrics on this port; 0 turns them off."""
    status_interval: float = 5.0
    """MODELD_STATUS_INTERVAL: seconds between refreshes of Cell and Session status from pods and workers."""
    probe_endpoints: bool = True
    """MODELD_PROBE_ENDPOINTS: ask each worker's /readyz before calling it ready (kubelet probes are not enough where
    pods are simulated, and a second opinion costs one small request)."""
    probe_timeout: float = 2.0
    """MODELD_PROBE_TIMEOUT: seconds a worker has to answer /readyz or a session close."""
    require_certified: bool = True
    """MODELD_REQUIRE_CERTIFIED: bind Sessions only to Cells whose Certified condition is True (a cell earns its place
    by measurement); false binds to any ready cell that fits, e.g. while bringing up a new cluster."""
    retry_delay: float = 10.0
    """MODELD_RETRY_DELAY: seconds before retrying a Cell with no capacity or a Session with no fitting cell."""
    watch_server_timeout: int = 60
    """MODELD_WATCH_SERVER_TIMEOUT: seconds the apiserver keeps a watch open; a silent watch cannot hang the operator."""
    watch_client_timeout: int = 90
    """MODELD_WATCH_CLIENT_TIMEOUT: seconds the client waits on a watch before reconnecting."""
    api_connections: int = 24
    """MODELD_API_CONNECTIONS: at most this many connections to the apiserver for kopf's watches, patches and Events
    (one watch per watched kind holds one; requests beyond the rest wait for a free one)."""
    bind_workers: int = 8
    """MODELD_BIND_WORKERS: Sessions bound at once (threads, each one apiserver request at a time: a status write,
    then an Event)."""
    log_format: str = "json"
    """MODELD_LOG_FORMAT: json (one object per line) or plain."""
    leader_election: bool = False
    """MODELD_LEADER_ELECTION: run kopf only while holding the Lease (leader.py), so replicas never act at once; the
    chart turns it on."""
    lease_namespace: str = ""
    """MODELD_LEASE_NAMESPACE: namespace of the Lease (the chart: the operator's own); required with leader election."""
    lease_name: str = "modeld-operator"
    """MODELD_LEASE_NAME: name of the Lease the replicas compete for."""
    lease_duration: int = 15
    """MODELD_LEASE_DURATION: seconds a Lease not renewed stays its holder's; the leader renews every sixth of it and
    stops leading when two thirds pass without a renewal (client-go's 15, 10 and 2 s, near enough)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = "MODELD_" + f.name.upper()
            if key not in env:
                continue
            raw = env[key]
            try:
                kind = type(f.default)
                values[f.name] = _bool(raw) if kind is bool else _PARSERS[kind](raw)
            except ValueError as exc:
                raise ValueError(f"{key}={raw!r}: {exc}") from None
        settings = cls(**values)
        if settings.log_format not in ("json", "plain"):
            raise ValueError(f"MODELD_LOG_FORMAT={settings.log_format!r}: use json or plain")
        if settings.leader_election and not settings.lease_namespace:
            raise ValueError("MODELD_LEADER_ELECTION=true needs MODELD_LEASE_NAMESPACE (the Lease's namespace)")
        if settings.api_connections < 8:
            raise ValueError(f"MODELD_API_CONNECTIONS={settings.api_connections}: at least 8 (a watch per kind holds one)")
        if settings.bind_workers < 1:
            raise ValueError(f"MODELD_BIND_WORKERS={settings.bind_workers}: at least 1")
        if settings.lease_duration < 3:
            raise ValueError(f"MODELD_LEASE_DURATION={settings.lease_duration}: at least 3 seconds")
        return settings


SETTINGS = Settings.from_env()
