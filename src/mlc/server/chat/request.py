"""A chat completion request made ready for the engine, on the tokenizer thread: its tools, the prompt under the
chat template (with chat_template_kwargs), the grammar its output must follow, and how to read the reply
(reasoning, tool calls)."""

from __future__ import annotations

from dataclasses import dataclass

from mlc.engine.grammar import GrammarSpec
from mlc.errors import InvalidRequestError
from mlc.models.tokenizer import RESERVED_TEMPLATE_KWARGS
from mlc.server.chat.assistant_output import AssistantOutput
from mlc.server.chat.messages import render
from mlc.server.chat.reasoning import ReasoningSplitter, starts_inside, template_reasons
from mlc.server.chat.structured import compile_grammar, requested_spec
from mlc.server.chat.tool_grammar import tool_call_grammar
from mlc.server.chat.tools import ToolSetup, requested_tools, setup_tools
from mlc.server.prompting import Prompt, encode
from mlc.server.protocol.schemas import ChatCompletionRequest
from mlc.server.protocol.schemas_openai import THINKING_OFF
from mlc.server.state import ServerState, loaded_engine


@dataclass
class ChatPlan:
    prompt: Prompt
    tools: ToolSetup | None
    grammar: GrammarSpec | None
    reasoning: bool  # the template's model thinks in <think>: split it out as reasoning_content
    inside: bool  # the prompt opened <think> for the model
    legacy: bool = False  # asked with the deprecated functions: the call comes back as message.function_call
    prediction: list[int] | None = None  # OpenAI's predicted output, tokenized: a draft source for the engine

    def output(self) -> AssistantOutput:
        """A fresh reader of one choice's text."""
        splitter = ReasoningSplitter(self.inside) if self.reasoning else None
        parser = self.tools.parser() if self.tools is not None and self.tools.parses else None
        return AssistantOutput(splitter, parser, self.legacy)


def template_kwargs(body: ChatCompletionRequest, template: str | None = None) -> dict | None:
    """chat_template_kwargs, checked, plus enable_thinking from reasoning_effort for a template that reads it
    (GLM-4.5+: none and minimal turn thinking off); chat_template_kwargs' own enable_thinking wins."""
    kwargs = dict(body.chat_template_kwargs or {})
    bad = [k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS or not k.isidentifier()]
    if bad:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {bad[0]!r} (reserved, or not a name); set it "
                                  "with its own request field", field="chat_template_kwargs")
    if body.reasoning_effort is not None and template is not None and "enable_thinking" in template:
        kwargs.setdefault("enable_thinking", body.reasoning_effort not in THINKING_OFF)
    return kwargs or None


def plan_chat(state: ServerState, body: ChatCompletionRequest, context: int) -> ChatPlan:
    template = getattr(loaded_engine(state).tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    asked = requested_tools(body.tools, body.tool_choice, body.parallel_tool_calls, body.functions,
                            body.function_call)
    tools = setup_tools(asked.tools, asked.choice, asked.parallel, template, state.config.tool_call_parser)
    prompt = render(state, body.messages, True, context, tools, template_kwargs(body, template))
    forced = None
    if tools is not None and tools.forced:  # tags that are added tokens must be forced as those tokens
        forced = tool_call_grammar(tools, loaded_engine(state).tokenizer.get_added_vocab())
    grammar = compile_grammar(state, requested_spec(body, forced))
    reasons = template_reasons(template)
    return ChatPlan(prompt, tools, grammar, reasons, reasons and starts_inside(prompt.text or ""), asked.legacy,
                    predicted(state, body, context))


def predicted(state: ServerState, body: ChatCompletionRequest, context: int) -> list[int] | None:
    """The prediction's text as tokens (no special tokens): the engine drafts from them by prompt lookup, and
    verifies every draft, so the output is the same with or without them."""
    if body.prediction is None:
        return None
    content = body.prediction.content
    text = content if isinstance(content, str) else "".join(part.text for part in content)
    if not text:
        return None
    return encode(state, text, "prediction.content", False, context).ids
