"""The OpenAPI document is generated from the code and committed; drift between the two fails here."""

from __future__ import annotations

import pytest

from modeld_cell import openapi
from modeld_cell.server import create_app

pytestmark = pytest.mark.unit


def test_committed_openapi_matches_the_generator():
    assert openapi.COMMITTED.exists(), "run: python -m modeld_cell.openapi --write"
    assert openapi.COMMITTED.read_text() == openapi.render(), (
        "cellimage/modeld_cell/openapi.json is stale: run `python -m modeld_cell.openapi --write` and commit it"
    )


def test_every_route_is_documented_and_every_documented_route_served():
    app = create_app()
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    doc = openapi.build()
    documented = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
    assert served == documented


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
