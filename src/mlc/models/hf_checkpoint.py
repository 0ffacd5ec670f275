"""Reading an HF checkpoint dir (config.json + safetensors, sharded or not) and building its architecture empty."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from mlc.errors import ModelFormatError
from mlc.models.base import CausalLM
from mlc.models.registry import model_class


def read_config_json(path: Path) -> dict:
    """A checkpoint's config.json as a dict, with a clear error when it is missing, broken or has no model_type."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path.parent} has no config.json; point at an HF checkpoint directory or a .gguf file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path} is not valid JSON ({e}); re-download or repair the checkpoint") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelFormatError(f"{path} has no model_type; it is not a transformers config.json")
    return raw


def read_config(model_dir: Path):
    """The transformers config object (its defaults are the architecture's defaults)."""
    path = Path(model_dir) / "config.json"
    model_type = read_config_json(path)["model_type"]
    model_class(model_type)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types for bad configs
        raise ModelFormatError(f"{path} could not be read as a {model_type} config: {e}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelFormatError(f"{index} is unreadable ({e}); re-download the checkpoint") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(
                f"{model_dir} is missing shard(s) {', '.join(missing)} listed in model.safetensors.index.json; "
                "the download is incomplete"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(
            f"{model_dir} has no *.safetensors weights (.bin checkpoints are not read); "
            "convert with transformers' save_pretrained(safe_serialization=True)"
        )
    return files


def iter_safetensors(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=device) as handle:
                for key in handle.keys():
                    yield key, handle.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelFormatError(
                f"{f} is truncated or corrupt ({e}); re-download it or run `mlc-cli models verify`"
            ) from None


def build_model(hf_config, device: torch.device, dtype: torch.dtype) -> CausalLM:
    cls = model_class(hf_config.model_type)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
