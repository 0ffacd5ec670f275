"""The synchronous engine: requests in, one scheduled model step at a time, outputs with deltas back."""

from __future__ import annotations

import logging
import time
import weakref

import torch

from mlc.config.engine_config import EngineConfig
from mlc.engine.compiled_forward import compile_forward, uncompile
from mlc.engine.detokenizer import IncrementalDetokenizer
from mlc.engine.kv_cache import KVCache, KVDtype, kv_dtype
from mlc.engine.memory import CachePlan, plan_cache
from mlc.engine.model_runner import ModelRunner
from mlc.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from mlc.engine.page_manager import PageManager
from mlc.engine.recovery import recover
from mlc.engine.request import Request, Sent
from mlc.engine.sampler import Sampler
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.scheduler import Scheduler, SchedulerOutput
from mlc.engine.sequence import FinishReason, Sequence
from mlc.engine.sparse_kv import SparseKV
from mlc.distributed.state import SINGLE, parallel_scope, parallel_state
from mlc.errors import (
    CapacityError,
    ConfigError,
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLargeError,
)
from mlc.layers.lora import LoRAAdapter
from mlc.models.loader import describe_weights
from mlc.models.tokenizer import eos_token_ids

log = logging.getLogger("mlc.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer=None, **overrides):
        self.config = config = EngineConfig(**{**(config or EngineConfig()).model_dump(), **overrides})
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.tp_group = None
        if config.tensor_parallel_size > 1:
            from mlc.engine.tp_runner import start_tensor_parallel

            model, self.tp_group = start_tensor_parallel(config, model)
            weakref.finalize(self, self.tp_group.shutdown)  # workers never outlive their engine
        try:
            with parallel_scope(parallel_state() if self.tp_group is not None else SINGLE):
                self._build(config, model, tokenizer)  # whole, even beside a tensor-parallel engine
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; a lone engine holds nothing to release)."""
        if self.tp_group is not None:
            self.tp_group.shutdown()

    def _build(self, config: EngineConfig, model, tokenizer) -> None:
        if model is None:
            from mlc.models.loader import load_model

            model = load_model(config.model, config.device, config.dtype, config.weight_dtype, verify=config.verify)
        if tokenizer is None:
            from mlc.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model.model_dir)
        self.model, self.tokenizer = model, tokenizer
        if config.compile:
            compile_forward(model, config)
        self.model_name = config.model
        context = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
        self.max_seq_len = min(config.max_seq_len or context, context)
        cache_dtype = self._cache_dtype(config.kv_cache_dtype)
        spec = model.kv_cache_spec()  # this rank's heads under tensor parallelism: the budget is per rank
        ranks = config.tensor_parallel_size
        # on a CPU every rank's cache comes out of the same free memory
        fraction = config.kv_cache_fraction / (ranks if model.device.type == "cpu" else 1)
        self.cache_plan: CachePlan = plan_cache(
            KVCache.bytes_per_token_for(spec, cache_dtype), config.page_size, config.kv_cache_memory,
            fraction, model.device, config.max_batch_size, self.max_seq_len,
        )
        if self.cache_plan.num_pages < 2:
            raise ConfigError(
                f"kv_cache_memory {config.kv_cache_memory} bytes holds no page of {config.page_size} tokens "
                f"({self.cache_plan.bytes_per_page} bytes each); raise --kv-cache-memory"
            )
        self.kv_cache = KVCache(spec, self.cache_plan.num_pages, config.page_size, cache_dtype, model.device)
        self.page_manager = PageManager(self.cache_plan.num_pages, config.page_size, config.enable_prefix_caching)
        if self.tp_group is not None:  # every rank holds the same pages of its own heads
            from mlc.engine.tp_runner import TPModelRunner

            self.tp_group.run("init_cache", lambda *a: None, self.cache_plan.num_pages, config.page_size,
                              config.kv_cache_dtype)
            self.runner = TPModelRunner(model, self.kv_cache, self.tp_group)
        else:
            self.runner = ModelRunner(model, self.kv_cache)
        sparse = config.sparse_kv
        self.sparse = SparseKV(sparse, self.page_manager, self.runner) if sparse and sparse.ratio < 1 else None
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_batch_size = self.cache_plan.max_batch_size
        self.weights = describe_weights(model) + (f"; tensor parallel {ranks}" if ranks > 1 else "")
        plan = self.cache_plan
        log.info("weights: %s; KV cache: %d pages of %d tokens (%.0f MiB, %s); max_batch_size %d%s",
                 self.weights, plan.num_pages - 1, plan.page_size, plan.total_bytes / 2**20,
                 str(cache_dtype).removeprefix("torch."), self.max_batch_size,
                 " (sized from the KV budget)" if plan.batch_auto else "")
        self.scheduler = Scheduler(
            self.page_manager, self.max_batch_size, config.max_num_batched_tokens, config.enable_chunked_prefill,
            self.eos_ids, self.sparse,
        )
        self.sampler = Sampler(self.eos_ids, config.seed)
        self.requests: dict[str, Request] = {}
        self.adapters: dict[str, LoRAAdapter] = {}
        self.adapter_ids: dict[str, int] = {}
        for name, path in config.lora_adapters.items():
            self.add_lora(name, path)
        self._seq_request: dict[int, Request] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.consecutive_failures = 0  # steps failed since the last good one (engine/recovery.py)
        self.failed_prompts: set[int] = set()  # the prompts those steps held

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
        if self.config.compile:
            uncompile(self.model, f"LoRA adapter {name!r} loaded")
        self.adapters[name] = self.runner.attach_adapter(adapter_id, name, path)
        self.adapter_ids[name] = adapter_id
        return adapter_id

    def adapter_id(self, name: str | None) -> int:
        """0 for the base model (None or its own name), else the id of a loaded adapter."""
        if name in (None, "", self.model_name):
            return 0
        if name not in self.adapter_ids:
            known = ", ".join([self.model_name, *self.adapter_ids])
            raise ModelNotFoundError(f"model {name!r} is not served here; available: {known}",
                                     field="model")
        return self.adapter_ids[name]

    # -- requests ----------------------------------------------------------------------------------------------
    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """A conversation under the model's chat template: its text and token ids (the one render-then-tokenize
        path, for the offline API and the server alike)."""
        from mlc.models.tokenizer import render_chat

        text = render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt)
        return text, self.encode(text, add_special_tokens=False)

    def check_token_ids(self, ids: list[int], field: str) -> None:
        """Token ids must name tokens of this vocabulary."""
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{field}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                      field=field)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, adapter_id: int = 0,
        validated: bool = False,
    ) -> None:
        """Queue a request; `validated` skips `validate` when the caller (the server) already ran it."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not validated:
            self.validate(ids, params)
        if adapter_id and adapter_id not in self.adapter_ids.values():
            raise InvalidRequestError(f"adapter id {adapter_id} is not loaded", field="model")
        seq = Sequence(request_id, ids, params, adapter_id=adapter_id, max_len=self.max_seq_len)
        req = Request(request_id, ids, params, [seq], [self._detok(ids, params)], pending_forks=params.n - 1)
        req.sent = [Sent()]
        self.prompt_tokens += len(ids)
        self.requests[request_id] = req
        self._seq_request[seq.seq_id] = req
        self.scheduler.add(seq)

    def _detok(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output)

    def validate(self, ids: list[int], params: SamplingParams, context: int | None = None,
                 context_source: str = "the context limit") -> None:
        """Every rule a request must meet here (prompt, vocabulary, context, KV capacity), raised as the error
        `add_request` would raise, without adding it; safe from any thread. `context` bounds prompt + completion
        below the model's own limit (a server's context profile)."""
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", field="prompt")
        self.check_token_ids(ids, "prompt")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        vocab = self.model.config.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(f"top_k={params.top_k} is more than the model's {vocab} tokens; use at most "
                                      f"{vocab}, or 0 or -1 to turn top_k off", field="top_k")
        limit = min(context or self.max_seq_len, self.max_seq_len)
        if context is None or context >= self.max_seq_len:
            context_source = f"the context limit of {self.max_seq_len} tokens"
        room = limit - len(ids)
        if room < 1:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens, which leaves no room for a completion within "
                                     f"{context_source}; shorten the prompt", field="prompt")
        if params.max_new_tokens > room:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds {context_source}; "
                f"lower max_new_tokens to at most {room}", field="max_new_tokens",
            )
        entries = len(ids) + params.max_new_tokens
        if self.sparse is not None and not params.full_kv:
            entries = self.sparse.policy.max_entries(entries, self.config.max_num_batched_tokens)
        need = self.page_manager.pages_for(entries)
        if need > self.page_manager.usable_pages:
            raise RequestTooLargeError(
                f"this request needs {need} KV pages but the cache holds {self.page_manager.usable_pages}; "
                "raise --kv-cache-memory or shorten the request",
                field="max_new_tokens",
            )

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """Stop a request now and free its pages."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.pending_forks = 0
        for seq in req.seqs:
            self.scheduler.finish(seq, None if seq.is_finished else reason)
        req.finished_time = time.monotonic()
        out = self._output(req)
        self._forget(req)
        return out

    def forget(self, request_id: str) -> None:
        """Drop a request's records without touching its pages (recovery rebuilds the pages after)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._forget(req)

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for s in req.seqs:
            self._seq_request.pop(s.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_alive(self) -> None:
        """Raise `EngineDeadError` if a tensor-parallel worker has exited, even with no step to run."""
        if self.tp_group is not None:
            self.tp_group.check_alive()

    # -- one step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. A failure ends only the requests it touched, with finish_reason "error" and
        `RequestOutput.error` set, and the engine repairs itself; beyond repair it raises `EngineDeadError`
        (`engine/recovery.py`)."""
        try:
            plan = self.scheduler.schedule()
        except Exception as e:
            return self._fail_step(e, self.scheduler.running + list(self.scheduler.waiting)[:1])
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                raise CapacityError("no waiting request fits the free KV pages; raise --kv-cache-memory")
            return []
        try:
            outputs = self._execute(plan)
        except EngineDeadError:
            raise
        except Exception as e:
            return self._fail_step(e, [s.seq for s in plan.scheduled])
        self.consecutive_failures = 0
        self.failed_prompts.clear()
        return outputs

    def _fail_step(self, error: Exception, seqs: list[Sequence]) -> list[RequestOutput]:
        """A whole step failed: count it (with the prompts it held, so that one poison prompt sent again and again
        is not mistaken for a broken model) and end its requests."""
        self.consecutive_failures += 1
        rids = list(dict.fromkeys(s.request_id for s in seqs if s.request_id in self.requests))
        self.failed_prompts.update(hash(tuple(self.requests[r].prompt_ids)) for r in rids)
        return recover(self, error, rids)

    def _execute(self, plan: SchedulerOutput) -> list[RequestOutput]:
        self.runner.apply_copies(plan.copies)
        step = self.runner.run_isolating(plan.scheduled)
        now = time.monotonic()
        sampled: list[Sequence] = []
        rows: list[int] = []
        for row, seq in enumerate(self.scheduler.advance(step.scheduled, step.prompt_logprobs, now)):
            children = self._fork(self._seq_request[seq.seq_id], seq)
            sampled += [seq, *children]
            rows += [row] * (1 + len(children))  # forked samples read their parent's logits row
        self.scheduler.compact()
        touched: dict[str, Request] = {}
        failed = dict(step.failed)
        if sampled:
            results, bad_rows = self.sampler.sample_isolating(step.logits[torch.tensor(rows)], sampled)
            failed.update(bad_rows)
            kept = [(s, r) for s, r in zip(sampled, results) if s.request_id not in failed]
            self.scheduler.postprocess([s for s, _ in kept], [r for _, r in kept], now)
            self.generation_tokens += len(kept)
            for seq, _ in kept:
                touched[seq.request_id] = req = self._seq_request[seq.seq_id]
                self._detokenize(req, seq)
        finished = [r for r in touched.values() if r.finished]
        for r in finished:
            r.finished_time = now
        outputs = [self._output(r) for r in touched.values()]  # all built before any is forgotten
        for r in finished:
            self._forget(r)
        for rid, error in failed.items():  # culprits found by running them alone; the step itself went on
            outputs += recover(self, error, [rid])
        return outputs

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """At the end of the prompt, the request's other samples start sharing the parent's pages."""
        if not req.pending_forks or parent.output_ids:
            return []
        children = self.scheduler.fork(parent, req.pending_forks)
        for child in children:
            req.seqs.append(child)
            req.detoks.append(self._detok(req.prompt_ids, req.params))
            req.sent.append(Sent())
            self._seq_request[child.seq_id] = req
        req.pending_forks = 0
        return children

    def _detokenize(self, req: Request, seq: Sequence) -> None:
        """The new token's text; a stop string in it ends the sequence (the scheduler ended those on stop ids)."""
        detok = req.detoks[seq.sample_index]
        token = seq.output_ids[-1]
        if not self.scheduler.is_stop_token(seq, token):
            detok.add(token)
        if seq.is_finished or detok.stopped:
            detok.flush()
        if detok.stopped and seq.finish_reason is not FinishReason.STOP:
            self.scheduler.finish(seq, FinishReason.STOP)

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for seq, detok, sent in zip(req.seqs, req.detoks, req.sent):
            start, sent.tokens = sent.tokens, len(seq.output_ids)
            text_start, sent.chars = sent.chars, max(sent.chars, detok.releasable(seq.is_finished))
            want_lp = seq.params.logprobs is not None
            outs.append(CompletionOutput(
                index=seq.sample_index, text=detok.text, token_ids=list(seq.output_ids),
                finish_reason=seq.finish_reason, logprobs=list(seq.logprobs) if want_lp else None,
                delta_text=detok.text[text_start : sent.chars], delta_token_ids=seq.output_ids[start:],
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

    def waiting_samples(self) -> int:
        """Samples in the waiting queue, a prompt's `n - 1` samples still to fork counted too (safe from any thread:
        it only reads)."""
        total = 0
        for seq in list(self.scheduler.waiting):
            req = self._seq_request.get(seq.seq_id)
            total += 1 + (req.pending_forks if req is not None and seq.sample_index == 0 else 0)
        return total

    def stats(self) -> EngineStats:
        pm = self.page_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=pm.usage(), num_free_pages=pm.num_free_pages, num_pages=pm.usable_pages,
            prefix_cache_queries=pm.prefix_queries, prefix_cache_hits=pm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )
