"""The training model: a transformers causal LM with a PEFT LoRA adapter, and the masked token loss."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mlc.config.device import DTYPES, resolve_device
from mlc.config.train_config import LoraSection
from mlc.errors import ConfigError, DeviceError, ModelFormatError
from mlc.train.data import model_inputs
from mlc.train.preprocess import IGNORE_INDEX


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CPUs with bf16 units (AMX / AVX512-BF16), else fp32; bf16 where the accelerator has it
    (else fp16). Without bf16 units a CPU runs bf16 matmuls hundreds of times slower than fp32."""
    if precision == "auto":
        if device.type == "cpu":
            from mlc.config.hardware import detect_cpu

            return torch.bfloat16 if detect_cpu().has_bf16_units else torch.float32
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    return DTYPES[precision]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision around the forward; fp32 runs plain."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def quiet_hf() -> None:
    """No per-tensor loading bars or deprecation chatter from transformers/peft/datasets in our output."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def load_base_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    from mlc.models.hf_checkpoint import transformers_model
    from mlc.models.store.verifying import check_at_load

    check_at_load(model_dir)  # a store model whose weights differ from its manifest would train on garbage
    quiet_hf()
    dev = resolve_device(device)
    try:
        model = transformers_model(model_dir, dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelFormatError(f"{model_dir}: transformers could not load it as a causal LM ({e})") from None
    model.config.use_cache = False  # training and scoring never reuse a cache
    try:
        return model.to(dev)
    except RuntimeError as e:
        raise DeviceError(f"could not move the model to {dev}: {e}") from None


def linear_module_names(model) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def attach_lora(model, lora: LoraSection, modules_to_save: list[str] | None = None):
    """Wrap `model` with a fresh LoRA adapter; base weights frozen, adapter weights in `lora.dtype`.
    `modules_to_save`: whole modules trained and saved with the adapter (the reward stage's head)."""
    from peft import LoraConfig, get_peft_model

    targets = lora.resolved_target_modules()
    available = linear_module_names(model)
    missing = [t for t in targets if t not in available and t != "all-linear"]
    if missing:
        raise ConfigError(
            f"lora.target_modules: {missing} match no linear layer of this model; "
            f"its linear layers are: {', '.join(available)} (aliases: query, key, value, dense)"
        )
    config = LoraConfig(
        # peft annotates lora_alpha as int; it only scales by lora_alpha / r, and the config allows any alpha > 0
        r=lora.r, lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout, target_modules=targets,
        bias="none", task_type="CAUSAL_LM", modules_to_save=modules_to_save,
    )
    peft_model = get_peft_model(model, config)
    adapter_dtype = DTYPES[lora.dtype]
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.to(adapter_dtype)
    return peft_model


def load_adapter(model, adapter_dir: str | Path, trainable: bool = False):
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ModelFormatError(f"{adapter_dir} is not a PEFT adapter (no adapter_config.json)")
    try:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelFormatError(f"{adapter_dir}: adapter does not fit this base model ({e})") from None


CE_CHUNK_TOKENS = 512  # target tokens whose logits exist at once in `loss_sum` (512 x 49,152 fp32: 96 MiB)
# transformers model types whose logits are exactly the head applied to the decoder's output (no scaling, capping or
# multiplier between them); any other type takes the plain path
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "glm", "glm4", "glm4_moe",
                                    "glm_moe_dsa"})


def loss_sum(model, batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Summed next-token cross entropy over unmasked labels (fp32); callers divide by the token count.

    The output head runs only at positions that carry a label, `CE_CHUNK_TOKENS` of them at a time, each chunk's
    logits recomputed in the backward (activation checkpointing) rather than kept: batch x tokens x vocabulary logits
    never exist at once (about 1.2 GB at 2,048 tokens for the default model), and masked prompt tokens cost no head.
    A model wrapped for data parallelism, or of a type not known to apply its head plainly, takes the plain path."""
    parts = _decoder_and_head(model)
    targets = batch["labels"][:, 1:].to(device)
    if parts is None:
        with autocast(device, dtype):
            logits = model(**model_inputs(batch, device)).logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    decoder, head = parts
    with autocast(device, dtype):
        hidden = decoder(**model_inputs(batch, device)).last_hidden_state[:, :-1]
    keep = targets != IGNORE_INDEX
    hidden, targets = hidden[keep], targets[keep]
    total = hidden.sum() * 0.0  # a batch without targets still gives a graph (every parameter's gradient 0)
    for i in range(0, hidden.shape[0], CE_CHUNK_TOKENS):
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_ce, head, hidden[i : i + CE_CHUNK_TOKENS], targets[i : i + CE_CHUNK_TOKENS], device, dtype,
            use_reentrant=False)
    return total.float()


def _chunk_ce(head, hidden: torch.Tensor, targets: torch.Tensor, device: torch.device,
              dtype: torch.dtype) -> torch.Tensor:
    with autocast(device, dtype):
        logits = head(hidden)
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def _decoder_and_head(model):
    """(the decoder that gives the final hidden states, the output head) of a transformers causal LM (PEFT-wrapped or
    not), or None where calling them apart from the model's forward would change the result."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):  # its gradient hooks hang on its own forward
        return None
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(causal, "config", None), "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    try:
        decoder, head = causal.get_decoder(), causal.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return (decoder, head) if decoder is not None and head is not None and decoder is not causal else None


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_base(adapter: Path) -> str:
    """The base model recorded in the adapter's config (a checkpoint dir or store name)."""
    try:
        config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{adapter} is not a PEFT adapter (adapter_config.json unreadable: {e})") from None
    base = config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{adapter}/adapter_config.json names no base model; pass --model")
    return base
