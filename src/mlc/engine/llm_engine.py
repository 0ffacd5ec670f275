"""The synchronous engine: requests in, one scheduled model step at a time, outputs with deltas back."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from mlc.config.engine_config import EngineConfig
from mlc.engine.block_manager import BlockManager
from mlc.engine.detokenizer import IncrementalDetokenizer
from mlc.engine.kv_cache import KVCache, KVDtype, kv_dtype
from mlc.engine.memory import CachePlan, plan_cache
from mlc.engine.model_runner import ModelRunner
from mlc.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mlc.engine.sampler import Sampler
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.scheduler import Scheduler
from mlc.engine.sequence import Sequence
from mlc.engine.sparse_kv import SparseKV
from mlc.errors import (
    CapacityError,
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLargeError,
)
from mlc.layers.lora import LoRAAdapter, attach_adapter

log = logging.getLogger("mlc.engine")


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    pending_forks: int = 0
    finished_time: float | None = None
    emitted_tokens: list[int] = field(default_factory=list)  # per sample, tokens already reported

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(s.is_finished for s in self.seqs)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_pages: int
    num_pages: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        extra = gen.get("eos_token_id")
        ids.update(extra if isinstance(extra, list) else [extra])
    return {i for i in ids if isinstance(i, int)}


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer=None, **overrides):
        self.config = config = EngineConfig(**{**(config or EngineConfig()).model_dump(), **overrides})
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            from mlc.models.loader import load_model

            model = load_model(config.model, config.device, config.dtype, config.weight_dtype)
        if tokenizer is None:
            from mlc.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model.model_dir)
        self.model, self.tokenizer = model, tokenizer
        self.model_name = config.model
        context = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
        self.max_seq_len = min(config.max_seq_len or context, context)
        cache_dtype = self._cache_dtype(config.kv_cache_dtype)
        spec = model.kv_cache_spec()
        self.cache_plan: CachePlan = plan_cache(
            KVCache.bytes_per_token_for(spec, cache_dtype), config.page_size, config.kv_cache_memory,
            config.kv_cache_fraction, model.device, config.max_batch_size, self.max_seq_len,
        )
        if self.cache_plan.num_pages < 2:
            raise ConfigError(
                f"kv_cache_memory {config.kv_cache_memory} bytes holds no page of {config.page_size} tokens "
                f"({self.cache_plan.bytes_per_page} bytes each); raise --kv-cache-memory"
            )
        self.kv_cache = KVCache(spec, self.cache_plan.num_pages, config.page_size, cache_dtype, model.device)
        self.block_manager = BlockManager(self.cache_plan.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_batch_size, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self.runner = ModelRunner(model, self.kv_cache)
        sparse = config.sparse_kv
        self.sparse = SparseKV(sparse, self.block_manager, self.kv_cache) if sparse and sparse.ratio < 1 else None
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.sampler = Sampler(self.eos_ids, config.seed)
        self.requests: dict[str, Request] = {}
        self.adapters: dict[str, LoRAAdapter] = {}
        self.adapter_ids: dict[str, int] = {}
        for name, path in config.lora_adapters.items():
            self.add_lora(name, path)
        self._seq_request: dict[int, Request] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def _cache_dtype(self, name: str) -> KVDtype:
        try:
            return kv_dtype(name, self.model.dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # -- adapters ----------------------------------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> int:
        """Serve a PEFT LoRA adapter under `name`; requests pick it with `adapter_id`. Returns that id."""
        if not name or name == self.model_name:
            raise ConfigError(f"LoRA adapter name {name!r} must be non-empty and differ from the base model's name")
        if name in self.adapter_ids:
            raise ConfigError(f"a LoRA adapter named {name!r} is already loaded")
        adapter_id = len(self.adapter_ids) + 1
        self.adapters[name] = attach_adapter(self.model, adapter_id, name, path)
        self.adapter_ids[name] = adapter_id
        return adapter_id

    def adapter_id(self, name: str | None) -> int:
        """0 for the base model (None or its own name), else the id of a loaded adapter."""
        if name in (None, "", self.model_name):
            return 0
        if name not in self.adapter_ids:
            known = ", ".join([self.model_name, *self.adapter_ids])
            raise ModelNotFoundError(f"model {name!r} is not served here; available: {known}", field="model")
        return self.adapter_ids[name]

    # -- requests ----------------------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, adapter_id: int = 0
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        if adapter_id and adapter_id not in self.adapter_ids.values():
            raise InvalidRequestError(f"adapter id {adapter_id} is not loaded", field="model")
        seq = Sequence(request_id, ids, params, adapter_id=adapter_id, max_len=self.max_seq_len)
        req = Request(request_id, ids, params, [seq], [self._detok(ids, params)], pending_forks=params.n - 1)
        req.emitted_tokens = [0]
        self.prompt_tokens += len(ids)
        self.requests[request_id] = req
        self._seq_request[seq.seq_id] = req
        self.scheduler.add(seq)

    def _detok(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise the error `add_request` would raise for this prompt, without adding it (safe from any thread)."""
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", field="prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", field="prompt")
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            room = self.max_seq_len - len(ids)
            hint = f"lower max_new_tokens to at most {room}" if room > 0 else "shorten the prompt"
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context limit "
                f"of {self.max_seq_len} tokens; {hint}",
                field="max_new_tokens" if room > 0 else "prompt",
            )
        entries = len(ids) + params.max_new_tokens
        if self.sparse is not None and not params.full_kv:
            entries = self.sparse.policy.max_entries(entries, self.config.max_num_batched_tokens)
        need = self.block_manager.pages_for(entries)
        if need > self.block_manager.usable_pages:
            raise RequestTooLargeError(
                f"this request needs {need} KV pages but the cache holds {self.block_manager.usable_pages}; "
                "raise --kv-cache-memory or shorten the request",
                field="max_new_tokens",
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.pending_forks = 0
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish("abort")
            self.scheduler.finish(seq)
        req.finished_time = time.monotonic()
        out = self._output(req)
        self._forget(req)
        return out

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for s in req.seqs:
            self._seq_request.pop(s.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                raise CapacityError("no waiting request fits the free KV pages; raise --kv-cache-memory")
            return []
        self.runner.apply_copies(plan.copies)
        logits = self.runner.run(plan.scheduled)
        now = time.monotonic()
        sampled: list[Sequence] = []
        rows: list[int] = []
        touched: dict[str, Request] = {}
        for item in plan.scheduled:
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            done = item.completes
            seq.num_cached += item.num_tokens
            seq.num_cache_entries += item.num_tokens
            self.block_manager.register_full_pages(seq)
            if done:
                req = self._seq_request[seq.seq_id]
                rows.append(len(sampled))
                sampled.append(seq)
                sampled += self._fork(req, seq)
                rows += [rows[-1]] * (len(sampled) - len(rows))
        if self.sparse is not None:
            self.sparse.compact(self.scheduler.running)
        if sampled:
            results = self.sampler(logits[torch.tensor(rows)], sampled)
            for seq, (token, logprob) in zip(sampled, results):
                req = self._seq_request[seq.seq_id]
                self._append(req, seq, token, logprob, now)
                touched[req.request_id] = req
        outputs = []
        for r in touched.values():
            if r.finished:
                r.finished_time = now
            outputs.append(self._output(r))
            if r.finished:
                self._forget(r)
        return outputs

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """At the end of the prompt, the request's other samples start sharing the parent's pages."""
        if not req.pending_forks or parent.output_ids:
            return []
        children = []
        for j in range(1, req.pending_forks + 1):
            child = Sequence(req.request_id, req.prompt_ids, req.params, adapter_id=parent.adapter_id,
                             sample_index=j, max_len=parent.max_len, arrival_time=parent.arrival_time)
            child.first_scheduled_time = parent.first_scheduled_time
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            req.seqs.append(child)
            req.detoks.append(self._detok(req.prompt_ids, req.params))
            req.emitted_tokens.append(0)
            self._seq_request[child.seq_id] = req
            children.append(child)
        req.pending_forks = 0
        return children

    def _append(self, req: Request, seq: Sequence, token: int, logprob, now: float) -> None:
        seq.output_ids.append(token)
        seq.token_times.append(now)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.generation_tokens += 1
        p = seq.params
        detok = req.detoks[seq.sample_index]
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            reason = "stop"
        else:
            detok.add(token)
            reason = "stop" if detok.stopped else None
        if reason is None and (len(seq.output_ids) >= p.max_new_tokens or len(seq) >= (seq.max_len or 1 << 30)):
            reason = "length"
        if reason is not None:
            detok.flush()
            seq.finish(reason)
            self.scheduler.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for i, (seq, detok) in enumerate(zip(req.seqs, req.detoks)):
            start = req.emitted_tokens[i]
            req.emitted_tokens[i] = len(seq.output_ids)
            want_lp = seq.params.logprobs is not None
            outs.append(CompletionOutput(
                index=seq.sample_index, text=detok.text, token_ids=list(seq.output_ids),
                finish_reason=seq.finish_reason, logprobs=list(seq.logprobs) if want_lp else None,
                delta_text=detok.take_delta(seq.is_finished), delta_token_ids=seq.output_ids[start:],
                delta_logprobs=seq.logprobs[start:] if want_lp else None,
            ))
        first = req.seqs[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time, finished_time=req.finished_time,
            token_times=list(first.token_times), num_prompt_tokens=len(req.prompt_ids),
            num_prefix_hit_tokens=first.num_prefix_hit, num_preemptions=sum(s.num_preemptions for s in req.seqs),
        )
        prompt_lp = list(first.prompt_logprobs) if req.params.prompt_logprobs else None
        return RequestOutput(req.request_id, req.prompt_ids, outs, req.finished, metrics, prompt_lp)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage(), num_free_pages=bm.num_free_pages, num_pages=bm.usable_pages,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )
