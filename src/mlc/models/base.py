"""What every architecture shares: the engine-facing interface, dense scoring and weight loading by HF names."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mlc.errors import ModelFormatError
from mlc.layers.attention import AttentionMetadata, build_attention_metadata
from mlc.layers.kv_store import LayerCache
from mlc.layers.linear import MergedLinear
from mlc.layers.weight_target import WeightTarget


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class CausalLM(nn.Module):
    """Engine-facing model. Subclasses build `self.model` and `self.lm_head` and define the cache layout.

    forward(input_ids [T], positions [T], meta, kv_caches) -> hidden states [T, hidden]
    compute_logits(hidden [N, hidden]) -> fp32 logits [N, vocab]
    """

    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config

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
            return F.linear(hidden, self.lm_head.weight).float()
        return self.lm_head(hidden).float()  # a Linear, or its quantized stand-in

    def kv_cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer: cache tensor name -> per-token shape."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device  # not lm_head: quantize_model may replace it

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

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
        params = dict(self.named_parameters())
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
        if target.shard is not None:
            module_name, _, attr = target.param.rpartition(".")
            module = modules[module_name]
            assert isinstance(module, MergedLinear)
            module.load_shard(target.shard, name, tensor, attr == "bias")
            return
        if target.expert is not None and not 0 <= target.expert < param.shape[0]:
            raise ModelFormatError(
                f"{name}: expert {target.expert} does not exist, the config declares {param.shape[0]} experts; "
                "the checkpoint and its config.json disagree"
            )
        dest = param.data if target.expert is None else param.data[target.expert]
        if target.rows is not None:
            dest = dest[target.rows[0] : target.rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelFormatError(
                f"{name}: shape {tuple(tensor.shape)} does not match the config's {tuple(dest.shape)}; "
                "the checkpoint and its config.json disagree"
            )
        dest.copy_(tensor)
