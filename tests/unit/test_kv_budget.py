"""Where the KV budget comes from on a CPU (`engine/memory.py`): the memory cgroup's limit beside free memory (v2
and v1 layouts), the cap at what an automatic batch can use, an explicit budget that cannot fit refused at start;
and the pool written once at start (`KVCache.touch`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mlc.engine import memory
from mlc.engine.kv_cache import KVCache
from mlc.engine.memory import (
    AUTO_MAX_BATCH,
    AUTO_TOKENS_PER_SEQ,
    CPU_SEQS_PER_CORE,
    cgroup_memory_left,
    check_budget_fits,
    cpu_auto_batch,
    cpu_auto_pages,
    plan_cache,
)
from mlc.errors import ConfigError

GiB = 2**30


def _write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for line in text.split(";"):
        name, value = line.split("=")
        (path / name).write_text(value + "\n")


def test_a_cgroup_v2_limit_is_the_tightest_of_the_group_and_its_parents(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "system.slice", f"memory.max={8 * GiB};memory.current={5 * GiB}")
    _write(root / "system.slice" / "mlc.service", f"memory.max=max;memory.current={GiB}")
    me = tmp_path / "self"
    me.write_text("0::/system.slice/mlc.service\n")
    assert cgroup_memory_left(root, me) == 3 * GiB  # the parent's 8 GiB, 5 GiB of it used
    _write(root / "system.slice" / "mlc.service", f"memory.max={2 * GiB};memory.current={GiB}")
    assert cgroup_memory_left(root, me) == GiB
    _write(root / "system.slice", "memory.max=max;memory.current=0")
    _write(root / "system.slice" / "mlc.service", "memory.max=max;memory.current=0")
    assert cgroup_memory_left(root, me) is None  # no limit anywhere
    assert cgroup_memory_left(root, tmp_path / "missing") is None


def test_a_cgroup_v1_memory_controller_counts_too(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "memory", f"memory.limit_in_bytes={2**63 - 4096};memory.usage_in_bytes={GiB}")  # v1's "none"
    _write(root / "memory" / "job", f"memory.limit_in_bytes={4 * GiB};memory.usage_in_bytes={GiB}")
    me = tmp_path / "self"
    me.write_text("4:memory:/job\n3:cpuset:/\n0::/\n")
    assert cgroup_memory_left(root, me) == 3 * GiB


def test_free_memory_is_bounded_by_the_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_memory_left", lambda: 123 * 2**20)
    assert memory.available_memory(torch.device("cpu")) == 123 * 2**20


def test_a_cpu_default_budget_stops_at_what_an_automatic_batch_can_use(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 20 * GiB)
    per_token, page = 23040, 16 * 23040  # the default model's bf16 K and V: 30 layers x 2 x 3 heads x 64 x 2 bytes
    monkeypatch.setattr(memory, "usable_cores", lambda: 2)
    cap = cpu_auto_pages(16, 8192)
    assert cpu_auto_batch() == 2 * CPU_SEQS_PER_CORE == 64
    assert cap == 64 * AUTO_TOKENS_PER_SEQ // 16 + 8192 // 16 + 1
    plan = plan_cache(per_token, 16, None, 0.9, torch.device("cpu"), None, 8192)
    # 64 sequences, and 16 more in the full context's room
    assert plan.num_pages == cap and plan.capped_by_need and plan.max_batch_size == 80
    assert plan.total_bytes < 1.0e9  # not 90% of 20 GiB, touched bit by bit over hours
    monkeypatch.setattr(memory, "usable_cores", lambda: 64)  # a big host: at most AUTO_MAX_BATCH sequences
    assert cpu_auto_batch() == AUTO_MAX_BATCH
    fixed = plan_cache(per_token, 16, None, 0.9, torch.device("cpu"), 2, 1024)  # an explicit batch: as before
    assert fixed.num_pages == 2 * 64 + 1
    meta = plan_cache(per_token, 16, None, 0.9, torch.device("meta"), None, 8192)  # other devices: no CPU cap
    assert meta.num_pages == int(20 * GiB * 0.9) // page


def test_an_explicit_budget_the_machine_cannot_give_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 4 * GiB)
    check_budget_fits(3 * GiB, 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"kv_cache_memory 3.00 GiB x 2 ranks is more than the 4.00 GiB this "
                                          r"process may still use on cpu .*lower --kv-cache-memory"):
        check_budget_fits(3 * GiB, 2, torch.device("cpu"))


def test_touch_writes_every_page_and_keeps_the_null_page_zero():
    spec = [{"k": (2, 8), "v": (2, 8)}] * 2
    for dtype in (torch.float32, "int8"):
        cache = KVCache(spec, num_pages=4, page_size=16, dtype=dtype)
        assert cache.touch() == cache.total_bytes() > 0
        for layer in cache.layers:
            for t in layer.values():
                assert not t.data.any()
