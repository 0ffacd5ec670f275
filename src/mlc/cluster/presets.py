"""The tutorial's launcher presets (`mlc-cli glm5 --mode inference --seq-len 16384`): which model an alias names,
where its weights must be, the hardware this machine has, and the settings `plan` recommends for it there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlc.errors import ConfigError, ModelNotFoundError

BATCH = 8  # sequences the recommendation must hold at --seq-len


@dataclass(frozen=True)
class Preset:
    name: str  # the store name, and the built-in shape `plan` knows
    title: str
    aliases: tuple[str, ...]  # the first is the command shown in --help
    seq_len: int  # default --seq-len


PRESETS = (
    Preset("glm-5", "GLM-5 (744B MoE with MLA and DSA)", ("glm5", "glm-5"), 16384),
    Preset("glm-4.5", "GLM-4.5 (355B MoE)", ("glm4.5", "glm-4.5", "glm45"), 16384),
    Preset("glm-4-9b", "GLM-4-9B", ("glm4-9b", "glm-4-9b", "glm4"), 8192),
    Preset("smollm2-135m-instruct", "SmolLM2-135M-Instruct, the default model", ("smollm2", "default"), 2048),
)


def find_preset(alias: str) -> Preset:
    for p in PRESETS:
        if alias.lower() in p.aliases or alias.lower() == p.name:
            return p
    names = ", ".join(p.aliases[0] for p in PRESETS)
    raise ConfigError(f"unknown model preset {alias!r} (presets: {names})")


@dataclass
class Hardware:
    profile: str  # a hardware profile name (`mlc-cli plan --hardware`)
    device: str  # cpu, cuda or npu
    count: int
    description: str


def detect_hardware() -> Hardware:
    """The accelerator torch sees here, mapped to the nearest profile; else this CPU."""
    import torch

    from mlc.config.device import npu_available

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        profile = "nvidia-a100-80g" if "A100" in name else "nvidia-h200"
        return Hardware(profile, "cuda", torch.cuda.device_count(), name)
    if npu_available():
        npu = torch.npu  # type: ignore[attr-defined]  # torch_npu adds torch.npu; torch's stubs lack it
        name = npu.get_device_name(0)
        return Hardware("ascend-310p" if "310" in name else "ascend-910b", "npu", npu.device_count(), name)
    return Hardware("cpu", "cpu", 1, "this CPU")


def weights_dir(preset: Preset) -> Path:
    """The preset's checkpoint in the model store; ModelNotFoundError saying where to put it when it is absent."""
    from mlc.config.paths import models_dir
    from mlc.models.store import KNOWN_MODELS, SHORT_NAMES

    path = models_dir() / preset.name
    if (path / "config.json").is_file():
        return path
    pullable = preset.name in KNOWN_MODELS or preset.name in SHORT_NAMES
    pull = f"run `mlc-cli models pull {preset.name}`, or " if pullable else ""
    raise ModelNotFoundError(
        f"{preset.title} weights are not on this machine: {pull}put its Hugging Face checkpoint (config.json, "
        f"tokenizer files and *.safetensors) in {path}/ (the model store; $MLC_HOME moves it), then run this "
        "again. `--mode plan` works without weights")


@dataclass
class Settings:
    hardware: str
    device: str
    seq_len: int
    weight_dtype: str
    kv_cache_dtype: str
    sparse_kv_ratio: float | None
    max_batch_size: int
    devices: int
    fits: bool
    reason: str
    notes: list[str]
    tensor_parallel: int = 1
    expert_parallel: bool = False


def recommend(preset: Preset, hw: Hardware, seq_len: int) -> Settings:
    """The layout `plan` recommends for the preset on this hardware at `seq_len` tokens per sequence."""
    from mlc.config.hardware import load_profile
    from mlc.plan.model_facts import inspect_model
    from mlc.plan.planner import PlanRequest, plan

    result = plan(inspect_model(preset.name), load_profile(hw.profile), PlanRequest(seq_len=seq_len, batch=BATCH))
    rec = result.recommendation or result.requested
    seq = min(seq_len, result.model["max_context"])
    notes = list(result.notes[:1])
    if rec.pipeline_parallel > 1:
        notes.append(f"the plan needs {rec.devices} devices over {rec.pipeline_parallel} nodes (pipeline parallel), "
                     "which the engine does not run yet; it serves one node's tensor-parallel ranks")
    if rec.devices > hw.count:
        notes.append(f"this machine has {hw.count} {hw.device} device(s); the plan needs {rec.devices}")
    return Settings(hw.profile, hw.device, seq, rec.weight_dtype, rec.kv_dtype, rec.sparse_kv_ratio,
                    max(1, min(rec.max_batch, 64)), rec.devices, rec.fits, result.reason, notes,
                    rec.tensor_parallel, rec.expert_parallel)
