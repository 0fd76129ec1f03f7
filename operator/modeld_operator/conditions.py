"""Kubernetes-convention status conditions (type, status, reason, message, lastTransitionTime, observedGeneration)."""

from __future__ import annotations

import datetime as dt
from typing import Any


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int | None,
) -> tuple[list[dict[str, Any]], bool]:
    """Returns the new list and whether the condition's status changed (an Event is due then).

    lastTransitionTime moves only when status changes, as the API conventions say.
    """
    text = "Unknown" if status is None else ("True" if status else "False")
    out = [dict(c) for c in conditions or []]
    for cond in out:
        if cond.get("type") == type_:
            changed = cond.get("status") != text
            if changed:
                cond["lastTransitionTime"] = now()
            cond.update(status=text, reason=reason, message=message, observedGeneration=generation)
            return out, changed
    out.append(
        {
            "type": type_,
            "status": text,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now(),
            "observedGeneration": generation,
        }
    )
    return out, True


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def spec_errors(exc: Any) -> str:
    """A pydantic ValidationError as the fields it names: ``spec.topology.gpus: Input should be ...; ...``."""
    try:
        errors = exc.errors()
    except AttributeError:
        return str(exc)
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(p) for p in e.get("loc") or ())
        parts.append(f"spec.{loc}: {e.get('msg', '')}" if loc else str(e.get("msg", "")))
    return "; ".join(parts) + ("; ..." if len(errors) > 5 else "")
