"""A real multi-turn agent exchange through bound Sessions: the agent runtime's side of the contract.

For each ``--session``: reads its status (cell, endpoint, worker session id) with kubectl, then runs turns that each
re-send the whole growing transcript with EnsurePrefix, decode a reply, and print the trace's token accounting and
each turn's end-to-end time on the client's clock (through the binding: the endpoint the operator chose). With
``--stateless`` every turn goes to a new worker session on the bound endpoint (the Session's id plus the turn), as a
client of a stateless chat API sends it: only a cell with cross-session prefix reuse keeps the earlier turns' KV.
Ends with each bound cell's turn and EnsurePrefix p50 / p90 / p95 (the prefix step is what reuse changes; the
decode's length depends on the reply).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from modeld_cell.certify.harness import stats

SYSTEM = "You are a concise assistant inside a coding agent. Answer in one short sentence."
TURNS = [
    "What is the capital of France?",
    "Tool output (ls):\nREADME.md\nMakefile\noperator/\ncellimage/\ncharts/\nWhich folder holds the Helm chart?",
    "Tool output (cat Makefile | head -3):\n# Everyday targets.\nSHELL := /bin/bash\nWhat does the first line say?",
    "Tool output (git log --oneline -2):\n92cfe90 Cell endpoints: read Ready once per pod\nb93fb20 Review mends\n"
    "What did the last commit change?",
    "Tool output (grep -c def operator/modeld_operator/placement.py):\n14\nHow many functions is that?",
    "Tool output (python -c 'print(2**10)'):\n1024\nWhat number did the command print?",
]


def call(url: str, body: dict | None, method: str = "POST") -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        sys.exit(f"{url}: HTTP {exc.code}: {exc.read().decode()}")


def exchange(kubectl: str, namespace: str, session: str, max_tokens: int,
             stateless: bool) -> tuple[str, list[float], list[float], int]:
    """One agent exchange through a bound Session: (the cell it is bound to, each turn's ms and each EnsurePrefix's ms
    on the client's clock, the prompt tokens the worker computed)."""
    raw = subprocess.run(
        [kubectl, "get", "session", session, "-n", namespace, "-o", "json"], capture_output=True, text=True, check=True
    ).stdout
    status = json.loads(raw)["status"]
    base, sid = status["endpoint"], status["sessionId"]
    print(f"session {namespace}/{session} -> cell {status['cell']} at {base} (worker session {sid})")
    with urllib.request.urlopen(f"{base}/v1/capability", timeout=30) as resp:
        cap = json.loads(resp.read())
    print("capability:", json.dumps({k: cap[k] for k in list(cap)[:8]}, default=str)[:400])
    messages = [{"role": "system", "content": SYSTEM}]
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'computed':>8} {'prefill ms':>10} {'generated':>9} {'decode ms':>9}"
          f" {'turn ms':>8}  reply")
    turn_ms, prefix_ms, computed = [], [], 0
    for i, user in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": user})
        turn_sid = f"{sid}.turn{i}" if stateless else sid
        t0 = time.perf_counter()
        pre = call(f"{base}/v1/sessions/{turn_sid}/prefix", {"messages": messages, "add_generation_prompt": True})
        prefix_ms.append((time.perf_counter() - t0) * 1e3)
        out = call(f"{base}/v1/sessions/{turn_sid}/decode", {"max_tokens": max_tokens, "stop": ["\n"]})
        turn_ms.append((time.perf_counter() - t0) * 1e3)
        if stateless:
            call(f"{base}/v1/sessions/{turn_sid}", None, method="DELETE")
        computed += pre["trace"]["tokens_computed"]
        reply = out["text"].strip()
        messages.append({"role": "assistant", "content": reply})
        t, d = pre["trace"], out["trace"]
        print(
            f"{i:>4} {t['prompt_tokens']:>7} {t['tokens_reused']:>7} {t['tokens_computed']:>8} {t['prefill_ms']:>10.0f}"
            f" {d['completion_tokens']:>9} {d['total_ms']:>9.0f} {turn_ms[-1]:>8.0f}  {reply}"
        )
    print("session totals:" if not stateless else "last turn's session totals:", json.dumps(out["trace"]["totals"]))
    print()
    return status["cell"], turn_ms, prefix_ms, computed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubectl", default="kubectl")
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--session", required=True, action="append", help="a bound Session (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--stateless", action="store_true", help="each turn a new worker session (a stateless client)")
    args = ap.parse_args()
    results = [(s, *exchange(args.kubectl, args.namespace, s, args.max_tokens, args.stateless)) for s in args.session]
    how = "each turn a new worker session" if args.stateless else "one worker session"
    print(f"end-to-end through the binding (client clock, {len(TURNS)} turns each, {how}; ms):")
    print(f"  {'session':<16} {'cell':<22} {'turn p50':>9} {'p90':>7} {'p95':>7} {'prefix p50':>11} {'p90':>7} {'p95':>7}"
          f" {'computed':>9}")
    for session, cell, turn_ms, prefix_ms, computed in results:
        t, p = stats(turn_ms) or {}, stats(prefix_ms) or {}      # the certification harness's percentiles
        print(f"  {session:<16} {cell:<22} {t['p50']:>9,.0f} {t['p90']:>7,.0f} {t['p95']:>7,.0f} {p['p50']:>11,.0f}"
              f" {p['p90']:>7,.0f} {p['p95']:>7,.0f} {computed:>9}")


if __name__ == "__main__":
    main()
