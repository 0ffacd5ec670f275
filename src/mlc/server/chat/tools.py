"""Tool calling for /v1/chat/completions: which format the model speaks, the tools and tool_choice of a request,
and the conversation as the chat template takes it.

The format is read from the chat template (or set with --tool-call-parser): `<arg_key>` -> glm45, GLM-4's
"在调用上述函数时" -> glm4, `<tool_call>` -> hermes, `<|python_tag|>` / ipython -> llama3_json. A template that
renders `tools` itself gets them through `apply_chat_template(tools=...)`; one that knows no tools (the default
model's) gets them in a system message in the generic hermes format (`GENERIC_PROMPT`, documented in the README),
with earlier calls and results written out as that format's text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mlc.errors import InvalidRequestError, UnsupportedFeatureError
from mlc.server.chat.tool_parsers import PARSER_NAMES, ToolParser, make_parser
from mlc.server.protocol.schemas_agent import (
    AllowedToolsChoice,
    FunctionDef,
    NamedCustomChoice,
    NamedFunction,
    NamedToolChoice,
    ToolDef,
)
from mlc.server.protocol.schemas_openai import FunctionName

GENERIC_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def detect_format(template: str | None) -> str:
    t = template or ""
    if "<arg_key>" in t:
        return "glm45"
    if "在调用上述函数时" in t:
        return "glm4"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def template_knows_tools(template: str | None) -> bool:
    """Whether the template reads a `tools` variable (jinja's own analysis; a substring test if it will not
    parse outside transformers)."""
    if not template:
        return False
    try:
        from jinja2 import Environment, meta

        return "tools" in meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"]).parse(
            template))
    except Exception:  # transformers' own tags ({% generation %}) make plain jinja refuse the template
        return "tools" in template


@dataclass
class ToolSetup:
    tools: list[dict]  # the request's definitions as dicts, for the template
    schemas: dict[str, dict]  # function name -> its parameters schema
    choice: str  # none, auto, required or named
    named: str | None
    parallel: bool  # a forced call may be followed by more only when the request says parallel_tool_calls: true
    format: str
    native: bool  # the template renders the tools itself
    names: dict[str, str] = field(default_factory=dict)  # tool call id -> function name (earlier calls)

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def parser(self) -> ToolParser:
        return make_parser(self.format, self.schemas)


def _check_schema(schema: dict, field_name: str) -> None:
    try:
        from jsonschema import SchemaError, validators
    except ImportError:  # jsonschema is optional: then only the grammar engine checks forced calls' schemas
        return
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise InvalidRequestError(f"{field_name} is not a valid JSON Schema: {e.message}", field=field_name) from None
    if schema.get("type", "object") != "object":
        raise InvalidRequestError(f"{field_name} must describe an object (\"type\": \"object\"): arguments are "
                                  "always a JSON object", field=field_name)


@dataclass
class RequestedTools:
    tools: list[ToolDef] | None
    choice: str | NamedToolChoice | None
    parallel: bool | None
    legacy: bool  # asked with OpenAI's deprecated functions / function_call: answered in that shape


def requested_tools(tools: list[ToolDef] | None, choice, parallel: bool | None, functions: list[FunctionDef] | None,
                    function_call) -> RequestedTools:
    """A request's tools as one list and one choice: the legacy `functions` / `function_call` become function tools
    and their tool_choice (one call at most, as that API returns one), and an `allowed_tools` choice narrows the
    tools to those it names."""
    if functions is not None or function_call is not None:
        if tools is not None or choice is not None:
            raise InvalidRequestError("functions / function_call cannot combine with tools / tool_choice; send "
                                      "tools only (functions is their deprecated form)", field="functions")
        if isinstance(function_call, FunctionName):
            function_call = NamedToolChoice(type="function", function=NamedFunction(name=function_call.name))
        defs = [ToolDef(type="function", function=f) for f in functions or []]
        return RequestedTools(defs or None, function_call, False, True)
    if isinstance(choice, NamedCustomChoice):
        raise UnsupportedFeatureError("tool_choice: custom tools (free-form input) are not supported; name a function "
                                      "tool", field="tool_choice")
    if isinstance(choice, AllowedToolsChoice):
        names = {t.get("function", {}).get("name") for t in choice.allowed_tools.tools if isinstance(t.get("function"),
                                                                                                 dict)}
        tools = [t for t in tools or [] if t.function is not None and t.function.name in names] or None
        if tools is None:
            raise InvalidRequestError("tool_choice.allowed_tools.tools names none of the request's function tools",
                                      field="tool_choice.allowed_tools.tools")
        choice = choice.allowed_tools.mode
    return RequestedTools(tools, choice, parallel, False)


def setup_tools(tools: list[ToolDef] | None, choice, parallel: bool | None, template: str | None,
                override: str | None) -> ToolSetup | None:
    """The request's tools, checked (400s name the field), or None when it has none."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools: send the functions in tools, or drop tool_choice",
                                      field="tool_choice")
        return None
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if tool.type == "custom":
            raise UnsupportedFeatureError(f"tools[{i}]: custom tools (free-form input) are not supported; declare a "
                                          "function tool with a JSON Schema of its arguments", field=f"tools[{i}]")
        if tool.function is None:
            raise InvalidRequestError(f"tools[{i}].function is missing; a function tool needs its name and "
                                      "parameters", field=f"tools[{i}].function")
        name = tool.function.name
        if name in schemas:
            raise InvalidRequestError(f"tools[{i}].function.name {name!r} is given twice; function names must be "
                                      "unique", field=f"tools[{i}].function.name")
        params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
        _check_schema(params, f"tools[{i}].function.parameters")
        schemas[name] = params
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in schemas:
            raise InvalidRequestError(f"tool_choice names function {named!r}, which is not in tools (known: "
                                      f"{', '.join(schemas)})", field="tool_choice")
    kind = "named" if named else (choice or "auto")
    fmt = override or detect_format(template)
    if fmt not in PARSER_NAMES:
        raise InvalidRequestError(f"unknown tool call format {fmt!r}", field="tools")
    defs = [tool.model_dump(exclude_none=True) for tool in tools]
    return ToolSetup(defs, schemas, kind, named, parallel is True, fmt, template_knows_tools(template))


def call_arguments(arguments, field_name: str) -> dict:
    """An earlier call's arguments as an object (templates iterate them); a JSON string must hold an object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{field_name} is not JSON ({e.msg}); send the arguments object as a JSON string",
                                  field=field_name) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field_name} must be a JSON object", field=field_name)
    return value


def for_template(conversation: list[dict], setup: ToolSetup | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template: as they are for a template that renders tools, else with the
    generic system prompt and earlier calls and results written out in the hermes format."""
    if setup is None or setup.native:
        return [_native(m) for m in conversation], (setup.tools if setup is not None else None)
    tools_text = "\n".join(json.dumps(t, ensure_ascii=False) for t in setup.tools)
    prompt = GENERIC_PROMPT.format(tools=tools_text)
    out: list[dict] = []
    for m in conversation:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(p for p in (m.get("content"), calls) if p)})
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_result": True})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return [{k: v for k, v in m.items() if k != "tool_result"} for m in out], None


def _native(m: dict) -> dict:
    if m.get("content") is None and m["role"] == "assistant":
        return {**m, "content": ""}  # templates concatenate content: None would fail
    return m
