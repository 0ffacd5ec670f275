"""How many KV pages to preallocate from a memory budget, and in which dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mlc.config.engine_config import EngineConfig
from mlc.config.hardware import usable_cores
from mlc.engine.kv_cache import KVCache, KVDtype, kv_dtype
from mlc.errors import ConfigError
from mlc.models.base import CausalLM

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


_V1_NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_memory_left(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """Bytes this process's memory cgroup may still take: the tightest limit - usage over its cgroup and the cgroups
    above it (v2: memory.max / memory.current; v1: the memory controller's memory.limit_in_bytes /
    memory.usage_in_bytes); None where no limit is set or no cgroup is found."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            places.append((root, path, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            places.append((root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    left: int | None = None
    for base, path, limit_file, used_file in places:
        group = base / path.strip().lstrip("/")
        for d in (group, *group.parents):
            try:
                limit = (d / limit_file).read_text().strip()
                if limit != "max" and int(limit) < _V1_NO_LIMIT:
                    room = max(0, int(limit) - int((d / used_file).read_text().strip()))
                    left = room if left is None else min(left, room)
            except (OSError, ValueError):
                pass
            if d == base:
                break
    return left


def available_memory(device: torch.device) -> int:
    """Free bytes on the device; for the CPU, MemAvailable or what the process's cgroup still allows, the less."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]  # torch_npu adds torch.npu
    free = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    if free is None:
        raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
    left = cgroup_memory_left()
    return free if left is None else min(free, left)


AUTO_MAX_BATCH = 256  # vLLM's default max_num_seqs; the KV budget usually binds first
AUTO_TOKENS_PER_SEQ = 512  # the room each sequence of an automatic batch size is planned to hold
CPU_SEQS_PER_CORE = 32  # a CPU's automatic KV cache is planned for this many sequences a core (cpu_auto_batch)


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


def cpu_auto_batch() -> int:
    """The batch a CPU's automatic KV cache is planned for: CPU_SEQS_PER_CORE sequences a usable core, at most
    AUTO_MAX_BATCH. Decode on two cores gains little past 32 streams (bench scale: c=32 gives 1.1-1.3x c=8), so a
    cache for 256 of them only held memory (4.6 GB at a 1B shape, against llama-server's 1.1 GB)."""
    return max(1, min(AUTO_MAX_BATCH, CPU_SEQS_PER_CORE * usable_cores()))


def cpu_auto_pages(page_size: int, max_seq_len: int) -> int:
    """On a CPU with an automatic batch size, the pages the batch can use: `cpu_auto_batch()` sequences of the
    AUTO_TOKENS_PER_SEQ each is planned with, plus one sequence of the full context, plus the null page. A CPU
    batch never fills more, and its memory is the machine's: the rest of a free-memory fraction is left alone.
    More sequences than that still run when they are shorter (the scheduler admits by free pages)."""
    per_seq = -(-min(max_seq_len, AUTO_TOKENS_PER_SEQ) // page_size)
    return cpu_auto_batch() * per_seq + -(-max_seq_len // page_size) + 1


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
    (max_batch_size full-length sequences; AUTO_MAX_BATCH of them when the batch size is automatic, and on a CPU
    `cpu_auto_pages`). An automatic batch size (`max_batch_size=None`) is then sized from the pages the budget
    gives."""
    bytes_per_page = bytes_per_token * page_size
    need_pages = (max_batch_size or AUTO_MAX_BATCH) * ((max_seq_len + page_size - 1) // page_size) + 1
    if max_batch_size is None and device is not None and device.type == "cpu":
        need_pages = min(need_pages, cpu_auto_pages(page_size, max_seq_len))
    if budget_bytes is not None:
        pages, capped = budget_bytes // bytes_per_page, False
    else:
        budget_bytes = int(available_memory(device) * fraction)
        pages = budget_bytes // bytes_per_page
        capped = pages > need_pages
        pages = min(pages, need_pages)
    batch = max_batch_size or auto_batch_size(int(pages), page_size, max_seq_len)
    return CachePlan(int(pages), bytes_per_token, page_size, int(budget_bytes), capped, batch, max_batch_size is None)


def size_cache(config: EngineConfig, model: CausalLM, max_seq_len: int,
               extra: list[dict[str, tuple[int, ...]]] | None = None) -> tuple[CachePlan, KVDtype]:
    """The KV cache `config` asks for on `model` (its MTP layer and `extra` layers, a draft model's, included):
    its plan and dtype. The budget is this rank's (the model's spec is its own heads under tensor parallelism), and
    on a CPU every rank's cache comes out of the same free memory."""
    try:
        cache_dtype = kv_dtype(config.kv_cache_dtype, model.dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ranks = config.tensor_parallel_size
    fraction = config.kv_cache_fraction / (ranks if model.device.type == "cpu" else 1)
    if config.kv_cache_memory is not None:
        check_budget_fits(config.kv_cache_memory, ranks if model.device.type == "cpu" else 1, model.device)
    spec = model.kv_cache_spec() + ([model.mtp_cache_spec()] if model.mtp is not None else []) + (extra or [])
    plan = plan_cache(KVCache.bytes_per_token_for(spec, cache_dtype), config.page_size,
                      config.kv_cache_memory, fraction, model.device, config.max_batch_size, max_seq_len)
    if plan.num_pages < 2:
        raise ConfigError(f"kv_cache_memory {config.kv_cache_memory} bytes holds no page of {config.page_size} "
                          f"tokens ({plan.bytes_per_page} bytes each); raise --kv-cache-memory")
    return plan, cache_dtype


def check_budget_fits(budget: int, ranks: int, device: torch.device) -> None:
    """An explicit KV budget (per rank; on a CPU every rank's comes out of one memory) that the device cannot give
    is refused at start, with the numbers, rather than failing hours later when the pages are first written."""
    free = available_memory(device)
    if budget * ranks > free:
        each = f" x {ranks} ranks" if ranks > 1 else ""
        raise ConfigError(f"kv_cache_memory {budget / 2**30:.2f} GiB{each} is more than the {free / 2**30:.2f} GiB "
                          f"this process may still use on {device.type} (free memory, and the cgroup's memory.max "
                          "where one is set); lower --kv-cache-memory or leave it unset to size it from free memory")
