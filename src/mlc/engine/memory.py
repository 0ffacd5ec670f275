"""How many KV pages to preallocate from a memory budget, and in which dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlc.config.engine_config import EngineConfig
from mlc.engine.kv_cache import KVCache, KVDtype, kv_dtype
from mlc.errors import ConfigError
from mlc.models.base import CausalLM


def available_memory(device: torch.device) -> int:
    """Free bytes on the device (MemAvailable for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]  # torch_npu adds torch.npu
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


AUTO_MAX_BATCH = 256  # vLLM's default max_num_seqs; the KV budget usually binds first
AUTO_TOKENS_PER_SEQ = 512  # the room each sequence of an automatic batch size is planned to hold


@dataclass
class CachePlan:
    num_pages: int  # including the reserved null page
    bytes_per_token: int
    page_size: int
    budget_bytes: int
    capped_by_need: bool
    max_batch_size: int = 1  # the batch size asked for, or the one sized from this budget
    batch_auto: bool = False

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page


def auto_batch_size(num_pages: int, page_size: int, max_seq_len: int) -> int:
    """As many sequences as the cache holds at `AUTO_TOKENS_PER_SEQ` tokens each (fewer if the context is shorter),
    between 1 and AUTO_MAX_BATCH. Longer sequences still run: the scheduler admits by free pages."""
    per_seq = -(-min(max_seq_len, AUTO_TOKENS_PER_SEQ) // page_size)
    return max(1, min(AUTO_MAX_BATCH, (num_pages - 1) // per_seq))


def plan_cache(
    bytes_per_token: int,
    page_size: int,
    budget_bytes: int | None,
    fraction: float,
    device: torch.device,
    max_batch_size: int | None,
    max_seq_len: int,
) -> CachePlan:
    """An explicit budget is taken as is; otherwise `fraction` of free memory, but never more than the batch can use
    (max_batch_size full-length sequences; AUTO_MAX_BATCH when the batch size is automatic). An automatic batch
    size (`max_batch_size=None`) is then sized from the pages the budget gives."""
    bytes_per_page = bytes_per_token * page_size
    need_pages = (max_batch_size or AUTO_MAX_BATCH) * ((max_seq_len + page_size - 1) // page_size) + 1
    if budget_bytes is not None:
        pages, capped = budget_bytes // bytes_per_page, False
    else:
        budget_bytes = int(available_memory(device) * fraction)
        pages = budget_bytes // bytes_per_page
        capped = pages > need_pages
        pages = min(pages, need_pages)
    batch = max_batch_size or auto_batch_size(int(pages), page_size, max_seq_len)
    return CachePlan(int(pages), bytes_per_token, page_size, int(budget_bytes), capped, batch, max_batch_size is None)


def size_cache(config: EngineConfig, model: CausalLM, max_seq_len: int) -> tuple[CachePlan, KVDtype]:
    """The KV cache `config` asks for on `model`: its plan and dtype. The budget is this rank's (the model's spec is
    its own heads under tensor parallelism), and on a CPU every rank's cache comes out of the same free memory."""
    try:
        cache_dtype = kv_dtype(config.kv_cache_dtype, model.dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ranks = config.tensor_parallel_size
    fraction = config.kv_cache_fraction / (ranks if model.device.type == "cpu" else 1)
    plan = plan_cache(KVCache.bytes_per_token_for(model.kv_cache_spec(), cache_dtype), config.page_size,
                      config.kv_cache_memory, fraction, model.device, config.max_batch_size, max_seq_len)
    if plan.num_pages < 2:
        raise ConfigError(f"kv_cache_memory {config.kv_cache_memory} bytes holds no page of {config.page_size} "
                          f"tokens ({plan.bytes_per_page} bytes each); raise --kv-cache-memory")
    return plan, cache_dtype
