"""Certification as the operator sees it: when a Cell needs measuring, the Job that measures it, and reading the
verdict back. Pure functions (``next_step`` decides from what the handler read); handlers/cell.py acts on them.

The Job runs the cell image's `modeld-cell certify` against the cell's ready endpoint and its baseline's, and writes
a small JSON summary to its termination message (the kubelet hands that back in the pod status), so the operator
needs no volume, no logs access and no extra RBAC to read the verdict.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

import modeld_api as api

from .cellstatus import Verdict  # a condition: (status True/False/None for Unknown, reason, message)
from .placement import spec_json  # the spec as a worker reads it, the same text the cell's pod carries

TERMINATION_LOG = "/dev/termination-log"
DEFAULT_TIERS = (1024, 4096, 8192, 32768, 131072)


def topology_of(spec: api.CellSpec, node_labels: dict[str, str]) -> str:
    """The topology a measurement stands for: GPU count, product and interconnect, or the CPU (with its ranks when the
    cell runs several: CPU ranks over gloo are a topology of their own, and so are a data-parallel cell's copies,
    which share the node's cores)."""
    if spec.topology.gpus == 0:
        ranks, shape = spec.runtime.ranks or 1, api.enum_value(spec.runtime.parallelism)
        if ranks == 1 or shape == "single":
            return "cpu"
        # a data-parallel copy is measured alone, on its share of the node's cores
        return f"cpu x{ranks} copies" if shape == "data" else f"cpu x{ranks} ranks"
    product = node_labels.get(api.LABEL_GPU_PRODUCT, "unknown-gpu")
    return f"{spec.topology.gpus}x {product} {spec.topology.interconnect}"


def certification_key(spec: api.CellSpec, topology: str, baseline: api.CellSpec | None) -> str:
    """Changes whenever what is measured changes: the tuple, the image, the model digest, the topology, the baseline.

    Replicas, resources and localRun do not change a cell's certification."""
    relevant = spec.model_dump(mode="json", exclude={"replicas", "resources", "localRun", "port"})
    base = baseline.model_dump(mode="json", exclude={"replicas", "resources", "localRun", "port"}) if baseline else None
    text = json.dumps({"spec": relevant, "topology": topology, "baseline": base}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tiers_for(spec: api.CellSpec, annotations: dict[str, str]) -> list[int]:
    raw = annotations.get(api.ANNOTATION_CERTIFY_TIERS)
    if raw:
        try:
            tiers = sorted({int(t) for t in raw.split(",") if t.strip()})
        except ValueError as exc:
            raise ValueError(f"annotation {api.ANNOTATION_CERTIFY_TIERS}={raw!r}: comma-separated integers expected") from exc
        if not tiers or tiers[0] < 1:
            raise ValueError(f"annotation {api.ANNOTATION_CERTIFY_TIERS}={raw!r}: positive tiers expected")
        return tiers
    return [t for t in DEFAULT_TIERS if t < spec.contextTier] + [spec.contextTier]


# Workload-size flags of `modeld-cell certify` an admin may set through the certify-args annotation; nothing else.
CERTIFY_FLAGS: dict[str, Any] = {
    "--repeats": int, "--agent-turns": int, "--agent-runs": int, "--decode-tokens": int,
    "--agent-tool-tokens": int, "--agent-decode-tokens": int, "--latency-budget-ms": float,
    "--agent-sessions": ("run", "turn"),
}


def extra_args(annotations: dict[str, str]) -> list[str]:
    raw = annotations.get(api.ANNOTATION_CERTIFY_ARGS, "")
    words = raw.split()
    if len(words) % 2:
        raise ValueError(f"annotation {api.ANNOTATION_CERTIFY_ARGS}={raw!r}: flags and values come in pairs")
    out: list[str] = []
    for flag, value in zip(words[::2], words[1::2], strict=True):
        kind = CERTIFY_FLAGS.get(flag)
        if kind is None:
            raise ValueError(f"annotation {api.ANNOTATION_CERTIFY_ARGS}: {flag!r} is not one of {sorted(CERTIFY_FLAGS)}")
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(f"annotation {api.ANNOTATION_CERTIFY_ARGS}: {flag} takes one of {', '.join(kind)}, "
                                 f"not {value!r}")
            out += [flag, value]
            continue
        try:
            if kind(value) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"annotation {api.ANNOTATION_CERTIFY_ARGS}: {flag} needs a positive number, not {value!r}") from None
        out += [flag, value]
    return out


def job_name(cell: str, key: str) -> str:
    return f"certify-{cell}"[:52] + f"-{key[:8]}"


def job_manifest(
    cell: str,
    namespace: str,
    spec: api.CellSpec,
    endpoint: str,
    topology: str,
    key: str,
    tiers: list[int],
    baseline: tuple[str, api.CellSpec, str] | None,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    """A Job that measures `cell` at `endpoint` (and its baseline in the same run) and reports in its termination message."""
    args = ["certify", "--endpoint", endpoint, "--topology", topology, "--tiers", ",".join(map(str, tiers)),
            "--summary", TERMINATION_LOG, "--cell-name", cell, *(extra or [])]
    env = [{"name": "MODELD_CELL_SPEC", "value": spec_json(spec)}]
    if baseline:
        bname, bspec, bendpoint = baseline
        args += ["--baseline-endpoint", bendpoint, "--baseline-name", bname]
        env.append({"name": "MODELD_BASELINE_SPEC", "value": spec_json(bspec)})
    labels = {api.LABEL_CERTIFIES: cell, api.LABEL_MANAGED_BY: "modeld"}
    if spec.localRun:
        labels[api.LABEL_LOCAL_RUN] = "true"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(cell, key), "namespace": namespace, "labels": labels, "annotations": {f"{api.GROUP}/key": key}},
        "spec": {
            "backoffLimit": 0,  # a failed measurement is reported, not retried into a loop
            "activeDeadlineSeconds": 3600,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "containers": [
                        {
                            "name": "certify",
                            "image": spec.image,
                            "command": ["modeld-cell"],
                            "args": args,
                            "env": env,
                            "terminationMessagePath": TERMINATION_LOG,
                            "terminationMessagePolicy": "File",
                            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
                        }
                    ],
                },
            },
        },
    }


def verdict_from_pod(pod: dict[str, Any]) -> tuple[str, api.Certification | None, str]:
    """(state, certification, message): state is running, done or failed."""
    phase = (pod.get("status") or {}).get("phase")
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    terminated = (statuses[0].get("state") or {}).get("terminated") if statuses else None
    if phase not in ("Succeeded", "Failed") or terminated is None:
        return "running", None, ""
    message = terminated.get("message") or ""
    if phase == "Failed" or terminated.get("exitCode", 1) != 0:
        return "failed", None, message.strip()[-400:] or f"certification exited with {terminated.get('exitCode')}"
    try:
        summary = api.CertificationSummary.model_validate_json(message)
        cert = api.Certification.model_validate(
            {
                "certified": summary.certified,
                "gate": summary.gate,
                "reason": summary.reason,
                "topology": summary.topology,
                "measuredAt": summary.measuredAt,
                "summary": summary.to_json_dict(),
            }
        )
    except (ValueError, KeyError, TypeError, ValidationError) as exc:
        return "failed", None, f"unreadable certification summary: {exc}"
    return "done", cert, cert.reason or ""


def gate_reason(text: str) -> str:
    """A condition reason is CamelCase: 'context-tier' becomes 'GateContextTier'."""
    words = re.findall(r"[A-Za-z0-9]+", text)
    return "Gate" + "".join(w[:1].upper() + w[1:] for w in words) if words else "Gate"


@dataclass(frozen=True)
class Baseline:
    """The cell's baseline as read from the apiserver: ``spec``/``url`` when it exists with a ready worker, else
    ``missing`` (no such Cell) or no ``url`` (not ready yet)."""

    name: str
    spec: api.CellSpec | None = None
    url: str | None = None
    missing: bool = False


@dataclass(frozen=True)
class Observed:
    """What the handler read for one reconcile of a cell's certification."""

    name: str
    namespace: str
    spec: api.CellSpec
    ready_url: str | None                       # the first ready worker's URL, None when none is ready
    node_labels: dict[str, str]                 # of that worker's node
    old: dict[str, Any] | None                  # status.certification as stored
    annotations: dict[str, str] = field(default_factory=dict)
    baseline: Baseline | None = None            # None: the cell names no baseline
    job_pods: list[dict[str, Any]] = field(default_factory=list)   # pods of the Job for ``target(...)``'s key
    now: str = ""                               # RFC 3339, for a failed measurement's record


@dataclass(frozen=True)
class Step:
    """What to do: store ``cert`` as status.certification (the old one when unchanged), set the Certified
    condition to ``verdict`` (None: leave it), create ``job`` (a manifest) and record ``event`` (reason, message)."""

    cert: dict[str, Any] | None
    verdict: Verdict | None
    job: dict[str, Any] | None = None
    event: tuple[str, str] | None = None


def target(o: Observed) -> tuple[str, str, str] | None:
    """(topology, key, job name) of the measurement the cell needs now; None while it cannot be measured (no ready
    worker, or the baseline is missing or not ready)."""
    if o.ready_url is None or (o.baseline is not None and o.baseline.url is None):
        return None
    topology = topology_of(o.spec, o.node_labels)
    key = certification_key(o.spec, topology, o.baseline.spec if o.baseline else None)
    return topology, key, job_name(o.name, key)


def is_current(old: dict[str, Any] | None, key: str) -> bool:
    """The stored certification measured exactly this key: kept, nothing to read or run."""
    return bool(old and old.get("key") == key and old.get("measuredAt"))


def jobs_to_read(o: Observed) -> str | None:
    """The Job whose pods ``next_step`` needs in ``o.job_pods``, or None when it needs none."""
    t = target(o)
    return None if t is None or is_current(o.old, t[1]) else t[2]


def outdated_by(o: Observed) -> str | None:
    """Why the stored verdict no longer stands for the cell, known before any worker is ready (a changed spec
    replaces the pods first): the key of the spec and baseline as they are now, on the topology it was measured on,
    differs from the stored one. None when it still stands or nothing is stored."""
    if not (o.old and o.old.get("key") and o.old.get("topology")):
        return None
    if o.baseline is not None and o.baseline.missing:
        return None                     # said as BaselineMissing once a worker is ready
    if certification_key(o.spec, o.old["topology"], o.baseline.spec if o.baseline else None) == o.old["key"]:
        return None
    return (f"the spec or its baseline changed since certification {o.old['key']} on {o.old['topology']}: "
            "the cell is measured again once a worker of the new spec is ready")


def next_step(o: Observed) -> Step:
    """The cell's certification on the topology it runs on: kept while nothing measured changes, else measured by a
    Job, then read back from the Job's pod. Pure: the handler reads ``o`` and acts on the Step."""
    if o.ready_url is None:
        if (stale := outdated_by(o)) is not None:
            return Step(o.old, (None, "SpecChanged", stale))
        return Step(o.old, None)
    if o.baseline is not None and o.baseline.missing:
        return Step(o.old, (False, "BaselineMissing", f"baseline cell {o.baseline.name} does not exist in {o.namespace}"))
    if o.baseline is not None and o.baseline.url is None:
        return Step(o.old, (None, "WaitingForBaseline", f"baseline cell {o.baseline.name} has no ready worker yet"))
    t = target(o)
    assert t is not None
    topology, key, job = t
    if o.old and is_current(o.old, key):
        gate = o.old.get("gate") or ("CertificationFailed" if not o.old.get("certified") else "Certified")
        return Step(o.old, (bool(o.old.get("certified")), gate_reason(gate), o.old.get("reason") or ""))
    measuring = f"job {job} measures the cell on {topology}"
    if not o.job_pods:
        try:
            tiers = tiers_for(o.spec, o.annotations)
            extra = extra_args(o.annotations)
        except ValueError as exc:
            return Step(o.old, (False, "InvalidCertifyAnnotation", str(exc)))
        base = (o.baseline.name, o.baseline.spec, o.baseline.url) if o.baseline and o.baseline.spec and o.baseline.url else None
        manifest = job_manifest(o.name, o.namespace, o.spec, o.ready_url, topology, key, tiers, base, extra)
        return Step(o.old, (None, "Certifying", measuring), job=manifest, event=("Certifying", measuring))
    state, cert, message = verdict_from_pod(o.job_pods[0])
    if state == "running":
        return Step(o.old, (None, "Certifying", measuring))
    if cert is None:
        failed = api.Certification(certified=False, reason=message, topology=topology, key=key, job=job,
                                   gate="CertificationFailed", measuredAt=o.now)
        return Step(failed.model_dump(mode="json", exclude_none=True), (False, "CertificationFailed", message))
    cert.key, cert.job, cert.topology = key, job, cert.topology or topology
    return Step(cert.model_dump(mode="json", exclude_none=True),
                (cert.certified, gate_reason(cert.gate or "none"), cert.reason or ""))
