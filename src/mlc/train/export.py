"""`mlc-cli export`: a LoRA adapter as a merged HF checkpoint, or the adapter alone in PEFT format."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from mlc.config.device import DTYPES
from mlc.errors import ConfigError, ModelFormatError
from mlc.models.store import resolve_model_dir
from mlc.models.tokenizer import load_tokenizer
from mlc.train.model import adapter_base, load_adapter, load_base_model

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return torch.float32
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return DTYPES.get(name, torch.float32)


def _check_adapter(adapter: Path) -> None:
    missing = [f for f in ADAPTER_FILES if not (adapter / f).is_file()]
    if missing:
        raise ModelFormatError(f"{adapter} is not a PEFT adapter dir (missing {', '.join(missing)})")


def _publish(tmp: Path, out: Path, overwrite: bool) -> Path:
    if out.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"{out} already exists; pass --overwrite or choose another --out")
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def export_adapter(
    adapter: str | Path, out: str | Path, *, merge: bool = False, model: str | None = None,
    dtype: str | None = None, overwrite: bool = False, progress=None,
) -> Path:
    """`progress(step, steps, what)` before each step of a merge (load, merge, save, tokenizer)."""
    say = progress or (lambda *_: None)
    adapter, out = Path(adapter), Path(out)
    _check_adapter(adapter)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if not merge:
        for name in ADAPTER_FILES:
            shutil.copy2(adapter / name, tmp / name)
        return _publish(tmp, out, overwrite)
    from mlc.train.reward import is_reward_adapter

    if is_reward_adapter(adapter):
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"{adapter} is a reward model (stage: rm): its head cannot merge into a causal LM; export it "
                          "without --merge and load it with mlc.train.reward.load_reward_model")
    model_dir = resolve_model_dir(model or adapter_base(adapter))
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(sorted(DTYPES))}")
    say(0, 4, "loading the base model")
    base = load_base_model(model_dir, torch.float32)  # merge in fp32, then store in the checkpoint's own dtype
    say(1, 4, "merging the adapter")
    merged = load_adapter(base, adapter).merge_and_unload()
    merged = merged.to(DTYPES[dtype] if dtype is not None else checkpoint_dtype(model_dir))
    merged.config.use_cache = True  # the training loader turned it off; served models want it
    say(2, 4, "writing safetensors")
    merged.save_pretrained(str(tmp), safe_serialization=True)
    say(3, 4, "copying the tokenizer")
    load_tokenizer(model_dir).save_pretrained(str(tmp))
    say(4, 4, "done")
    return _publish(tmp, out, overwrite)
