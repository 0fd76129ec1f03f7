"""The certification decision is a pure function of measurements: every gate, passing and failing, from constructed
numbers. Plus the status summary the operator stores, which must fit a Kubernetes status."""

from __future__ import annotations

import json

import pytest

from modeld_cell.certify import gates, summary_for_status
from modeld_cell.certify.gates import CellMeasurements, Quality, TierResult

pytestmark = pytest.mark.unit

GOOD = Quality(paris=True, next_token_agreement=1.0, greedy_agreement=1.0)


def tier(p90: float | None, status: str = "ok", decode: float = 50.0, passkey: tuple[int, int] = (3, 3)) -> TierResult:
    if status != "ok":
        return TierResult(status)
    return TierResult("ok", first_output_p50=p90 * 0.9, first_output_p90=p90, decode_p50=decode,
                      passkey_found=passkey[0], passkey_runs=passkey[1])


def cell(name: str, ctx: int, tiers: dict[int, TierResult], agent: float | None = 1000.0,
         quality: Quality = GOOD) -> CellMeasurements:
    return CellMeasurements(name, ctx, quality, tiers, agent)


BASE = cell("base", 8192, {1024: tier(1000), 4096: tier(5000), 8192: tier(12000)})


def by_gate(decision: gates.Decision) -> dict[str, gates.GateResult]:
    return {g.gate: g for g in decision.gates}


def test_equal_cell_is_not_kept_and_names_the_closest_gate():
    """Every gate is scored on the same numbers: context 0 (the baseline runs every tier), usable-context 1x / 2x =
    0.5 (best budget: the first, the baseline's own 1,000 ms at 1024), long-prefill 0 (no 32k+ tier), agent-turn
    1x / 1.5x = 0.667: the closest is agent-turn."""
    d = gates.decide(cell("c", 8192, dict(BASE.tiers)), BASE)
    assert not d.certified
    assert [g.gate for g in d.gates] == list(gates.GATES) and all(not g.passed for g in d.gates)
    assert {g.gate: g.score for g in d.gates} == {"context": 0.0, "usable-context": 0.5, "long-prefill": 0.0,
                                                  "agent-turn": pytest.approx(1 / gates.AGENT_SPEEDUP)}
    assert d.gate == "agent-turn"
    gs = by_gate(d)
    assert gs["usable-context"].evidence == {"budget_ms": 1000, "budget_rule": "baseline p90 at 1024",
                                             "cell_usable": 1024, "baseline_usable": 1024, "ratio": 1.0}
    assert gs["agent-turn"].evidence == {"speedup": 1.0, "cell_p50_ms": 1000.0, "baseline_p50_ms": 1000.0}


# (a) a tier the baseline cannot run
def test_context_gate_passes_when_baseline_refuses_the_tier():
    base = cell("base", 8192, {1024: tier(1000), 4096: tier(5000), 8192: tier(None, "refused")})
    c = cell("c", 8192, {1024: tier(1000), 4096: tier(5000), 8192: tier(12000)})
    d = gates.decide(c, base)
    assert d.certified and d.gate == "context"
    g = by_gate(d)["context"]
    assert g.score == 1.0
    assert g.evidence == {"tiers": [8192], "baseline_context_tier": 8192, "baseline_refused": [8192]}


def test_context_gate_passes_when_baseline_capability_tier_is_lower_even_untested():
    base = cell("base", 2048, {1024: tier(1000)})
    c = cell("c", 8192, {1024: tier(1000), 4096: tier(5000)})
    d = gates.decide(c, base)
    assert d.certified and d.gate == "context"
    g = by_gate(d)["context"]
    # won on the baseline's capability tier (2048 < 4096), not on a refusal: it refused nothing
    assert g.score == 1.0
    assert g.evidence == {"tiers": [4096], "baseline_context_tier": 2048, "baseline_refused": []}


def test_context_gate_needs_passing_quality_at_that_tier():
    base = cell("base", 2048, {1024: tier(1000), 4096: tier(None, "refused")})
    c = cell("c", 8192, {1024: tier(1000), 4096: tier(5000, passkey=(1, 3))})  # passkey lost at 4096
    g = by_gate(gates.decide(c, base))["context"]
    assert not g.passed and g.evidence["tiers"] == []


def test_context_gate_fails_when_the_cell_errors_at_the_tier():
    base = cell("base", 2048, {1024: tier(1000), 4096: tier(None, "refused")})
    c = cell("c", 8192, {1024: tier(1000), 4096: tier(None, "error")})
    assert not by_gate(gates.decide(c, base))["context"].passed


# (b) usable context at the same latency budget
def test_usable_context_gate_passes_at_the_baselines_own_budget():
    # baseline needs 1000 ms for 1024; the cell serves 4096 within those 1000 ms -> 4x usable context
    c = cell("c", 8192, {1024: tier(200), 4096: tier(900), 8192: tier(3000)})
    d = gates.decide(c, BASE)
    g = by_gate(d)["usable-context"]
    assert g.passed and g.evidence["cell_usable"] >= 2 * g.evidence["baseline_usable"]
    assert d.certified and d.gate == "usable-context"


def test_usable_context_gate_fails_below_2x():
    # at the baseline's 5000 ms budget the cell fits 4096 (baseline 4096) and at 12000 it fits 8192 (baseline 8192)
    c = cell("c", 8192, {1024: tier(600), 4096: tier(4000), 8192: tier(11000)})
    g = by_gate(gates.decide(c, BASE))["usable-context"]
    assert not g.passed and 0 < g.score < 1


@pytest.mark.parametrize("budget, passed", [(2000, True), (3000, False), (150, False), (600, True)],
                         ids=["4x", "1x", "neither-fits", "baseline-fits-none"])
def test_usable_context_gate_with_explicit_budget(budget, passed):
    c = cell("c", 8192, {1024: tier(200), 4096: tier(1500), 8192: tier(4000)})
    base = cell("base", 8192, {1024: tier(700), 4096: tier(2500), 8192: tier(6000)})
    g = by_gate(gates.decide(c, base, budget_ms=budget))["usable-context"]
    assert g.passed is passed, g.reason
    assert g.evidence["budget_ms"] == budget


# (c) 3x first output at 32k+
def long_tiers(p90_32k: float, p90_64k: float) -> dict[int, TierResult]:
    return {1024: tier(1000), 32768: tier(p90_32k), 65536: tier(p90_64k)}


def test_long_prefill_gate_passes_at_3x_on_every_long_tier():
    base = cell("base", 65536, long_tiers(30000, 90000))
    d = gates.decide(cell("c", 65536, long_tiers(9000, 25000)), base)
    assert by_gate(d)["long-prefill"].passed and d.certified


def test_long_prefill_gate_fails_when_one_long_tier_is_under_3x():
    base = cell("base", 65536, long_tiers(30000, 90000))
    g = by_gate(gates.decide(cell("c", 65536, long_tiers(9000, 40000)), base))["long-prefill"]
    # p50 = 0.9 x p90 on both: 32768 is 30000 / 9000 = 3.33x, 65536 only 90000 / 40000 = 2.25x; the worst decides
    assert not g.passed
    assert g.evidence == {"speedup": {"32768": 3.333, "65536": 2.25}}
    assert g.score == pytest.approx(2.25 / gates.PREFILL_SPEEDUP)


def test_a_long_tier_run_without_its_passkey_is_no_prefill_evidence_and_the_reason_says_so():
    base = cell("base", 32768, {32768: tier(30000, passkey=(0, 2))})
    fast = cell("c", 32768, {32768: tier(3000, passkey=(0, 2))})                  # 10x, passkey lost at 32k
    g = by_gate(gates.decide(fast, base))["long-prefill"]
    assert not g.passed and g.score == 0.0
    assert "tier 32768 ran on both cells, but the cell did not find the passkey there" in g.reason


def test_long_prefill_gate_ignores_short_tiers():
    fast_short = cell("c", 8192, {1024: tier(100), 4096: tier(500), 8192: tier(1200)})  # 10x, but below 32k
    g = by_gate(gates.decide(fast_short, BASE, budget_ms=1))["long-prefill"]
    assert not g.passed and g.score == 0.0
    assert g.evidence == {}                               # no speedup measured at all: no tier of 32768+ on both


# (d) agent turn
@pytest.mark.parametrize("agent_ms, passed, speedup", [(666.0, True, 1.502), (700.0, False, 1.429)],
                         ids=["1.50x", "1.43x"])
def test_agent_turn_gate_threshold(agent_ms, passed, speedup):
    c = cell("c", 8192, dict(BASE.tiers), agent=agent_ms)
    g = by_gate(gates.decide(c, BASE))["agent-turn"]
    assert g.passed is passed, g.reason
    assert g.evidence == {"speedup": speedup, "cell_p50_ms": agent_ms, "baseline_p50_ms": 1000.0}
    assert g.score == pytest.approx(1000.0 / agent_ms / gates.AGENT_SPEEDUP)     # 1.0 is the 1.5x bar


def test_agent_turn_gate_needs_both_measured():
    c = cell("c", 8192, dict(BASE.tiers), agent=100.0)
    base = cell("base", 8192, dict(BASE.tiers), agent=None)
    assert not by_gate(gates.decide(c, base))["agent-turn"].passed


# decode alone never passes
def test_decode_throughput_alone_never_certifies():
    c = cell("c", 8192, {t: tier(r.first_output_p90, decode=5.0) for t, r in BASE.tiers.items()})  # 10x decode
    d = gates.decide(c, BASE)
    equal = gates.decide(cell("c", 8192, dict(BASE.tiers)), BASE)       # the same cell at the baseline's decode
    assert not d.certified and d.gate == equal.gate == "agent-turn"
    assert d.gates == equal.gates                    # 10x decode moved no gate: not its verdict, score or evidence


# quality
@pytest.mark.parametrize("quality", [
    Quality(paris=False, next_token_agreement=1.0, greedy_agreement=1.0),
    Quality(paris=True, next_token_agreement=0.75, greedy_agreement=1.0),
    Quality(paris=True, next_token_agreement=1.0, greedy_agreement=0.4),
], ids=["paris", "next-token", "greedy"])
def test_quality_failure_fails_every_gate(quality):
    # this cell would pass (a), (b) and (d) on numbers
    base = cell("base", 2048, {1024: tier(1000), 4096: tier(None, "refused")}, agent=3000.0)
    c = cell("c", 8192, {1024: tier(100), 4096: tier(400)}, agent=100.0, quality=quality)
    d = gates.decide(c, base)
    assert not d.certified and d.gate == "quality" and "quality smoke failed" in d.reason


def test_quality_thresholds_are_inclusive():
    assert Quality(True, gates.NEXT_TOKEN_AGREEMENT_MIN, gates.GREEDY_AGREEMENT_MIN).passed


# no baseline
def test_no_baseline_is_certified_as_baseline_when_quality_passes():
    d = gates.decide(cell("c", 8192, {1024: tier(1000)}, quality=Quality(paris=True)), None)
    assert d.certified and d.gate == "baseline"


def test_no_baseline_and_failing_quality_is_not_certified():
    d = gates.decide(cell("c", 8192, {1024: tier(1000)}, quality=Quality(paris=False)), None)
    assert not d.certified and d.gate == "quality"


# missing tiers
def test_missing_tiers_are_no_evidence():
    c = cell("c", 8192, {})
    d = gates.decide(c, BASE)
    assert not d.certified
    gs = by_gate(d)
    assert gs["context"].evidence["tiers"] == []
    assert gs["usable-context"].evidence["cell_usable"] == 0
    assert not gs["long-prefill"].passed


def test_a_tier_the_baseline_did_not_test_is_not_a_refusal():
    base = cell("base", 8192, {1024: tier(1000)})  # 4096 untested, but its capability covers it
    c = cell("c", 8192, {1024: tier(1000), 4096: tier(5000)})
    assert not by_gate(gates.decide(c, base))["context"].passed


# the status summary
def report_for(decision: gates.Decision, n_tiers: int = 3) -> dict:
    tiers = {str(1024 << i): {"status": "ok", "first_output_ms": {"p50": 1.0, "p90": 2.0 * i, "p95": 3.0},
                              "passkey": {"found": 3, "runs": 3}} for i in range(n_tiers)}
    section = {"name": "c", "tiers": tiers, "agent": {"turn_ms": {"p50": 1234.5, "p90": 2000.0, "p95": 2500.0}},
               "quality": {"passed": True},
               "matrix": {"topology": "8x NVIDIA-H100-80GB-HBM3 nvswitch", "context_tier": 131072,
                          "model_digest": "sha256:" + "0" * 64}}
    return {"schema": "modeld.certification/v1", "workload": {"version": "modeld.certify-workload/1"},
            "measuredAt": "2026-11-29T12:00:00Z", "cell": section, "baseline": dict(section, name="b"),
            "decision": {"certified": decision.certified, "gate": decision.gate, "reason": decision.reason}}


def test_summary_fits_a_status_and_carries_the_certification_fields():
    import modeld_api as api

    d = gates.Decision(True, "context", "x" * 5000)
    s = summary_for_status(report_for(d, n_tiers=12))
    assert len(json.dumps(s, separators=(",", ":"))) < 2048
    assert s["certified"] and s["gate"] == "context" and s["topology"].startswith("8x")
    assert s["firstOutputP90Ms"]["2048"] == 2.0 and s["agentTurnP50Ms"] == 1234.5 and s["quality"] == "pass"
    assert s["agentTurnP90Ms"] == 2000.0 and s["agentTurnP95Ms"] == 2500.0
    cert = api.Certification.model_validate({k: s[k] for k in ("certified", "gate", "reason", "topology", "measuredAt")}
                                            | {"summary": s})
    assert cert.certified


# the communication check of a multi-rank cell
def ranked(collective: dict[int, float | None], decode: float = 100.0) -> CellMeasurements:
    """A cell that wins the context gate at 8192 (the baseline refuses it), with rank 0's collective ms per decode
    step measured at each tier."""
    tiers = {t: tier(p, decode=decode) for t, p in ((1024, 1000), (4096, 5000), (8192, 12000))}
    for t, c in collective.items():
        tiers[t].collective_ms = c
    return cell("ranks", 8192, tiers)


REFUSING = cell("base", 8192, {1024: tier(1000), 4096: tier(5000), 8192: tier(None, "refused")})


def test_a_multi_rank_cell_whose_collectives_fit_is_kept_with_the_check_in_its_evidence():
    d = gates.decide(ranked({1024: 10.0, 4096: 20.0, 8192: 30.0}), REFUSING)
    assert d.certified and d.gate == "context"
    g = by_gate(d)["communication"]
    assert g.passed and g.evidence["tier"] == 8192 and g.evidence["share"] == pytest.approx(0.3)
    assert g.evidence["shares"] == {"1024": 0.1, "4096": 0.2, "8192": 0.3}


@pytest.mark.parametrize("at_top, kept", [(50.0, True), (50.1, False), (90.0, False)])
def test_communication_that_eats_the_gain_rejects_a_cell_a_gate_kept(at_top, kept):
    """Judged at the largest tier the cell ran at passing quality, where the gain lives; the threshold is inclusive."""
    d = gates.decide(ranked({1024: 5.0, 8192: at_top}), REFUSING)
    assert d.certified is kept
    assert by_gate(d)["context"].passed                  # the gate itself passed either way
    if not kept:
        assert d.gate == "communication" and "communication eats the gain" in d.reason and "gate context" in d.reason


def test_a_single_rank_cell_has_no_communication_check():
    d = gates.decide(cell("c", 8192, {1024: tier(1000), 4096: tier(5000), 8192: tier(12000)}), REFUSING)
    assert d.certified and "communication" not in by_gate(d)


def test_the_communication_check_never_rescues_a_cell_no_gate_kept():
    d = gates.decide(ranked({1024: 1.0, 4096: 1.0, 8192: 1.0}), BASE)     # the baseline runs every tier
    assert not d.certified and d.gate != "communication" and by_gate(d)["communication"].passed


def test_the_summary_carries_the_collective_share_per_tier():
    section = {"name": "c", "quality": {"passed": True},
               "tiers": {"1024": {"first_output_ms": {"p90": 10.0}, "passkey": {"found": 1, "runs": 1},
                                  "decode_ms_per_token": {"p50": 80.0, "p90": 90.0},
                                  "collective_ms_per_decode_step": {"p50": 20.0}},
                         "2048": {"first_output_ms": {"p90": 20.0}, "passkey": {"found": 1, "runs": 1},
                                  "decode_ms_per_token": {"p50": 100.0, "p90": 110.0}}},
               "agent": {"turn_ms": None},
               "matrix": {"topology": "cpu x2 ranks", "context_tier": 2048, "model_digest": None}}
    s = summary_for_status({"schema": "modeld.certification/v1", "workload": {"version": "w"},
                            "measuredAt": "2026-12-01T00:00:00Z", "cell": section, "baseline": None,
                            "decision": {"certified": False, "gate": "communication", "reason": "r"}})
    assert s["collectiveShare"] == {"1024": 0.25}
    assert s["decodeP90MsPerToken"] == {"1024": 90.0, "2048": 110.0}     # the binding's per-token budget reads it


def test_collective_per_step_reads_the_counters_around_a_decode():
    from modeld_cell.certify.harness import collective_per_step

    before = {"forwards": {"decode": 10}, "collective_ms_total": {"decode": 100.0}}
    after = {"forwards": {"decode": 42}, "collective_ms_total": {"decode": 260.0}}
    assert collective_per_step(before, after) == pytest.approx(5.0)
    assert collective_per_step(before, before) is None
