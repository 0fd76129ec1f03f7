"""The keep-or-drop decision for a cell, from measurements against its baseline. Pure: no I/O, no clock.

A cell is kept (certified) only if its quality smoke passes and it shows at least one of:

  (a) ``context``       a context tier the baseline cannot run (it refused the tier, or its capability tier is lower),
                        run by the cell at passing quality (passkey found at that tier);
  (b) ``usable-context`` at least USABLE_CONTEXT_RATIO x the usable context at the same latency budget. Usable context
                        = the largest tier (run at passing quality) whose first-output p90 fits the budget. Budget rule:
                        an explicit ``budget_ms`` if given; otherwise each budget the baseline itself needs, i.e. its
                        first-output p90 at each tier it ran at passing quality; the gate passes if any budget does;
  (c) ``long-prefill``  at least PREFILL_SPEEDUP x faster first output (p50, baseline / cell) at every tier of
                        LONG_TIER tokens or more that both ran (and there is at least one);
  (d) ``agent-turn``    end-to-end agent turn p50 at most 1/AGENT_SPEEDUP of the baseline's (>= 1.5x), quality passing.

Decode throughput is not a gate: a faster decode alone never keeps a cell. Failing quality fails every gate. A cell
with no baseline is certified only as a baseline (gate ``baseline``) if its quality smoke passes.

A multi-rank cell (its ranks serve one session together, so every decode step waits on collectives) has one more
check, ``communication``, on the topology it was measured on: at the largest tier it ran at passing quality, the time
rank 0 spent in collectives per decode step (measured around that tier's decode, from the capability report's
counters) must be at most MAX_COLLECTIVE_SHARE of the step. Above it the step is bound by the link, not by the
compute the shape divides: communication eats the gain, and a gate that passed does not keep the cell on this
topology. (A pipeline's wait for the other ranks' compute is its bubble, reported apart, not communication.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

USABLE_CONTEXT_RATIO = 2.0
LONG_TIER = 32768
PREFILL_SPEEDUP = 3.0
AGENT_SPEEDUP = 1.5
NEXT_TOKEN_AGREEMENT_MIN = 0.875  # first greedy token equal to the baseline's on >= 7 of 8 prompts
GREEDY_AGREEMENT_MIN = 0.5  # mean fraction of the greedy continuation equal to the baseline's before they diverge
PASSKEY_MIN = 0.5  # a tier's passkey passes when found in more than this fraction of its repeats

MAX_COLLECTIVE_SHARE = 0.5  # of a decode step spent in collectives (multi-rank cells): more is link-bound

GATES = ("context", "usable-context", "long-prefill", "agent-turn")


@dataclass
class TierResult:
    """One context tier as measured on one cell. Latencies in ms; None where not measured."""

    status: str  # ok | refused (overflow / unsupported: the cell cannot run it) | error (anything else)
    first_output_p50: float | None = None
    first_output_p90: float | None = None
    decode_p50: float | None = None  # per generated token
    passkey_found: int = 0
    passkey_runs: int = 0
    collective_ms: float | None = None  # p50 per decode step in collectives (multi-rank cells); None: not measured

    @property
    def passkey_passed(self) -> bool:
        return self.passkey_runs > 0 and self.passkey_found / self.passkey_runs > PASSKEY_MIN


@dataclass
class Quality:
    """The quality smoke. Agreement fields are None without a baseline (nothing to agree with)."""

    paris: bool
    next_token_agreement: float | None = None
    greedy_agreement: float | None = None

    def failures(self) -> list[str]:
        out = [] if self.paris else ['"The capital of France is" does not continue with Paris']
        if self.next_token_agreement is not None and self.next_token_agreement < NEXT_TOKEN_AGREEMENT_MIN:
            out.append(f"next-token agreement {self.next_token_agreement:.3f} < {NEXT_TOKEN_AGREEMENT_MIN}")
        if self.greedy_agreement is not None and self.greedy_agreement < GREEDY_AGREEMENT_MIN:
            out.append(f"greedy agreement {self.greedy_agreement:.3f} < {GREEDY_AGREEMENT_MIN}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()


@dataclass
class CellMeasurements:
    name: str
    context_tier: int  # from /v1/capability
    quality: Quality
    tiers: dict[int, TierResult] = field(default_factory=dict)  # tiers absent here were not tested
    agent_turn_p50: float | None = None  # ms; None when the agent workload did not run to the end

    def tier_ok(self, tier: int) -> bool:
        """Ran this tier at passing quality."""
        t = self.tiers.get(tier)
        return t is not None and t.status == "ok" and self.quality.passed and t.passkey_passed

    def cannot_run(self, tier: int) -> bool:
        t = self.tiers.get(tier)
        return (t is not None and t.status == "refused") or self.context_tier < tier


@dataclass
class GateResult:
    gate: str
    passed: bool
    reason: str
    score: float = 0.0  # measured / threshold (1.0 = just passing); picks the closest gate when none passes
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class Decision:
    certified: bool
    gate: str  # the gate that passed, else the closest that failed; "quality" or "baseline" as described above
    reason: str
    gates: list[GateResult] = field(default_factory=list)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f} ms"


def gate_context(cell: CellMeasurements, base: CellMeasurements) -> GateResult:
    wins = [t for t in sorted(cell.tiers) if cell.tier_ok(t) and base.cannot_run(t)]
    evidence = {"tiers": wins, "baseline_context_tier": base.context_tier,
                "baseline_refused": [t for t in sorted(base.tiers) if base.tiers[t].status == "refused"]}
    if wins:
        t = wins[-1]
        how = "refused it" if t in evidence["baseline_refused"] else f"serves only {base.context_tier}"
        fo = cell.tiers[t].first_output_p90
        return GateResult("context", True, f"runs tier {t} at passing quality (passkey found, first output p90 "
                          f"{_ms(fo)}); baseline {base.name} {how}", 1.0, evidence)
    return GateResult("context", False, f"no tier the cell runs at passing quality is beyond baseline {base.name} "
                      f"(context tier {base.context_tier})", 0.0, evidence)


def usable_context(m: CellMeasurements, budget_ms: float) -> int:
    """Largest tier run at passing quality whose first-output p90 fits the budget; 0 if none."""
    fits = [t for t in m.tiers if m.tier_ok(t) and (m.tiers[t].first_output_p90 or float("inf")) <= budget_ms]
    return max(fits, default=0)


def gate_usable_context(cell: CellMeasurements, base: CellMeasurements, budget_ms: float | None = None) -> GateResult:
    if budget_ms is not None:
        budgets = [("explicit budget", budget_ms)]
    else:
        budgets = [(f"baseline p90 at {t}", base.tiers[t].first_output_p90) for t in sorted(base.tiers)
                   if base.tier_ok(t) and base.tiers[t].first_output_p90 is not None]
    best: GateResult | None = None
    for label, b in budgets:
        uc, ub = usable_context(cell, b), usable_context(base, b)
        ratio = (float("inf") if uc else 0.0) if ub == 0 else uc / ub
        ok = uc > 0 and ratio >= USABLE_CONTEXT_RATIO
        ev = {"budget_ms": round(b, 1), "budget_rule": label, "cell_usable": uc, "baseline_usable": ub,
              "ratio": None if ratio == float("inf") else round(ratio, 3)}
        r = GateResult("usable-context", ok, f"within {b:,.0f} ms first-output p90 ({label}): cell {uc} tokens vs "
                       f"baseline {ub} ({'baseline fits none' if ub == 0 else f'{ratio:.2f}x'}, needs "
                       f"{USABLE_CONTEXT_RATIO:g}x)", min(ratio, 1e6) / USABLE_CONTEXT_RATIO, ev)
        if best is None or (r.passed, r.score) > (best.passed, best.score):
            best = r
    return best or GateResult("usable-context", False, "no latency budget: the baseline ran no tier at passing quality")


def gate_long_prefill(cell: CellMeasurements, base: CellMeasurements) -> GateResult:
    both = [t for t in sorted(cell.tiers) if t >= LONG_TIER and cell.tier_ok(t) and t in base.tiers
            and base.tiers[t].status == "ok" and base.tiers[t].first_output_p50 and cell.tiers[t].first_output_p50]
    if not both:
        ran = [t for t in sorted(cell.tiers) if t >= LONG_TIER and cell.tiers[t].status == "ok" and t in base.tiers
               and base.tiers[t].status == "ok"]
        if ran:   # measured on both, but the passkey was lost there (decide() stops earlier on a failed smoke)
            return GateResult("long-prefill", False, f"tier {ran[-1]} ran on both cells, but the cell did not find "
                              "the passkey there; a prefill speedup counts only at passing quality", 0.0)
        return GateResult("long-prefill", False, f"no tier of {LONG_TIER}+ tokens measured on both cells")
    speed = {t: base.tiers[t].first_output_p50 / cell.tiers[t].first_output_p50 for t in both}  # type: ignore[operator]
    worst = min(speed, key=lambda t: speed[t])
    ok = speed[worst] >= PREFILL_SPEEDUP
    return GateResult("long-prefill", ok, f"first output p50 {speed[worst]:.2f}x faster at tier {worst} "
                      f"({_ms(cell.tiers[worst].first_output_p50)} vs {_ms(base.tiers[worst].first_output_p50)}; "
                      f"needs {PREFILL_SPEEDUP:g}x at every {LONG_TIER}+ tier)", speed[worst] / PREFILL_SPEEDUP,
                      {"speedup": {str(t): round(s, 3) for t, s in speed.items()}})


def gate_agent_turn(cell: CellMeasurements, base: CellMeasurements) -> GateResult:
    if not cell.agent_turn_p50 or not base.agent_turn_p50:
        return GateResult("agent-turn", False, "agent workload not measured on both cells")
    s = base.agent_turn_p50 / cell.agent_turn_p50
    return GateResult("agent-turn", s >= AGENT_SPEEDUP and cell.quality.passed,
                      f"agent turn p50 {_ms(cell.agent_turn_p50)} vs baseline {_ms(base.agent_turn_p50)} ({s:.2f}x, "
                      f"needs {AGENT_SPEEDUP:g}x)", s / AGENT_SPEEDUP,
                      {"speedup": round(s, 3), "cell_p50_ms": cell.agent_turn_p50, "baseline_p50_ms": base.agent_turn_p50})


def gate_communication(cell: CellMeasurements) -> GateResult | None:
    """The communication check (module docstring); None for a cell whose ranks do not share a session's steps."""
    measured = [t for t in sorted(cell.tiers) if cell.tiers[t].collective_ms is not None]
    if not measured:
        return None
    ok = [t for t in measured if cell.tier_ok(t) and cell.tiers[t].decode_p50]
    if not ok:
        return GateResult("communication", False, "no tier ran at passing quality with its collectives measured")
    t = ok[-1]
    coll, step = cell.tiers[t].collective_ms or 0.0, cell.tiers[t].decode_p50 or 0.0
    share = coll / step
    ev = {"tier": t, "collective_ms_per_decode_step": round(coll, 3), "decode_ms_per_token": round(step, 3),
          "share": round(share, 4), "max_share": MAX_COLLECTIVE_SHARE,
          "shares": {str(x): round((cell.tiers[x].collective_ms or 0.0) / d, 4)
                     for x in measured if (d := cell.tiers[x].decode_p50)}}
    passed = share <= MAX_COLLECTIVE_SHARE
    return GateResult("communication", passed, f"at tier {t} the ranks spend {coll:,.1f} of {step:,.1f} ms per decode "
                      f"step in collectives ({share:.0%}; at most {MAX_COLLECTIVE_SHARE:.0%})"
                      + ("" if passed else ": communication eats the gain on this topology"),
                      MAX_COLLECTIVE_SHARE / share if share else 1e6, ev)


def decide(cell: CellMeasurements, base: CellMeasurements | None, budget_ms: float | None = None) -> Decision:
    if not cell.quality.passed:
        return Decision(False, "quality", "quality smoke failed: " + "; ".join(cell.quality.failures()))
    if base is None:
        ok = [t for t in sorted(cell.tiers) if cell.tier_ok(t)]
        return Decision(True, "baseline", f"no baseline named: certified as a baseline (quality passed; tiers at "
                        f"passing quality: {', '.join(map(str, ok)) or 'none'})")
    results = [gate_context(cell, base), gate_usable_context(cell, base, budget_ms), gate_long_prefill(cell, base),
               gate_agent_turn(cell, base)]
    passed = [r for r in results if r.passed]
    comm = gate_communication(cell)
    if comm is not None:
        results.append(comm)
    if passed and comm is not None and not comm.passed:
        return Decision(False, "communication", f"gate {passed[0].gate} passed ({passed[0].reason}), but {comm.reason}",
                        results)
    if passed:
        return Decision(True, passed[0].gate, f"gate {passed[0].gate}: {passed[0].reason}", results)
    closest = max((r for r in results if r.gate != "communication"), key=lambda r: r.score)
    note = ""
    shared = [t for t in cell.tiers if t in base.tiers and cell.tiers[t].decode_p50 and base.tiers[t].decode_p50]
    if shared:
        t = max(shared)
        note = (f" (decode p50 at {t}: {cell.tiers[t].decode_p50:.1f} vs {base.tiers[t].decode_p50:.1f} ms/token; "
                "decode alone is not a gate)")
    return Decision(False, closest.gate, f"no gate passed vs {base.name}; closest {closest.gate}: {closest.reason}"
                    + note, results)


def measurements_from_report(section: dict[str, Any]) -> CellMeasurements:
    """Reads one cell's section of a modeld.certification/v1 report back into measurements."""
    tiers: dict[int, TierResult] = {}
    for key, t in section["tiers"].items():
        fo, dec, pk = t.get("first_output_ms") or {}, t.get("decode_ms_per_token") or {}, t.get("passkey") or {}
        coll = t.get("collective_ms_per_decode_step") or {}
        tiers[int(key)] = TierResult(t["status"], fo.get("p50"), fo.get("p90"), dec.get("p50"),
                                     pk.get("found", 0), pk.get("runs", 0), coll.get("p50"))
    agent = section.get("agent") or {}
    turn = agent.get("turn_ms") or {}
    quality = section["quality"]
    q = Quality(quality["paris"]["passed"], quality.get("next_token_agreement"), quality.get("greedy_agreement"))
    return CellMeasurements(section["name"], section["matrix"]["context_tier"], q, tiers,
                            turn.get("p50") if agent.get("status") == "ok" else None)
