"""``modeld-cell``: serve a cell over HTTP, or print its capability report.

    modeld-cell serve [--cell FILE] [--host H] [--port P] [--model PATH]
    modeld-cell capability [--cell FILE] [--model PATH]
    modeld-cell certify --endpoint URL | --spawn  [--cell FILE] [--baseline-...] --tiers T,... --out DIR (see certify/)

The cell comes from ``--cell`` (a Cell manifest or a bare spec, YAML or JSON), else ``MODELD_CELL_SPEC`` (JSON, so a
pod needs no volume), else the embedded laptop cell ``cells/laptop-cpu.yaml``. Flags win over environment variables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from . import logs
from .errors import ContractError
from .settings import Settings

log = logging.getLogger("modeld_cell.cli")
DEFAULT_CELL = "cells/laptop-cpu.yaml"


class SpecError(ValueError):
    """The cell spec cannot be read or is invalid; the message says which field and why."""


DRAIN_S = 25.0   # seconds the requests in flight get after SIGTERM (within the pod's 30 s grace period)


def load_spec(cell_file: str | None, settings: Settings) -> dict[str, Any]:
    """The validated Cell ``.spec`` as a plain dict, with MODELD_KV_MEMORY_MIB applied."""
    if cell_file:
        try:
            obj = yaml.safe_load(Path(cell_file).read_text())  # YAML is a superset of JSON
        except (OSError, yaml.YAMLError) as e:
            raise SpecError(f"cannot read cell file {cell_file}: {e}") from None
        source = cell_file
    elif settings.cell_spec is not None:
        obj, source = settings.cell_spec, "MODELD_CELL_SPEC"
    else:
        obj = yaml.safe_load(resources.files("modeld_cell").joinpath(DEFAULT_CELL).read_text())
        source = f"embedded {DEFAULT_CELL}"
    if not isinstance(obj, dict):
        raise SpecError(f"{source}: a Cell manifest or spec must be a mapping")
    spec = _validate(obj, source)
    if settings.kv_memory_mib is not None:
        spec["kvMemoryMiB"] = settings.kv_memory_mib
    return spec


def _validate(obj: dict[str, Any], source: str) -> dict[str, Any]:
    """The spec as the API package (modeld_api, the CRDs' source) validates it: the same rules the apiserver applies."""
    from pydantic import ValidationError

    from modeld_api import parse_cell_spec, validation_problems
    from modeld_api.served import unserved

    try:
        spec = parse_cell_spec(obj)
    except ValidationError as e:
        problems = "; ".join(f"{f}: {m}" for f, m in validation_problems(e))
        raise SpecError(f"{source}: invalid Cell spec: {problems}") from None
    if refused := unserved(spec):
        raise SpecError(f"{source}: " + "; ".join(u.message() for u in refused))
    return spec.model_dump(mode="json", exclude_none=True)


def model_name(spec: dict[str, Any]) -> str:
    """A short served-model name for metrics labels: the weights file's stem, else the family."""
    ref = str(spec.get("model", {}).get("ref", ""))
    stem = Path(ref.split("#", 1)[-1]).name
    for ext in (".gguf", ".safetensors"):
        stem = stem.removesuffix(ext)
    return stem or str(spec.get("model", {}).get("family", ""))


def parallelism(spec: dict[str, Any]) -> str:
    return str(spec.get("runtime", {}).get("parallelism", "single"))


def multi_rank(spec: dict[str, Any]) -> bool:
    """Ranks that serve sessions together: rank 0 serves HTTP and drives, the others follow it."""
    return parallelism(spec) not in ("single", "data")


def engine_settings(spec: dict[str, Any], settings: Settings) -> Any:
    from .config import EngineSettings

    out = EngineSettings.from_env()
    if settings.threads:
        out.threads = settings.threads  # MODELD_THREADS, validated by Settings
    elif parallelism(spec) != "single":  # the node's cores shared by the ranks the launcher started on it
        out.threads = max(1, out.threads // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return out


def build_engine(spec: dict[str, Any], settings: Settings) -> Any:
    from .engine import Engine

    return Engine.from_cell(spec, model_path=settings.model_path, settings=engine_settings(spec, settings),
                            quality_cache=settings.cache_dir)


def follow(spec: dict[str, Any], settings: Settings) -> int:
    """A follower rank (RANK > 0 under torch's launcher): no HTTP; runs what rank 0 sends (parallel/ranks.py)."""
    from .loader import load_follower

    log.info("follower rank: loading the model", extra={"fields": {"rank": os.environ.get("RANK"),
                                                                    "cell": settings.cell_name}})
    try:
        load_follower(spec, settings.model_path, engine_settings(spec, settings))
    except ContractError as e:
        # the spec is refused (rank 0 finds the same and answers it on every route): exiting would make the launcher
        # stop rank 0 and the pod restart into the same refusal, so this rank waits for the pod's SIGTERM instead
        log.error("the cell spec is refused: %s", e.message, extra={"fields": {"kind": e.kind}})
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()
    return 0


async def serve(settings: Settings, spec: dict[str, Any]) -> int:
    from aiohttp import web

    from .server import WORKER, create_app

    app = create_app(settings, model_name=model_name(spec))
    # handler_cancellation: a client that disconnects cancels its request, so the engine stops working for nobody
    # (the engine leaves the session consistent on cancellation). aiohttp's test server does the same, so the
    # tests exercise this behaviour. access_log=None: the server logs its own structured line per request.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    # shutdown_timeout: on SIGTERM the requests in flight get this long to finish (the pod's grace period is 30 s)
    site = web.TCPSite(runner, settings.host, settings.port, shutdown_timeout=DRAIN_S)
    await site.start()
    log.info("listening; loading the model", extra={"fields": {"host": settings.host, "port": settings.port,
                                                                "cell": settings.cell_name,
                                                                "namespace": settings.cell_namespace}})

    stop = asyncio.Event()
    cleaned = False
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # /healthz answers while the model loads (minutes for big models); /readyz says not_ready until it is attached.
    load = asyncio.ensure_future(asyncio.to_thread(build_engine, spec, settings))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            try:
                engine = load.result()
            except ContractError as e:
                # a refusal the spec carries (Unsupported / BadRequest naming a field): restarting cannot help, so
                # the worker stays up and answers it on every route, /readyz included, where the operator reads it
                log.error("the cell spec is refused: %s", e.message, extra={"fields": {"kind": e.kind, **{
                    k: v for k, v in e.details.items() if isinstance(v, (str, int, float))}}})
                app[WORKER].refuse(e)
                await stopping
                return 0
            except Exception:
                log.exception("the engine failed to load")
                return 1
            app[WORKER].attach(engine)
            log.info("ready", extra={"fields": {"model": model_name(spec)}})
            await stopping
            # drain: new requests answer not_ready, the listener closes, the requests in flight finish (up to
            # DRAIN_S), and only then does the engine stop
            app[WORKER].drain()
            log.info("draining", extra={"fields": {"timeout_s": DRAIN_S}})
            await runner.cleanup()
            cleaned = True
            await asyncio.to_thread(engine.shutdown)      # a multi-rank cell's followers stop with it
        log.info("shutting down")
        return 0
    finally:
        stopping.cancel()
        if not cleaned:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="modeld-cell", description="The modeld cell worker.")
    sub = ap.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="serve the session contract over HTTP")
    p_cap = sub.add_parser("capability", help="load the cell and print its capability report (JSON)")
    for p in (p_serve, p_cap):
        p.add_argument("--cell", metavar="FILE", help="Cell manifest or bare spec (YAML/JSON)")
        p.add_argument("--model", metavar="PATH", help="local weights file (overrides MODELD_MODEL_PATH)")
    p_serve.add_argument("--host", help="bind address (overrides MODELD_CELL_HOST)")
    p_serve.add_argument("--port", type=int, help="port (overrides MODELD_CELL_PORT, then the spec's port)")
    from .certify import cli as certify_cli

    p_cert = sub.add_parser("certify", help="measure a cell against its baseline and decide whether to keep it")
    certify_cli.add_arguments(p_cert)
    args = ap.parse_args(argv)
    if args.command == "certify":
        return certify_cli.run(args, argv)

    try:
        settings = Settings.from_env(model_path=args.model, host=getattr(args, "host", None),
                                     port=getattr(args, "port", None))
    except ValueError as e:
        print(f"modeld-cell: {e}", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.cell, settings)
    except SpecError as e:
        print(f"modeld-cell: {e}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)

    if multi_rank(spec) and os.environ.get("RANK", "0") != "0":
        return follow(spec, settings)
    if args.command == "capability":
        eng = build_engine(spec, settings)
        print(json.dumps(eng.capability(), indent=2, sort_keys=True, default=str))
        eng.shutdown()
        return 0
    if settings.port is None:
        settings = dataclasses.replace(settings, port=int(spec.get("port", 8080)))
    if parallelism(spec) == "data" and "RANK" in os.environ:
        # copy i of a data-parallel cell serves on port + i (the operator lists one endpoint per copy); started
        # without the launcher, the engine refuses runtime.ranks on every route of the base port
        settings = dataclasses.replace(settings, port=settings.port + int(os.environ["RANK"]))
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(settings, spec))
    return 0
