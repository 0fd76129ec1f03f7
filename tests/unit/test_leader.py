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
