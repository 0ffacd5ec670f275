"""Speculative decoding with a small draft model (`{"method": "draft_model", "model": ...}`): a model of the same
vocabulary proposes `num_speculative_tokens` tokens greedily, the target verifies them in its step.

The draft model's KV cache is more layers of the target's paged cache (the same pages and page tables), so it is
sized, moved, forked, freed and prefix-cached with the target's. It runs after scheduling, before the target's
step, over every scheduled sequence: first over the tokens the target computes this step that it has not seen yet
(a prompt chunk, or the last sampled token and whatever it skipped), which keeps its cache whole for every page
the prefix cache may hand to another sequence; then, for the sequences that draft, one token at a time, writing
its cache at the slots the target's verify rows use (the scheduler grew the pages for them). What verification
rejects is overwritten later: a sequence's draft cache is valid up to `DraftState.draft_cached`, which never
exceeds what the target holds (`Sequence.num_cached`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import torch

from mlc.engine.sequence import ScheduledSeq
from mlc.errors import ConfigError
from mlc.layers.attention import build_attention_metadata

if TYPE_CHECKING:
    from mlc.config.engine_config import EngineConfig
    from mlc.engine.kv_cache import KVCache
    from mlc.engine.sequence import Sequence
    from mlc.models.base import CausalLM

@dataclasses.dataclass
class _Rows:
    seq: Sequence
    start: int  # the first position fed this pass
    tokens: list[int]


class DraftModel:
    """Runs the draft model over its layers of the shared cache (`first_layer` on)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, first_layer: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.first_layer = first_layer
        self.device = model.device

    @torch.inference_mode()
    def _forward(self, rows: list[_Rows]) -> list[int]:
        """Greedy next token after each job's last row, its cache written on the way."""
        ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long, device=self.device)
        pos = torch.tensor([p for r in rows for p in range(r.start, r.start + len(r.tokens))], device=self.device)
        meta = build_attention_metadata([len(r.tokens) for r in rows], [r.start + len(r.tokens) for r in rows],
                                        [r.seq.page_table for r in rows], self.kv_cache.page_size, self.device)
        hidden = self.model(ids, pos, meta, self.kv_cache.layers[self.first_layer:])
        last = torch.tensor(list(itertools.accumulate(len(r.tokens) for r in rows)), device=self.device) - 1
        return self.model.compute_logits(hidden[last]).argmax(-1).tolist()

    def fill(self, scheduled: list[ScheduledSeq], cached: dict[int, int], rooms: set[int]) -> dict[int, list[int]]:
        """Feed every scheduled sequence's unseen tokens, then draft for those in `rooms` (seq_ids) into their
        `num_draft`: returns seq_id -> its greedy drafts. `cached` (seq_id -> how many positions of its draft cache
        are valid; a sequence not in it trusts the pages it holds, e.g. a prefix-cache hit) is moved on."""
        catch_up: list[_Rows] = []
        for item in scheduled:
            seq = item.seq
            start = min(cached.get(seq.seq_id, seq.num_cached), seq.num_cached)
            stop = seq.num_cached + item.num_tokens - item.num_draft
            catch_up.append(_Rows(seq, start, seq.all_ids[start:stop]))
            cached[seq.seq_id] = stop
        going = [item for item in scheduled if item.num_draft and item.seq.seq_id in rooms]
        drafts = {item.seq.seq_id: [token] for item, token in zip(scheduled, self._forward(catch_up))
                  if item.num_draft and item.seq.seq_id in rooms}
        for j in range(1, max((item.num_draft for item in going), default=0)):
            going = [item for item in going if item.num_draft > j]
            rows = [_Rows(item.seq, cached[item.seq.seq_id], [drafts[item.seq.seq_id][-1]]) for item in going]
            for item, token in zip(going, self._forward(rows)):
                drafts[item.seq.seq_id].append(token)
                cached[item.seq.seq_id] += 1
        return drafts


def load_draft_model(config: EngineConfig, model: CausalLM, max_seq_len: int) -> CausalLM | None:
    """Speculative method draft_model: the draft, loaded as the target is, and checked against it."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return None
    from mlc.models.loader import load_model

    draft = load_model(spec.model, config.device, config.dtype, config.weight_dtype, verify=config.verify)
    if draft.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"draft model {spec.model} has a vocabulary of {draft.config.vocab_size} tokens, the "
                          f"served model {model.config.vocab_size}; a draft model must share the tokenizer")
    context = int(getattr(draft.config, "max_position_embeddings", 0) or 4096)
    if context < max_seq_len:
        raise ConfigError(f"draft model {spec.model} reads {context} positions, less than the {max_seq_len} "
                          f"served; pass --max-seq-len {context} or a draft model of a longer context")
    return draft
