"""Serving PEFT LoRA adapters: several adapters and the base model in one batch.

An adapter is read from PEFT's format (adapter_config.json + adapter_model.safetensors) and mapped onto our modules
by each architecture's own weight-name mapping, so `q_proj` lands on the q rows of the fused `qkv_proj`. Targeted
modules are wrapped in `LoRALinear`, which adds `scale * (x A^T) B^T` to the rows of the tokens that use the adapter.
Which rows use which adapter is set per forward with `lora_rows(...)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mlc.errors import ModelFormatError

_ROWS: contextvars.ContextVar[dict[int, slice | torch.Tensor] | None] = contextvars.ContextVar(
    "lora_rows", default=None)


@contextlib.contextmanager
def lora_rows(rows: dict[int, slice | torch.Tensor] | None):
    """During the block, tokens at `rows[adapter_id]` (flat rows of the batch) run with that adapter."""
    token = _ROWS.set(rows or None)
    try:
        yield
    finally:
        _ROWS.reset(token)


@dataclass
class LoRADelta:
    start: int  # output columns this delta adds to (a shard of a fused projection)
    stop: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.deltas: dict[int, list[LoRADelta]] = {}

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)  # shard_sizes, in_features, split, ... of the wrapped layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = _ROWS.get()
        if not rows:
            return y
        for adapter_id, idx in rows.items():
            for d in self.deltas.get(adapter_id, ()):
                part = (x[idx] @ d.a.t()) @ d.b.t()
                y[idx, d.start : d.stop] += d.scale * part.to(y.dtype)
        return y


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    alpha: float
    scale: float
    target_modules: list[str]
    num_tensors: int


def read_adapter(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(path).expanduser()
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ModelFormatError(
            f"{path} is not a PEFT adapter (no adapter_config.json); export one with `mlc-cli export`")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_file} is not valid JSON ({e})") from None
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ModelFormatError(f"{path} has no adapter_model.safetensors (.bin adapters are not read)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ModelFormatError(f"{weights} is truncated or corrupt ({e})") from None
    return cfg, tensors


def _check_supported(cfg: dict, path: Path) -> None:
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise ModelFormatError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise ModelFormatError(
                f"{path}: {key}={bad} adapters are not supported for serving; merge it with `mlc-cli export --merge`")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ModelFormatError(f"{path}: adapters with trained biases or modules_to_save are not supported for "
                               "serving; serve the merged export instead")


def attach_adapter(model, adapter_id: int, name: str, path: Path) -> LoRAAdapter:
    """Wrap the adapter's target modules of `model` (once) and register its deltas under `adapter_id`."""
    path = Path(path)
    cfg, tensors = read_adapter(path)
    _check_supported(cfg, path)
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in stem:
                module = stem.split(marker)[0]
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise ModelFormatError(f"{path}: unexpected tensor {key!r} in the adapter")
    modules = dict(model.named_modules())
    plan = []
    for hf_module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ModelFormatError(f"{path}: {hf_module} has only {sorted(ab)}; the adapter file is incomplete")
        target = model.map_weight_name(hf_module + ".weight")
        if target is None or target.expert is not None:
            raise ModelFormatError(f"{path}: LoRA on {hf_module} is not supported for serving (only attention and "
                                   "dense MLP projections); serve the merged export instead")
        module_name = target.param.removesuffix(".weight")
        base = modules.get(module_name)
        if base is None:
            raise ModelFormatError(
                f"{path}: {hf_module} does not exist in this model; the adapter was trained for another base")
        sizes = getattr(base, "shard_sizes", None) or [base.out_features]
        start = sum(sizes[: target.shard]) if target.shard is not None else 0
        stop = start + (sizes[target.shard] if target.shard is not None else base.out_features)
        a, b = ab["lora_A"], ab["lora_B"]
        if getattr(base, "tp", None) is not None:  # this rank's part of a tensor-parallel layer
            a, b = base.tp.lora(target.shard, a, b)
        if a.shape != (rank, base.in_features) or b.shape != (stop - start, rank):
            raise ModelFormatError(f"{path}: {hf_module} LoRA shapes {tuple(a.shape)}/{tuple(b.shape)} do not fit the "
                                   f"base layer ({base.in_features} -> {stop - start}, r={rank})")
        plan.append((module_name, LoRADelta(start, stop, a, b, scale)))
    device, dtype = model.device, model.dtype
    for module_name, delta in plan:
        wrapper = _wrap(model, module_name)
        delta.a, delta.b = delta.a.to(device, dtype), delta.b.to(device, dtype)
        wrapper.deltas.setdefault(adapter_id, []).append(delta)
    targets = sorted({m.rsplit(".", 1)[-1] for m in pairs})
    return LoRAAdapter(name, path, rank, alpha, scale, targets, len(tensors))


def _wrap(model: nn.Module, name: str) -> LoRALinear:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    current = getattr(parent, child)
    if isinstance(current, LoRALinear):
        return current
    wrapper = LoRALinear(current)
    setattr(parent, child, wrapper)
    changed = getattr(model, "modules_changed", None)
    if callable(changed):
        changed()
    return wrapper

