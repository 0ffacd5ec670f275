"""A reward model trained with `stage: rm`, loaded back from its adapter dir and used to score replies.

The adapter dir (`output_dir/adapter`, a checkpoint, or `mlc-cli export` without --merge) holds the LoRA weights and
the head (`score`, saved by PEFT as a module to save); the base model is the one its adapter_config.json names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlc.errors import ModelFormatError
from mlc.models.store import resolve_model_dir
from mlc.models.tokenizer import load_tokenizer
from mlc.train.data import collate
from mlc.train.model import adapter_base, load_adapter, load_base_model
from mlc.train.preprocess import pad_row, pad_token_id, tokenize_messages

HEAD = "score"


def is_reward_adapter(adapter_dir: str | Path) -> bool:
    try:
        config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return HEAD in (config.get("modules_to_save") or [])


def add_reward_head(base) -> torch.nn.Linear:
    """A fresh hidden -> 1 head on `base` as `base.score`, initialised like transformers' classification heads."""
    head = torch.nn.Linear(base.config.hidden_size, 1, bias=False)
    torch.nn.init.normal_(head.weight, std=getattr(base.config, "initializer_range", 0.02))
    ref = base.get_output_embeddings().weight
    setattr(base, HEAD, head.to(device=ref.device, dtype=ref.dtype))
    return head


def last_token_scores(peft_model, batch: dict, device: torch.device) -> torch.Tensor:
    """The head on each row's last real token (rows right-padded), as fp32."""
    base = peft_model.get_base_model()
    decoder = getattr(base, base.base_model_prefix)
    hidden = decoder(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                     use_cache=False).last_hidden_state
    last = batch["attention_mask"].sum(-1).to(device) - 1
    picked = hidden[torch.arange(hidden.shape[0], device=device), last]
    return getattr(base, HEAD)(picked).squeeze(-1).float()


class RewardModel:
    def __init__(self, adapter_dir: str | Path, model: str | None = None, device: str = "cpu"):
        adapter_dir = Path(adapter_dir)
        if not is_reward_adapter(adapter_dir):
            raise ModelFormatError(f"{adapter_dir} is not a reward model (its adapter_config.json has no "
                                   f"modules_to_save: [{HEAD}]); train one with stage: rm")
        model_dir = resolve_model_dir(model or adapter_base(adapter_dir))
        self.tokenizer = load_tokenizer(model_dir)
        base = load_base_model(model_dir, torch.float32, device)
        add_reward_head(base)
        self.model = load_adapter(base, adapter_dir).eval()
        self.device = torch.device(device)

    @torch.no_grad()
    def score(self, prompt: str | list[dict], replies: list[str]) -> list[float]:
        """One scalar per reply to `prompt` (a user message, or the conversation so far); higher is preferred."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        pad = pad_token_id(self.tokenizer)
        rows = [pad_row(*tokenize_messages(self.tokenizer, [*messages, {"role": "assistant", "content": r}]), 1, pad)
                for r in replies]
        return last_token_scores(self.model, collate(rows, pad), self.device).tolist()


def load_reward_model(adapter_dir: str | Path, model: str | None = None, device: str = "cpu") -> RewardModel:
    return RewardModel(adapter_dir, model, device)
