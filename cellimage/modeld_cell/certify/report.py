"""What a certification run leaves behind: the JSON report, a Markdown rendering, a PNG of latency by context tier
(cell vs baseline), and the small summary the operator puts in ``Cell.status.certification``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import gates

SUMMARY_MAX_BYTES = 2048
_REASON_MAX = 600


def _quantization(m: dict[str, Any]) -> str:
    q = m["quantization"]
    return f"{q['stored']} → {q['compute']}" + (f" ({q['kernel']})" if q.get("kernel") else "")


def summary_for_status(report: dict[str, Any]) -> dict[str, Any]:
    """A flat summary for ``Cell.status.certification`` (and a Job's termination message), under 2 KiB as JSON:
    certified, gate, reason, topology, measuredAt (the Certification fields), then firstOutputP90Ms per tier,
    agentTurnP50Ms / P90 / P95, quality, baseline, schema and workload version."""
    cell, base, dec = report["cell"], report.get("baseline"), report["decision"]

    def p90s(section: dict[str, Any]) -> dict[str, float | None]:
        return {k: (round(t["first_output_ms"]["p90"], 1) if t["first_output_ms"] else None)
                for k, t in section["tiers"].items()}

    def agent(section: dict[str, Any], q: str = "p50") -> float | None:
        tm = section["agent"]["turn_ms"]
        return round(tm[q], 1) if tm else None

    out: dict[str, Any] = {
        "certified": dec["certified"], "gate": dec["gate"], "reason": dec["reason"][:_REASON_MAX],
        "topology": cell["matrix"]["topology"], "measuredAt": report["measuredAt"],
        "firstOutputP90Ms": p90s(cell), "agentTurnP50Ms": agent(cell),
        "agentTurnP90Ms": agent(cell, "p90"), "agentTurnP95Ms": agent(cell, "p95"),
        "decodeP90MsPerToken": {k: (round(t["decode_ms_per_token"]["p90"], 2) if t.get("decode_ms_per_token") else None)
                                for k, t in cell["tiers"].items()},
        "quality": "pass" if cell["quality"]["passed"] else "fail",
        "passkeyTiers": [int(k) for k, t in cell["tiers"].items() if t["passkey"]["runs"]
                         and t["passkey"]["found"] / t["passkey"]["runs"] > gates.PASSKEY_MIN],
        "contextTier": cell["matrix"]["context_tier"], "modelDigest": cell["matrix"]["model_digest"],
        "schema": report["schema"], "workload": report["workload"]["version"],
    }
    if base is not None:
        out.update(baseline=base["name"], baselineFirstOutputP90Ms=p90s(base), baselineAgentTurnP50Ms=agent(base))
    shares = {k: round(t["collective_ms_per_decode_step"]["p50"] / t["decode_ms_per_token"]["p50"], 4)
              for k, t in cell["tiers"].items()
              if (t.get("collective_ms_per_decode_step") or {}).get("p50") is not None
              and (t.get("decode_ms_per_token") or {}).get("p50")}
    if shares:
        out["collectiveShare"] = shares
    while len(json.dumps(out, separators=(",", ":"))) > SUMMARY_MAX_BYTES and len(out["reason"]) > 80:
        out["reason"] = out["reason"][: len(out["reason"]) // 2] + "..."
    for key in ("baselineFirstOutputP90Ms", "agentTurnP95Ms", "agentTurnP90Ms", "collectiveShare", "passkeyTiers",
                "modelDigest", "decodeP90MsPerToken"):  # many tiers: drop the least needed
        if len(json.dumps(out, separators=(",", ":"))) > SUMMARY_MAX_BYTES:
            out.pop(key, None)
    from modeld_api import CertificationSummary  # the one model the operator validates too

    return CertificationSummary.model_validate(out).to_json_dict()


def _p(st: dict[str, Any] | None, key: str) -> str:
    return "–" if not st else f"{st[key]:,.1f}"


def markdown(report: dict[str, Any], png_name: str | None = None) -> str:
    cell, base, dec, wl, h = report["cell"], report.get("baseline"), report["decision"], report["workload"], report["harness"]
    sections = [s for s in (cell, base) if s]
    verdict = "CERTIFIED" if dec["certified"] else "NOT CERTIFIED"
    lines = [f"# Certification: {cell['name']}" + (f" vs {base['name']}" if base else ""), "",
             f"**{verdict}** (gate `{dec['gate']}`): {dec['reason']}", "",
             f"Measured {report['startedAt']} → {report['measuredAt']} ({report['durationS']:.0f} s), schema "
             f"`{report['schema']}`, workload `{wl['version']}`.  ",
             f"Harness host: {h['host']} ({h['cpu']}, {h['cores']} cores), load average {h['loadavg_start']} at start, "
             f"{h['loadavg_end']} at the end.", ""]
    if h.get("command"):
        lines += ["```", h["command"], "```", ""]

    lines += ["## Matrix", "", "| | " + " | ".join(f"{s['name']} ({s['role']})" for s in sections) + " |",
              "|---|" + "---|" * len(sections)]
    rows = [("topology", lambda m: m["topology"]),
            ("hardware", lambda m: f"{m['hardware']['device']}, {m['hardware']['threads']} threads, "
                                   f"{m['hardware']['gpus'] if m['hardware']['gpus'] is not None else '?'} GPUs, "
                                   f"interconnect {m['hardware']['interconnect'] or '?'}"),
            ("backend / runtime", lambda m: f"{m['backend']} ({m['runtime_version']})"),
            ("model family", lambda m: f"{m['model_family']} ({m['model_name']})"),
            ("model digest", lambda m: f"`{m['model_digest']}`"),
            ("quantization (stored → compute, kernel)", _quantization),
            ("KV precision", lambda m: m["kv_precision"]),
            ("attention / prefix reuse", lambda m: f"{m['attention']} / {m['prefix_reuse']}"),
            ("capability context tier", lambda m: str(m["context_tier"])),
            ("tiers tested", lambda m: ", ".join(map(str, m["tiers_tested"]))),
            ("unsupported modes", lambda m: "; ".join(m["unsupported"]) or "none"),
            ("profile quality (measured at start)", _profile_quality)]
    for label, fn in rows:
        lines.append(f"| {label} | " + " | ".join(str(fn(s["matrix"])) for s in sections) + " |")

    lines += ["", "## Latency by context tier (ms)", "",
              "First output: prefix request sent → first streamed token, cold prompt of `tier − "
              f"{wl['decode_tokens']}` tokens. Prefill: the server's `trace.prefill_ms`. Decode: per token, all "
              f"{wl['decode_tokens']} tokens of every repeat pooled. {wl['repeats']} repeats per tier.", "",
              "| cell | tier | status | first output p50 | p90 | p95 | prefill p50 | p90 | p95 | decode/token p50 | p90 "
              "| p95 | passkey |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tier in wl["tiers"]:
        for s in sections:
            t = s["tiers"][str(tier)]
            fo, pf, dc, pk = t["first_output_ms"], t["prefill_ms"], t["decode_ms_per_token"], t["passkey"]
            status = t["status"] + (f" ({t['error'][:60]})" if t.get("error") else "")
            lines.append(f"| {s['name']} | {tier} | {status} | {_p(fo, 'p50')} | {_p(fo, 'p90')} | {_p(fo, 'p95')} | "
                         f"{_p(pf, 'p50')} | {_p(pf, 'p90')} | {_p(pf, 'p95')} | {_p(dc, 'p50')} | {_p(dc, 'p90')} | "
                         f"{_p(dc, 'p95')} | {pk['found']}/{pk['runs']} |")

    for s in sections:
        coll = [(tier, t["collective_ms_per_decode_step"]["p50"], (t["decode_ms_per_token"] or {}).get("p50"))
                for tier, t in ((tier, s["tiers"][str(tier)]) for tier in wl["tiers"])
                if t.get("collective_ms_per_decode_step")]
        if coll:
            lines += ["", f"{s['name']}: rank 0's time in collectives per decode step (p50 of the runs), the "
                      "communication check's input: " + ", ".join(
                          f"tier {tier} {c:,.1f} ms" + (f" ({c / d:.0%} of the step)" if d else "")
                          for tier, c, d in coll) + "."]
    lines += ["", "Tier prompt tokens served from KV already held, all repeats (the prompts share at most their first "
              "few intro tokens, so prefill ran cold): " + ", ".join(
        f"{s['name']} {sum(t.get('tokens_reused', 0) for t in s['tiers'].values())}" for s in sections) + "."]
    ag = wl["agent"]
    lines += ["", "## Agent turns (ms)", "",
              f"{ag['runs']} runs × {ag['turns']} turns; each turn appends {ag['tool_tokens']} tokens of tool output, "
              f"re-sends the transcript with EnsurePrefix and decodes {ag['decode_tokens']} tokens greedily; "
              + ("a new session per turn (a stateless client: only cross-session prefix reuse keeps earlier turns)."
                 if ag.get("sessions") == "turn" else "one session per run."), "",
              "| cell | status | turn p50 | p90 | p95 | last transcript tokens | tokens reused / computed |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for s in sections:
        a = s["agent"]
        status = a["status"] + (f" ({a['error'][:60]})" if a.get("error") else "")
        lines.append(f"| {s['name']} | {status} | {_p(a['turn_ms'], 'p50')} | {_p(a['turn_ms'], 'p90')} | "
                     f"{_p(a['turn_ms'], 'p95')} | {a['last_transcript_tokens']} | {a['tokens_reused']:,} / "
                     f"{a['tokens_computed']:,} |")

    q = cell["quality"]
    lines += ["", "## Quality smoke", "",
              f"- \"The capital of France is\" → {json.dumps(q['paris']['text'][:60])}: "
              f"{'pass' if q['paris']['passed'] else 'FAIL'}"]
    if q.get("next_token_agreement") is not None:
        lines += [f"- next-token agreement with {base['name'] if base else '?'}: {q['next_token_agreement']:.3f} "
                  f"(min {dec['thresholds']['next_token_agreement_min']}); greedy agreement "
                  f"{q['greedy_agreement']:.3f} (min {dec['thresholds']['greedy_agreement_min']}), compared by "
                  f"{q.get('compared', 'tokens')}, {wl['quality']['prompts']} prompts × {wl['quality']['tokens']} tokens"]
    lines += ["- passkey per tier: " + ", ".join(f"{k}: {t['passkey']['found']}/{t['passkey']['runs']}"
                                                   for k, t in cell["tiers"].items()),
              f"- result: {'pass' if q['passed'] else 'FAIL: ' + '; '.join(q['failures'])}"]

    if dec["gates"]:
        lines += ["", "## Gates", "", "| gate | passed | evidence |", "|---|---|---|"]
        lines += [f"| {g['gate']} | {'yes' if g['passed'] else 'no'} | {g['reason']} |" for g in dec["gates"]]
    if png_name:
        lines += ["", f"![latency by context tier]({png_name})"]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """First-output p50/p90 and decode p50 by tier, cell vs baseline; refused tiers are marked on the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [s for s in (report["cell"], report.get("baseline")) if s]
    tiers = report["workload"]["tiers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s, color in zip(sections, ("tab:blue", "tab:orange"), strict=False):
        ok = [t for t in tiers if s["tiers"][str(t)]["first_output_ms"]]
        refused = [t for t in tiers if s["tiers"][str(t)]["status"] != "ok"]
        if ok:
            ax1.plot(ok, [s["tiers"][str(t)]["first_output_ms"]["p90"] for t in ok], "o-", color=color,
                     label=f"{s['name']} p90")
            ax1.plot(ok, [s["tiers"][str(t)]["first_output_ms"]["p50"] for t in ok], "o--", color=color, alpha=0.5,
                     label=f"{s['name']} p50")
            dec = [t for t in ok if s["tiers"][str(t)]["decode_ms_per_token"]]
            ax2.plot(dec, [s["tiers"][str(t)]["decode_ms_per_token"]["p50"] for t in dec], "o-", color=color,
                     label=f"{s['name']} p50")
        for t in refused:
            ax1.axvline(t, color=color, ls=":", alpha=0.6)
            ax1.annotate(f"{s['name']}: {s['tiers'][str(t)]['status']}", (t, 0.02), xycoords=("data", "axes fraction"),
                         rotation=90, fontsize=7, color=color, ha="right", va="bottom")
    for ax, title, ylabel in ((ax1, "first output (cold prompt)", "ms"), (ax2, "decode per token", "ms/token")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(tiers, [str(t) for t in tiers])
        ax.set_xlabel("context tier (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    fig.suptitle(f"{report['cell']['name']}" + (f" vs {report['baseline']['name']}" if report.get("baseline") else "")
                 + f" — {report['workload']['version']}, {report['measuredAt']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(report: dict[str, Any], out: Path, stem: str = "certification") -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    plot(report, paths["png"])
    paths["md"].write_text(markdown(report, paths["png"].name))
    return paths


def _profile_quality(m: dict) -> str:
    """The worker's start-up verdicts on its lossy profiles, with the numbers they rest on."""
    out = []
    for v in m.get("profile_quality") or []:
        r = v["result"]
        out.append(f"{v['profile']}: {'pass' if v['passed'] else 'fail'} (agreement {r.get('greedy_agreement')}, "
                   f"KL mean {r.get('kl_mean')}, on {v['hardware'].get('name')})")
    return "; ".join(out) or "none gated"
