"""Prints the certification matrix of the Cells in a namespace from their status (what the operator's Jobs measured).

The full matrix of a run, with every percentile, is what `modeld-cell certify --out DIR` writes (docs/certification/).
"""

from __future__ import annotations

import argparse
import json
import subprocess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubectl", default="kubectl")
    ap.add_argument("--namespace", required=True)
    args = ap.parse_args()
    cells = json.loads(subprocess.run([args.kubectl, "get", "cells", "-n", args.namespace, "-o", "json"],
                                      capture_output=True, text=True, check=True).stdout)["items"]
    rows = []
    for cell in cells:
        spec, cert = cell["spec"], (cell.get("status") or {}).get("certification") or {}
        summary = cert.get("summary") or {}
        tiers = summary.get("firstOutputP90Ms") or {}
        base = summary.get("baselineFirstOutputP90Ms") or {}

        def fmt(ms):
            return "refused" if ms is None else f"{ms:,.0f}"

        rows.append([
            cell["metadata"]["name"],
            cert.get("topology") or "-",
            f"{spec['runtime']['backend']} / {spec['model']['family']}",
            (summary.get("modelDigest") or "-")[:19],
            f"{spec['profile'].get('weights')} / kv {spec['profile'].get('kv')}",
            str(spec["contextTier"]),
            " ".join(f"{t}:{fmt(ms)}" for t, ms in sorted(tiers.items(), key=lambda kv: int(kv[0]))) or "-",
            " ".join(f"{t}:{fmt(ms)}" for t, ms in sorted(base.items(), key=lambda kv: int(kv[0]))) or "-",
            " / ".join(fmt(summary.get(f"agentTurnP{q}Ms")) for q in (50, 90, 95)) if summary else "-",
            summary.get("quality", "-"),
            f"{'KEPT' if cert.get('certified') else 'dropped'} ({cert.get('gate', '-')})" if cert else "not measured",
        ])
    head = ["cell", "topology", "backend / model", "digest", "weights / KV", "tier", "first-output p90 ms by tier",
            "baseline p90 ms", "agent turn p50 / p90 / p95 ms", "quality", "decision (gate)"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    for cell in cells:
        cert = (cell.get("status") or {}).get("certification") or {}
        if cert.get("reason"):
            print(f"\n{cell['metadata']['name']}: {cert['reason']}")


if __name__ == "__main__":
    main()
