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


def safetensors_names(files: list[Path]) -> list[str]:
    """The tensor names of safetensors files (their headers only)."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                names += handle.keys()
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelFormatError(f"{f} is truncated or corrupt ({e}); re-download it") from None
    return names


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


def build_model(hf_config, device: torch.device, dtype: torch.dtype, mtp: bool = False) -> CausalLM:
    cls = model_class(hf_config.model_type)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
            if mtp:
                model.add_mtp()
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A model dir's weights in float under their HF names: its safetensors, or the GGUF it keeps, dequantized."""
    from mlc.models.gguf.convert import GGUF_FILE, iter_hf_tensors
    from mlc.models.gguf.reader import open_gguf_tensors

    gguf = Path(model_dir) / GGUF_FILE
    if not gguf.is_file():
        yield from iter_safetensors(safetensors_files(model_dir))
        return
    cfg = read_config_json(Path(model_dir) / "config.json")
    for name, values in iter_hf_tensors(open_gguf_tensors(gguf), cfg):
        yield name, torch.from_numpy(values)


def transformers_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' causal LM of a model dir: `from_pretrained` for a checkpoint; for a store model that keeps its
    GGUF, built from config.json and given the GGUF's dequantized tensors (no float copy on disk, and much faster
    than transformers' own GGUF reader)."""
    from transformers import AutoModelForCausalLM

    from mlc.models.gguf.convert import GGUF_FILE

    if not (Path(model_dir) / GGUF_FILE).is_file():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight comes from the GGUF next
        model = AutoModelForCausalLM.from_config(read_config(model_dir), dtype=dtype)
    state = {name: t.to(dtype) for name, t in checkpoint_tensors(model_dir)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelFormatError(f"{model_dir}: its GGUF and config.json disagree (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}); pull it again with `mlc-cli models pull --force`")
    if tied:
        model.tie_weights()
    return model
