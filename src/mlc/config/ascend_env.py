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
