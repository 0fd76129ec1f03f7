"""The report's JSON Schema (certification.schema.json, draft 2020-12) and a small validator for the subset it uses:
type, const, enum, required, properties, additionalProperties, items, minItems, minimum, maximum, minLength, pattern,
anyOf and local ``$ref`` (``#/$defs/...``). No third-party dependency, so the certification Job needs nothing more."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources
from typing import Any

_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


@lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    return json.loads(resources.files("modeld_cell.certify").joinpath("certification.schema.json").read_text())


def _is(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def errors(value: Any, schema: dict[str, Any] | None = None, path: str = "$") -> list[str]:
    """Every violation as ``path: message``; empty when ``value`` is valid."""
    root = load() if schema is None else schema
    return _check(value, root, root, path)


def _check(v: Any, s: dict[str, Any], root: dict[str, Any], path: str) -> list[str]:
    if "$ref" in s:
        node: Any = root
        for part in s["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return _check(v, node, root, path)
    if "anyOf" in s:
        if not any(not _check(v, sub, root, path) for sub in s["anyOf"]):
            return [f"{path}: matches none of anyOf"]
        return []
    out: list[str] = []
    if "const" in s and v != s["const"]:
        out.append(f"{path}: must be {s['const']!r}")
    if "enum" in s and v not in s["enum"]:
        out.append(f"{path}: {v!r} not one of {s['enum']}")
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is(v, t) for t in types):
            return out + [f"{path}: expected {'/'.join(types)}, got {type(v).__name__}"]
    if _is(v, "number"):
        if "minimum" in s and v < s["minimum"]:
            out.append(f"{path}: {v} < minimum {s['minimum']}")
        if "maximum" in s and v > s["maximum"]:
            out.append(f"{path}: {v} > maximum {s['maximum']}")
    if isinstance(v, str):
        if len(v) < s.get("minLength", 0):
            out.append(f"{path}: shorter than {s['minLength']}")
        if "pattern" in s and not re.search(s["pattern"], v):
            out.append(f"{path}: {v!r} does not match {s['pattern']}")
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0):
            out.append(f"{path}: fewer than {s['minItems']} items")
        if "items" in s:
            for i, x in enumerate(v):
                out += _check(x, s["items"], root, f"{path}[{i}]")
    if isinstance(v, dict):
        props = s.get("properties", {})
        out += [f"{path}: missing {k!r}" for k in s.get("required", []) if k not in v]
        extra = s.get("additionalProperties", True)
        for k, x in v.items():
            if k in props:
                out += _check(x, props[k], root, f"{path}.{k}")
            elif extra is False:
                out.append(f"{path}: unexpected {k!r}")
            elif isinstance(extra, dict):
                out += _check(x, extra, root, f"{path}.{k}")
    return out
