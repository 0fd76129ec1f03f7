"""The worker's OpenAI-compatible API under an existing load tool: guidellm (hack/guidellm-setup.sh installs it in a
virtualenv of its own) drives a real worker on SmolLM2-135M-Instruct at several concurrency levels, on loopback
only, bounded in requests and time, and stops by itself.

    .venv/bin/python benchmarks/load_openai.py --streams 1,2,4 --requests 12 --out docs/bench/DATE/load_openai.json

Two workloads: ``single`` (one chat turn per request: a synthetic prompt of --prompt-tokens, --output-tokens out,
``ignore_eos`` fixing the length) and ``multiturn`` (--turns chat turns per conversation, each request re-sending
the history, no affinity header: the cell's cross-session prefix cache is what serves the earlier turns). For each
level the JSON keeps guidellm's medians and p90s (TTFT, ITL, request latency, throughput), its error count, and the
worker's own prefix-cache counters read from /metrics around the run. guidellm's full report for each workload is
written beside it (``<out>.guidellm-<workload>.json``). Nothing here is asserted: figures are measurements of the
machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from load_worker import start_worker  # noqa: E402  (the same worker start as the contract's load test)


def tokenizer_dir(dest: Path) -> Path:
    """The model's tokenizer as an HF tokenizer directory (guidellm sizes its synthetic prompts with it), written from
    the GGUF the worker serves: nothing is fetched from a hub."""
    from modeld_cell.models.fetch import ensure_smollm2
    from modeld_cell.models.gguf_file import GGUFFile
    from modeld_cell.tokenizer import Tokenizer

    with GGUFFile(ensure_smollm2()) as f:
        tok = Tokenizer.from_gguf_fields(f.fields)
    dest.mkdir(parents=True, exist_ok=True)
    tok._tok.save(str(dest / "tokenizer.json"))
    name = tok._tok.id_to_token
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": name(tok.eos_token_ids[0]),
        "bos_token": name(tok.bos_token_id) if tok.bos_token_id is not None else None,
        "chat_template": tok.chat_template}))
    return dest


def prefix_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "tokens_computed_total"):
        m = re.search(rf"^modeld:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def stat(metric: dict[str, Any]) -> dict[str, Any]:
    s = metric.get("successful") or {}
    p = s.get("percentiles") or {}
    return {"median": _r(s.get("median")), "p90": _r(p.get("p90")), "count": s.get("count")}


def _r(x: Any) -> Any:
    return round(x, 2) if isinstance(x, float) else x


def run_guidellm(guidellm: str, url: str, model: str, tok: Path, streams: list[int], requests: int, data: str,
                 report: Path, max_seconds: int) -> list[dict[str, Any]]:
    cmd = [guidellm, "run",
           "--backend", f"kind=openai_http,target={url},model={model},timeout=600",
           "--profile", f"kind=concurrent,streams={streams[0]}",
           "--override", "profile.streams", ",".join(map(str, streams)),
           "--constraint", f"kind=max_requests,count={requests}",
           "--constraint", f"kind=max_duration,seconds={max_seconds}",
           "--data", data,
           "--tokenizer", f"kind=huggingface_auto,model={tok}",
           "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, timeout=max_seconds * len(streams) + 600)
    levels = []
    for bench, level in zip(json.loads(report.read_text())["benchmarks"], streams, strict=True):
        m = bench["metrics"]
        levels.append({
            "streams": level, "requests": m["request_totals"], "duration_s": _r(bench.get("duration")),
            "ttft_ms": stat(m["time_to_first_token_ms"]), "itl_ms": stat(m["inter_token_latency_ms"]),
            "request_latency_s": stat(m["request_latency"]),
            "output_tokens_per_s": _r((m["output_tokens_per_second"].get("successful") or {}).get("mean")),
            "requests_per_s": _r((m["requests_per_second"].get("successful") or {}).get("mean")),
            "prompt_tokens": stat(m["prompt_token_count"]), "output_tokens": stat(m["output_token_count"]),
        })
    return levels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,2,4", help="concurrency levels (guidellm's concurrent profile)")
    ap.add_argument("--requests", type=int, default=12, help="requests per level")
    ap.add_argument("--max-seconds", type=int, default=300, help="cap per level")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation in the multiturn workload")
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--tier", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="the worker's threads")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    guidellm = subprocess.run([str(ROOT / "hack" / "guidellm-setup.sh")], check=True, capture_output=True,
                              text=True).stdout.strip().splitlines()[-1]
    work = Path(tempfile.mkdtemp(prefix="modeld-openai-load-"))
    tok = tokenizer_dir(work / "tokenizer")
    t0 = time.monotonic()
    proc, url = start_worker(args.kv_mib, args.tier, args.threads, work)
    result: dict[str, Any] = {
        "command": " ".join(["benchmarks/load_openai.py", *sys.argv[1:]]),
        "tool": subprocess.run([guidellm, "--version"], capture_output=True, text=True).stdout.strip(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "setup": {"kv_mib": args.kv_mib, "context_tier": args.tier, "worker_threads": args.threads,
                  "worker_ready_s": round(time.monotonic() - t0, 1)},
        "workloads": {},
    }
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        common = f"prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
        for name, data in (("single", f"kind=synthetic_text,{common}"),
                           ("multiturn", f"kind=synthetic_text,{common},turns={args.turns}")):
            before = prefix_counters(url)
            report = args.out.with_suffix(f".guidellm-{name}.json")
            levels = run_guidellm(guidellm, url, model, tok, streams, args.requests, data, report, args.max_seconds)
            after = prefix_counters(url)
            d = {k: after[k] - before[k] for k in after}
            result["workloads"][name] = {
                "data": data, "levels": levels, "guidellm_report": report.name,
                "worker_prefix_cache": {**d, "hit_rate": round(d["prefix_cache_hits_total"] /
                                                               d["prefix_cache_queries_total"], 3)
                                        if d["prefix_cache_queries_total"] else None}}
            print(json.dumps({name: result["workloads"][name]["worker_prefix_cache"]}), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    result["machine"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
