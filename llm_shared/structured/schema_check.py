"""Bounds a client's JSON schema must meet before llguidance sees it: plain JSON values, a bounded
depth and size, and ``$ref``s that point inside the schema.

Cheap, structural and done once at the boundary; whether llguidance supports every keyword is
learnt when the grammar compiles (``compiler.py``), which names the same field. The walk is
iterative and checks the depth first, so a 100,000-deep schema costs a bounded loop, not a
RecursionError from ``json.dumps``.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from collections.abc import Mapping
from typing import Any

from llm_shared.structured.errors import SchemaError
from llm_shared.structured.spec import StructuredLimits

# llguidance's compiler options, set by us at the top of every embedded schema: a client must not
# turn on ``lenient`` (which ignores what it cannot enforce) or change the whitespace rules.
COMPILER_OPTIONS_KEY = "x-guidance"


def canonical_schema(schema: Any, *, param: str, limits: StructuredLimits, object_root: bool = False) -> str:
    """The schema's compact JSON text (client key order kept, our compiler-options key dropped), or
    a ``SchemaError`` naming ``param`` and saying which bound it breaks."""
    if not isinstance(schema, Mapping):
        raise SchemaError(f"{param} must be a JSON schema object", param=param)
    if object_root and schema.get("type", "object") != "object":
        raise SchemaError(f"{param} must be a schema of type 'object', got type {schema.get('type')!r}", param=param)
    refs = _walk(schema, param=param, limits=limits)
    top = {k: v for k, v in schema.items() if k != COMPILER_OPTIONS_KEY}
    for where, ref in refs:
        _check_ref(top, ref, where=where, param=param)
    text = json.dumps(top, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    size = len(text.encode("utf-8"))
    if size > limits.max_schema_bytes:
        raise SchemaError(f"{param} is too large: {size} bytes of JSON, at most {limits.max_schema_bytes}", param=param)
    return text


def _walk(schema: Mapping[str, Any], *, param: str, limits: StructuredLimits) -> list[tuple[str, str]]:
    """Check every value is plain JSON within the depth bound; return the ``$ref``s with where
    each sits (a dotted path for messages)."""
    refs: list[tuple[str, str]] = []
    stack: list[tuple[Any, int, str]] = [(schema, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, (Mapping, list)) and depth > limits.max_schema_depth:
            raise SchemaError(
                f"{param} is nested too deeply (more than {limits.max_schema_depth} levels"
                f"{' at ' + where if where else ''})",
                param=param,
            )
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise SchemaError(f"{param} has a non-string key {key!r}", param=param)
                at = f"{where}.{key}" if where else key
                if key == "$ref" and isinstance(item, str):
                    refs.append((at, item))
                stack.append((item, depth + 1, at))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise SchemaError(f"{param} holds a number JSON cannot represent at {where}", param=param)
        elif not (value is None or isinstance(value, (str, int, float, bool))):
            raise SchemaError(f"{param} holds a {type(value).__name__}, which is not JSON, at {where}", param=param)
    return refs


def _check_ref(root: Mapping[str, Any], ref: str, *, where: str, param: str) -> None:
    """A ``$ref`` must be a JSON pointer into this schema ("#", "#/$defs/X"); remote references
    are never fetched. Anchor references ("#name") are left to the compiler."""
    if not ref.startswith("#"):
        raise SchemaError(
            f"{param}: $ref {ref!r} at {where} is not local; only references into the "
            "schema itself ('#/...') are supported",
            param=param,
        )
    if ref != "#" and not ref.startswith("#/"):
        return
    node: Any = root
    for raw in ref[2:].split("/") if ref != "#" else ():
        token = urllib.parse.unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise SchemaError(f"{param}: $ref {ref!r} at {where} points to nothing in the schema", param=param)
