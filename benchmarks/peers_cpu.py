"""modeld's CPU cell side by side with its CPU peers, llama.cpp and HF transformers, in one run on the same prompts.

Providers (each runs as a subprocess of this script, in its own venv, and hands back JSON; the project venv never
gets a peer package):
  * modeld        the in-process Engine (modeld_cell.engine, the path the server calls), as benchmarks/cell_cpu.py
                  drives it; the project venv's python. Weights: the same Q4_1 GGUF, computed by the path the
                  worker's measurement at start chooses (modeld_cell/autotune.py: the int4 kernel or a dense copy).
  * llama.cpp     llama-cpp-python on the same Q4_1 GGUF (its native 4-bit format); the peers venv made by
                  hack/peers-setup.sh (built without AMX, see there).
  * hf            HF transformers loading the same GGUF (gguf_file=..., dequantized to fp32), sdpa attention; the
                  peers venv. Offline only (HF_HUB_OFFLINE=1): config and weights come from the GGUF.

Prompts: real English/Python text (the Python standard-library sources benchmarks/cell_cpu.py uses), tokenized once
by the model's tokenizer (the GGUF's, through modeld_cell.tokenizer) and cut to 1k / 4k / 8k tokens; every provider
gets the same token ids ("8k" is 8160 tokens so that generated tokens still fit the 8192-token context).

Measured per provider: prefill tok/s of a cold prompt and first-output latency (prompt in -> first greedy token
out) at each context; decode ms per token (p50 / p90 / p95 of tokens 2..N in each round, then the median over rounds)
for --decode-tokens greedy tokens after 1k and 4k; peak RSS (VmHWM of the provider's process, so it includes loading and the 8k
context). Every provider uses --threads threads.

Rounds: --repeats rounds; each round starts every provider afresh (load, one warm-up prompt, then each context once,
cold), rotating their order, so the shared machine's background load falls on all of them alike. Figures are medians
over rounds. The machine is shared: before each provider run the parent waits (--wait-quiet, bounded) until other
processes keep under 0.3 cores busy, and records, for every run, the load average and how many cores the other
processes kept busy meanwhile (from /proc/stat less the worker's own CPU time). OpenMP thread pools spin at their
barriers, so a third runnable thread on 2 cores can slow a provider many-fold: read those columns before the figures.

    hack/peers-setup.sh                                    # once: ~/.cache/modeld/peers-venv
    .venv/bin/python benchmarks/peers_cpu.py --out _out/peers_cpu.json

JSON (--out) holds every round's raw figures; a Markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROVIDERS = ("modeld", "llama.cpp", "hf")
DEFAULT_PEERS_PYTHON = Path.home() / ".cache" / "modeld" / "peers-venv" / "bin" / "python"


# ---------------------------------------------------------------------------------------------------------------
# helpers shared by the parent and the workers (stdlib only: a worker's venv may hold nothing of modeld's)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def proc_status_mib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith(key + ":"))
    except (OSError, StopIteration):
        return None


class Clock:
    """Wall and process CPU time of the measured regions: cpu/wall says how many cores the process really got."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def __enter__(self) -> Clock:
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def run_contexts(job: dict, one) -> dict:  # noqa: ANN001  (one: (ids, n_new_tokens) -> measurement dict)
    """Warm up once, then each context once (cold). Shared by every worker so all measure the same thing."""
    ids: list[int] = job["ids"]
    one(ids[: job["warmup_tokens"]], 4)
    out: dict = {"contexts": {}}
    clock = Clock()
    for n in job["contexts"]:
        gen = job["decode_tokens"] if n in job["decode_contexts"] else 1
        with clock:
            out["contexts"][str(n)] = one(ids[:n], gen)
        out["contexts"][str(n)]["loadavg_after"] = os.getloadavg()[0]
    out["cpu_per_wall"] = clock.cpu / clock.wall if clock.wall else None
    out["peak_rss_mib"] = proc_status_mib("VmHWM")
    return out


def run_replay(job: dict, turn) -> dict | None:  # noqa: ANN001  (turn: (conversation ids, gen) -> (tokens, first_s))
    """The agent replay: ``replay_turns`` turns, each appending the next ``replay_append`` tokens of the corpus (a
    tool's output) to the conversation so far (earlier appends and replies) and generating ``replay_gen`` greedy
    tokens. ``turn`` reuses the provider's own cache, as a user of it would: it gets the whole conversation and
    computes only what its cache lacks. Per turn: its wall time (new tokens in -> last reply token out) and first
    output. None when the job has no replay."""
    if not job.get("replay_turns"):
        return None
    ids, size, gen = job["replay_ids"], job["replay_append"], job["replay_gen"]
    conv: list[int] = []
    turns = []
    for i in range(job["replay_turns"]):
        conv = conv + ids[i * size:(i + 1) * size]
        t0 = time.perf_counter()
        toks, first_s = turn(conv, gen)
        turns.append({"turn_s": time.perf_counter() - t0, "first_output_s": first_s, "context": len(conv),
                      "tokens": toks})
        conv = conv + toks
    return {"turns": turns, "total_s": sum(t["turn_s"] for t in turns)}


# ---------------------------------------------------------------------------------------------------------------
# workers


def modeld_engine(job: dict):  # noqa: ANN201  (modeld_cell.engine.Engine: not imported where a peer's venv runs)
    """modeld's engine as this comparison loads it (benchmarks/replay_profile.py loads the same): the job's
    ``modeld_weights``, ``modeld_kv`` and ``modeld_kv_mib`` over an 8192-token tier with prefix reuse, and the
    worker's settings: the MODELD_* environment (MODELD_WEIGHTS_PATH, MODELD_DECODE_THREADS, ...) as the worker
    reads it, with MODELD_THREADS the job's ``threads``."""
    from modeld_cell.engine import Engine, EngineSettings
    from modeld_cell.models.fetch import SMOLLM2_REF

    spec = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
            "profile": {"weights": job["modeld_weights"], "kv": job["modeld_kv"], "prefixReuse": True},
            "contextTier": 8192, "kvMemoryMiB": job["modeld_kv_mib"]}
    settings = dataclasses.replace(EngineSettings.from_env(), threads=job["threads"])
    return Engine.from_cell(spec, model_path=job["model"], settings=settings)


def worker_modeld(job: dict) -> dict:
    import asyncio

    import torch

    from modeld_cell.engine import SamplingParams

    t = time.perf_counter()
    eng = modeld_engine(job)
    load_s = time.perf_counter() - t
    rss_loaded = proc_status_mib("VmRSS")
    loop = asyncio.new_event_loop()
    counter = iter(range(1 << 30))

    async def one_async(ids: list[int], gen: int) -> dict:
        sid = f"bench-{next(counter)}"
        eng.clear_prefix_cache()            # cold: nothing of an earlier round's identical prompt is reused
        t0 = time.perf_counter()
        tr = await eng.ensure_prefix(sid, ids)
        prefill_s = time.perf_counter() - t0
        assert tr.tokens_computed == len(ids), (tr.tokens_computed, len(ids))
        toks: list[int] = []
        first_ms, per_tok = None, []
        async for ev in eng.decode(sid, SamplingParams(), gen, stop_token_ids=[]):
            if ev.done:
                first_ms, per_tok = ev.trace.first_output_ms, ev.trace.decode_ms_per_token
            else:
                toks.append(ev.token_id)
        eng.close_session(sid)
        return {"prefill_s": prefill_s, "first_output_s": prefill_s + (first_ms or 0.0) / 1e3,
                "decode_ms": list(per_tok), "tokens": toks}

    async def turn_async(conv: list[int], gen: int) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        await eng.ensure_prefix("replay", conv)          # the session's own KV holds every earlier turn
        toks: list[int] = []
        first_s = 0.0
        async for ev in eng.decode("replay", SamplingParams(), gen, stop_token_ids=[]):
            if not ev.done:
                if not toks:
                    first_s = time.perf_counter() - t0
                toks.append(ev.token_id)
        return toks, first_s

    res = run_contexts(job, lambda ids, gen: loop.run_until_complete(one_async(ids, gen)))
    eng.clear_prefix_cache()
    res["replay"] = run_replay(job, lambda conv, gen: loop.run_until_complete(turn_async(conv, gen)))
    cap = eng.capability()
    res.update(load_s=load_s, rss_after_load_mib=rss_loaded, threads=torch.get_num_threads(),
               versions={"torch": torch.__version__, "modeld": cap.get("runtime", {}).get("version")
                         if isinstance(cap.get("runtime"), dict) else None},
               config={"weights": eng.config.weights, "weights_requested": eng.config.weights_storage,
                       "weights_kernel": eng.config.weights_kernel, "weights_choice": eng.config.weights_choice,
                       "kv": eng.config.kv, "kvMemoryMiB": job["modeld_kv_mib"],
                       "prefill_chunk": eng.settings.prefill_chunk,
                       "capability": {k: cap.get(k) for k in ("kv", "runtime", "attention")}})
    eng.shutdown()
    return res


def worker_llama(job: dict) -> dict:
    import llama_cpp
    import numpy as np

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=8192, n_batch=job["llama_n_batch"],
                          n_threads=job["threads"], n_threads_batch=job["threads"], logits_all=False,
                          verbose=False, **({"flash_attn": True} if job["llama_flash_attn"] else {}))
    load_s = time.perf_counter() - t
    rss_loaded = proc_status_mib("VmRSS")
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        # logits of the last evaluated token, straight from the context (what Llama.eval copies into .scores)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    def one(ids: list[int], gen: int) -> dict:
        llm.reset()                      # n_tokens = 0; eval() drops every KV cell past n_tokens: a cold prompt
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill_s = time.perf_counter() - t0
        tok = int(np.argmax(last_logits()))
        first_s = time.perf_counter() - t0
        toks, per_tok = [tok], []
        for _ in range(gen - 1):
            t1 = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
            per_tok.append((time.perf_counter() - t1) * 1e3)
            toks.append(tok)
        return {"prefill_s": prefill_s, "first_output_s": first_s, "decode_ms": per_tok, "tokens": toks}

    # the same ids come out of llama.cpp's own tokenizer? (a check on "same prompt", not part of the timing)
    text = job["check_text"]
    tok_same = llm.tokenize(text.encode(), add_bos=False, special=True) == job["check_ids"]
    def turn(conv: list[int], gen: int) -> tuple[list[int], float]:
        # keep the KV cells of the longest common prefix (eval() drops every cell past n_tokens), compute the rest
        held = list(llm.input_ids[: llm.n_tokens])
        keep = next((i for i, (x, y) in enumerate(zip(held, conv, strict=False)) if x != y), min(len(held), len(conv)))
        keep = min(keep, len(conv) - 1)             # at least one new token, for its logits
        llm.n_tokens = keep
        t0 = time.perf_counter()
        llm.eval(conv[keep:])
        tok = int(np.argmax(last_logits()))
        first_s = time.perf_counter() - t0
        toks = [tok]
        for _ in range(gen - 1):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
            toks.append(tok)
        return toks, first_s

    res = run_contexts(job, one)
    llm.reset()
    res["replay"] = run_replay(job, turn)
    res.update(load_s=load_s, rss_after_load_mib=rss_loaded, tokenizer_matches=tok_same,
               threads=job["threads"], versions={"llama-cpp-python": llama_cpp.__version__},
               config={"n_ctx": 8192, "n_batch": job["llama_n_batch"], "flash_attn": job["llama_flash_attn"],
                       "weights": "Q4_1 (the GGUF as is)", "kv": "f16 (default)",
                       "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()})
    return res


def worker_hf(job: dict) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    d, name = os.path.split(job["model"])
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    load_s = time.perf_counter() - t
    rss_loaded = proc_status_mib("VmRSS")
    tok_same: bool | str
    try:  # the tokenizer transformers builds from the same GGUF: does it give the same ids?
        from transformers import AutoTokenizer
        hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        tok_same = hf_tok(job["check_text"], add_special_tokens=False)["input_ids"] == job["check_ids"]
    except Exception as e:  # noqa: BLE001  (recorded, not fatal: the benchmark feeds token ids)
        tok_same = f"{type(e).__name__}: {e}"[:300]

    # transformers 5.x names the KV cache argument/output `cache` (past_key_values is deprecated); 4.x: the old name
    import inspect as _inspect
    cache_name = "cache" if "cache" in _inspect.signature(model.forward).parameters else "past_key_values"

    @torch.inference_mode()
    def one(ids: list[int], gen: int) -> dict:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        tok = int(out.logits[0, -1].argmax())
        first_s = time.perf_counter() - t0
        pkv, toks, per_tok = getattr(out, cache_name), [tok], []
        for _ in range(gen - 1):
            t1 = time.perf_counter()
            out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{cache_name: pkv})
            pkv = getattr(out, cache_name)
            tok = int(out.logits[0, -1].argmax())
            per_tok.append((time.perf_counter() - t1) * 1e3)
            toks.append(tok)
        return {"prefill_s": prefill_s, "first_output_s": first_s, "decode_ms": per_tok, "tokens": toks}

    state: dict = {"cache": None, "held": []}        # the conversation's cache and the tokens it holds

    @torch.inference_mode()
    def turn(conv: list[int], gen: int) -> tuple[list[int], float]:
        held = state["held"]
        assert conv[: len(held)] == held, "the replay's conversation only grows"
        t0 = time.perf_counter()
        kw = {cache_name: state["cache"]} if state["cache"] is not None else {}
        out = model(input_ids=torch.tensor([conv[len(held):]]), use_cache=True, logits_to_keep=1, **kw)
        tok = int(out.logits[0, -1].argmax())
        first_s = time.perf_counter() - t0
        pkv, toks = getattr(out, cache_name), [tok]
        for _ in range(gen - 1):
            out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{cache_name: pkv})
            pkv = getattr(out, cache_name)
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
        state["cache"], state["held"] = pkv, conv + toks[:-1]    # the last reply token is not in the cache yet
        return toks, first_s

    res = run_contexts(job, one)
    res["replay"] = run_replay(job, turn)
    res.update(load_s=load_s, rss_after_load_mib=rss_loaded, tokenizer_matches=tok_same,
               threads=torch.get_num_threads(),
               versions={"transformers": transformers.__version__, "torch": torch.__version__},
               config={"dtype": "float32 (GGUF Q4_1 dequantized by transformers)",
                       "attn_implementation": model.config._attn_implementation,
                       "prefill": "one forward over the whole prompt, logits_to_keep=1",
                       "kv": "fp32, the default cache (DynamicCache)", "cache_argument": cache_name})
    return res


WORKERS = {"modeld": worker_modeld, "llama.cpp": worker_llama, "hf": worker_hf}


# ---------------------------------------------------------------------------------------------------------------
# the parent


def corpus_text() -> str:
    """The same fixed standard-library sources as benchmarks/cell_cpu.py."""
    import asyncio.base_events
    import email.message
    import json.decoder
    import logging
    import typing
    return "\n".join(open(inspect.getsourcefile(m)).read()  # type: ignore[arg-type]
                     for m in (asyncio.base_events, logging, typing, email.message, json.decoder))


def model_path(arg: str | None) -> str:
    if arg:
        return arg
    from modeld_cell.models.fetch import ensure_smollm2
    return str(ensure_smollm2())


def _kv_default() -> str:
    from modeld_cell.autotune import bf16_computes
    return "bf16" if bf16_computes() else "fp32"


def tokenize(model: str) -> tuple[list[int], object]:
    from modeld_cell.models.gguf_file import GGUFFile
    from modeld_cell.tokenizer import Tokenizer
    with GGUFFile(model) as f:
        tok = Tokenizer.from_gguf_fields(f.fields)
    return tok.encode(corpus_text()), tok


def git_state() -> dict:
    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip()
    return {"head": git("rev-parse", "HEAD"),
            "dirty_files_under_cellimage": len(git("status", "--short", "cellimage").splitlines())}


def cpu_busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")   # minus idle and iowait


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(max_wait: float, busy_cores: float = 0.3, window: float = 3.0) -> dict:
    """Wait (at most max_wait s) until the other engineers' processes use under busy_cores cores over a window: the
    providers' spin-waiting thread pools (OpenMP) slow down many-fold when a third runnable thread shares 2 cores."""
    t0 = time.perf_counter()
    while True:
        b0 = cpu_busy_s()
        time.sleep(window)
        busy = (cpu_busy_s() - b0) / window
        waited = time.perf_counter() - t0
        if busy < busy_cores or waited >= max_wait:
            return {"busy_cores_before": round(busy, 2), "waited_s": round(waited, 1), "quiet": busy < busy_cores}


def run_worker(provider: str, python: str, job: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), MKL_NUM_THREADS=str(job["threads"]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if provider == "modeld":
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "cellimage"), str(REPO / "api"),
                                             env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as td:
        jf, rf = Path(td, "job.json"), Path(td, "result.json")
        jf.write_text(json.dumps(job))
        la0, t0, b0, c0 = os.getloadavg(), time.perf_counter(), cpu_busy_s(), children_cpu_s()
        try:
            p = subprocess.run([python, str(Path(__file__).resolve()), "--worker", provider, "--job", str(jf),
                                "--result", str(rf)], env=env, capture_output=True, text=True, timeout=timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e)[-3000:]
        wall, la1 = time.perf_counter() - t0, os.getloadavg()
        own = children_cpu_s() - c0
        others = max(0.0, (cpu_busy_s() - b0 - own) / wall)   # cores the rest of the machine kept busy meanwhile
        if rc == 0 and rf.exists():
            res = json.loads(rf.read_text())
        else:
            why = rc if not isinstance(rc, int) or rc >= 0 else f"killed by {signal.Signals(-rc).name}"
            res = {"error": f"{provider} worker failed ({why})", "output_tail": tail}
    res.update(wall_s=wall, loadavg_before=la0, loadavg_after=la1, own_cpu_s=own, others_busy_cores=others)
    return res


def summarize(rounds: list[dict], job: dict) -> dict:
    s: dict = {}
    for prov in job["providers"]:
        ok = [r[prov] for r in rounds if prov in r and "error" not in r[prov]]
        if not ok:
            errs = [r[prov] for r in rounds if prov in r]
            s[prov] = {"error": errs[0]["error"] if errs else "not run",
                       "output_tail": errs[0].get("output_tail", "") if errs else ""}
            continue
        p: dict = {"rounds": len(ok), "contexts": {}}
        for n in job["contexts"]:
            cs = [r["contexts"][str(n)] for r in ok]
            c = {"prefill_tok_s": statistics.median(n / x["prefill_s"] for x in cs),
                 "first_output_s": statistics.median(x["first_output_s"] for x in cs)}
            if n in job["decode_contexts"] and all(x["decode_ms"] for x in cs):
                for q in (50, 90, 95):   # each round's percentile, then the median over rounds
                    c[f"decode_p{q}_ms"] = statistics.median(pct(x["decode_ms"], q) for x in cs)
                c.update(decode_samples=sum(len(x["decode_ms"]) for x in cs), tokens=cs[0]["tokens"])
            p["contexts"][n] = c
        loads = [x for r in ok for x in (r["loadavg_before"][0], r["loadavg_after"][0])] + \
                [c["loadavg_after"] for r in ok for c in r["contexts"].values()]
        p.update(peak_rss_mib=max(r["peak_rss_mib"] for r in ok),
                 rss_after_load_mib=statistics.median(r["rss_after_load_mib"] for r in ok),
                 load_s=statistics.median(r["load_s"] for r in ok),
                 cpu_per_wall=statistics.median(r["cpu_per_wall"] for r in ok),
                 others_busy_cores=statistics.median(r["others_busy_cores"] for r in ok),
                 others_busy_cores_max=max(r["others_busy_cores"] for r in ok),
                 loadavg_1m_range=[min(loads), max(loads)], versions=ok[0]["versions"], config=ok[0]["config"],
                 threads=ok[0]["threads"], tokenizer_matches=ok[0].get("tokenizer_matches"))
        reps = [r["replay"] for r in ok if r.get("replay")]
        if reps:
            p["replay"] = {"total_s": statistics.median(x["total_s"] for x in reps),
                           "turn_p50_s": statistics.median(statistics.median(t["turn_s"] for t in x["turns"])
                                                           for x in reps),
                           "first_output_p50_s": statistics.median(
                               statistics.median(t["first_output_s"] for t in x["turns"]) for x in reps),
                           "last_turn_s": statistics.median(x["turns"][-1]["turn_s"] for x in reps),
                           "turns": len(reps[0]["turns"]), "context_end": reps[0]["turns"][-1]["context"],
                           "tokens": [t["tokens"] for t in reps[0]["turns"]]}
        s[prov] = p
    ref = s.get("modeld", {})
    for p in s.values():  # greedy tokens agreeing with modeld's, from the first token on
        if "error" in p or "contexts" not in ref:
            continue
        for n, c in p["contexts"].items():
            if "tokens" in c and "tokens" in ref["contexts"].get(n, {}):
                a, b = c["tokens"], ref["contexts"][n]["tokens"]
                c["same_tokens_as_modeld"] = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                                                  min(len(a), len(b)))
    return s


NAMES = {"modeld": "modeld", "llama.cpp": "llama.cpp", "hf": "HF transformers"}


def table(s: dict, job: dict) -> str:
    provs = [p for p in job["providers"] if p in s]
    head = "| figure | " + " | ".join(NAMES[p] for p in provs) + " |"
    lines = [head, "|---|" + "---:|" * len(provs)]

    def row(label: str, f) -> None:  # noqa: ANN001
        cells = []
        for p in provs:
            try:
                cells.append(f(s[p]) if "error" not in s[p] else "failed")
            except (KeyError, TypeError):
                cells.append("n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def ctx_label(n: int) -> str:
        return f"{n // 1024}k" if n % 1024 == 0 else f"8k ({n})" if n > 4096 else str(n)

    for n in job["contexts"]:
        row(f"prefill tok/s, {ctx_label(n)}", lambda p, n=n: f"{p['contexts'][n]['prefill_tok_s']:.0f}")
    for n in job["contexts"]:
        row(f"first output s, {ctx_label(n)} prompt", lambda p, n=n: f"{p['contexts'][n]['first_output_s']:.2f}")
    for n in job["decode_contexts"]:
        row(f"decode ms/token p50 / p90 / p95 after {ctx_label(n)}",
            lambda p, n=n: "{decode_p50_ms:.1f} / {decode_p90_ms:.1f} / {decode_p95_ms:.1f}".format(
                **p["contexts"][n]))
    for n in job["decode_contexts"]:
        if "contexts" in s.get("modeld", {}):
            row(f"greedy tokens equal to modeld's after {ctx_label(n)}",
                lambda p, n=n: "(reference)" if p is s.get("modeld") else
                f"{p['contexts'][n]['same_tokens_as_modeld']} of {job['decode_tokens']}")
    if any("replay" in s[p] for p in provs if "error" not in s[p]):
        row(f"agent replay total s ({job.get('replay_turns')} turns x {job.get('replay_append')} appended + "
            f"{job.get('replay_gen')} generated)", lambda p: f"{p['replay']['total_s']:.1f}")
        row("agent replay turn p50 s / last turn s", lambda p: "{turn_p50_s:.2f} / {last_turn_s:.2f}".format(
            **p["replay"]))
        row("agent replay first output p50 s", lambda p: f"{p['replay']['first_output_p50_s']:.2f}")
        if "replay" in s.get("modeld", {}):
            ref_turns = s["modeld"]["replay"]["tokens"]
            row("replay turns whose reply equals modeld's", lambda p: "(reference)" if p is s.get("modeld") else
                f"{sum(a == b for a, b in zip(p['replay']['tokens'], ref_turns, strict=False))} of "
                f"{len(ref_turns)}")
    row("peak RSS MiB (whole run, incl. 8k)", lambda p: f"{p['peak_rss_mib']:,}")
    row("RSS after load MiB", lambda p: f"{p['rss_after_load_mib']:,}")
    row("load s", lambda p: f"{p['load_s']:.1f}")
    row("cores used while measuring (cpu/wall)", lambda p: f"{p['cpu_per_wall']:.2f}")
    row("other processes' busy cores during its runs, median (max)",
        lambda p: f"{p['others_busy_cores']:.2f} ({p['others_busy_cores_max']:.2f})")
    row("load average (1 min) during its runs", lambda p: "{:.1f}–{:.1f}".format(*p["loadavg_1m_range"]))
    row("rounds", lambda p: str(p["rounds"]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=PROVIDERS, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1 from ensure_smollm2)")
    ap.add_argument("--peers-python", default=str(DEFAULT_PEERS_PYTHON), help="python of hack/peers-setup.sh's venv")
    ap.add_argument("--contexts", default="1024,4096,8160")
    ap.add_argument("--decode-contexts", default="1024,4096")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each starts every provider afresh")
    ap.add_argument("--modeld-weights", default="q4_1", help="profile.weights (default q4_1: the GGUF llama.cpp "
                    "runs, computed as the worker's measurement at start chooses; MODELD_WEIGHTS_PATH forces a path)")
    ap.add_argument("--modeld-kv", default=None, help="profile.kv (default: bf16 where this torch computes bf16, "
                    "else fp32)")
    ap.add_argument("--modeld-kv-mib", type=int, default=512, help="modeld's KV pool (an 8k bf16 session: 180 MiB)")
    ap.add_argument("--llama-n-batch", type=int, default=512)
    ap.add_argument("--llama-flash-attn", action="store_true")
    ap.add_argument("--worker-timeout", type=float, default=900)
    ap.add_argument("--wait-quiet", type=float, default=90,
                    help="before each provider run, wait up to this many seconds for the other processes to go quiet")
    ap.add_argument("--replay-turns", type=int, default=10, help="agent replay turns (0: no replay)")
    ap.add_argument("--replay-append", type=int, default=700, help="tokens each replay turn appends")
    ap.add_argument("--replay-gen", type=int, default=32, help="greedy tokens each replay turn generates")
    ap.add_argument("--out", default="_out/peers_cpu.json")
    ap.add_argument("--report", metavar="JSON", help="only print the table of an earlier run's JSON")
    a = ap.parse_args()

    if a.report:
        report(json.loads(Path(a.report).read_text()), a.report)
        return
    if a.worker:
        # Python put this script's folder first on the path, where benchmarks/kernels.py would stand in for the
        # PyPI package `kernels` that newer transformers imports when it finds one: the worker needs none of it.
        here = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
        job = json.loads(Path(a.job).read_text())
        res = WORKERS[a.worker](job)
        Path(a.result).write_text(json.dumps(res))
        return

    providers = [p.strip() for p in a.providers.split(",") if p.strip()]
    model = model_path(a.model)
    ids, tok = tokenize(model)
    contexts = [int(x) for x in a.contexts.split(",")]
    if len(ids) < max(contexts):
        sys.exit(f"corpus has only {len(ids)} tokens, fewer than {max(contexts)}")
    check_text = tok.decode(ids[:1024])
    job = {"model": model, "ids": ids[: max(contexts)], "contexts": contexts,
           "decode_contexts": [int(x) for x in a.decode_contexts.split(",")], "decode_tokens": a.decode_tokens,
           "threads": a.threads, "warmup_tokens": 256, "modeld_weights": a.modeld_weights,
           "modeld_kv": a.modeld_kv or _kv_default(),
           "modeld_kv_mib": a.modeld_kv_mib, "llama_n_batch": a.llama_n_batch,
           "llama_flash_attn": a.llama_flash_attn, "providers": providers,
           "check_text": check_text, "check_ids": tok.encode(check_text),
           "replay_turns": a.replay_turns, "replay_append": a.replay_append, "replay_gen": a.replay_gen,
           # the replay's appends: the corpus after the contexts' prompts (text no cold prompt above held)
           "replay_ids": ids[max(contexts): max(contexts) + a.replay_turns * a.replay_append]}
    if len(job["replay_ids"]) < a.replay_turns * a.replay_append:
        sys.exit(f"corpus has only {len(ids)} tokens: too few for the replay after the {max(contexts)}-token prompt")
    if a.replay_turns * (a.replay_append + a.replay_gen) > 8192:
        sys.exit("the replay's conversation would outgrow the 8192-token context")
    pythons = {"modeld": sys.executable, "llama.cpp": a.peers_python, "hf": a.peers_python}
    for p in providers:
        if not os.path.exists(pythons[p]):
            sys.exit(f"{pythons[p]} missing: run hack/peers-setup.sh first (or --providers modeld)")

    meta = {"command": " ".join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO))
                                 else sys.executable] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": platform.processor() or platform.machine(),
            "nproc": os.cpu_count(), "loadavg_start": os.getloadavg(), "git": git_state(), "model": model,
            "corpus_tokens": len(ids)}
    print(f"peers_cpu: {len(providers)} providers x {a.repeats} rounds; load avg {meta['loadavg_start'][0]:.1f}",
          file=sys.stderr, flush=True)
    rounds: list[dict] = []
    t_all = time.perf_counter()
    for r in range(a.repeats):
        order = providers[r % len(providers):] + providers[: r % len(providers)]
        rounds.append({})
        for p in order:
            quiet = wait_quiet(a.wait_quiet)
            res = run_worker(p, pythons[p], job, a.worker_timeout)
            res["before"] = quiet
            rounds[-1][p] = res
            msg = res.get("error") or " ".join(f"{n}:{int(n) / c['prefill_s']:.0f}tok/s"
                                               for n, c in res["contexts"].items())
            print(f"  round {r + 1} {p}: {res['wall_s']:.0f} s (waited {quiet['waited_s']:.0f} s for a quiet machine),"
                  f" others busy {res['others_busy_cores']:.2f} cores, load {res['loadavg_after'][0]:.1f}; {msg}",
                  file=sys.stderr, flush=True)
        # after every round, so a run cut short still leaves its rounds (re-print with --report)
        meta.update(total_s=time.perf_counter() - t_all, loadavg_end=os.getloadavg(), rounds_done=len(rounds))
        out = {"meta": meta, "job": {k: v for k, v in job.items()
                                     if k not in ("ids", "check_ids", "check_text", "replay_ids")},
               "summary": summarize(rounds, job), "rounds": rounds}
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    report(out, a.out)


def report(out: dict, path: str) -> None:
    meta, job = out["meta"], out["job"]
    summary = summarize(out["rounds"], job)   # recomputed: --report works on a file cut short
    a = argparse.Namespace(threads=job["threads"], repeats=len(out["rounds"]), out=path)
    print(f"CPU peers side by side: SmolLM2-135M-Instruct, {a.threads} threads each, medians of {a.repeats} rounds; "
          f"{meta['date']}; load avg {meta['loadavg_start'][0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end; "
          f"total {meta['total_s'] / 60:.1f} min")
    print()
    print(table(summary, job))
    print()
    for p, x in summary.items():
        if "error" in x:
            print(f"- {NAMES[p]}: {x['error']}\n```\n{x['output_tail'][-1500:]}\n```")
        else:
            print(f"- {NAMES[p]}: {json.dumps(x['versions'])}; "
                  f"{json.dumps({k: v for k, v in x['config'].items() if k not in ('system_info', 'capability')})}; "
                  f"tokenizer gives the same ids: {x['tokenizer_matches']}")
    print(f"\nJSON: {a.out}")


if __name__ == "__main__":
    main()
