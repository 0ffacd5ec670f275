"""OpenAI's published OpenAPI spec (openai/openai-openapi, MIT licence), trimmed to the operations mlc serves, and
what the fuzz test does to it before fuzzing: pin `model` to the served id, and close the request objects
(`additionalProperties: false`), since the spec leaves them open while it means its listed fields: a field it does
not list is what mlc refuses without --api-lenient.

The vendored copy is `openai_openapi/openai-openapi-f85dbe2-served.json.gz` (see the README there). To make it again
from the whole spec: `python -m tests.support.openai_spec WHOLE.json.gz` (it rewrites the vendored file).
"""

from __future__ import annotations

import copy
import gzip
import json
import sys
from pathlib import Path

VENDORED = Path(__file__).parent / "openai_openapi" / "openai-openapi-f85dbe2-served.json.gz"
SERVED = {"/chat/completions": ["post"], "/completions": ["post"], "/models": ["get"], "/models/{model}": ["get"]}


def _refs(node, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/"):
            found.add(ref)
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def trim(spec: dict) -> dict:
    """The spec with only the served operations and the components they reach."""
    paths = {p: {m: spec["paths"][p][m] for m in methods} for p, methods in SERVED.items()}
    out = {k: spec[k] for k in ("openapi", "info", "servers", "security") if k in spec}
    out["paths"] = paths
    components: dict[str, dict] = {"securitySchemes": spec["components"].get("securitySchemes", {})}
    todo, seen = set(), set()
    _refs(paths, todo)
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        _, _, kind, name = ref.split("/", 3)
        node = spec["components"][kind][name]
        components.setdefault(kind, {})[name] = node
        found: set[str] = set()
        _refs(node, found)
        todo |= found - seen
    out["components"] = components
    return out


def load() -> dict:
    with gzip.open(VENDORED, "rt", encoding="utf-8") as f:
        return json.load(f)


def _close(node, schemas: dict, skip: set[str], seen: set[str]) -> None:
    """additionalProperties: false on every object schema with properties under `node`, following $refs (but not
    into `skip`, the schemas responses use too)."""
    if isinstance(node, list):
        for value in node:
            _close(value, schemas, skip, seen)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name not in seen and name not in skip and name in schemas:
            seen.add(name)
            _close(schemas[name], schemas, skip, seen)
        return
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for key, value in node.items():
        if key != "properties":
            _close(value, schemas, skip, seen)
    for value in node.get("properties", {}).values():
        _close(value, schemas, skip, seen)


def _response_schemas(spec: dict) -> set[str]:
    found: set[str] = set()
    for operations in spec["paths"].values():
        for operation in operations.values():
            _refs(operation.get("responses", {}), found)
    todo, names = set(found), set()
    while todo:
        name = todo.pop().rsplit("/", 1)[-1]
        if name in names or name not in spec["components"]["schemas"]:
            continue
        names.add(name)
        more: set[str] = set()
        _refs(spec["components"]["schemas"][name], more)
        todo |= more
    return names


def _flatten(schemas: dict, name: str) -> dict:
    """An allOf of objects as one object (closing each part alone would forbid the other parts' fields)."""
    node = schemas[name]
    if "allOf" not in node:
        return node
    parts = [_flatten(schemas, p["$ref"].rsplit("/", 1)[-1]) if "$ref" in p else p for p in node["allOf"]]
    flat = {k: v for k, v in node.items() if k != "allOf"} | {"type": "object", "properties": {}, "required": []}
    for part in parts:
        flat["properties"].update(part.get("properties", {}))
        flat["required"] += [r for r in part.get("required", []) if r not in flat["required"]]
    return flat


def pinned(model: str) -> dict:
    """The vendored spec with every request's `model` (body field and path parameter) fixed to the served id and
    its request objects closed."""
    spec = copy.deepcopy(load())
    schemas = spec["components"]["schemas"]
    schemas["CreateChatCompletionRequest"] = _flatten(schemas, "CreateChatCompletionRequest")
    skip, seen = _response_schemas(spec), set()
    for operations in spec["paths"].values():
        for operation in operations.values():
            _close(operation.get("requestBody", {}), spec["components"]["schemas"], skip, seen)
    const = {"type": "string", "enum": [model]}
    for name in ("CreateChatCompletionRequest", "CreateCompletionRequest"):
        for part in [schemas[name], *schemas[name].get("allOf", [])]:
            if "model" in part.get("properties", {}):
                part["properties"]["model"] = const
    for parameter in spec["paths"]["/models/{model}"]["get"].get("parameters", []):
        if parameter.get("name") == "model":
            parameter["schema"] = const
    return spec


if __name__ == "__main__":
    with gzip.open(sys.argv[1], "rt", encoding="utf-8") as f:
        whole = json.load(f)
    with gzip.GzipFile(VENDORED, "wb", mtime=0) as f:
        f.write(json.dumps(trim(whole), indent=1, ensure_ascii=False).encode() + b"\n")
    print(f"wrote {VENDORED}")
