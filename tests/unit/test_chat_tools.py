"""Tools through chat templates: the built-in GLM-4 and GLM-4.5 templates render tools, earlier calls and results;
the format is detected from the template; a template without tools gets the generic hermes prompt; and for every
format, a call as the template writes it is what the forced-call grammar accepts and what the parser reads back."""

from __future__ import annotations

import json

import pytest

from mlc.engine.grammar import GrammarCompiler
from mlc.models.chat_templates import GLM4_CHAT_TEMPLATE, GLM45_CHAT_TEMPLATE
from mlc.models.tokenizer import render_chat
from mlc.server.chat.tool_grammar import tool_call_grammar
from mlc.server.chat.tool_parsers import make_parser
from mlc.server.chat.tools import GENERIC_PROMPT, detect_format, for_template, setup_tools, template_knows_tools
from mlc.server.protocol.schemas_agent import NamedToolChoice, ToolDef
from tests.support.tiny_glm import build_glm_tokenizer
from tests.support.tiny_llama import CHATML

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city"]}}}
TOOLS = [ToolDef.model_validate(WEATHER)]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_glm_tokenizer(tmp_path_factory.mktemp("glmtok"), tags=True)


def _render(tok, template, messages, tools=None, **kw):
    tok.chat_template = template
    setup = setup_tools(tools, None, None, template, None)
    conversation, defs = for_template(messages, setup)
    return render_chat(tok, conversation, True, defs, kw or None)


def test_glm4_template_without_tools_is_unchanged(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "there"}, {"role": "user", "content": "again"}]
    assert _render(tok, GLM4_CHAT_TEMPLATE, msgs) == (
        "[gMASK]<sop><|system|>\nS<|user|>\nhi<|assistant|>\nthere<|user|>\nagain<|assistant|>")


def test_glm4_template_renders_tools_calls_and_observations(tok):
    text = _render(tok, GLM4_CHAT_TEMPLATE, CONVERSATION, TOOLS)
    assert text.startswith("[gMASK]<sop><|system|>\n# 可用工具\n\n## get_weather\n\n{\n    ")
    assert "在调用上述函数时，请使用 Json 格式表示调用的参数。<|user|>\nWeather in Paris?" in text
    assert text.endswith('<|assistant|>get_weather\n{"city": "Paris", "days": 2}<|observation|>\n{"temp": 21}'
                         "<|assistant|>")


def test_glm45_template_renders_tools_calls_results_and_thinking(tok):
    msgs = [*CONVERSATION, {"role": "tool", "content": "second", "tool_call_id": "call_1"}]
    text = _render(tok, GLM45_CHAT_TEMPLATE, msgs, TOOLS, enable_thinking=False)
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    assert "<|user|>\nWeather in Paris?/nothink<|assistant|>\n<think></think>\n<tool_call>get_weather\n" \
           "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>" \
           "\n</tool_call><|observation|>\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n" \
           "second\n</tool_response><|assistant|>\n<think></think>" in text
    thinking = _render(tok, GLM45_CHAT_TEMPLATE, [{"role": "user", "content": "hi"}])
    assert thinking.endswith("<|user|>\nhi<|assistant|>")  # the model opens <think> itself


def test_format_detection():
    assert detect_format(GLM45_CHAT_TEMPLATE) == "glm45" and detect_format(GLM4_CHAT_TEMPLATE) == "glm4"
    assert detect_format("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert detect_format("<|python_tag|>{{ tools }}") == "llama3_json"
    assert detect_format(CHATML) == "hermes" and not template_knows_tools(CHATML)
    assert template_knows_tools(GLM4_CHAT_TEMPLATE) and template_knows_tools(GLM45_CHAT_TEMPLATE)


def test_template_without_tools_gets_the_generic_hermes_prompt(tok):
    text = _render(tok, CHATML, [{"role": "system", "content": "Be brief."}, *CONVERSATION], TOOLS)
    prompt = GENERIC_PROMPT.format(tools=json.dumps(WEATHER, ensure_ascii=False))
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{prompt}<|im_end|>\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
            "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>"
            ) in text


def _assistant_part(tok, template: str) -> str:
    """What the template writes for the assistant's call: the model's own format."""
    tok.chat_template = template
    setup = setup_tools(TOOLS, None, None, template, None)
    before, _ = for_template(CONVERSATION[:1], setup)
    upto, _ = for_template(CONVERSATION[:2], setup)
    head = render_chat(tok, before, True, setup.tools if setup.native else None)
    full = render_chat(tok, upto, False, setup.tools if setup.native else None)
    return full[len(head):]


@pytest.mark.parametrize("template,fmt", [(GLM45_CHAT_TEMPLATE, "glm45"), (GLM4_CHAT_TEMPLATE, "glm4"),
                                          (CHATML, "hermes")])
def test_a_call_as_the_template_writes_it_is_what_the_grammar_forces_and_the_parser_reads(tok, template, fmt):
    part = _assistant_part(tok, template)
    if fmt == "hermes":
        part = part.removesuffix("<|im_end|>\n")
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    setup = setup_tools(TOOLS, named, None, template, None)
    assert setup.format == fmt and setup.forced
    matcher = GrammarCompiler(tok, {tok.eos_token_id}, len(tok)).compile(
        tool_call_grammar(setup, tok.get_added_vocab())).matcher()
    assert matcher.consume_tokens(tok.encode(part, add_special_tokens=False)) and matcher.is_accepting(), part
    parser = make_parser(fmt, setup.schemas)
    events = [e for e in parser.feed(part) + parser.finish() if not isinstance(e, tuple) or e[1].strip()]
    if fmt == "glm45":
        events = [e for e in events if not isinstance(e, tuple)]  # "<think></think>" is the reasoning splitter's
    assert len(events) == 1 and json.loads(events[0].arguments) == {"city": "Paris", "days": 2}


def test_bad_tool_definitions_are_400s_naming_the_field():
    from mlc.errors import InvalidRequestError

    bad = ToolDef.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": 5}}})
    with pytest.raises(InvalidRequestError) as e:
        setup_tools([bad], None, None, None, None)
    assert e.value.field == "tools[0].function.parameters"
    with pytest.raises(InvalidRequestError) as e:
        setup_tools(TOOLS * 2, None, None, None, None)
    assert e.value.field == "tools[1].function.name"
    unknown = NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidRequestError) as e:
        setup_tools(TOOLS, unknown, None, None, None)
    assert e.value.field == "tool_choice" and "get_weather" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        setup_tools(None, "required", None, None, None)
    assert e.value.field == "tool_choice"
