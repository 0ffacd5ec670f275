"""Tokenizer loading (transformers' fast tokenizer from a local checkpoint dir) and chat-prompt rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlc.errors import InvalidRequestError, ModelFormatError

# GLM-4 chat format (LLaMA-Factory's glm4 template): the model writes the newline after <|assistant|> itself.
GLM4_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>\n{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}"
    "{% elif message['role'] in ('tool', 'observation') %}<|observation|>\n{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GLM_MODEL_TYPES = ("glm", "glm4", "glm4_moe", "glm_moe_dsa", "chatglm")


def _model_type(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError):
        return None


def load_tokenizer(model_dir: str | Path):
    """The fast tokenizer of a local checkpoint dir; GLM-family dirs without a chat template get GLM-4's."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise ModelFormatError(f"{model_dir} has no tokenizer.json or tokenizer_config.json; the checkpoint is incomplete")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, use_fast=True)
    except Exception as e:  # transformers raises OSError, ValueError or JSON errors for broken tokenizer files
        raise ModelFormatError(f"the tokenizer in {model_dir} could not be loaded ({e}); re-download the checkpoint") from None
    if not getattr(tokenizer, "chat_template", None) and (_model_type(model_dir) or "") in GLM_MODEL_TYPES:
        tokenizer.chat_template = GLM4_CHAT_TEMPLATE
    return tokenizer


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` (`[{"role": ..., "content": ...}]`) in the model's chat format."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelFormatError(
            "this model has no chat template (tokenizer_config.json has no chat_template); "
            "use plain completion (`mlc-cli generate`) or add a template to the checkpoint"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"message {i} needs 'role' and 'content'", field=f"messages[{i}]")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises TemplateError (e.g. the template's own raise_exception) or TypeError
        raise InvalidRequestError(f"the chat template rejected these messages: {e}", field="messages") from None
