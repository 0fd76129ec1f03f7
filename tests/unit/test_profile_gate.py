"""Which serving profiles are gated by profile_gate (a measured quality smoke) before a cell serves them: the lossy
ones only. The measurement and its verdicts on the real model are in tests/cell/test_profiles.py."""

from __future__ import annotations

import pytest

from modeld_cell import profile_gate, quality

pytestmark = pytest.mark.unit


def test_only_lossy_profiles_are_gated():
    assert profile_gate.gated_profiles("bf16", False) == [] and profile_gate.gated_profiles("fp32", False) == []
    assert profile_gate.gated_profiles("int8", True) == ["int8", "block-sparse"]
    assert profile_gate.gated_profiles("fp8-e4m3", False) == ["fp8-e4m3"]


def _result(ok: bool, reference_ok: bool) -> dict:
    return {"greedy_agreement": 1.0, "kl_mean": 0.0, "kl_max": 0.0,
            "capital": {"text": " Paris", "ok": True, "reference_ok": True},
            "passkey": {"text": " 1. 1.", "ok": ok, "reference_ok": reference_ok}}


def test_a_profile_fails_on_the_passkey_only_where_the_reference_finds_it():
    """A profile is judged on what it loses against the exact path: a miss the reference makes too is the model's
    (e.g. under RoPE scaling), recorded in the result and judged by the certification, not a profile failure."""
    assert quality.check("block-sparse", _result(ok=False, reference_ok=True)) == ["passkey failed: ' 1. 1.'"]
    assert quality.check("block-sparse", _result(ok=False, reference_ok=False)) == []
    assert quality.check("int8", _result(ok=True, reference_ok=True)) == []
    old = _result(ok=False, reference_ok=True)
    del old["passkey"]["reference_ok"]            # a result without the reference's answer: judged absolutely
    assert quality.check("int8", old) == ["passkey failed: ' 1. 1.'"]


def test_the_kernels_identity_is_the_isa_not_the_cpu_model(monkeypatch):
    """The cache identity's ``kernels`` holds what picks a CPU's kernels (ISA flags, torch's CPU capability, the
    variables that cap the ISA or change oneDNN's / MKL's rounding), not the model name nor torch's version (another
    field's); setting such a variable makes it another identity."""
    from modeld_cell.profile_gate import hardware, kernels_identity

    for var in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_DEFAULT_FPMATH_MODE"):
        monkeypatch.delenv(var, raising=False)
    hw, ident = hardware("cpu"), kernels_identity("cpu")
    assert "name" not in ident and "torch" not in ident
    assert ident == {k: v for k, v in hw.items() if k not in ("name", "torch")}
    assert ident["torch_cpu_capability"] == hw["torch_cpu_capability"] and "isa_flags" in ident
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert kernels_identity("cpu")["isa_env"] == {**ident["isa_env"], "MKL_CBWR": "COMPATIBLE"}
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    assert kernels_identity("cpu")["isa_env"]["ONEDNN_DEFAULT_FPMATH_MODE"] == "BF16"


def test_the_backend_version_moves_with_the_numerics_sources(tmp_path):
    """backend_version carries a hash of the sources that compute K/V bits (loader.NUMERICS_SOURCES), so a snapshot
    or a stored session never outlives the code that computed it, whatever the package's version string says."""
    from modeld_cell import loader

    assert f"(numerics {loader.numerics_hash()})" in loader.backend_version("torch")
    for name in loader.NUMERICS_SOURCES:
        p = tmp_path / name
        if "." in name:
            p.write_text("x = 1\n")
        else:
            (p / "sub").mkdir(parents=True)
            (p / "sub" / "k.c").write_text("int k;\n")
            (p / "notes.md").write_text("not code\n")
    before = loader.numerics_hash(tmp_path)
    (tmp_path / "notes.md").write_text("still not code\n")
    (tmp_path / "kernels" / "notes.md").write_text("changed, not code\n")
    assert loader.numerics_hash.__wrapped__(tmp_path) == before
    (tmp_path / "kernels" / "sub" / "k.c").write_text("int k = 1;\n")
    assert loader.numerics_hash.__wrapped__(tmp_path) != before
