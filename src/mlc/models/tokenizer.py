"""Tokenizer loading (transformers' fast tokenizer from a local checkpoint dir) and chat-prompt rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlc.errors import InvalidRequestError, ModelFormatError
from mlc.models.chat_templates import GLM4_CHAT_TEMPLATE, builtin_template  # noqa: F401 (re-exported)

# Arguments of apply_chat_template that a request's chat_template_kwargs must not replace.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "return_dict", "return_tensors", "chat_template", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask",
})


def _model_type(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError):
        return None


def load_tokenizer(model_dir: str | Path):
    """The fast tokenizer of a local checkpoint dir; GLM-family dirs without a chat template get a built-in one
    (`models/chat_templates.py`: GLM-4's, or GLM-4.5's for the MoE generations)."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise ModelFormatError(
            f"{model_dir} has no tokenizer.json or tokenizer_config.json; the checkpoint is incomplete")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, use_fast=True)
    except Exception as e:  # transformers raises OSError, ValueError or JSON errors for broken tokenizer files
        raise ModelFormatError(
            f"the tokenizer in {model_dir} could not be loaded ({e}); re-download the checkpoint") from None
    builtin = builtin_template(_model_type(model_dir))
    if not getattr(tokenizer, "chat_template", None) and builtin is not None:
        tokenizer.chat_template = builtin
    return tokenizer


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text for `messages` (`[{"role": ..., "content": ...}]`) in the model's chat format; `tools`
    (OpenAI function definitions) and `template_kwargs` (e.g. enable_thinking) go to the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelFormatError(
            "this model has no chat template (tokenizer_config.json has no chat_template); "
            "use plain completion (`mlc-cli generate`) or add a template to the checkpoint"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"message {i} needs 'role' and 'content'", field=f"messages[{i}]")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except Exception as e:  # jinja raises TemplateError (e.g. the template's own raise_exception) or TypeError
        raise InvalidRequestError(f"the chat template rejected these messages: {e}", field="messages") from None


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every end-of-sequence id the config, the tokenizer and generation_config name."""
    ids: set[object] = set()  # whatever the configs give; only the ints are kept
    for source in (getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        extra = gen.get("eos_token_id")
        ids.update(extra if isinstance(extra, list) else [extra])
    return {i for i in ids if isinstance(i, int)}
