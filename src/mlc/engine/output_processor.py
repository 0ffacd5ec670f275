"""Requests as their callers see them (vLLM v1's OutputProcessor): the engine's request records, each sample's
text (incremental detokenizing, stop strings) and the `RequestOutput`s with the deltas since the last one.

The scheduler owns a sequence's tokens and its end; this module reads them. A stop string is the one end found here:
`detokenize` says so, and the engine has the scheduler finish the sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlc.engine.detokenizer import IncrementalDetokenizer
from mlc.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mlc.engine.request import Request, Sample
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seq: Sequence) -> Request:
        req = Request(request_id, prompt_ids, params, [], pending_forks=params.n - 1)
        self.requests[request_id] = req
        self.add_sample(req, seq)
        return req

    def add_sample(self, req: Request, seq: Sequence) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.stop,
                                       req.params.include_stop_str_in_output)
        req.samples.append(Sample(seq, detok))
        self._by_seq[seq.seq_id] = req

    def request_of(self, seq: Sequence) -> Request:
        return self._by_seq[seq.seq_id]

    def forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for s in req.samples:
            self._by_seq.pop(s.seq.seq_id, None)

    def live_sequences(self) -> list[Sequence]:
        """Every unfinished sequence of a live request."""
        return [s.seq for req in self.requests.values() for s in req.samples if not s.seq.is_finished]

    def samples_waiting(self, waiting: list[Sequence]) -> int:
        """Samples behind these waiting sequences, a prompt's `n - 1` samples still to fork counted too."""
        total = 0
        for seq in waiting:
            req = self._by_seq.get(seq.seq_id)
            total += 1 + (req.pending_forks if req is not None and seq.sample_index == 0 else 0)
        return total

    def detokenize(self, seq: Sequence, stop_token: bool) -> bool:
        """The sequence's newest token as text (a stop token id or EOS adds none); True when a stop string in it
        ends a sequence that did not end with a stop already."""
        detok = self._by_seq[seq.seq_id].samples[seq.sample_index].detok
        if not stop_token:
            detok.add(seq.output_ids[-1])
        if seq.is_finished or detok.stopped:
            detok.flush()
        return detok.stopped and seq.finish_reason is not FinishReason.STOP

    def step_outputs(self, touched: list[Request], now: float) -> list[RequestOutput]:
        """The outputs of the requests a step moved; the finished ones are forgotten, after every output is built."""
        finished = [r for r in touched if r.finished]
        for req in finished:
            req.finished_time = now
        outputs = [self.output(r) for r in touched]
        for req in finished:
            self.forget(req)
        return outputs

    def output(self, req: Request) -> RequestOutput:
        outs = [self._completion(s) for s in req.samples]
        first = req.samples[0].seq
        metrics = RequestMetrics(
            arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time, finished_time=req.finished_time,
            token_times=list(first.token_times), num_prompt_tokens=len(req.prompt_ids),
            num_prefix_hit_tokens=first.num_prefix_hit, num_preemptions=sum(s.num_preemptions for s in req.seqs),
        )
        prompt_lp = list(first.prompt_logprobs) if req.params.prompt_logprobs else None
        return RequestOutput(req.request_id, req.prompt_ids, outs, req.finished, metrics, prompt_lp)

    @staticmethod
    def _completion(sample: Sample) -> CompletionOutput:
        seq, detok = sample.seq, sample.detok
        start, sample.sent_tokens = sample.sent_tokens, len(seq.output_ids)
        text_start, sample.sent_chars = sample.sent_chars, max(sample.sent_chars, detok.releasable(seq.is_finished))
        want_lp = seq.params.logprobs is not None
        return CompletionOutput(
            index=seq.sample_index, text=detok.text, token_ids=list(seq.output_ids), finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if want_lp else None, delta_text=detok.text[text_start:sample.sent_chars],
            delta_token_ids=seq.output_ids[start:], delta_logprobs=seq.logprobs[start:] if want_lp else None,
        )
