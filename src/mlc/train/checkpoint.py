"""Checkpoints for exact resume: PEFT adapter, optimizer, scheduler, grad scaler, RNG states, data position.

Layout: `output_dir/checkpoints/step-000050/` with adapter_config.json + adapter_model.safetensors (PEFT format,
so a checkpoint is also a usable adapter), optimizer.pt, scheduler.pt, scaler.pt, rng-rank{N}.pt and
trainer_state.json, and checkpoint_manifest.json (size + sha256 of every other file). Each is written into a hidden
temp dir that is renamed into place only when complete, so a `kill -9` at any moment leaves either the old set of
checkpoints or the new one, never a half-written one. A checkpoint damaged later (disk, copy, a stray edit) is found
by `checkpoint_problem` at resume, which then falls back to the one before.
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

from mlc.errors import IntegrityError, TrainingError
from mlc.models.store.integrity import check_files, sha256_file

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "checkpoint_manifest.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
REQUIRED_FILES = ("adapter_config.json", ADAPTER_WEIGHTS, "optimizer.pt", "scheduler.pt", STATE_FILE)
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
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # legacy=True, the default: numpy's stubs allow its dict form too
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


def save_adapter(peft_model, out: Path, whole: dict | None = None) -> None:
    """PEFT's adapter files; `whole` (a tensor-parallel run's gathered state) replaces this rank's slices."""
    peft_model.save_pretrained(str(out), safe_serialization=True)
    if whole is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in whole.items()}, str(Path(out) / "adapter_model.safetensors"),
                  metadata={"format": "pt"})


def finish_save(tmp: Path, step: int, peft_model, optimizer, scheduler, scaler, state: dict, keep: int,
                whole_adapter: dict | None = None) -> Path:
    """Rank 0: write the shared state, then rename the temp dir into place and prune old checkpoints. A
    tensor-parallel run passes its gathered adapter; its other ranks wrote their optimizer-tp{r}.pt already."""
    save_adapter(peft_model, tmp, whole_adapter)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    if scaler is not None:
        torch.save(scaler.state_dict(), tmp / "scaler.pt")
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, ensure_ascii=False), encoding="utf-8")
    _write_manifest(tmp)
    _fsync_tree(tmp)
    final = tmp.parent / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    found = list_checkpoints(final.parent.parent)
    # Checkpoints past this step were skipped as unusable at resume; this run's own saves supersede them.
    newer = [p for p in found if step_of(p) > step]
    for old in newer + [p for p in found if p not in newer][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint-<step> directory")
    return int(m.group(1))


def _write_manifest(tmp: Path) -> None:
    files = {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)}
             for f in sorted(tmp.iterdir()) if f.is_file() and f.name != MANIFEST_FILE}
    (tmp / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=2), encoding="utf-8")


def checkpoint_problem(path: Path) -> str | None:
    """Why resuming from `path` would fail (a file missing, truncated or unreadable), or None when it is whole.
    With a manifest: every file's size and sha256; older checkpoints without one: every file is loaded once."""
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    if (path / MANIFEST_FILE).is_file():
        return _manifest_problem(path)
    return _load_problem(path)


def _manifest_problem(path: Path) -> str | None:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        problems = check_files(path, manifest["files"], full=True)
    except (OSError, ValueError, KeyError, TypeError, IntegrityError) as e:
        return f"{MANIFEST_FILE} is unreadable ({e})"
    return "; ".join(problems) or None


def _load_problem(path: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as handle:
            if not list(handle.keys()):
                return f"{ADAPTER_WEIGHTS} holds no tensors"
    except (SafetensorError, OSError) as e:
        return f"{ADAPTER_WEIGHTS} is truncated or corrupt ({e})"
    for name in ("adapter_config.json", STATE_FILE):
        try:
            if not isinstance(json.loads((path / name).read_text(encoding="utf-8")), dict):
                return f"{name} is not a JSON object"
        except (OSError, ValueError) as e:
            return f"{name} is unreadable ({e})"
    for f in sorted(path.glob("*.pt")):
        try:
            torch.load(f, weights_only=True)
        except Exception as e:  # torch.load raises EOFError, RuntimeError, OSError, UnpicklingError... for bad files
            return f"{f.name} is truncated or corrupt ({type(e).__name__}: {str(e)[:120] or 'empty file'})"
    return None


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TrainingError(f"checkpoint {path} is unreadable ({e}); delete it to resume from the one before") from None


def load_checkpoint(path: Path, peft_model, optimizer, scheduler, scaler, rank: int, tp=None) -> dict:
    """Restore everything saved by `finish_save`; RNG last, after model building has drawn its random numbers."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / "adapter_model.safetensors"))
        if tp is not None:
            weights = tp.local_state(peft_model, weights)
        result = set_peft_model_state_dict(peft_model, weights)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise TrainingError(f"checkpoint {path} has adapter tensors this model lacks: {unexpected[:3]}")
        opt_file = path / ("optimizer.pt" if tp is None or tp.rank == 0 else f"optimizer-tp{tp.rank}.pt")
        if not opt_file.is_file():
            raise TrainingError(f"checkpoint {path} has no {opt_file.name}; resume with the tensor_parallel it was "
                                "saved with")
        optimizer.load_state_dict(torch.load(opt_file, weights_only=True))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        if scaler is not None and (path / "scaler.pt").is_file():
            scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
        rng_file = path / f"rng-rank{rank}.pt"
        if not rng_file.is_file():
            raise TrainingError(
                f"checkpoint {path} has no RNG state for rank {rank}; resume with the --nproc it was saved with"
            )
        set_rng_state(torch.load(rng_file, weights_only=True))
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, SafetensorError) as e:
        raise TrainingError(
            f"checkpoint {path} could not be restored ({e}); delete it to resume from an older one") from None
    return read_state(path)
