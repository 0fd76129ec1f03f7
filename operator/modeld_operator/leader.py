"""Leader election over a coordination.k8s.io/v1 Lease, so several operator replicas never act at once.

kopf's own peering is not leader election: operators of equal priority all freeze (docs.kopf.dev "Peering"), and a
higher priority must be configured by hand. So the operator runs kopf only while it holds a Lease, the way
client-go's leaderelection package and controller-runtime's managers do: a candidate takes the Lease when it is
free or its holder stopped renewing it for ``duration`` seconds, the leader renews it every ``retry_s`` seconds
(optimistic concurrency on the resourceVersion: of two candidates only one update wins), and a leader that cannot
renew before its own lease runs out stops kopf and exits non-zero, so its pod restarts as a candidate. A leader that
stops cleanly gives the Lease up (holderIdentity cleared), so a standby takes over at once instead of after
``duration``.

``decide`` is the pure part (tests/unit/test_leader.py); ``run`` is the loop (tests/e2e: two operator processes,
the leader killed with SIGKILL, the standby takes over and nothing is created twice).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("modeld_operator.leader")


def identity() -> str:
    """This process among the candidates: the pod's name (its hostname) and the process id."""
    return f"{socket.gethostname()}_{os.getpid()}"


@dataclass(frozen=True)
class LeaseView:
    holder: str | None
    renewed: dt.datetime | None
    duration_s: int


def decide(lease: LeaseView | None, me: str, now: dt.datetime) -> str:
    """What a candidate does with the Lease as it reads it: "create" (none exists), "renew" (it is ours), "take" (free,
    or its holder stopped renewing it), or "wait" (another holds it)."""
    if lease is None:
        return "create"
    if lease.holder == me:
        return "renew"
    if not lease.holder or lease.renewed is None or now - lease.renewed > dt.timedelta(seconds=lease.duration_s):
        return "take"
    return "wait"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _view(obj: Any) -> LeaseView:
    spec = obj.spec or client.V1LeaseSpec()
    return LeaseView(spec.holder_identity, spec.renew_time, spec.lease_duration_seconds or 15)


class Elector:
    def __init__(self, namespace: str, name: str, duration_s: int, me: str | None = None) -> None:
        self.namespace, self.name, self.duration_s = namespace, name, duration_s
        self.me = me or identity()
        self.api = client.CoordinationV1Api()

    def attempt(self) -> bool:
        """One read and at most one write; True when this process holds the Lease afterwards."""
        try:
            obj = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("lease %s/%s: read failed: %s %s", self.namespace, self.name, exc.status, exc.reason)
                return False
            obj = None
        now = _now()
        action = decide(_view(obj) if obj is not None else None, self.me, now)
        if action == "wait":
            return False
        spec = client.V1LeaseSpec(holder_identity=self.me, lease_duration_seconds=self.duration_s, renew_time=now)
        try:
            if action == "create":
                spec.acquire_time, spec.lease_transitions = now, 0
                self.api.create_namespaced_lease(self.namespace, client.V1Lease(
                    metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace), spec=spec))
            else:
                assert obj is not None
                old = obj.spec or client.V1LeaseSpec()
                if action == "take":
                    spec.acquire_time = now
                    spec.lease_transitions = (old.lease_transitions or 0) + 1
                else:
                    spec.acquire_time, spec.lease_transitions = old.acquire_time, old.lease_transitions
                obj.spec = spec       # replace carries obj's resourceVersion: a concurrent writer makes it 409
                self.api.replace_namespaced_lease(self.name, self.namespace, obj)
        except ApiException as exc:
            if exc.status not in (409, 422):
                log.warning("lease %s/%s: %s failed: %s %s", self.namespace, self.name, action, exc.status, exc.reason)
            return False
        if action != "renew":
            log.info("lease %s/%s: %s, now held by %s", self.namespace, self.name, action, self.me)
        return True

    def release(self) -> None:
        """Give the Lease up (a clean stop): a standby takes it at its next attempt."""
        try:
            obj = self.api.read_namespaced_lease(self.name, self.namespace)
            if obj.spec is not None and obj.spec.holder_identity == self.me:
                obj.spec.holder_identity, obj.spec.renew_time = None, None
                self.api.replace_namespaced_lease(self.name, self.namespace, obj)
                log.info("lease %s/%s: released by %s", self.namespace, self.name, self.me)
        except ApiException as exc:
            log.warning("lease %s/%s: release failed: %s %s", self.namespace, self.name, exc.status, exc.reason)


async def run(elector: Elector, lead: Callable[[asyncio.Event], Awaitable[None]], retry_s: float) -> int:
    """Wait for the Lease, then ``lead(stop)`` while renewing it every ``retry_s``; returns the exit status: 0 after a
    clean stop, 1 when the Lease was lost (the pod restarts as a candidate). The caller loaded the kube config (the
    Elector's client needs it)."""
    waiting_logged = False
    while not await asyncio.to_thread(elector.attempt):
        if not waiting_logged:
            log.info("lease %s/%s: held by another replica; standing by as %s", elector.namespace, elector.name,
                     elector.me)
            waiting_logged = True
        await asyncio.sleep(retry_s)
    stop = asyncio.Event()
    lost = False

    async def renew() -> None:
        nonlocal lost
        last = _now()
        while not stop.is_set():
            await asyncio.sleep(retry_s)
            if await asyncio.to_thread(elector.attempt):
                last = _now()
            elif _now() - last > dt.timedelta(seconds=elector.duration_s):
                log.error("lease %s/%s: not renewed for %d s; stopping so another replica can lead",
                          elector.namespace, elector.name, elector.duration_s)
                lost = True
                stop.set()

    renewer = asyncio.create_task(renew())
    try:
        await lead(stop)
    finally:
        stop.set()
        renewer.cancel()
        if not lost:
            await asyncio.to_thread(elector.release)
    return 1 if lost else 0
