"""``modeld-cell certify``: measure a cell (and its baseline, in the same run) and decide whether to keep it.

    modeld-cell certify --endpoint URL --cell FILE [--baseline-endpoint URL --baseline-cell FILE] \\
        --tiers 1024,4096,8192 --out DIR [--summary FILE]
    modeld-cell certify --spawn --cell FILE [--baseline-cell FILE] --tiers 1024,4096,8192 --out DIR

Specs: ``--cell`` / ``--baseline-cell`` files, else ``MODELD_CELL_SPEC`` / ``MODELD_BASELINE_SPEC`` (JSON), else none
(the matrix then comes from /v1/capability alone). Exit status 0 when a decision was made (certified or not: read the
report or the summary), 1 when the measurement failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from . import harness, report, schema

log = logging.getLogger("modeld_cell.certify")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", metavar="URL", help="the cell's worker, e.g. http://10.0.0.5:8080")
    p.add_argument("--cell", metavar="FILE", help="the cell's manifest or bare spec (else MODELD_CELL_SPEC)")
    p.add_argument("--cell-name", help="name in the report (default: metadata.name, else 'cell')")
    p.add_argument("--baseline-endpoint", metavar="URL", help="the baseline cell's worker")
    p.add_argument("--baseline-cell", metavar="FILE", help="the baseline's manifest or spec (else MODELD_BASELINE_SPEC)")
    p.add_argument("--baseline-name", help="name in the report (default: metadata.name, else 'baseline')")
    p.add_argument("--spawn", action="store_true",
                   help="start the worker(s) from --cell / --baseline-cell as local subprocesses, stop them afterwards")
    p.add_argument("--topology", help="topology string to record (default: from the spec, e.g. 'cpu')")
    p.add_argument("--tiers", default="1024,4096,8192", help="context tiers, comma-separated (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="cold prompts per tier (default %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens after each tier prompt")
    p.add_argument("--agent-turns", type=int, default=6, help="turns per agent run (default %(default)s)")
    p.add_argument("--agent-runs", type=int, default=2, help="agent runs (default %(default)s)")
    p.add_argument("--agent-tool-tokens", type=int, default=192, help="tool-output tokens appended per turn")
    p.add_argument("--agent-decode-tokens", type=int, default=32, help="greedy tokens per agent turn")
    p.add_argument("--agent-sessions", choices=["run", "turn"], default="run",
                   help="run: one session per agent run; turn: a new session per turn, re-sending the transcript as a "
                        "stateless client does (default %(default)s)")
    p.add_argument("--latency-budget-ms", type=float,
                   help="gate (b) budget; default: each budget the baseline needs (its first-output p90 per tier)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per request (default %(default)s)")
    p.add_argument("--out", metavar="DIR", help="write certification.{json,md,png} here")
    p.add_argument("--summary", metavar="FILE", help="write the status summary (JSON, < 2 KiB) here")


def _read_spec(path: str | None, env: str) -> tuple[dict[str, Any] | None, str | None]:
    """(spec, metadata.name) from a file (manifest or bare spec, YAML/JSON) or a JSON environment variable."""
    if path:
        obj = yaml.safe_load(Path(path).read_text())
    elif os.environ.get(env):
        obj = json.loads(os.environ[env])
    else:
        return None, None
    if not isinstance(obj, dict):
        raise ValueError(f"{path or env}: a Cell manifest or spec must be a mapping")
    if "spec" in obj and ("kind" in obj or "apiVersion" in obj):
        return obj["spec"], (obj.get("metadata") or {}).get("name")
    return obj, None


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("modeld_cell.certify").setLevel(logging.INFO)
    try:
        tiers = sorted({int(t) for t in args.tiers.split(",") if t.strip()})
        if not tiers or tiers[0] < 1:
            raise ValueError("positive tiers expected")
        spec, name = _read_spec(args.cell, "MODELD_CELL_SPEC")
        bspec, bname = _read_spec(args.baseline_cell, "MODELD_BASELINE_SPEC")
    except (ValueError, OSError, yaml.YAMLError) as e:
        print(f"modeld-cell certify: {e}", file=sys.stderr)
        return 2
    if args.spawn and not args.cell:
        print("modeld-cell certify: --spawn needs --cell (and --baseline-cell for a baseline)", file=sys.stderr)
        return 2
    if not args.spawn and not args.endpoint:
        print("modeld-cell certify: give --endpoint, or --spawn with --cell", file=sys.stderr)
        return 2
    has_baseline = bool(args.baseline_cell) if args.spawn else bool(args.baseline_endpoint)
    opts = harness.Options(tiers=tiers, repeats=args.repeats, decode_tokens=args.decode_tokens,
                           agent_turns=args.agent_turns, agent_repeats=args.agent_runs,
                           agent_tool_tokens=args.agent_tool_tokens, agent_decode_tokens=args.agent_decode_tokens,
                           agent_sessions=args.agent_sessions,
                           latency_budget_ms=args.latency_budget_ms,
                           timeout_s=args.timeout_s)
    out = Path(args.out) if args.out else None
    workers = []
    try:
        cell_url, base_url = args.endpoint, args.baseline_endpoint
        if args.spawn:
            from .spawn import Worker

            logdir = Path(tempfile.mkdtemp(prefix="modeld-certify-"))  # worker logs stay out of the report dir
            workers.append(Worker("cell", args.cell, logdir / "worker-cell.log", spec))
            if has_baseline:
                workers.append(Worker("baseline", args.baseline_cell, logdir / "worker-baseline.log", bspec))
            for w in workers:
                w.wait_ready()
            cell_url = workers[0].url
            base_url = workers[1].url if has_baseline else None
        cell = harness.Target("cell", args.cell_name or name or "cell", cell_url, spec, args.topology)
        base = (harness.Target("baseline", args.baseline_name or bname or "baseline", base_url, bspec, args.topology)
                if has_baseline else None)
        command = "modeld-cell certify " + shlex.join(argv if argv is not None else sys.argv[2:])
        rep = harness.run(cell, base, opts, command)
    except Exception as e:  # any failure to measure is reported as such: exit 1
        log.exception("certification failed")
        print(f"modeld-cell certify: measurement failed: {e}", file=sys.stderr)
        return 1
    finally:
        for w in workers:
            w.stop()

    problems = schema.errors(rep)
    if problems:  # a harness bug, not a cell's fault: say so loudly, still write what was measured
        log.error("report does not match its schema: %s", "; ".join(problems[:10]))
    if out:
        paths = report.write_all(rep, out)
        log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    if args.summary:
        Path(args.summary).write_text(json.dumps(report.summary_for_status(rep), separators=(",", ":")))
    dec = rep["decision"]
    print(f"{'CERTIFIED' if dec['certified'] else 'NOT CERTIFIED'} ({dec['gate']}): {dec['reason']}")
    return 1 if problems else 0
