"""The OpenAPI document is generated from the code and committed; drift between the two fails here, and so does a
request the document and the models judge differently (tests/cell/test_server_fuzz.py does the same on a worker)."""

from __future__ import annotations

import json

import pytest

from modeld_cell import openapi, schemas, server
from modeld_cell.server import create_app

pytestmark = pytest.mark.unit


def test_committed_openapi_matches_the_generator():
    assert openapi.COMMITTED.exists(), "run: python -m modeld_cell.openapi --write"
    assert openapi.COMMITTED.read_text() == openapi.render(), (
        "cellimage/modeld_cell/openapi.json is stale: run `python -m modeld_cell.openapi --write` and commit it"
    )


def test_every_route_is_documented_and_every_documented_route_served():
    """Every route but the OpenAI-compatible ones, which follow OpenAI's own published API (openai_api.py)."""
    app = create_app()
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    doc = openapi.build()
    documented = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
    assert served - documented == {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                   ("GET", "/v1/models"), ("GET", "/health")}
    assert documented <= served


def test_request_bodies_forbid_unknown_fields_and_errors_are_typed():
    doc = openapi.build()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody")
            if body:
                name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                assert schemas[name]["additionalProperties"] is False, (method, path)
            for status, resp in op["responses"].items():
                if status != "200":
                    assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


# (model, body): the document's schema and the pydantic model must agree on each (both accept or both refuse).
AGREE = [
    (schemas.PrefixRequest, {"tokens": [1]}),
    (schemas.PrefixRequest, {"text": "x", "tokens": None, "messages": None, "add_generation_prompt": None}),
    (schemas.PrefixRequest, {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True}),
    (schemas.PrefixRequest, {}),
    (schemas.PrefixRequest, {"tokens": None}),
    (schemas.PrefixRequest, {"tokens": [1], "text": "x"}),
    (schemas.PrefixRequest, {"tokens": [1], "text": None}),
    (schemas.PrefixRequest, {"text": "x", "add_generation_prompt": False}),
    (schemas.PrefixRequest, {"tokens": [1], "messages": [{"role": "user", "content": "x"}],
                             "add_generation_prompt": False}),
    (schemas.SuffixRequest, {"tokens": []}),
    (schemas.SuffixRequest, {"text": "", "messages": [{"role": "user", "content": "x"}]}),
    (schemas.TokenizeRequest, {"text": "x"}),
    (schemas.TokenizeRequest, {"tokens": [1]}),
    (schemas.TokenizeRequest, {"text": "x", "tokens": None}),
    (schemas.SnapshotRequest, {"path": "a/b.snap"}),
    (schemas.SnapshotRequest, {"path": "_x/.hidden-ok/y"}),
    (schemas.SnapshotRequest, {"path": "../x"}),
    (schemas.SnapshotRequest, {"path": "/x"}),
    (schemas.SnapshotRequest, {"path": "a/./b"}),
    (schemas.SnapshotRequest, {"path": "a/"}),
    (schemas.SnapshotRequest, {"path": "a" * 129}),
    (schemas.DecodeRequest, {"top_k": 10**6, "max_tokens": 1, "seed": 2**63 - 1}),
    (schemas.DecodeRequest, {"seed": 2**63}),
]


@pytest.mark.parametrize(("model", "body"), AGREE, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(AGREE)])
def test_the_document_and_the_models_agree_on_what_is_valid(model, body):
    import jsonschema_rs

    doc = openapi.build()
    valid = jsonschema_rs.validator_for({"$ref": openapi.REF.format(model=model.__name__), **doc}).is_valid(body)
    try:
        model.model_validate(body)
        accepted = True
    except ValueError:
        accepted = False
    assert valid == accepted, (model.__name__, body, valid, accepted)


def test_model_bounds_are_numbers_in_the_served_document():
    committed = json.loads(openapi.COMMITTED.read_text())
    served = openapi.build(vocab_size=49152)
    assert served == openapi.for_model(committed, 49152)
    defs = served["components"]["schemas"]
    assert defs["DecodeRequest"]["properties"]["top_k"]["maximum"] == 49152
    assert defs["DecodeRequest"]["properties"]["stop_token_ids"]["items"]["maximum"] == 49151
    assert defs["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 49151
    assert "maximum" not in committed["components"]["schemas"]["DecodeRequest"]["properties"]["top_k"]


@pytest.mark.parametrize(("text", "want"), [
    ("2", 2), ("2.0", 2), ("2e3", 2000), ("-0.0", 0), ("9223372036854775807.0", 2**63 - 1), ("2.5", 2.5),
    ("1.0000000000000000001", 1.0), ("1e31", 1e31), ("1e400", float("inf")), ("5e-324", 5e-324),
])
def test_json_numbers_are_read_as_json_schema_reads_them(text, want):
    got = schemas.loads(text)
    assert got == want and type(got) is type(want), (text, got)


def test_session_ids_match_as_ecma_patterns_do():
    assert server.SESSION_ID.fullmatch("a.b_c-1") and not server.SESSION_ID.fullmatch("abc\n")
