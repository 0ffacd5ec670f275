"""Checkpoints for exact resume: PEFT adapter, optimizer, scheduler, grad scaler, RNG states, data position.

Layout: `output_dir/checkpoints/step-000050/` with adapter_config.json + adapter_model.safetensors (PEFT format,
so a checkpoint is also a usable adapter), optimizer.pt, scheduler.pt, scaler.pt, rng-rank{N}.pt and
trainer_state.json. Each is written into a hidden temp dir that is renamed into place only when complete, so a
`kill -9` at any moment leaves either the old set of checkpoints or the new one, never a half-written one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from mlc.errors import TrainingError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def tmp_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f".tmp-{step_dir_name(step)}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp dirs of an interrupted save are ignored)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with f.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path)


def begin_save(output_dir: str | Path, step: int) -> Path:
    """Rank 0: a clean temp dir for this step's checkpoint."""
    tmp = tmp_dir(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_rank_state(tmp: Path, rank: int) -> None:
    """Every rank: its own RNG streams (dropout draws differ per rank)."""
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")


def finish_save(tmp: Path, step: int, peft_model, optimizer, scheduler, scaler, state: dict, keep: int) -> Path:
    """Rank 0: write the shared state, then rename the temp dir into place and prune old checkpoints."""
    peft_model.save_pretrained(str(tmp), safe_serialization=True)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    if scaler is not None:
        torch.save(scaler.state_dict(), tmp / "scaler.pt")
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, ensure_ascii=False), encoding="utf-8")
    _fsync_tree(tmp)
    final = tmp.parent / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    for old in list_checkpoints(final.parent.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TrainingError(f"checkpoint {path} is unreadable ({e}); delete it to resume from the one before") from None


def load_checkpoint(path: Path, peft_model, optimizer, scheduler, scaler, rank: int) -> dict:
    """Restore everything saved by `finish_save`; RNG last, after model building has drawn its random numbers."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(peft_model, weights)
        if getattr(result, "unexpected_keys", None):
            raise TrainingError(f"checkpoint {path} has adapter tensors this model lacks: {result.unexpected_keys[:3]}")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        if scaler is not None and (path / "scaler.pt").is_file():
            scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
        rng_file = path / f"rng-rank{rank}.pt"
        if not rng_file.is_file():
            raise TrainingError(
                f"checkpoint {path} has no RNG state for rank {rank}; resume with the --nproc it was saved with"
            )
        set_rng_state(torch.load(rng_file, weights_only=True))
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise TrainingError(f"checkpoint {path} could not be restored ({e}); delete it to resume from an older one") from None
    return read_state(path)
