"""What planning needs to know about a model, read from the architecture itself built on torch's "meta" device
(no memory): exact parameter counts by kind and the per-token KV cache layout (`kv_cache_spec()`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlc.errors import ModelFormatError, ModelNotFoundError
from mlc.models.hf_checkpoint import read_config_json
from mlc.plan.shapes import SHAPES, hf_config_for, shape_names

# Modules kept in the compute dtype when weights are quantized (lookups, tiny or accuracy-critical matrices).
_KEEP_UNQUANTIZED = {"lm_head", "embed_tokens", "gate", "weights_proj"}


@dataclass
class ModelFacts:
    name: str
    source: str  # "built-in shape", or the config.json path
    model_type: str
    hf_config: Any  # a transformers PretrainedConfig: which fields it has depends on the architecture
    total_params: int
    quantizable_params: int  # linear and expert matrices: what int8/int4 weights shrink
    embedding_params: int  # input embedding rows (read by lookup, not streamed per token)
    routed_expert_params: int
    n_experts: int
    top_k: int
    buffer_bytes: int  # persistent buffers (e.g. the fp32 router correction bias)
    kv_spec: list[dict[str, tuple[int, ...]]] = field(repr=False)
    tied_embeddings: bool = False

    @property
    def active_params(self) -> int:
        """Parameters one token's forward touches (all but the unpicked routed experts)."""
        if not self.n_experts:
            return self.total_params
        return self.total_params - round(self.routed_expert_params * (1 - self.top_k / self.n_experts))

    @property
    def max_context(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 0) or 4096)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def is_mla(self) -> bool:
        return bool(getattr(self.hf_config, "kv_lora_rank", None))


def _config_source(model: str) -> tuple[dict, str]:
    """config.json values and where they came from: a path (file or dir), the store, or a built-in shape."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        return read_config_json(path), str(path)
    if path.is_dir():
        return read_config_json(path / "config.json"), str(path / "config.json")
    from mlc.models.store import resolve_model_dir
    from mlc.models.store.paths import is_pulled, store_path

    if is_pulled(model):
        config = store_path(model) / "config.json"
        return read_config_json(config), str(config)
    if model.lower() in SHAPES:
        return dict(SHAPES[model.lower()]), "built-in shape"
    if path.suffix == ".gguf" and path.is_file():
        config = resolve_model_dir(path) / "config.json"
        return read_config_json(config), str(config)
    from mlc.models.store.resolve import hub_config, hub_spec

    spec = hub_spec(model)
    config_path = hub_config(spec) if spec is not None else None
    if config_path is not None:
        return read_config_json(config_path), str(config_path)
    hub = f"; for a hub id, `mlc-cli plan -m {model} --pull` reads its config.json from the hub" if spec else ""
    raise ModelNotFoundError(
        f"model {model!r} is neither a config.json, a checkpoint dir, a pulled store model nor a built-in shape "
        f"(built-in: {', '.join(shape_names())}){hub}"
    )


def _build_on_meta(hf_config):
    from mlc.models.hf_checkpoint import build_model

    try:
        return build_model(hf_config, torch.device("meta"), torch.bfloat16)
    except ModelFormatError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelFormatError(
            f"the {hf_config.model_type} architecture cannot be built from this config: {e}") from None


def _persistent_buffer_bytes(net: torch.nn.Module) -> int:
    """Bytes of the buffers a checkpoint holds (rotary tables are derived, not stored)."""
    return sum(
        b.numel() * b.element_size()
        for m in net.modules()
        for name, b in m._buffers.items()
        if b is not None and name not in m._non_persistent_buffers_set
    )


def inspect_model(model: str) -> ModelFacts:
    values, source = _config_source(model)
    from mlc.models.registry import model_class

    model_class(values.get("model_type", "<missing>"))  # unsupported architectures fail here, with the list
    try:
        hf_config = hf_config_for(values)
    except (TypeError, ValueError, KeyError) as e:
        raise ModelFormatError(f"{source}: not a valid {values.get('model_type')} config: {e}") from None
    net = _build_on_meta(hf_config)
    total = quantizable = embedding = experts = 0
    for name, p in net.named_parameters():  # shared (tied) parameters are listed once
        n = p.numel()
        total += n
        if name.endswith("embed_tokens.weight"):
            embedding += n
        if ".experts." in name and ".shared_experts." not in name:
            experts += n
        owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if p.dim() >= 2 and owner not in _KEEP_UNQUANTIZED:
            quantizable += n
    buffers = _persistent_buffer_bytes(net)
    return ModelFacts(
        name=model,
        source=source,
        model_type=hf_config.model_type,
        hf_config=hf_config,
        total_params=total,
        quantizable_params=quantizable,
        embedding_params=embedding,
        routed_expert_params=experts,
        n_experts=int(getattr(hf_config, "n_routed_experts", 0) or 0),
        top_k=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
        buffer_bytes=buffers,
        kv_spec=net.kv_cache_spec(),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
