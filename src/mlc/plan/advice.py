"""The recommended layout: the least lossy dtypes on the fewest devices that fit, searched tier by tier."""

from __future__ import annotations

from mlc.config.engine_config import SparseKVConfig
from mlc.config.hardware import HardwareProfile
from mlc.distributed.checks import fits_tensor_parallel
from mlc.plan.layout import evaluate
from mlc.plan.memory import compute_dtype_for
from mlc.plan.model_facts import ModelFacts
from mlc.plan.types import Layout, PlanRequest

DEVICE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
SPARSE_RATIO = 0.25  # the tutorial's balance point; below 0.2 recall collapses (lint rule sparse-kv-ratio-min)
LOSSLESS_TIERS = 3  # native, int8 KV, int8 weights + int8 KV: accuracy close to the checkpoint's


def _tiers(profile: HardwareProfile, compute: str, long_context: bool) -> list[tuple[str, str, float | None]]:
    """(weight dtype, kv dtype, sparse ratio), from the least to the most lossy."""
    native_kv = compute if compute in profile.kv_cache_dtypes else profile.preferred_dtype
    tiers: list[tuple[str, str, float | None]] = [(compute, native_kv, None), (compute, "int8", None),
                                                  ("int8", "int8", None)]
    if long_context:
        tiers.append(("int8", "int8", SPARSE_RATIO))
    int4_sparse = SPARSE_RATIO if long_context else None
    tiers += [("int4", "int8", int4_sparse), ("int4", "int4", int4_sparse)]
    supported = [t for t in tiers if t[0] in profile.weight_dtypes + [compute] and t[1] in profile.kv_cache_dtypes]
    return list(dict.fromkeys(supported))


def recommend(
    facts: ModelFacts, profile: HardwareProfile, request: PlanRequest,
) -> tuple[Layout | None, str, list[Layout]]:
    compute = compute_dtype_for(request, profile)
    long_context = min(request.seq_len, facts.max_context) > SparseKVConfig().min_context
    # device counts whose tensor-parallel part the engine can shard this model over (heads, KV heads, vocabulary,
    # MLP widths, experts: `mlc.distributed.checks`)
    counts = [d for d in DEVICE_COUNTS if d % min(d, profile.devices_per_node) == 0
              and fits_tensor_parallel(facts.hf_config, min(d, profile.devices_per_node))]
    tiers = _tiers(profile, compute, long_context)
    best: dict[int, Layout] = {}
    for tier, (w, kv, sparse) in enumerate(tiers):
        for d in counts:
            lay = evaluate(facts, profile, request, w, kv, sparse, d)
            if lay.fits:
                lay.tier = tier
                best[tier] = lay
                break
    alternatives = [best[t] for t in sorted(best)]
    one_node = [a for a in alternatives if a.devices <= profile.devices_per_node]
    pick = _first(one_node, lambda a: a.tier < LOSSLESS_TIERS, key=lambda a: (a.devices, a.tier))
    reason = "fewest devices in one node with int8 or better weights and KV"
    if pick is None:
        pick = _first(one_node, lambda a: True, key=lambda a: (a.tier, a.devices))
        reason = "one node only fits with int4 weights or KV (and sparse KV where the context is long)"
    if pick is None:
        pick = _first(alternatives, lambda a: True, key=lambda a: (a.devices, a.tier))
        reason = "the model does not fit in one node; pipeline parallel across nodes"
    if pick is None:
        reason = (f"nothing fits at batch {request.batch} x {request.seq_len} tokens "
                  f"on up to {DEVICE_COUNTS[-1]} devices")
    return pick, reason, alternatives


def _first(items, keep, key):
    chosen = sorted((i for i in items if keep(i)), key=key)
    return chosen[0] if chosen else None
