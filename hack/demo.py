"""A real multi-turn agent exchange through bound Sessions: the agent runtime's side of the contract.

For each ``--session``: reads its status (cell, endpoint, worker session id) with kubectl, then runs turns that each
re-send the whole growing transcript with EnsurePrefix (the worker reuses what it holds and computes only the new
part), decode a reply, and print the trace's token accounting and each turn's end-to-end time on the client's clock
(through the binding: the endpoint the operator chose). Ends with each bound cell's turn p50 / p90 / p95.
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


def call(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        sys.exit(f"{url}: HTTP {exc.code}: {exc.read().decode()}")


def exchange(kubectl: str, namespace: str, session: str, max_tokens: int) -> tuple[str, list[float]]:
    """One agent exchange through a bound Session: (the cell it is bound to, each turn's ms on the client's clock)."""
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
    turn_ms = []
    for i, user in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": user})
        t0 = time.perf_counter()
        pre = call(f"{base}/v1/sessions/{sid}/prefix", {"messages": messages, "add_generation_prompt": True})
        out = call(f"{base}/v1/sessions/{sid}/decode", {"max_tokens": max_tokens, "stop": ["\n"]})
        turn_ms.append((time.perf_counter() - t0) * 1e3)
        reply = out["text"].strip()
        messages.append({"role": "assistant", "content": reply})
        t, d = pre["trace"], out["trace"]
        print(
            f"{i:>4} {t['prompt_tokens']:>7} {t['tokens_reused']:>7} {t['tokens_computed']:>8} {t['prefill_ms']:>10.0f}"
            f" {d['completion_tokens']:>9} {d['total_ms']:>9.0f} {turn_ms[-1]:>8.0f}  {reply}"
        )
    print("session totals:", json.dumps(out["trace"]["totals"]))
    print()
    return status["cell"], turn_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubectl", default="kubectl")
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--session", required=True, action="append", help="a bound Session (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    results = [(s, *exchange(args.kubectl, args.namespace, s, args.max_tokens)) for s in args.session]
    print(f"end-to-end agent turn through the binding (client clock, {len(TURNS)} turns each, ms):")
    print(f"  {'session':<16} {'cell':<24} {'p50':>7} {'p90':>7} {'p95':>7}")
    for session, cell, turn_ms in results:
        st = stats(turn_ms) or {}              # the certification harness's percentiles
        print(f"  {session:<16} {cell:<24} " + " ".join(f"{st[k]:>7,.0f}" for k in ("p50", "p90", "p95")))


if __name__ == "__main__":
    main()
