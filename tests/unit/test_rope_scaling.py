"""spec.model.ropeScaling: the API's bounds, the worker's linear position interpolation (p encoded as p / factor),
the tier it then serves and the tiers and checkpoints it refuses, naming the field."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from modeld_api import RopeScaling, parse_cell_spec, validation_problems
from modeld_cell import errors
from modeld_cell.loader import scale_rope, serveable_tier
from modeld_cell.model import ModelArgs, Transformer

pytestmark = pytest.mark.unit

SPEC = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
        "model": {"family": "smollm2", "ref": "x.gguf"}, "contextTier": 512}


def tiny(**kw) -> Transformer:
    args = ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48,
                     max_seq_len=64, **kw)
    return Transformer(args)


@pytest.mark.parametrize("factor,ok", [(4, True), (1.5, True), (32, True), (1, False), (0.5, False), (33, False)])
def test_the_api_takes_a_factor_above_one_up_to_32(factor, ok):
    spec = {**SPEC, "model": {**SPEC["model"], "ropeScaling": {"factor": factor}}}
    if ok:
        assert parse_cell_spec(spec).model.ropeScaling.factor == factor
        return
    with pytest.raises(ValidationError) as e:
        parse_cell_spec(spec)
    assert [f for f, _ in validation_problems(e.value)] == ["model.ropeScaling.factor"]


def test_linear_scaling_encodes_position_p_as_p_over_factor_and_serves_trained_times_factor():
    plain, scaled = tiny(), tiny()
    with pytest.raises(errors.BadRequest, match="trained context 64; model.ropeScaling") as e:
        serveable_tier(plain, 128)
    assert e.value.details["field"] == "contextTier"
    scale_rope(scaled, RopeScaling(factor=4))
    a = scaled.args
    assert (a.max_seq_len, a.trained_max_seq_len, a.rope_scaling) == (256, 64, {"type": "linear", "factor": 4.0})
    assert serveable_tier(scaled, 256) == 256
    with pytest.raises(errors.BadRequest, match=r"trained context 64 x model.ropeScaling.factor 4"):
        serveable_tier(scaled, 257)
    # position 4p under factor 4 is the unscaled model's position p
    for p in (0, 1, 7, 15, 63):
        assert torch.allclose(scaled.rope_cos[4 * p], plain.rope_cos[p], atol=1e-5)
        assert torch.allclose(scaled.rope_sin[4 * p], plain.rope_sin[p], atol=1e-5)
    assert not torch.allclose(scaled.rope_cos[1], plain.rope_cos[1])


def test_no_scaling_leaves_the_model_as_trained():
    m = tiny()
    before = m.rope_cos.clone()
    scale_rope(m, None)
    assert m.args.trained_max_seq_len is None and torch.equal(m.rope_cos, before)


def test_a_checkpoint_that_scales_its_rope_already_is_refused_naming_the_field():
    m = tiny(rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(errors.Unsupported, match="already scales its RoPE") as e:
        scale_rope(m, RopeScaling(factor=4))
    assert e.value.details["field"] == "model.ropeScaling"
