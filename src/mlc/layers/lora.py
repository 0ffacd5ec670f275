"""Serving PEFT LoRA adapters: many adapters and the base model in one batch, one batched LoRA step per layer.

An adapter is read from PEFT's format (`layers/lora_files.py`) and mapped onto our modules by each architecture's
own weight-name mapping, so `q_proj` lands on the q rows of the fused `qkv_proj`. Targeted modules are wrapped in
`LoRALinear`. Each loaded adapter owns a slot (slot 0: the base model, all zeros), the same in every wrapper of the
model; a wrapper stacks its adapters' weights by slot: `a [slots, R, in]` and `b [slots, out, R]`, where an
adapter's pairs on the parts of a fused projection (q, k, v of `qkv_proj`) are concatenated along the rank, `b`
block-diagonal with the scale folded in, and smaller ranks zero-padded to the wrapper's largest `R`.

A step's rows pick their slots (`lora_rows`). One adapter on every row: two plain matmuls. Otherwise the rows are
segmented by adapter, each segment two matmuls that read its adapter's weights once; or, up to `GATHER_MAX_ROWS`
rows, every row gathers its slot's `a` and `b` and one batched matmul pair adds all the deltas (measured slower on
this CPU, so off by default; ARCHITECTURE.md). Loading or unloading writes one slot in place.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlc.layers.lora_files import AdapterError, load_tensors, open_adapter, pair_modules

# Adapter rows up to which the gather + batched matmul runs instead of segments. 0: segments always, which measured
# faster on this CPU (ARCHITECTURE.md: 32 decode rows of 32 adapters, 4.3 vs 4.6 ms a layer; the gather reads the
# zero blocks of a fused projection's block-diagonal `b` too); a device with a batched-gather kernel would raise it.
GATHER_MAX_ROWS = 0


@dataclass
class _Plan:
    gather: tuple[torch.Tensor | None, torch.Tensor] | None  # (rows or None for all, their slots)
    groups: list[tuple[int, slice | torch.Tensor]]  # (slot, rows) per adapter
    whole: bool = False  # one adapter on every row: two plain matmuls, no indexing


class _Batch:
    """One forward's rows per adapter id, and the slot plan made from them once (the first wrapper asks)."""

    def __init__(self, rows: dict[int, slice | torch.Tensor]):
        self.rows = rows
        self.plans: dict[tuple[int, int], _Plan | None] = {}

    def plan(self, registry: LoRARegistry, n: int, device: torch.device) -> _Plan | None:
        key = (id(registry), n)
        if key not in self.plans:
            self.plans[key] = self._make(registry, n, device)
        return self.plans[key]

    def _make(self, registry: LoRARegistry, n: int, device: torch.device) -> _Plan | None:
        groups = [(registry.slot_of[i], idx) for i, idx in self.rows.items() if i in registry.slot_of]
        if not groups:
            return None
        num = sum(_count(idx, n) for _, idx in groups)
        if len(groups) == 1 or num > GATHER_MAX_ROWS:
            return _Plan(None, groups, whole=len(groups) == 1 and num == n)
        slots = torch.zeros(n, dtype=torch.long)
        for slot, idx in groups:
            slots[idx] = slot
        if num == n:
            return _Plan((None, slots.to(device)), groups)
        rows = torch.nonzero(slots, as_tuple=True)[0]
        return _Plan((rows.to(device), slots[rows].to(device)), groups)


def _count(idx: slice | torch.Tensor, n: int) -> int:
    return len(range(*idx.indices(n))) if isinstance(idx, slice) else int(idx.numel())


_ROWS: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("lora_rows", default=None)


@contextlib.contextmanager
def lora_rows(rows: dict[int, slice | torch.Tensor] | None):
    """During the block, tokens at `rows[adapter_id]` (flat rows of the batch) run with that adapter."""
    token = _ROWS.set(_Batch(rows) if rows else None)
    try:
        yield
    finally:
        _ROWS.reset(token)


@dataclass
class LoRADelta:
    start: int  # output columns this delta adds to (a shard of a fused projection)
    stop: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class LoRARegistry:
    """A model's adapter slots: adapter id -> slot, shared by all its wrappers; `capacity` slots in every stack."""

    slot_of: dict[int, int] = field(default_factory=dict)
    capacity: int = 4
    wrappers: dict[str, LoRALinear] = field(default_factory=dict)

    def take_slot(self, adapter_id: int) -> int:
        used = set(self.slot_of.values())
        slot = next(s for s in range(1, len(used) + 2) if s not in used)
        if slot >= self.capacity:
            self.capacity *= 2
            for w in self.wrappers.values():
                w.restack()
        self.slot_of[adapter_id] = slot
        return slot


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, registry: LoRARegistry | None = None):
        super().__init__()
        self.base = base
        self.registry = registry or LoRARegistry()
        self.deltas: dict[int, list[LoRADelta]] = {}  # adapter id -> its pairs on this projection
        self.a: torch.Tensor | None = None  # [capacity, R, in]
        self.b: torch.Tensor | None = None  # [capacity, out, R]

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)  # shard_sizes, in_features, split, ... of the wrapped layer

    def add(self, adapter_id: int, deltas: list[LoRADelta]) -> None:
        self.deltas[adapter_id] = deltas
        rank = sum(d.a.shape[0] for d in deltas)
        if self.a is None or rank > self.a.shape[1] or self.a.shape[0] < self.registry.capacity:
            self.restack(max(rank, 0 if self.a is None else self.a.shape[1]))
        else:
            self._write(self.registry.slot_of[adapter_id], deltas)

    def remove(self, adapter_id: int) -> None:
        if self.deltas.pop(adapter_id, None) is not None and self.a is not None and self.b is not None:
            slot = self.registry.slot_of[adapter_id]
            self.a[slot].zero_()  # a free slot is all zeros: the next adapter writes only its own parts
            self.b[slot].zero_()

    def restack(self, rank: int | None = None) -> None:
        """Stacks sized to the registry's capacity and rank `rank` (default: the current one), slots rewritten."""
        first = next(iter(self.deltas.values()))[0]
        rank = rank or (self.a.shape[1] if self.a is not None else 1)
        base: Any = self.base
        out = int(base.out_features) if hasattr(base, "out_features") else first.stop
        self.a = first.a.new_zeros(self.registry.capacity, rank, first.a.shape[1])
        self.b = first.b.new_zeros(self.registry.capacity, out, rank)
        for adapter_id, deltas in self.deltas.items():
            self._write(self.registry.slot_of[adapter_id], deltas)

    def _write(self, slot: int, deltas: list[LoRADelta]) -> None:
        assert self.a is not None and self.b is not None
        r0 = 0
        for d in deltas:
            r = d.a.shape[0]
            self.a[slot, r0 : r0 + r] = d.a
            self.b[slot, d.start : d.stop, r0 : r0 + r] = d.b * d.scale
            r0 += r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = _ROWS.get()
        if batch is None or self.a is None or self.b is None:
            return y
        plan = batch.plan(self.registry, x.shape[0], x.device)
        if plan is None:
            return y
        if plan.whole:  # one adapter on every row
            slot = plan.groups[0][0]
            y += ((x.to(self.a.dtype) @ self.a[slot].t()) @ self.b[slot].t()).to(y.dtype)
            return y
        if plan.gather is not None:  # every adapter row at once: gather its slot, two batched matmuls
            rows, slots = plan.gather
            xs = x if rows is None else x[rows]
            xa = torch.bmm(self.a[slots], xs.to(self.a.dtype).unsqueeze(-1))
            if rows is None and y.dtype == self.b.dtype and y.is_contiguous():
                y.unsqueeze(-1).baddbmm_(self.b[slots], xa)
            elif rows is None:
                y += torch.bmm(self.b[slots], xa).squeeze(-1).to(y.dtype)
            else:
                y.index_add_(0, rows, torch.bmm(self.b[slots], xa).squeeze(-1).to(y.dtype))
            return y
        for slot, idx in plan.groups:  # segments: one adapter's rows at a time
            y[idx] += ((x[idx].to(self.a.dtype) @ self.a[slot].t()) @ self.b[slot].t()).to(y.dtype)
        return y


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    alpha: float
    scale: float
    target_modules: list[str]
    num_tensors: int
    digest: str = ""  # sha256 of the adapter's files: keys the prefix cache


def registry(model: nn.Module) -> LoRARegistry:
    reg = getattr(model, "lora_registry", None)
    if reg is None:
        reg = LoRARegistry()
        model.__dict__["lora_registry"] = reg
    return reg


def _max_dim(model) -> int:
    cfg = getattr(model, "config", None)
    dims = [int(getattr(cfg, k, 0) or 0) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size")]
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0) * int(getattr(cfg, "head_dim", 0) or 0)
    return 4 * max(*dims, heads, 1)


@dataclass
class PreparedAdapter:
    """An adapter read and checked against a model, its weights in the model's device and LoRA dtype: what
    `install_adapter` writes. Preparing changes nothing, so it may run off the engine thread."""

    files: Any  # lora_files.AdapterFiles
    deltas: dict[str, list[LoRADelta]]  # module name -> its pairs
    targets: list[str]
    num_tensors: int


def attach_adapter(model, adapter_id: int, name: str, path: Path, max_rank: int | None = None) -> LoRAAdapter:
    """Check the adapter against `model` (nothing allocated until its header fits), then give it a slot and write
    its weights into the wrappers of its target modules (wrapping them on first use)."""
    return install_adapter(model, adapter_id, name, prepare_adapter(model, path, max_rank))


def _module(model, name: str) -> Any:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def prepare_adapter(model, path: Path, max_rank: int | None = None) -> PreparedAdapter:
    files = open_adapter(Path(path), max_rank, _max_dim(model))
    pairs = pair_modules(files)
    plan: list[tuple[str, int | None, int, int, str, str]] = []
    for hf_module, (key_a, key_b) in pairs.items():
        target = model.map_weight_name(hf_module + ".weight")
        if target is None or target.expert is not None:
            raise AdapterError(f"{files.path}: LoRA on {hf_module} is not supported for serving (only attention and "
                               "dense MLP projections); serve the merged export instead")
        module_name = target.param.removesuffix(".weight")
        base: Any = _module(model, module_name)
        if base is None:
            raise AdapterError(
                f"{files.path}: {hf_module} does not exist in this model; the adapter was trained for another base")
        if isinstance(base, LoRALinear):
            base = base.base
        sizes = getattr(base, "shard_sizes", None) or [base.out_features]
        start = sum(sizes[: target.shard]) if target.shard is not None else 0
        stop = start + (sizes[target.shard] if target.shard is not None else base.out_features)
        if getattr(base, "tp", None) is None:
            _check_shapes(files, hf_module, files.shapes[key_a], files.shapes[key_b], base.in_features, stop - start)
        plan.append((module_name, target.shard, start, stop, key_a, key_b))
    tensors = load_tensors(files)
    device, dtype = model.device, model.dtype
    if device.type == "cpu":  # CPUs without bf16 matmul units run the small LoRA matmuls far faster in fp32
        dtype = torch.float32
    found: list[tuple[str, LoRADelta]] = []
    for module_name, shard, start, stop, key_a, key_b in plan:
        layer: Any = _module(model, module_name)
        base = layer.base if isinstance(layer, LoRALinear) else layer
        a, b = tensors[key_a], tensors[key_b]
        if getattr(base, "tp", None) is not None:  # this rank's part of a tensor-parallel layer
            a, b = base.tp.lora(shard, a, b)
        _check_shapes(files, module_name, tuple(a.shape), tuple(b.shape), base.in_features, stop - start)
        found.append((module_name, LoRADelta(start, stop, a.to(device, dtype), b.to(device, dtype), files.scale)))
    by_module: dict[str, list[LoRADelta]] = {}
    for module_name, delta in found:
        by_module.setdefault(module_name, []).append(delta)
    return PreparedAdapter(files, by_module, sorted({m.rsplit(".", 1)[-1] for m in pairs}), 2 * len(pairs))


def install_adapter(model, adapter_id: int, name: str, prepared: PreparedAdapter) -> LoRAAdapter:
    """Give a prepared adapter a slot and write it into its wrappers (the engine thread, between steps)."""
    reg = registry(model)
    if adapter_id in reg.slot_of:
        raise AdapterError(f"adapter id {adapter_id} is attached already")
    reg.take_slot(adapter_id)
    for module_name, deltas in prepared.deltas.items():
        _wrap(model, module_name, reg).add(adapter_id, deltas)
    f = prepared.files
    return LoRAAdapter(name, f.path, f.rank, f.alpha, f.scale, prepared.targets, prepared.num_tensors, f.digest)


def _check_shapes(files, module: str, a: tuple[int, ...], b: tuple[int, ...], fan_in: int, fan_out: int) -> None:
    if a != (files.rank, fan_in) or b != (fan_out, files.rank):
        raise AdapterError(f"{files.path}: {module} LoRA shapes {list(a)}/{list(b)} do not fit the base layer "
                           f"({fan_in} -> {fan_out}, r={files.rank}); the adapter was trained for another base model")


def detach_adapter(model, adapter_id: int) -> None:
    """Free the adapter's slot; a wrapper left with no adapter gives its place back to the plain layer."""
    reg = registry(model)
    if adapter_id not in reg.slot_of:
        return
    for name, wrapper in list(reg.wrappers.items()):
        wrapper.remove(adapter_id)
        if not wrapper.deltas:
            _unwrap(model, name, reg)
    del reg.slot_of[adapter_id]


def _wrap(model: nn.Module, name: str, reg: LoRARegistry) -> LoRALinear:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    current = getattr(parent, child)
    if isinstance(current, LoRALinear):
        return current
    wrapper = LoRALinear(current, reg)
    setattr(parent, child, wrapper)
    reg.wrappers[name] = wrapper
    _changed(model)
    return wrapper


def _unwrap(model: nn.Module, name: str, reg: LoRARegistry) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, reg.wrappers.pop(name).base)
    _changed(model)


def _changed(model: nn.Module) -> None:
    changed = getattr(model, "modules_changed", None)
    if callable(changed):
        changed()
