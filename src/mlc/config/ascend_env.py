"""The reference tutorial's Ascend memory variables, read as engine settings (section 4.4):

    export ASCEND_ALLOC_MEM=1      # allocate HBM up front: what mlc always does with its KV cache
    export ASCEND_MAX_MEM=28000    # MB of device memory -> engine.kv_cache_memory (when that is not set)

Each one read yields a line saying what it became; a value that is not a number is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlc.config.engine_config import EngineConfig
from mlc.errors import ConfigError


def apply_ascend_env(engine: EngineConfig, environ: Mapping[str, str]) -> list[str]:
    """Set `engine.kv_cache_memory` from ASCEND_MAX_MEM when the config and flags left it unset; return the notes."""
    notes: list[str] = []
    alloc = environ.get("ASCEND_ALLOC_MEM")
    if alloc is not None:
        if alloc.strip() == "1":
            notes.append("ASCEND_ALLOC_MEM=1 -> nothing to change: mlc allocates the whole KV cache at start")
        else:
            notes.append(f"ASCEND_ALLOC_MEM={alloc} -> not followed: mlc always allocates the whole KV cache at "
                         "start (there is no on-demand mode); unset it or set it to 1")
    raw = environ.get("ASCEND_MAX_MEM")
    if raw is None:
        return notes
    try:
        megabytes = float(raw)
    except ValueError:
        raise ConfigError(f"ASCEND_MAX_MEM={raw!r} is not a number of megabytes; write e.g. ASCEND_MAX_MEM=28000, "
                          "or set the KV cache size with --kv-cache-memory 28GB") from None
    if megabytes <= 0:
        raise ConfigError(f"ASCEND_MAX_MEM={raw} must be above 0 (megabytes, e.g. 28000)")
    if engine.kv_cache_memory is not None:
        notes.append(f"ASCEND_MAX_MEM={raw} -> not used: the KV cache size is set (kv_cache_memory "
                     f"{engine.kv_cache_memory / 1e6:.0f}MB)")
        return notes
    engine.kv_cache_memory = int(megabytes * 1e6)
    notes.append(f"ASCEND_MAX_MEM={raw} -> --kv-cache-memory {raw}MB (the KV cache, allocated at start; the weights "
                 "come on top)")
    return notes


# The tutorial's train.sh (section 3.3) and 4-card launch (section 4.3) export these before training.
TRAIN_SIZE_VARS = {"BATCH_SIZE": "batch_size", "SEQ_LEN": "max_seq_len"}


def apply_train_env(cfg, environ: Mapping[str, str], nproc: int | None = None, launcher: bool = True):
    """`mlc-cli train` under the tutorial's environment: BATCH_SIZE and SEQ_LEN become `batch_size` and
    `max_seq_len` where the config and overrides left them unset; RANK_SIZE is checked against the processes mlc
    starts (by the launching process only: `launcher`), RANK_ID and HCCL_* are explained. Returns (the config,
    the notes)."""
    from mlc.config.loader import validate_train_config

    notes: list[str] = []
    update: dict[str, int] = {}
    for var, key in TRAIN_SIZE_VARS.items():
        raw = environ.get(var)
        if raw is None:
            continue
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ConfigError(f"{var}={raw!r} is not a positive whole number; write e.g. {var}=8, or set `{key}` in "
                              "the training config")
        if key in cfg.model_fields_set:
            notes.append(f"{var}={raw} -> not used: the config sets {key} = {getattr(cfg, key)}")
        else:
            update[key] = int(raw)
            notes.append(f"{var}={raw} -> {key}: {raw}")
    if update:
        cfg = validate_train_config({**cfg.model_dump(exclude_unset=True), **update}, "<config + environment>")
    ranks = (nproc or cfg.nproc) * cfg.tensor_parallel
    rank_size = environ.get("RANK_SIZE")
    if rank_size is not None and launcher:
        if rank_size.strip() != str(ranks):
            raise ConfigError(f"RANK_SIZE={rank_size} but this run starts {ranks} process(es) (data_parallel "
                              f"{nproc or cfg.nproc} x model_parallel {cfg.tensor_parallel}); mlc numbers the ranks "
                              f"itself: unset RANK_SIZE, or make parallel_config match it")
        notes.append(f"RANK_SIZE={rank_size} -> matches the {ranks} process(es) mlc starts; nothing to change")
    if environ.get("RANK_ID") is not None and ranks > 1:
        notes.append(f"RANK_ID={environ['RANK_ID']} -> not used: mlc starts every rank from this one command and "
                     "numbers them itself")
    hccl = sorted(k for k in environ if k.startswith("HCCL_"))
    if hccl:
        notes.append(f"{', '.join(hccl)} -> passed to HCCL unchanged (read by the hccl backend on Ascend; no effect "
                     "on gloo or nccl)")
    return cfg, notes
