"""Which serving profiles are gated by profile_gate (a measured quality smoke) before a cell serves them: the lossy
ones only. The measurement and its verdicts on the real model are in tests/cell/test_profiles.py."""

from __future__ import annotations

import pytest

from modeld_cell import profile_gate

pytestmark = pytest.mark.unit


def test_only_lossy_profiles_are_gated():
    assert profile_gate.gated_profiles("bf16", False) == [] and profile_gate.gated_profiles("fp32", False) == []
    assert profile_gate.gated_profiles("int8", True) == ["int8", "block-sparse"]
    assert profile_gate.gated_profiles("fp8-e4m3", False) == ["fp8-e4m3"]
