"""The fixed, versioned certification workload: what is sent, built deterministically from real text.

Corpus: Python standard-library source files read from disk (English comments and docstrings, Python code), in a fixed
order; the report records their sha256 so two runs can be compared. Each endpoint tokenizes the corpus itself
(``/v1/tokenize``), and prompts are token slices of it, never random tokens.

Bump WORKLOAD_VERSION whenever anything here changes what a cell is sent or how an answer is scored.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORKLOAD_VERSION = "modeld.certify-workload/2"

CORPUS_FILES = (  # relative to the running interpreter's stdlib
    "logging/__init__.py", "typing.py", "asyncio/base_events.py", "email/message.py", "json/decoder.py",
    "argparse.py", "collections/__init__.py", "dataclasses.py", "subprocess.py", "pathlib.py",
    "inspect.py", "threading.py", "tarfile.py", "enum.py", "functools.py", "shutil.py",
)

PASSKEY_INTRO = ("Archive document {doc} of set {run}. There is an important pass key hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about the pass key.\n\n")
PASSKEY_NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
NEEDLE_DEPTHS = (0.5, 0.25, 0.75)  # fraction of the filler before the needle, by repeat

PARIS_PROMPT = "The capital of France is"
PARIS_TOKENS = 8

QUALITY_PROMPTS = (  # chat prompts; each cell continues them greedily and the continuations are compared
    "What is 2 + 2? Answer with a number.",
    "Name the three primary colors.",
    "Write a Python function that returns the square of a number.",
    "Translate 'good morning' into French.",
    "At what temperature in Celsius does water boil at sea level?",
    "Explain in one sentence what a list comprehension is in Python.",
    "Who wrote Romeo and Juliet?",
    "Give one reason why unit tests are useful.",
)

AGENT_SYSTEM = ("You are a coding agent working in a Python repository. After each tool output, state the next step "
                "in one short sentence. Run {run} of set {nonce}.")
AGENT_TOOL = "read_file {name} (part {part}):\n{text}"


def corpus_text() -> tuple[str, list[dict[str, str]]]:
    """The corpus and, per file, its path and sha256."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, files = [], []
    for rel in CORPUS_FILES:
        p = root / rel
        if not p.is_file():  # an interpreter without one of them: skip it, the report lists what was used
            continue
        text = p.read_text(encoding="utf-8")
        parts.append(text)
        files.append({"path": rel, "sha256": hashlib.sha256(text.encode()).hexdigest()})
    if not parts:
        raise RuntimeError(f"no corpus files found under {root}")
    return "\n\n".join(parts), files


def passkey(tier: int, repeat: int) -> str:
    """A 5-digit key fixed by (tier, repeat)."""
    h = int(hashlib.sha256(f"passkey-{tier}-{repeat}".encode()).hexdigest()[:8], 16)
    return str(10000 + h % 90000)


@dataclass
class TierPrompt:
    tokens: list[int]
    key: str


def tier_prompt(tokenize: Callable[[str], list[int]], corpus_ids: list[int], tier: int, repeat: int,
                decode_tokens: int, nonce: str = "0") -> TierPrompt:
    """Exactly ``tier - decode_tokens`` tokens: an intro naming the document and the run's ``nonce`` (so no two
    repeats share their first tokens, and no prompt of an earlier certification run sits in a cell's prefix cache:
    a cold prompt stays cold on a cell with cross-session reuse), corpus filler with the passkey needle at a fixed
    depth, then the question. The filler starts at another corpus offset per repeat and wraps around for tiers
    longer than the corpus."""
    key = passkey(tier, repeat)
    intro = tokenize(PASSKEY_INTRO.format(doc=f"{tier}-{repeat + 1}", run=nonce))
    needle, question = tokenize(PASSKEY_NEEDLE.format(key=key)), tokenize(PASSKEY_QUESTION)
    n = tier - decode_tokens
    fill = n - len(intro) - len(needle) - len(question)
    if fill < 0:
        raise ValueError(f"tier {tier} is too short for the passkey prompt ({n - fill} tokens without filler)")
    start = (repeat * 7919) % len(corpus_ids)
    filler = [corpus_ids[(start + i) % len(corpus_ids)] for i in range(fill)]
    cut = int(fill * NEEDLE_DEPTHS[repeat % len(NEEDLE_DEPTHS)])
    return TierPrompt(intro + filler[:cut] + needle + filler[cut:] + question, key)


