"""`engine.compile` (`--compile`): the model's forward pass as one `torch.compile` (inductor) graph for every step.

At batch 1 most of an eager decode step is hundreds of small ops (norms, RoPE, residual adds, SiLU, dtype casts)
at a few microseconds each (ARCHITECTURE.md). Inductor fuses them into a few generated kernels; the quantized
matmuls stay the same ATen kernels. Paged attention cannot be traced (its metadata is Python lists and groups),
so it is an opaque custom op (`layers/attention_op.py`) that reads the step's metadata and KV cache from
`STEP`, set around each call. The graph is compiled once with a dynamic token count, so prefill, decode and
mixed steps of any batch size share it and never recompile in steady state.

Scope: Llama-architecture models (the default model, Llama 2/3, GLM-4 dense) on one rank, without LoRA
adapters (loading one later switches the engine back to eager); anything else is refused with what to do.
The graph is compiled as the model loads (before the server answers /health), and compiling needs a C++ compiler
(inductor's CPU backend); when compiling fails the engine logs why and runs eagerly. Inductor keeps its own
cache (under /tmp/torchinductor_$USER), which shortens later starts (default model: about 52 s cold, 25 s after).
`STEP` is process-wide: one compiled engine per process (the server's case).

Numerics: fused kernels round bf16 intermediates differently from eager ops, so compiled tokens can differ from
eager ones in near ties; every step runs the same graph, so a request's output still does not depend on its
batch (tests/integration/test_compiled_forward.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mlc.config.engine_config import EngineConfig
from mlc.errors import ConfigError
from mlc.layers.attention import AttentionMetadata, build_attention_metadata
from mlc.layers.attention_op import STEP
from mlc.layers.kv_store import LayerCache
from mlc.models.base import CausalLM

log = logging.getLogger("mlc.engine")

COMPILABLE = ("glm", "glm4", "llama")  # architectures whose layers reach their cache only through `attend`


def check_compilable(model_type: str, tensor_parallel_size: int, lora_adapters: dict[str, str]) -> None:
    """Refuse what the compiled forward does not cover."""
    if model_type not in COMPILABLE:
        raise ConfigError(f"--compile covers the {', '.join(sorted(COMPILABLE))} architectures, not {model_type!r}; "
                          "serve this model without --compile")
    if tensor_parallel_size > 1:
        raise ConfigError("--compile runs on one rank; drop --compile or --tensor-parallel-size")
    if lora_adapters:
        raise ConfigError("--compile does not cover LoRA adapters yet; drop --compile or the adapters")


class CompiledForward:
    """Stands in for `model.forward`: rotary tables eagerly, then the compiled body with attention as an op."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.eager = model.forward
        self.body = torch.compile(self._body, dynamic=True, fullgraph=True)
        self.compiled_in: float | None = None  # seconds the first call took (tracing and code generation)
        self.failed: str | None = None

    def _body(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        m: Any = self.model.model  # the architecture's decoder (embed_tokens, layers, norm): nn.Module attributes
        h = m.embed_tokens(input_ids)
        for layer in m.layers:
            h = layer(h, cos, sin, None, None)  # attention reaches its cache and metadata through STEP
        out: torch.Tensor = m.norm(h)
        return out

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[LayerCache] | None = None) -> torch.Tensor:
        if self.failed is not None:
            return self.eager(input_ids, positions, meta, kv_caches)
        decoder: Any = self.model.model
        rotary: Any = self.model.rotary
        cos, sin = rotary(positions, decoder.embed_tokens.dtype)
        for t in (input_ids, cos, sin):
            torch._dynamo.decorators.mark_unbacked(t, 0)  # one graph for every token count, 1 included
        STEP.update(meta=meta, caches=kv_caches)
        started = time.perf_counter()
        try:
            out = self.body(input_ids, cos, sin)
        except Exception as e:  # no C++ compiler, an op inductor cannot lower, ...: the eager path still works
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("--compile: compiling the forward pass failed (%s); running eagerly", self.failed)
            return self.eager(input_ids, positions, meta, kv_caches)
        finally:
            STEP.clear()
        if self.compiled_in is None:
            self.compiled_in = time.perf_counter() - started
            log.info("--compile: forward pass compiled in %.1f s (inductor; cached for the next start)",
                     self.compiled_in)
        return out


def compile_forward(model: CausalLM, config: EngineConfig) -> CompiledForward:
    """Replace `model.forward` (the engine calls `model(...)`) after checking `config` allows it."""
    check_compilable(getattr(model.config, "model_type", "?"), config.tensor_parallel_size, config.lora_adapters)
    model.forward = compiled = CompiledForward(model)  # type: ignore[method-assign]  # replaced at run time
    with torch.inference_mode():  # compile now, at load, rather than in the first request (two cache-less tokens)
        ids = torch.zeros(2, dtype=torch.long, device=model.device)
        compiled(ids, torch.arange(2, device=model.device), build_attention_metadata([2], [2], device=model.device))
    return compiled


def uncompile(model: CausalLM, why: str) -> None:
    """Back to the eager forward (a LoRA adapter was loaded at run time)."""
    if isinstance(model.forward, CompiledForward):
        log.info("--compile: %s; the forward pass runs eagerly from now on", why)
        model.forward = model.forward.eager  # type: ignore[method-assign]
