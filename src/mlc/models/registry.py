"""HF `model_type` -> our architecture class, imported on first use."""

from __future__ import annotations

import importlib

from mlc.errors import ModelFormatError

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("mlc.models.llama", "LlamaForCausalLM"),
    "glm": ("mlc.models.glm", "GlmForCausalLM"),
    "glm4": ("mlc.models.glm4", "Glm4ForCausalLM"),
    "glm4_moe": ("mlc.models.glm4_moe", "Glm4MoeForCausalLM"),
    "glm_moe_dsa": ("mlc.models.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def model_class(model_type: str):
    if model_type not in ARCHITECTURES:
        raise ModelFormatError(
            f"architecture {model_type!r} is not supported; supported model_type values: "
            f"{', '.join(supported_model_types())}"
        )
    module, name = ARCHITECTURES[model_type]
    return getattr(importlib.import_module(module), name)
