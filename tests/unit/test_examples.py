"""Every example manifest is one the API accepts, and says truthfully whether this worker version serves it: an
example whose comment says "Not served" is refused by modeld_api.served, every other one is served."""

from __future__ import annotations

import pathlib

import pytest
import yaml

import modeld_api as api
from modeld_api.served import unserved

pytestmark = pytest.mark.unit

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_is_valid_and_served_as_its_comment_says(path):
    text = path.read_text()
    obj = yaml.safe_load(text)
    if obj["kind"] != "Cell":
        api.SessionSpec.model_validate(obj["spec"])
        return
    refused = unserved(api.parse_cell_spec(obj))
    comment = " ".join(ln for ln in text.splitlines() if ln.startswith("#"))
    assert bool(refused) == ("Not served" in comment), (path.name, refused)
