"""Random PEFT LoRA adapters for a Llama-style checkpoint (adapter_config.json + adapter_model.safetensors, PEFT's
names and shapes), for benchmarks and tests: no training run and no peft import needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_dims(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-style layer, from its config.json."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapter(out: Path, model_dir: Path, rank: int = 8, alpha: float | None = None,
                         targets: tuple[str, ...] = ALL_LINEAR, seed: int = 0, std: float = 0.05,
                         rslora: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """A rank-`rank` adapter on `targets` of every layer of the checkpoint at `model_dir`, weights N(0, std)."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    dims = projection_dims(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for name in targets:
            fan_in, fan_out = dims[name]
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{stem}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * std).to(dtype)
            tensors[f"{stem}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * std).to(dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": rslora,
           "base_model_name_or_path": str(model_dir)}
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return out
