"""Leader election over a coordination.k8s.io/v1 Lease, so several operator replicas never act at once.

kopf's own peering is not leader election: operators of equal priority all freeze (docs.kopf.dev "Peering"), and a
higher priority must be configured by hand. So the operator runs kopf only while it holds a Lease, the way
client-go's leaderelection package and controller-runtime's managers do: a candidate takes the Lease when it is
free or its holder stopped renewing it for ``duration`` seconds, the leader renews it every ``retry_s`` seconds
(optimistic concurrency on the resourceVersion: of two candidates only one update wins), and a leader that has not
renewed for two thirds of the duration (client-go's renewDeadline) stops kopf and exits non-zero, so its pod
restarts as a candidate, and it stopped before a standby may take over. A leader that
stops cleanly gives the Lease up (holderIdentity cleared), so a standby takes over at once instead of after
``duration``.

``decide`` is the pure part (tests/unit/test_leader.py); ``run`` is the loop (tests/e2e: two operator processes,
the leader killed with SIGKILL, the standby takes over and nothing is created twice).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import urllib3
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
        # A renewal that hangs must fail in time to be retried before the Lease runs out: a call stuck past it would
        # leave this process leading after a standby took over.
        self.timeout = max(1.0, duration_s / 5)

    def attempt(self) -> bool:
        """One read and at most one write; True when this process holds the Lease afterwards. A call that fails or
        times out is a failed attempt (logged), never an exception: the renewal loop must go on counting."""
        try:
            return self._attempt()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("lease %s/%s: unreachable: %s", self.namespace, self.name, exc)
            return False

    def _attempt(self) -> bool:
        try:
            obj = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.timeout)
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
                    metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace), spec=spec),
                    _request_timeout=self.timeout)
            else:
                assert obj is not None
                old = obj.spec or client.V1LeaseSpec()
                if action == "take":
                    spec.acquire_time = now
                    spec.lease_transitions = (old.lease_transitions or 0) + 1
                else:
                    spec.acquire_time, spec.lease_transitions = old.acquire_time, old.lease_transitions
                obj.spec = spec       # replace carries obj's resourceVersion: a concurrent writer makes it 409
                self.api.replace_namespaced_lease(self.name, self.namespace, obj, _request_timeout=self.timeout)
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
            obj = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.timeout)
            if obj.spec is not None and obj.spec.holder_identity == self.me:
                obj.spec.holder_identity, obj.spec.renew_time = None, None
                self.api.replace_namespaced_lease(self.name, self.namespace, obj, _request_timeout=self.timeout)
                log.info("lease %s/%s: released by %s", self.namespace, self.name, self.me)
        except ApiException as exc:
            log.warning("lease %s/%s: release failed: %s %s", self.namespace, self.name, exc.status, exc.reason)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("lease %s/%s: release failed: %s", self.namespace, self.name, exc)


async def run(elector: Elector, lead: Callable[[asyncio.Event], Awaitable[None]], retry_s: float) -> int:
    """Wait for the Lease, then ``lead(stop)`` while renewing it every ``retry_s``; returns the exit status: 0 after a
    clean stop, 1 when the Lease was lost (the pod restarts as a candidate). The caller loaded the kube config (the
    Elector's client needs it)."""
    # The elector's calls get a thread of their own: nothing queued in a shared pool can delay a renewal.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")
    loop = asyncio.get_running_loop()

    async def attempt() -> bool:
        return await loop.run_in_executor(pool, elector.attempt)

    waiting_logged = False
    while not await attempt():
        if not waiting_logged:
            log.info("lease %s/%s: held by another replica; standing by as %s", elector.namespace, elector.name,
                     elector.me)
            waiting_logged = True
        await asyncio.sleep(retry_s)
    stop = asyncio.Event()
    lost = False

    async def renew() -> None:
        nonlocal lost
        # Like client-go's renewDeadline: give up at two thirds of the duration since the last renewal was written
        # (its renewTime, taken before the call), so this process stops before a standby may take the Lease.
        deadline = dt.timedelta(seconds=elector.duration_s * 2 / 3)
        last = _now()
        while not stop.is_set():
            await asyncio.sleep(retry_s)
            started = _now()
            if await attempt():
                last = started
            elif _now() - last > deadline:
                log.error("lease %s/%s: not renewed for %.0f s of its %d; stopping so another replica can lead",
                          elector.namespace, elector.name, (_now() - last).total_seconds(), elector.duration_s)
                lost = True
                stop.set()

    renewer = asyncio.create_task(renew())
    try:
        await lead(stop)
    finally:
        stop.set()
        renewer.cancel()
        if not lost:
            await loop.run_in_executor(pool, elector.release)
        pool.shutdown(wait=False)
    return 1 if lost else 0
