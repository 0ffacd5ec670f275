"""`mlc-cli plan`: will a model fit on a device at a length and batch, with which dtypes, on how many devices,
and how fast can it decode (bandwidth roofline)?

Exact figures: parameter counts (the architecture built on "meta"), KV bytes per token for every cache dtype,
int8/int4 scales included (`KVCache.bytes_per_token_for` on the model's own `kv_cache_spec()`), pages (the engine's
`plan_cache` rule: a full-length page run per sequence plus the null page). Estimates, labelled as such: int8/int4
weight sizes (group scales), sparse-KV kept tokens, activation headroom, runtime reserve, and tok/s (an upper
bound). The arithmetic lives in plan_memory, plan_speed, plan_layout and plan_advice; this module puts it together.
"""

from __future__ import annotations

from dataclasses import asdict

from mlc.config.hardware import HardwareProfile
from mlc.errors import ConfigError
from mlc.plan.advice import recommend
from mlc.plan.layout import evaluate

# the sizes callers of the plan import from here
from mlc.plan.memory import compute_dtype_for, kv_bytes_per_token, weight_bytes  # noqa: F401 (re-exported)
from mlc.plan.model_facts import ModelFacts
from mlc.plan.types import PlanRequest, PlanResult


def plan(facts: ModelFacts, profile: HardwareProfile, request: PlanRequest) -> PlanResult:
    if request.seq_len < 1 or request.batch < 1:
        raise ConfigError("--seq-len and --batch must be at least 1")
    notes: list[str] = []
    if request.seq_len > facts.max_context:
        notes.append(
            f"seq_len {request.seq_len} exceeds the model's context ({facts.max_context}); the engine caps "
            f"max_seq_len there, so the plan uses {facts.max_context}"
        )
    requested = evaluate(facts, profile, request, request.weight_dtype, request.kv_dtype, request.sparse_kv_ratio,
                         request.devices or 1)
    pick, reason, alternatives = recommend(facts, profile, request)
    if facts.is_mla:
        notes.append("MLA: the engine re-expands the cached latent with kv_b_proj at every step (no absorbed MLA), "
                     "so long-context decode is compute-bound; the latent is replicated, not split, across TP ranks")
    notes.append("decode tok/s is a roofline upper bound: bytes streamed per step / memory bandwidth, or FLOPs / peak")
    notes += [f"profile {profile.name}: {k} is uncertain: {v}" for k, v in profile.uncertain.items()]
    model = {
        "name": facts.name, "source": facts.source, "model_type": facts.model_type,
        "total_params": facts.total_params, "active_params": facts.active_params,
        "layers": facts.num_layers, "max_context": facts.max_context,
        "kv_cache_spec_layer0": {k: list(v) for k, v in facts.kv_spec[0].items()},
    }
    hardware = {
        "name": profile.name, "description": profile.description, "memory_bytes": profile.memory,
        "memory_bandwidth_gbps": profile.memory_bandwidth_gbps, "devices_per_node": profile.devices_per_node,
        "compute_dtype": compute_dtype_for(request, profile),
    }
    chosen = pick or requested
    if chosen.pipeline_parallel > 1:
        notes.append(f"pipeline parallel {chosen.pipeline_parallel} x tensor parallel {chosen.tensor_parallel}: "
                     f"each stage's {chosen.tensor_parallel} ranks on one node, the stages across nodes: serve it "
                     "on one host with the line below, or across nodes with `mlc-cli deploy` "
                     f"(tensor_parallel_size: {chosen.tensor_parallel}, pipeline_parallel_size: "
                     f"{chosen.pipeline_parallel} in the cluster file; each replica is one Ray placement group)")
    return PlanResult(model, hardware, asdict(request), requested, pick, reason, alternatives, notes,
                      serve_command(facts.name, profile, request, chosen, min(request.seq_len, facts.max_context)))


def serve_command(model: str, profile: HardwareProfile, request: PlanRequest, lay, seq_len: int) -> str:
    """The `mlc-cli serve` line that runs `lay` (its tensor-parallel ranks, and its pipeline stages)."""
    parts = [f"mlc-cli serve --model {model} --device {profile.device}"]
    if lay.tensor_parallel > 1:
        parts.append(f"--tensor-parallel-size {lay.tensor_parallel}")
    if lay.pipeline_parallel > 1:
        parts.append(f"--pipeline-parallel-size {lay.pipeline_parallel}")
    if lay.expert_parallel:
        parts.append("--enable-expert-parallel")
    parts.append(f"--weight-dtype {lay.weight_dtype} --kv-cache-dtype {lay.kv_dtype}")
    parts.append(f"--max-seq-len {seq_len} --max-batch-size {request.batch}")
    return " ".join(parts)
