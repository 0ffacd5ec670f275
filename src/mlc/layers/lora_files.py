"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) safely: the config is checked
first, then the safetensors header (names, shapes, dtypes) against the config and the model, and only then are the
tensors read, so a file that claims a huge tensor is refused before anything is allocated. The adapter's digest
(sha256 of both files) keys the prefix cache: a changed adapter under the same name never meets its old KV."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mlc.errors import ModelFormatError


class AdapterError(ModelFormatError):
    """An adapter that cannot be served here (bad files, rank, targets, base): a 400 at run time."""

    http_status = 400
    error_type = "invalid_lora_adapter"


CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass
class AdapterFiles:
    path: Path
    config: dict
    rank: int
    alpha: float
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape, from the safetensors header
    digest: str  # sha256 over adapter_config.json and adapter_model.safetensors


def read_config(path: Path, max_rank: int | None = None) -> tuple[dict, int, float, float]:
    """(config, rank, alpha, scale) of the adapter at `path`, checked: a LoRA, a supported kind, rank in bounds."""
    cfg_file = path / CONFIG
    if not cfg_file.is_file():
        raise AdapterError(
            f"{path} is not a PEFT adapter (no {CONFIG}); export one with `mlc-cli export`")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file} is not a JSON object")
    check_supported(cfg, path)
    try:
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha") or cfg["r"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{cfg_file} has no valid rank `r`; is it a LoRA adapter config?") from None
    if rank < 1:
        raise AdapterError(f"{cfg_file}: rank r={rank} must be at least 1")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}; restart the server with "
                           f"--max-lora-rank {rank} or train a smaller adapter")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return cfg, rank, alpha, scale


def check_supported(cfg: dict, path: Path) -> None:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise AdapterError(
                f"{path}: {key}={bad} adapters are not supported for serving; merge it with `mlc-cli export --merge`")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise AdapterError(f"{path}: adapters with trained biases or modules_to_save are not supported for "
                           "serving; serve the merged export instead")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"{path}: per-module rank_pattern/alpha_pattern adapters are not supported for serving; "
                           "serve the merged export instead")


def read_header(path: Path, rank: int, max_dim: int) -> dict[str, tuple[int, ...]]:
    """The safetensors header's tensor shapes, each checked against the rank and the model's largest dimension."""
    weights = path / WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{path} has no {WEIGHTS} (only safetensors adapters are read, never .bin)")
    size = weights.stat().st_size
    try:
        with weights.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} does not fit the {size}-byte file")
            header = json.loads(f.read(n))
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise AdapterError(f"{weights} is not a safetensors file ({e})") from None
    shapes: dict[str, tuple[int, ...]] = {}
    need = 8 + n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        shape = tuple(int(d) for d in info.get("shape", ()))
        if info.get("dtype") not in _DTYPE_BYTES:
            raise AdapterError(f"{weights}: tensor {key!r} has dtype {info.get('dtype')}; LoRA weights are floats")
        if len(shape) != 2 or rank not in shape or max(shape) > max_dim:
            raise AdapterError(f"{weights}: tensor {key!r} of shape {list(shape)} does not fit a rank-{rank} adapter "
                               "of this model (its config says another rank, or it was trained for another base)")
        need += shape[0] * shape[1] * _DTYPE_BYTES[info["dtype"]]
        shapes[key] = shape
    if need > size:
        raise AdapterError(f"{weights} is truncated: its header describes {need} bytes, the file has {size}")
    return shapes


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        h.update((path / name).read_bytes())
    return h.hexdigest()


def open_adapter(path: Path, max_rank: int | None, max_dim: int) -> AdapterFiles:
    """Config and header checked, nothing of the weights read yet."""
    path = Path(path).expanduser()
    cfg, rank, alpha, scale = read_config(path, max_rank)
    shapes = read_header(path, rank, max_dim)
    return AdapterFiles(path, cfg, rank, alpha, scale, shapes, digest(path))


def load_tensors(files: AdapterFiles) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(files.path / WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{files.path / WEIGHTS} is truncated or corrupt ({e})") from None


def pair_modules(files: AdapterFiles) -> dict[str, tuple[str, str]]:
    """HF module name -> (its lora_A tensor name, its lora_B tensor name)."""
    pairs: dict[str, dict[str, str]] = {}
    for key in files.shapes:
        stem = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in stem:
                pairs.setdefault(stem.split(marker)[0], {})[part] = key
                break
        else:
            raise AdapterError(f"{files.path}: unexpected tensor {key!r} in the adapter")
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{files.path}: {module} has only {sorted(ab)}; the adapter file is incomplete")
    if not pairs:
        raise AdapterError(f"{files.path}: the adapter holds no LoRA tensors")
    return {m: (ab["lora_A"], ab["lora_B"]) for m, ab in pairs.items()}
