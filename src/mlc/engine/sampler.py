"""Turns next-token logits into tokens, each row with its own parameters and its own random generator.

Order: penalties (repetition over prompt+output, presence/frequency over output), logit_bias (added to the rows
that have one), min_new_tokens (EOS barred), then greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw
from the row's generator. A seeded request draws from a generator seeded by (seed + sample index), so its output does
not depend on what it is batched with. Rows of requests with a grammar (structured outputs) then lose every token
their sequence's matcher forbids (`engine/grammar.py`; the sampler only reads matchers, the scheduler moves them on);
a batch without one never reaches that code. Reported logprobs are those of the model's distribution before any
processing.
"""

from __future__ import annotations

import torch

from mlc.engine.grammar import GrammarMasks, GuidedRow
from mlc.engine.isolate import one_by_one
from mlc.engine.sampling_params import MAX_BIAS
from mlc.engine.sequence import Sequence, TokenLogprob


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0):
        self.eos_token_ids = set(eos_token_ids)
        self.rng = torch.Generator().manual_seed(seed)
        self.grammars = GrammarMasks(self.eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        logits = logits.float().cpu()  # the per-sequence generators are CPU generators (same draws on any device)
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        raw = logits
        if any(self._needs_processing(s) for s in seqs):
            logits = logits.clone()
            for i, s in enumerate(seqs):
                self._penalize(logits[i], s)
        guided = [GuidedRow(i, s.request_id, s.matcher, s.grammar.special_ids)
                  for i, s in enumerate(seqs) if s.matcher is not None and s.grammar is not None]
        if guided:
            logits = logits if logits is not raw else logits.clone()
            self.grammars.apply(logits, guided, raw)
        greedy = [s.params.greedy for s in seqs]
        tokens = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(seqs)
        for i, s in enumerate(seqs):
            if not greedy[i]:
                tokens[i] = self._draw(logits[i], s)
        return [(t, self._logprob(raw_logprobs, i, t, s)) for i, (t, s) in enumerate(zip(tokens, seqs))]

    def sample_isolating(self, logits: torch.Tensor, seqs: list[Sequence]
                         ) -> tuple[list[tuple[int, TokenLogprob | None] | None], dict[str, Exception]]:
        """`self(logits, seqs)`; if that fails, row by row, so that only the requests whose rows fail alone are
        dropped (None results, and why in the dict by request id). Every row failing raises."""
        try:
            results: list[tuple[int, TokenLogprob | None] | None] = list(self(logits, seqs))
            return results, {}
        except Exception:
            if len(seqs) == 1:
                raise
        done, failed = one_by_one([s.request_id for s in seqs], lambda i: self(logits[i : i + 1], [seqs[i]])[0])
        return [done.get(i) for i in range(len(seqs))], failed

    def _needs_processing(self, s: Sequence) -> bool:
        p = s.params
        return (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or bool(p.logit_bias) or len(s.output_ids) < p.min_new_tokens
        )

    def _penalize(self, row: torch.Tensor, s: Sequence) -> None:
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.all_ids)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and s.output_ids:
            counts = torch.bincount(torch.tensor(s.output_ids), minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:  # -100 (OpenAI's "ban") is applied as -inf, so a sampled row cannot draw the token either
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
            row.index_add_(0, ids, bias.masked_fill(bias <= -MAX_BIAS, float("-inf")))
        if len(s.output_ids) < p.min_new_tokens:
            barred = (self.eos_token_ids | set(p.stop_token_ids)) - {None}
            if barred:
                row[torch.tensor(sorted(barred), dtype=torch.long)] = float("-inf")

    def _draw(self, row: torch.Tensor, s: Sequence) -> int:
        gen = s.generator if s.generator is not None else self.rng
        return int(torch.multinomial(self.distribution(row, s), 1, generator=gen))

    @staticmethod
    def distribution(row: torch.Tensor, s: Sequence) -> torch.Tensor:
        """The probabilities a sampled row draws from (its processed logits after temperature, top-k/p, min-p)."""
        p = s.params
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly above each token
            drop = before >= p.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs

    @staticmethod
    def _logprob(raw: torch.Tensor | None, i: int, token: int, s: Sequence) -> TokenLogprob | None:
        if raw is None or s.params.logprobs is None:
            return None
        entry = TokenLogprob(token, float(raw[i, token]))
        if s.params.logprobs > 0:
            vals, ids = raw[i].topk(s.params.logprobs)
            entry.top = list(zip(ids.tolist(), vals.tolist()))
        return entry
