"""Drives cell endpoints through the contract with the fixed workload and assembles the modeld.certification/v1 report.

Measurement order interleaves the cell and its baseline (per tier and repeat, per agent run), so load from anything
else on the machine lands on both alike. Every latency is the client's wall clock unless named after a trace field.

  first output  (per tier)  POST /prefix of a cold ``tier - decode_tokens``-token prompt sent -> first streamed token
                            of the following greedy decode arrives (what a caller waits for a cold prompt)
  prefill       (per tier)  the prefix request's ``trace.prefill_ms`` (server side)
  decode        (per tier)  ``trace.decode_ms_per_token`` of that decode, every token of every repeat pooled
  agent turn                POST /prefix of the whole transcript (EnsurePrefix, reuses what the session holds) +
                            greedy decode of ``agent_decode_tokens`` tokens, one sample per turn, all runs pooled
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from modeld_cell import __version__
from modeld_cell.tokenizer import common_prefix

from . import gates, workload
from .client import CellError, Client

log = logging.getLogger("modeld_cell.certify")
SCHEMA_ID = "modeld.certification/v1"


@dataclass
class Options:
    tiers: list[int]
    repeats: int = 3  # cold prompts per tier
    decode_tokens: int = 32  # greedy tokens after each tier prompt (the prompt is tier - this)
    agent_turns: int = 6
    agent_repeats: int = 2
    agent_tool_tokens: int = 192  # tokens of tool output appended per turn
    agent_decode_tokens: int = 32
    agent_sessions: str = "run"  # run: one session per agent run; turn: a new session per turn (a stateless client)
    quality_tokens: int = 16  # greedy tokens per quality prompt
    latency_budget_ms: float | None = None  # gate (b); None: the baseline's own p90 per tier
    timeout_s: float = 1800.0  # per request
    # in every tier prompt's and agent run's first tokens: nothing an earlier run sent is in a cell's prefix cache
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass
class Target:
    role: str  # cell | baseline
    name: str
    url: str
    spec: dict[str, Any] | None = None
    topology: str | None = None  # overrides the string derived from spec + capability
    client: Client = field(init=False)
    capability: dict[str, Any] = field(default_factory=dict)
    corpus: list[int] = field(default_factory=list)
    tiers: dict[int, dict[str, Any]] = field(default_factory=dict)
    agent_runs: list[dict[str, Any]] = field(default_factory=list)
    quality: dict[str, Any] = field(default_factory=dict)


def quantile(s: list[float], p: float) -> float:
    """The ``p`` quantile of sorted samples ``s``, by linear interpolation between order statistics."""
    k = (len(s) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: list[float]) -> dict[str, float] | None:
    """p50/p90/p95 by linear interpolation between order statistics, with n, min and max; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return {"p50": round(quantile(s, 0.5), 3), "p90": round(quantile(s, 0.9), 3), "p95": round(quantile(s, 0.95), 3),
            "n": len(s), "min": round(s[0], 3), "max": round(s[-1], 3)}


def topology_string(spec: dict[str, Any] | None, cap: dict[str, Any]) -> str:
    """Like the operator's: ``cpu``, or ``<gpus>x <product> <interconnect>``."""
    topo = (spec or {}).get("topology") or {}
    gpus = topo.get("gpus")
    if gpus is None:
        return str(cap.get("runtime", {}).get("device", "unknown"))
    if gpus == 0:
        rt = (spec or {}).get("runtime") or {}
        ranks = rt.get("ranks") or 1
        if ranks == 1:
            return "cpu"
        return f"cpu x{ranks} copies" if rt.get("parallelism") == "data" else f"cpu x{ranks} ranks"
    products = topo.get("products") or []
    return f"{gpus}x {products[0] if products else 'gpu'} {topo.get('interconnect', 'unknown')}"


def matrix(t: Target, opts: Options) -> dict[str, Any]:
    cap, spec = t.capability, t.spec or {}
    rt, model, kv = cap.get("runtime", {}), cap.get("model", {}), cap.get("kv", {})
    topo = spec.get("topology") or {}
    return {
        "topology": t.topology or topology_string(t.spec, cap),
        "hardware": {"gpus": topo.get("gpus"), "interconnect": topo.get("interconnect"),
                     "products": topo.get("products", []), "device": rt.get("device"), "threads": rt.get("threads"),
                     "parallelism": (spec.get("runtime") or {}).get("parallelism", "single")},
        "backend": rt.get("backend"),
        "runtime_version": " ".join(f"{k} {rt[k]}" for k in ("version", "torch", "triton") if rt.get(k)),
        "model_family": model.get("family"),
        "model_name": model.get("name"),
        "model_digest": model.get("digest"),
        "quantization": {"stored": rt.get("weights_requested") or (spec.get("profile") or {}).get("weights"),
                         "compute": rt.get("weights_dtype"), "kernel": rt.get("weights_kernel")},
        "kv_precision": kv.get("precision"),
        "attention": (cap.get("attention") or {}).get("mode"),
        "prefix_reuse": cap.get("prefix_reuse"),
        "context_tier": int(cap.get("context_tier", 0)),
        "tiers_tested": list(opts.tiers),
        "unsupported": list(cap.get("unsupported", [])),
        # the verdicts the worker measured on its own hardware at start (quantized KV, block-sparse)
        "profile_quality": [{k: v.get(k) for k in ("profile", "passed", "failures", "result", "hardware", "measured_at")}
                            for v in (cap.get("quality") or {}).get("verdicts", [])],
    }


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise."""

    def __init__(self, total: int):
        self.total, self.done, self.bar = total, 0, None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(what[:48])
            self.bar.update(1)
        else:
            log.info("[%d/%d] %s", self.done, self.total, what)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _sid(role: str, what: str) -> str:
    return f"cert-{role}-{what}-{uuid.uuid4().hex[:8]}"


def warm_up(t: Target) -> None:
    sid = _sid(t.role, "warmup")
    try:
        t.client.prefix(sid, tokens=t.corpus[:64])
        t.client.decode(sid, 4)
    finally:
        t.client.close(sid)


def run_quality(t: Target, opts: Options) -> None:
    sid = _sid(t.role, "paris")
    try:
        t.client.prefix(sid, text=workload.PARIS_PROMPT)
        paris = t.client.decode(sid, workload.PARIS_TOKENS)
    finally:
        t.client.close(sid)
    answers = []
    for i, prompt in enumerate(workload.QUALITY_PROMPTS):
        sid = _sid(t.role, f"q{i}")
        try:
            t.client.prefix(sid, messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
            d = t.client.decode(sid, opts.quality_tokens)
        finally:
            t.client.close(sid)
        answers.append({"prompt": prompt, "text": d["text"], "tokens": d["tokens"]})
    t.quality = {"paris": {"passed": "Paris" in paris["text"], "text": paris["text"]}, "prompts": answers}


def agreement(cell: Target, base: Target) -> tuple[float, float, bool]:
    """(next-token agreement, greedy agreement, compared token ids). Greedy agreement per prompt = length of the
    common prefix / the longer continuation (stop tokens included, so identical early stops count as agreeing); token
    ids when both tokenizers are the same, else characters of the text."""
    same = cell.capability.get("model", {}).get("tokenizer_hash") == base.capability.get("model", {}).get("tokenizer_hash")
    nxt, greedy = [], []
    for a, b in zip(cell.quality["prompts"], base.quality["prompts"], strict=True):
        x, y = (a["tokens"], b["tokens"]) if same else (list(a["text"]), list(b["text"]))
        nxt.append(1.0 if (x[:1] == y[:1]) else 0.0)
        greedy.append(common_prefix(x, y) / max(len(x), len(y)) if (x or y) else 1.0)
    return round(sum(nxt) / len(nxt), 4), round(sum(greedy) / len(greedy), 4), same


def run_tier(t: Target, tier: int, repeat: int, opts: Options) -> dict[str, Any]:
    sid = _sid(t.role, f"{tier}-{repeat}")
    try:
        p = workload.tier_prompt(t.client.tokenize, t.corpus, tier, repeat, opts.decode_tokens, opts.nonce)
    except ValueError as e:
        return {"status": "error", "error": str(e)}
    counted = "collective_ms_total" in (t.capability.get("parallel") or {})   # ranks sharing each decode step
    try:
        before = t.client.capability()["parallel"] if counted else None    # outside the timed span
        t0 = time.perf_counter()
        pre = t.client.prefix(sid, tokens=p.tokens)
        s = t.client.decode_stream(sid, opts.decode_tokens)
        after = t.client.capability()["parallel"] if counted else None
    except CellError as e:
        return {"status": "refused" if e.refused else "error", "error": f"{e.kind}: {e.message}"}
    finally:
        t.client.close(sid)
    out = {"status": "ok", "prompt_tokens": len(p.tokens), "first_output_ms": (s.first_token_at - t0) * 1e3,
           "prefill_ms": pre["prefill_ms"], "tokens_reused": pre["tokens_reused"],
           "decode_ms_per_token": s.trace.get("decode_ms_per_token", []),
           "passkey_found": p.key in s.text, "key": p.key, "answer": s.text[:80]}
    if before is not None and after is not None:
        out["collective_ms_per_decode_step"] = collective_per_step(before, after)
    return out


def collective_per_step(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Mean ms rank 0 spent in collectives per decode step between two reads of the capability's "parallel" counters
    (the certification is the cell's only client while it measures); None when no decode step ran between them."""
    steps = after["forwards"]["decode"] - before["forwards"]["decode"]
    if steps <= 0:
        return None
    return (after["collective_ms_total"]["decode"] - before["collective_ms_total"]["decode"]) / steps


def tier_section(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r["status"] == "ok"]
    bad = [r for r in runs if r["status"] != "ok"]
    status = "ok" if ok and not bad else (bad[0]["status"] if bad else "error")
    out: dict[str, Any] = {
        "status": status, "runs": len(runs), "prompt_tokens": ok[0]["prompt_tokens"] if ok else None,
        "first_output_ms": stats([r["first_output_ms"] for r in ok]),
        "prefill_ms": stats([r["prefill_ms"] for r in ok]),
        "tokens_reused": sum(r["tokens_reused"] for r in ok),  # prompt tokens found in KV already held: 0 when cold
        "decode_ms_per_token": stats([x for r in ok for x in r["decode_ms_per_token"]]),
        # multi-rank cells: rank 0's time in collectives per decode step, one sample per run (gates.gate_communication)
        **({"collective_ms_per_decode_step": stats([r["collective_ms_per_decode_step"] for r in ok
                                                    if r.get("collective_ms_per_decode_step") is not None])}
           if any("collective_ms_per_decode_step" in r for r in ok) else {}),
        "passkey": {"found": sum(r["passkey_found"] for r in ok), "runs": len(ok),
                    "answers": [r["answer"] for r in ok][:3]},
    }
    if bad:
        out["error"] = bad[0]["error"]
    return out


def run_agent(t: Target, repeat: int, opts: Options) -> dict[str, Any]:
    """One agent conversation: each turn appends a tool output (a token slice of the corpus) to the transcript,
    re-sends the whole transcript with EnsurePrefix (prefix) and decodes greedily. ``agent_sessions`` "run": one
    session holds the conversation (EnsurePrefix reuses what it holds); "turn": each turn is a new session, closed
    after it, as a stateless client (an OpenAI-style API) sends it: only cross-session prefix reuse keeps the
    earlier turns' KV."""
    per_turn = opts.agent_sessions == "turn"
    run_sid = _sid(t.role, f"agent-{repeat}")
    messages = [{"role": "system", "content": workload.AGENT_SYSTEM.format(run=repeat + 1, nonce=opts.nonce)}]
    n, turns = len(t.corpus), []
    try:
        for i in range(opts.agent_turns):
            start = n // 2 + (repeat * opts.agent_turns + i) * opts.agent_tool_tokens
            text = t.client.detokenize([t.corpus[(start + j) % n] for j in range(opts.agent_tool_tokens)])
            name = workload.CORPUS_FILES[(repeat * opts.agent_turns + i) % len(workload.CORPUS_FILES)]
            messages.append({"role": "tool", "content": workload.AGENT_TOOL.format(name=name, part=i + 1, text=text)})
            sid = _sid(t.role, f"agent-{repeat}-turn-{i}") if per_turn else run_sid
            try:
                t0 = time.perf_counter()
                pre = t.client.prefix(sid, messages=messages, add_generation_prompt=True)
                d = t.client.decode(sid, opts.agent_decode_tokens)
            finally:
                if per_turn:
                    t.client.close(sid)
            turns.append({"turn_ms": (time.perf_counter() - t0) * 1e3, "prompt_tokens": pre["prompt_tokens"],
                          "tokens_reused": pre["tokens_reused"], "tokens_computed": pre["tokens_computed"],
                          "completion_tokens": d["trace"]["completion_tokens"],
                          "first_output_ms": d["trace"]["first_output_ms"]})
            messages.append({"role": "assistant", "content": d["text"]})
    except CellError as e:
        return {"status": "refused" if e.refused else "error", "error": f"turn {len(turns) + 1}: {e.kind}: "
                f"{e.message}", "turns": turns}
    finally:
        if not per_turn:
            t.client.close(run_sid)
    return {"status": "ok", "turns": turns}


def agent_section(runs: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [r for r in runs if r["status"] != "ok"]
    turns = [x for r in runs for x in r["turns"]]
    out: dict[str, Any] = {
        "status": bad[0]["status"] if bad else "ok", "runs": len(runs),
        "turn_ms": stats([x["turn_ms"] for x in turns]) if not bad else None,
        "last_transcript_tokens": max((x["prompt_tokens"] for x in turns), default=0),
        "tokens_reused": sum(x["tokens_reused"] for x in turns),
        "tokens_computed": sum(x["tokens_computed"] for x in turns),
        "turns": [{k: round(v, 3) if isinstance(v, float) else v for k, v in x.items()} for x in turns],
    }
    if bad:
        out["error"] = bad[0]["error"]
    return out


def run(cell: Target, baseline: Target | None, opts: Options, command: str = "") -> dict[str, Any]:
    """Measures the cell (and its baseline) and returns the report (schema modeld.certification/v1)."""
    targets = [x for x in (cell, baseline) if x is not None]
    started, load0 = datetime.now(timezone.utc), _loadavg()
    corpus, files = workload.corpus_text()
    for t in targets:
        t.client = Client(t.url, opts.timeout_s)
        t.capability = t.client.capability()
        t.corpus = t.client.tokenize(corpus)
        log.info("%s %s: %s, context tier %s, corpus %d tokens", t.role, t.name, t.capability["model"].get("name"),
                 t.capability.get("context_tier"), len(t.corpus))
    k = len(targets)
    prog = Progress(k * (2 + len(opts.tiers) * opts.repeats + opts.agent_repeats))
    tier_runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    agent_runs: dict[str, list[dict[str, Any]]] = {t.role: [] for t in targets}
    try:
        for t in targets:
            warm_up(t)
            prog.step(f"{t.role}: warm-up")
        for t in targets:
            run_quality(t, opts)
            prog.step(f"{t.role}: quality smoke")
        for tier in opts.tiers:
            for r in range(opts.repeats):
                for t in targets:
                    runs = tier_runs.setdefault((t.role, tier), [])
                    if runs and runs[-1]["status"] != "ok":  # refused or failed once: not again
                        prog.step(f"{t.role}: tier {tier} skipped")
                        continue
                    runs.append(run_tier(t, tier, r, opts))
                    prog.step(f"{t.role}: tier {tier} #{r + 1} {runs[-1]['status']}")
        for r in range(opts.agent_repeats):
            for t in targets:
                if agent_runs[t.role] and agent_runs[t.role][-1]["status"] != "ok":
                    prog.step(f"{t.role}: agent skipped")
                    continue
                agent_runs[t.role].append(run_agent(t, r, opts))
                prog.step(f"{t.role}: agent run #{r + 1} {agent_runs[t.role][-1]['status']}")
    finally:
        prog.close()

    if baseline is not None:
        nxt, greedy, same = agreement(cell, baseline)
        cell.quality.update(next_token_agreement=nxt, greedy_agreement=greedy, compared="tokens" if same else "text")
    sections = {}
    for t in targets:
        q = gates.Quality(t.quality["paris"]["passed"], t.quality.get("next_token_agreement"),
                          t.quality.get("greedy_agreement"))
        t.quality.update(passed=q.passed, failures=q.failures())
        sections[t.role] = {
            "name": t.name, "role": t.role, "endpoint": t.url, "matrix": matrix(t, opts),
            "tiers": {str(tier): tier_section(tier_runs[(t.role, tier)]) for tier in opts.tiers},
            "agent": agent_section(agent_runs[t.role]), "quality": t.quality,
        }
    cm = gates.measurements_from_report(sections["cell"])
    bm = gates.measurements_from_report(sections["baseline"]) if baseline is not None else None
    decision = gates.decide(cm, bm, opts.latency_budget_ms)
    finished = datetime.now(timezone.utc)
    return {
        "schema": SCHEMA_ID,
        "workload": {
            "version": workload.WORKLOAD_VERSION, "nonce": opts.nonce, "tiers": list(opts.tiers), "repeats": opts.repeats,
            "decode_tokens": opts.decode_tokens,
            "agent": {"turns": opts.agent_turns, "runs": opts.agent_repeats, "tool_tokens": opts.agent_tool_tokens,
                      "decode_tokens": opts.agent_decode_tokens, "sessions": opts.agent_sessions},
            "quality": {"prompts": len(workload.QUALITY_PROMPTS), "tokens": opts.quality_tokens},
            "corpus": {"python": platform.python_version(), "files": files},
        },
        "measuredAt": _rfc3339(finished),
        "startedAt": _rfc3339(started),
        "durationS": round((finished - started).total_seconds(), 1),
        "harness": {"modeld_version": __version__, "python": platform.python_version(), "host": platform.node(),
                    "cpu": _cpu_model(), "cores": os.cpu_count(), "loadavg_start": load0, "loadavg_end": _loadavg(),
                    "command": command},
        "cell": sections["cell"],
        "baseline": sections.get("baseline"),
        "comparison": comparison(sections["cell"], sections.get("baseline")),
        "decision": {
            "certified": decision.certified, "gate": decision.gate, "reason": decision.reason,
            "thresholds": {"usable_context_ratio": gates.USABLE_CONTEXT_RATIO, "long_tier": gates.LONG_TIER,
                           "prefill_speedup": gates.PREFILL_SPEEDUP, "agent_speedup": gates.AGENT_SPEEDUP,
                           "next_token_agreement_min": gates.NEXT_TOKEN_AGREEMENT_MIN,
                           "greedy_agreement_min": gates.GREEDY_AGREEMENT_MIN, "passkey_min": gates.PASSKEY_MIN,
                           "max_collective_share": gates.MAX_COLLECTIVE_SHARE,
                           "latency_budget_ms": opts.latency_budget_ms},
            "gates": [{"gate": g.gate, "passed": g.passed, "reason": g.reason, "evidence": g.evidence}
                      for g in decision.gates],
        },
    }


def comparison(cell: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any] | None:
    """Baseline / cell ratios (above 1: the cell is faster), per tier both ran and for the agent turn."""
    if base is None:
        return None

    def ratio(b: dict | None, c: dict | None, key: str) -> float | None:
        return round(b[key] / c[key], 3) if b and c and c.get(key) else None

    tiers = {}
    for key, c in cell["tiers"].items():
        b = base["tiers"].get(key, {})
        tiers[key] = {"cell_status": c["status"], "baseline_status": b.get("status", "not_tested"),
                      "first_output_p50_speedup": ratio(b.get("first_output_ms"), c["first_output_ms"], "p50"),
                      "first_output_p90_speedup": ratio(b.get("first_output_ms"), c["first_output_ms"], "p90"),
                      "decode_p50_speedup": ratio(b.get("decode_ms_per_token"), c["decode_ms_per_token"], "p50")}
    return {"baseline": base["name"], "tiers": tiers,
            "agent_turn_p50_speedup": ratio(base["agent"].get("turn_ms"), cell["agent"].get("turn_ms"), "p50"),
            "next_token_agreement": cell["quality"].get("next_token_agreement"),
            "greedy_agreement": cell["quality"].get("greedy_agreement")}


def _rfc3339(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
