"""The driver's model runner under tensor parallelism: each call that touches the model or the KV cache runs on
every rank (the workers first, then the driver's own shard), and the driver alone returns the results."""

from __future__ import annotations

import os

import torch

from mlc.config.engine_config import EngineConfig
from mlc.engine.kv_cache import KVCache
from mlc.engine.model_runner import ModelRunner, StepInputs
from mlc.engine.page_manager import PageCopy
from mlc.engine.tp_group import TPGroup
from mlc.layers.lora import LoRAAdapter, PreparedAdapter
from mlc.models.base import CausalLM


class TPModelRunner(ModelRunner):
    def __init__(self, model: CausalLM, kv_cache: KVCache, group: TPGroup) -> None:
        super().__init__(model, kv_cache)
        self.group = group

    def execute(self, step: StepInputs) -> tuple[torch.Tensor, dict[int, list[float]]]:
        return self.group.run("execute", super().execute, step)

    def touch_cache(self) -> int:
        return self.group.run("touch_cache", super().touch_cache)

    def apply_copies(self, copies: list[PageCopy]) -> None:
        if copies:
            self.group.run("apply_copies", super().apply_copies, copies)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.group.run("move_slots", super().move_slots, src, dst)

    def attach_adapter(self, adapter_id: int, name: str, path: str, max_rank: int | None = None,
                       prepared: PreparedAdapter | None = None) -> LoRAAdapter:
        return self.group.run("attach_adapter", super().attach_adapter, adapter_id, name, str(path), max_rank)

    def prepare_adapter(self, path: str, max_rank: int | None = None) -> PreparedAdapter | None:
        return None  # every rank reads its own part when it attaches

    def detach_adapter(self, adapter_id: int) -> None:
        self.group.run("detach_adapter", super().detach_adapter, adapter_id)


def start_tensor_parallel(config: EngineConfig, model: CausalLM | None) -> tuple[CausalLM, TPGroup]:
    """(this rank's model shard, the group) for an engine config asking for more than one rank."""
    from mlc.config.device import resolve_device
    from mlc.distributed.checks import check_tensor_parallel, rank_device
    from mlc.errors import ConfigError
    from mlc.models.hf_checkpoint import read_config
    from mlc.models.loader import load_model
    from mlc.models.store import resolve_model_dir

    if model is not None:
        raise ConfigError("tensor parallelism loads the model in every rank: pass the model's name or path, "
                          "not a model object")
    size = config.tensor_parallel_size
    device = resolve_device(config.device)
    check_tensor_parallel(read_config(resolve_model_dir(config.model)), size, config.enable_expert_parallel,
                          config.device)
    # on a CPU the ranks share its cores: each gets its part, or num_threads when set
    threads = config.num_threads or (max(1, (os.cpu_count() or 1) // size) if device.type == "cpu" else 1)
    torch.set_num_threads(threads)
    group = TPGroup(size, config.enable_expert_parallel, device, config.model_dump(), threads)
    try:
        model = load_model(config.model, rank_device(device, 0), config.dtype, config.weight_dtype,
                           verify=config.verify)
    except Exception:
        group.shutdown()
        raise
    group.collect("load", None)
    return model, group
