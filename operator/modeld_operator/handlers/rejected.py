"""Nothing accepted and then dropped: a Cell or Session the apiserver took but the operator cannot realize gets a
condition and a Warning Event with the reason (the field it names), never a reason only in the operator's log.

Handlers raise kopf.PermanentError for what no retry can fix: a spec the API's own model refuses (the CRD's schema
and CEL let through something the operator's model does not: a bug between the two, which the user must still
see), or the apiserver refusing a write the operator derived from the spec (a Deployment, a Job, a status).
``surfaced`` reports those on the object as ``Reconciled=False`` (reason ``Rejected``; a Cell's phase ``Failed``)
and re-raises, so kopf stops retrying; ``Reported`` marks a PermanentError whose reason the handler already wrote
(a Session no cell can ever fit). A later successful reconcile sets ``Reconciled=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import kopf

from modeld_operator import kube
from modeld_operator.conditions import get_condition, set_condition

F = TypeVar("F", bound=Callable[..., Any])
CONDITION, REASON = "Reconciled", "Rejected"


class Reported(kopf.PermanentError):
    """A permanent failure whose reason the handler already put on the object's status."""


def report(plural: str, namespace: str, name: str, body: Any, message: str) -> None:
    status = dict(body.get("status") or {})
    generation = (body.get("metadata") or {}).get("generation")
    message = message[:1000]
    conditions, changed = set_condition(status.get("conditions"), CONDITION, False, REASON, message, generation)
    patch: dict[str, Any] = {"conditions": conditions, "phase": "Failed" if plural == "cells" else "Pending"}
    if plural == "sessions":
        patch["reason"] = message
    if get_condition(status.get("conditions"), CONDITION) != get_condition(conditions, CONDITION):
        kube.patch_status(plural, namespace, name, patch)
    if changed:
        emit(body, "Warning", REASON, message)


def emit(body: Any, type: str, reason: str, message: str) -> None:
    """An Event on the object: kopf's (queued, posted by kopf) inside a kopf handler; posted at once outside one
    (the Session retry sweep, which kopf does not run)."""
    try:
        kopf.event(body, type=type, reason=reason, message=message)
    except LookupError:           # kopf's event queue is bound only in the context of its handlers
        kube.post_event(body, type, reason, message)


def accepted(plural: str, namespace: str, name: str, body: Any, patch: Any = None) -> None:
    """After a successful reconcile: clear an earlier rejection (nothing written when there was none). With kopf's
    ``patch``, into the conditions the handler put there (kopf writes it after this, and a list in a merge patch
    replaces the stored one whole: written apart, the handler's older list would undo it)."""
    status = dict(body.get("status") or {})
    old = get_condition(status.get("conditions"), CONDITION)
    if old is None or old.get("status") == "True":
        return
    generation = (body.get("metadata") or {}).get("generation")
    pending = patch.get("status") if patch is not None else None
    base = pending["conditions"] if isinstance(pending, dict) and pending.get("conditions") else status.get("conditions")
    conditions, _ = set_condition(base, CONDITION, True, "Reconciled", "reconciled", generation)
    if patch is None:
        kube.patch_status(plural, namespace, name, {"conditions": conditions})
    else:
        patch.setdefault("status", {})["conditions"] = conditions


def holds(status: dict[str, Any], generation: int | None) -> bool:
    """The status carries a rejection of this generation (a Cell's status refresh keeps its phase Failed then)."""
    cond = get_condition(status.get("conditions"), CONDITION)
    return bool(cond and cond.get("status") == "False" and cond.get("observedGeneration") == generation)


def surfaced(plural: str, clears: bool = True) -> Callable[[F], F]:
    """Wrap a kopf handler: a PermanentError it raises is reported on the object (see the module's doc); when
    ``clears``, a success clears an earlier rejection (the reconcile handlers; a timer's success says nothing of
    what its reconcile handler was refused)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def handler(*args: Any, **kw: Any) -> Any:
            try:
                out = fn(*args, **kw)
            except Reported:
                raise
            except kopf.PermanentError as exc:
                namespace = kw.get("namespace")
                if namespace:
                    report(plural, namespace, kw["name"], kw["body"], str(exc))
                raise
            if clears and kw.get("namespace"):
                accepted(plural, kw["namespace"], kw["name"], kw["body"], kw.get("patch"))
            return out

        return handler  # type: ignore[return-value]

    return wrap
