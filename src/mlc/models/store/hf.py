"""Models from where users already keep them: a Hugging Face repo id (`org/name`) found in the local HF cache.

Offline only (`local_files_only`): the cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`, read at each call so that a changed environment is honoured. Also the messages for
files other tools load and we do not (MindIE's `.om`, MindSpore's `.ckpt`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mlc.errors import ModelFormatError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
FOREIGN_FORMATS = {
    ".om": "a MindIE offline model compiled by ATC for one Ascend chip; mlc loads the checkpoint it was compiled "
           "from (an HF dir with config.json + *.safetensors), a store name or a .gguf file. `mlc-cli compile` "
           "makes mlc's own ahead-of-time form (fused, quantized, aligned)",
    ".ckpt": "a MindSpore/MindFormers checkpoint; mlc loads HF checkpoints (config.json + *.safetensors), store "
             "names and .gguf files. Use the Hugging Face release of the model, or convert the .ckpt to "
             "Hugging Face format with MindFormers' weight conversion script",
    ".onnx": "an ONNX graph; mlc loads HF checkpoints (config.json + *.safetensors), store names and .gguf files",
}


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def looks_like_repo_id(name: str) -> bool:
    return bool(REPO_ID.fullmatch(name)) and not name.endswith((".gguf", ".json"))


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot dir of `repo_id` at `revision` (default: its `main` ref), or None when it is not in the
    local HF cache."""
    if not looks_like_repo_id(repo_id):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(hf_cache_dir()), local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return Path(path)


def check_snapshot(repo_id: str, path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelFormatError(
            f"{repo_id} is in the Hugging Face cache ({path}) but has no config.json there; download the whole "
            f"repo (`huggingface-cli download {repo_id}`) or pass a checkpoint directory")
    return path


def has_weights(path: Path) -> bool:
    """A snapshot with weights, not only the config.json that `plan --pull` fetches."""
    return any(path.glob("*.safetensors")) or any(path.glob("*.gguf"))


def not_local_message(name: str, store: Path) -> str:
    return (f"{name} is not on this machine: not a local path, not in the store ({store}), not in the Hugging Face "
            f"cache ({hf_cache_dir()}); run `mlc-cli models pull {name}` first, or pass --pull to this command to "
            "pull it now")


def foreign_format_message(path: Path) -> str | None:
    why = FOREIGN_FORMATS.get(path.suffix.lower())
    return f"{path} is {why}" if why else None
