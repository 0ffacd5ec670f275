"""Which grammar a request's output must follow: OpenAI's response_format (json_object, json_schema with strict),
vLLM's structured_outputs {json, regex, choice, grammar, json_object} and its older guided_* fields, or the forced
tool call of tool_choice required / named. At most one of them, as a `GrammarSpec` in the request's SamplingParams;
the engine compiles it (once per distinct spec) when asked on the tokenizer thread, and a spec that cannot compile
is a 400 naming its field.
"""

from __future__ import annotations

import dataclasses
import json

from mlc.engine.grammar import GrammarSpec
from mlc.errors import InvalidRequestError
from mlc.server.protocol.schemas_agent import StructuredFields
from mlc.server.state import ServerState, loaded_engine


def _schema(value, field: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{field} is not JSON ({e.msg}); send a JSON Schema", field=field) from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(f"{field} must be a JSON Schema object", field=field)
    return value


def _response_format(body: StructuredFields) -> tuple[GrammarSpec, str] | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object"), "response_format"
    if rf.json_schema is None:
        raise InvalidRequestError("response_format json_schema needs its json_schema: {\"name\": ..., \"schema\": "
                                  "{...}}", field="response_format.json_schema")
    field = "response_format.json_schema.schema"
    return GrammarSpec.json_schema(_schema(rf.json_schema.schema_, field), bool(rf.json_schema.strict)), field


def _vllm(body: StructuredFields) -> list[tuple[GrammarSpec, str]]:
    found: list[tuple[GrammarSpec, str]] = []
    so = body.structured_outputs
    if so is not None:
        kinds = ("json_", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(so, k) not in (None, False)]
        if len(given) > 1:
            names = ", ".join(k.rstrip("_") for k in given)
            raise InvalidRequestError(f"structured_outputs gives {names}; give exactly one", field="structured_outputs")
        if given:
            kind = given[0].rstrip("_")
            found.append((_spec(kind, getattr(so, given[0]), f"structured_outputs.{kind}"),
                          f"structured_outputs.{kind}"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            found.append((_spec(kind, value, f"guided_{kind}"), f"guided_{kind}"))
    return found


def _spec(kind: str, value, field: str) -> GrammarSpec:
    """The grammar for one structured-output field: json (a schema), choice, json_object, regex or grammar."""
    if kind == "json":
        return GrammarSpec.json_schema(_schema(value, field), False)
    if kind == "choice":
        return GrammarSpec.choice(value)
    if kind == "json_object":
        return GrammarSpec("json_object")
    return GrammarSpec(kind, value)


def requested_spec(body: StructuredFields, forced_tools: GrammarSpec | None = None) -> tuple[GrammarSpec, str] | None:
    """The one (spec, field) the request asks for, or None; two at once is a 400 naming the second."""
    found = [f for f in [_response_format(body)] if f is not None] + _vllm(body)
    if forced_tools is not None:
        if found:
            raise InvalidRequestError(f"{found[0][1].split('.')[0]} cannot combine with tool_choice required or a "
                                      "named function (that forces a tool call); drop one", field=found[0][1])
        found.append((forced_tools, "tool_choice"))
    if len(found) > 1:
        raise InvalidRequestError(f"{found[0][1]} and {found[1][1]} both constrain the output; send one",
                                  field=found[1][1])
    return found[0] if found else None


def compile_grammar(state: ServerState, spec: tuple[GrammarSpec, str] | None) -> GrammarSpec | None:
    """The spec for the request's SamplingParams, compiled by the engine now, on the tokenizer thread (off_loop):
    the first grammar also builds llguidance's tokenizer."""
    if spec is None:
        return None
    named = dataclasses.replace(spec[0], field=spec[1])
    loaded_engine(state).compile_grammar(named)
    return named
