"""The Lease decisions of leader election (leader.decide): create, renew, take a free or expired Lease, or wait."""

from __future__ import annotations

import datetime as dt

import pytest

from modeld_operator import leader
from modeld_operator.settings import Settings

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def lease(holder: str | None, renewed_s_ago: float | None, duration: int = 15) -> leader.LeaseView:
    renewed = None if renewed_s_ago is None else NOW - dt.timedelta(seconds=renewed_s_ago)
    return leader.LeaseView(holder, renewed, duration)


@pytest.mark.parametrize("view, action", [
    (None, "create"),
    (lease("me", 3), "renew"),
    (lease("me", 60), "renew"),            # ours even if late: renewing it is what keeps it
    (lease("other", 3), "wait"),
    (lease("other", 15), "wait"),          # exactly the duration: still the holder's
    (lease("other", 15.5), "take"),        # not renewed for longer than the duration
    (lease(None, None), "take"),           # released by a clean stop
    (lease("", 1), "take"),
    (lease("other", None), "take"),
])
def test_a_candidate_decides_from_the_lease_as_it_reads_it(view, action):
    assert leader.decide(view, "me", NOW) == action


def test_leader_election_needs_the_lease_namespace():
    with pytest.raises(ValueError, match="MODELD_LEASE_NAMESPACE"):
        Settings.from_env({"MODELD_LEADER_ELECTION": "true"})
    s = Settings.from_env({"MODELD_LEADER_ELECTION": "true", "MODELD_LEASE_NAMESPACE": "modeld-system"})
    assert s.leader_election and s.lease_name == "modeld-operator" and s.lease_duration == 15
    with pytest.raises(ValueError, match="at least 3"):
        Settings.from_env({"MODELD_LEASE_DURATION": "1"})


class FlakyLease:
    """An Elector that wins the Lease once, then renews only while ``renewals`` lasts: a stand-in for an apiserver
    that stops answering (the loop under test is leader.run; the Lease calls are Elector's)."""

    namespace, name, me = "modeld-system", "modeld-operator", "me"

    def __init__(self, renewals: int, duration_s: float) -> None:
        self.renewals, self.duration_s, self.released, self.calls = renewals, duration_s, False, 0

    def attempt(self) -> bool:
        self.calls += 1
        if self.calls == 1:
            return True
        self.renewals -= 1
        return self.renewals >= 0

    def release(self) -> None:
        self.released = True


def test_a_leader_that_cannot_renew_stops_leading_and_exits_1_without_releasing():
    import asyncio

    elector = FlakyLease(renewals=2, duration_s=0.3)
    led = []

    async def lead(stop: asyncio.Event) -> None:
        led.append("start")
        await stop.wait()                     # kopf.operator(stop_flag=stop) returns once the flag is set
        led.append("stopped")

    rc = asyncio.run(asyncio.wait_for(leader.run(elector, lead, retry_s=0.02), timeout=30))  # type: ignore[arg-type]
    assert rc == 1 and led == ["start", "stopped"] and not elector.released
    assert elector.calls > 3                  # it went on trying after the renewals stopped working


def test_a_clean_stop_releases_the_lease():
    import asyncio

    elector = FlakyLease(renewals=10**6, duration_s=30)

    async def lead(stop: asyncio.Event) -> None:
        await asyncio.sleep(0.05)             # kopf returning by itself (SIGTERM)

    assert asyncio.run(leader.run(elector, lead, retry_s=0.01)) == 0  # type: ignore[arg-type]
    assert elector.released


def test_a_lease_call_that_times_out_is_a_failed_attempt_not_an_exception():
    import urllib3

    class Hanging:
        def read_namespaced_lease(self, *_a, **kw):
            assert kw["_request_timeout"] == pytest.approx(3.0)     # a fifth of the duration
            raise urllib3.exceptions.ReadTimeoutError(None, "/apis/coordination.k8s.io", "read timed out")

    elector = leader.Elector("modeld-system", "modeld-operator", 15, me="me")
    elector.api = Hanging()  # type: ignore[assignment]
    assert elector.attempt() is False
