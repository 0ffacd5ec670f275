"""What every architecture shares: the engine-facing interface, dense scoring and weight loading by HF names."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mlc.distributed.state import gather_from_tp, reduce_from_tp, tp_rank, tp_size
from mlc.errors import ConfigError, ModelFormatError
from mlc.layers.attention import AttentionMetadata, build_attention_metadata
from mlc.layers.kv_store import LayerCache
from mlc.layers.linear import MergedLinear, split_evenly
from mlc.layers.weight_target import WeightTarget

if TYPE_CHECKING:
    from mlc.layers.quant import QuantReport


class Embedding(nn.Module):
    """Token embedding; vocabulary-parallel under tensor parallelism (each rank holds a contiguous slice of rows,
    looks up the ids that fall in it and zeros the rest, and the ranks' lookups are summed)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.full_rows = num_embeddings
        self.rows = split_evenly(num_embeddings, "vocabulary size") if tp_size() > 1 else num_embeddings
        self.start = tp_rank() * self.rows if tp_size() > 1 else 0
        self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows == self.full_rows:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return reduce_from_tp(out)

    def tp_slice(self, attr: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.rows == self.full_rows or tensor.shape[0] != self.full_rows:
            return tensor
        return tensor[self.start : self.start + self.rows]


class DecoderModel(nn.Module):
    """The decoder stack a CausalLM wraps (its `model`): what the shared code reads of it."""

    embed_tokens: Embedding  # or a GGUFEmbedding (models/gguf/native.py): both say their dtype and device
    layers: nn.ModuleList
    norm: nn.Module


class CausalLM(nn.Module):
    """Engine-facing model. Subclasses build `self.model` and `self.lm_head` and define the cache layout.

    forward(input_ids [T], positions [T], meta, kv_caches) -> hidden states [T, hidden]
    compute_logits(hidden [N, hidden]) -> fp32 logits [N, vocab]
    """

    model_dir: Path  # the checkpoint dir it was loaded from (set by models/loader.py)
    model: DecoderModel
    lm_head: nn.Module  # a Linear (or its quantized stand-in), or the tied Embedding
    weight_info: str  # set by models/loader.py where the weights are not the checkpoint's own precision
    quant_report: QuantReport  # set by models/loader.py where it quantizes
    stage_layers: tuple[int, int] | None = None  # [first, end) of the layers a pipeline stage holds (engine/pp_stage)

    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config
        self.decode_plans: list | None = None  # fused decode layers (models/fused_decode.py), built at first use
        self.mtp: nn.Module | None = None  # the multi-token-prediction layer, where `add_mtp` built it (models/mtp.py)

    def modules_changed(self) -> None:
        """A projection was wrapped (a LoRA adapter): plans made from the old modules are dropped."""
        self.decode_plans = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerCache] | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, Embedding):  # tied: the embedding matrix is the head
            return gather_from_tp(F.linear(hidden, self.lm_head.weight)).float()
        # a Linear, or its quantized stand-in; under tensor parallelism each rank scores its slice of the vocabulary
        return gather_from_tp(self.lm_head(hidden)).float()

    def kv_cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer: cache tensor name -> per-token shape."""
        raise NotImplementedError

    def stage_cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        """`kv_cache_spec` of the layers this model holds (all of them, or one pipeline stage's); an MTP layer's
        cache comes last."""
        spec = self.kv_cache_spec()
        if self.stage_layers is not None:
            return spec[self.stage_layers[0] : self.stage_layers[1]]
        return spec + [self.mtp_cache_spec()] if self.mtp is not None else spec

    def add_mtp(self) -> None:
        """Build the checkpoint's multi-token-prediction layer (models/mtp.py), for speculative method "mtp"."""
        raise ConfigError(f"{self.config.model_type} models have no multi-token-prediction (MTP) layer; use "
                          'speculative method "ngram"')

    def mtp_cache_spec(self) -> dict[str, tuple[int, ...]]:
        return self.kv_cache_spec()[0]

    def run_mtp_block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None,
                      meta: AttentionMetadata) -> torch.Tensor:
        """The MTP layer's decoder block, called the way this model calls its own layers."""
        assert self.mtp is not None
        return self.mtp(x, cos, sin, cache, meta)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.device  # not lm_head: quantize_model may replace it

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.dtype  # an Embedding's, or a GGUFEmbedding's output dtype

    @torch.inference_mode()
    def dense_logits(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits `[len_i, vocab]` for each token list, all sequences run in one flat batch."""
        lens = [len(t) for t in token_lists]
        meta = build_attention_metadata(lens, lens, None, device=self.device)
        ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        logits = self.compute_logits(self.forward(ids, positions, meta, None))
        return list(logits.split(lens))

    def map_weight_name(self, name: str) -> WeightTarget | None:
        """Map a checkpoint tensor name to its target; None skips it (e.g. MTP layers). Override per model."""
        return WeightTarget(name)

    def required_params(self) -> set[str]:
        return {n for n, _ in self.named_parameters()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        params.update(dict(self.named_buffers()))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self.map_weight_name(name)
            if target is None:
                continue
            if target.param not in params:
                raise ModelFormatError(
                    f"checkpoint tensor {name!r} has no place in the {type(self).__name__} built from config.json; "
                    "the checkpoint and its config disagree (layers, experts or attention type)"
                )
            self._load_one(name, tensor, target, params[target.param], modules)
            loaded.add(target.param)
        missing = sorted(self.required_params() - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelFormatError(
                f"checkpoint is missing {len(missing)} tensor(s): {shown}; the download may be incomplete "
                "(run `mlc-cli models verify`) or the config does not match the weights"
            )
        self.post_load()

    def post_load(self) -> None:
        """Hook after all tensors are in (derive fused or absorbed weights)."""

    def _load_one(self, name, tensor, target: WeightTarget, param, modules) -> None:
        module_name, _, attr = target.param.rpartition(".")
        module = modules.get(module_name)
        if target.shard is not None:
            assert isinstance(module, MergedLinear)
            module.load_shard(target.shard, name, tensor, attr == "bias")
            return
        if hasattr(module, "load_tensor"):  # stacked experts place (and shard) their own tensors
            module.load_tensor(attr, name, tensor, target)
            return
        if hasattr(module, "tp_slice"):
            tensor = module.tp_slice(attr, tensor)
        dest = param.data
        if target.rows is not None:
            dest = dest[target.rows[0] : target.rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelFormatError(
                f"{name}: shape {tuple(tensor.shape)} does not match the config's {tuple(dest.shape)}; "
                "the checkpoint and its config.json disagree"
            )
        dest.copy_(tensor)
