"""The synchronous engine: requests in, one scheduled model step at a time, outputs with deltas back."""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from mlc.config.engine_config import EngineConfig
from mlc.distributed.state import SINGLE, parallel_scope, parallel_state
from mlc.engine.compiled_forward import compile_forward, uncompile
from mlc.engine.draft_model import DraftModel, load_draft_model
from mlc.engine.grammar import Grammar, GrammarSpec
from mlc.engine.kv_cache import KVCache
from mlc.engine.kv_transfer import KVConnector
from mlc.engine.lora_manager import LoRAManager
from mlc.engine.memory import size_cache
from mlc.engine.model_runner import ModelRunner, StepOutput
from mlc.engine.output_processor import OutputProcessor
from mlc.engine.outputs import EngineStats, RequestOutput
from mlc.engine.page_manager import PageManager
from mlc.engine.pd_engine import PDMixin
from mlc.engine.recovery import Recovery
from mlc.engine.request import Request
from mlc.engine.request_rules import RequestRules
from mlc.engine.sampler import Sampler
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.scheduler import Scheduler, SchedulerOutput
from mlc.engine.sequence import FinishReason, Sequence
from mlc.engine.sparse_kv import SparseKV
from mlc.engine.speculative import Speculator
from mlc.errors import (
    CapacityError,
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
)
from mlc.layers.lora import LoRAAdapter, PreparedAdapter
from mlc.models.base import CausalLM
from mlc.models.loader import describe_weights
from mlc.models.tokenizer import eos_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mlc.engine.pp_runner import Pipeline
    from mlc.engine.tp_group import TPGroup

log = logging.getLogger("mlc.engine")


class LLMEngine(PDMixin):
    def __init__(self, config: EngineConfig | None = None, model: CausalLM | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, **overrides: Any) -> None:
        self.config = config = EngineConfig(**{**(config or EngineConfig()).model_dump(), **overrides})
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.tp_group: TPGroup | None = None  # the worker processes: tensor-parallel ranks or pipeline stages
        self.pipeline: Pipeline | None = None
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            from mlc.engine.pp_runner import start_pipeline_parallel
            from mlc.engine.tp_runner import start_tensor_parallel

            start = start_pipeline_parallel if config.pipeline_parallel_size > 1 else start_tensor_parallel
            model, self.tp_group = start(config, model)
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

    def _build(self, config: EngineConfig, model: CausalLM | None, tokenizer: PreTrainedTokenizerBase | None) -> None:
        mtp = config.speculative_config is not None and config.speculative_config.method == "mtp"
        if model is None:
            from mlc.models.loader import load_model

            model = load_model(config.model, config.device, config.dtype, config.weight_dtype, verify=config.verify,
                               mtp=mtp)
        elif mtp and model.mtp is None:
            raise ConfigError('speculative method "mtp" needs the model loaded with its MTP layer '
                              "(load_model(..., mtp=True))")
        if tokenizer is None:
            from mlc.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model.model_dir)
        self.model, self.tokenizer = model, tokenizer
        if config.compile:
            compile_forward(model, config)
        self.model_name = config.model
        context = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
        self.max_seq_len = min(config.max_seq_len or context, context)
        draft = load_draft_model(config, model, self.max_seq_len)
        extra = draft.kv_cache_spec() if draft is not None else []  # the draft model's layers share the pages
        self.cache_plan, cache_dtype = size_cache(config, model, self.max_seq_len, extra)
        ranks = config.tensor_parallel_size
        self.kv_cache = KVCache(model.stage_cache_spec() + extra, self.cache_plan.num_pages, config.page_size,
                                cache_dtype, model.device)
        self.page_manager = PageManager(self.cache_plan.num_pages, config.page_size, config.enable_prefix_caching)
        self.page_manager.spare_last_hit = mtp  # models/mtp.py: why a hit gives back a page
        if self.tp_group is not None:  # every rank holds the same pages of its own heads (or its stage's layers)
            self.tp_group.run("init_cache", lambda *a: None, self.cache_plan.num_pages, config.page_size,
                              config.kv_cache_dtype)
            if config.pipeline_parallel_size > 1:
                from mlc.engine.pp_runner import PPGroup, PPModelRunner

                assert isinstance(self.tp_group, PPGroup)
                self.runner: ModelRunner = PPModelRunner(model, self.kv_cache, self.tp_group)
            else:
                from mlc.engine.tp_runner import TPModelRunner

                self.runner = TPModelRunner(model, self.kv_cache, self.tp_group)
        else:
            self.runner = ModelRunner(model, self.kv_cache)
        self.runner.keep_hidden = mtp  # the MTP layer drafts from the step's hidden states (models/mtp.py)
        sparse = config.sparse_kv
        self.sparse = SparseKV(sparse, self.page_manager, self.runner) if sparse and sparse.ratio < 1 else None
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_batch_size = self.cache_plan.max_batch_size
        stages = config.pipeline_parallel_size
        self.weights = describe_weights(model) + (f"; tensor parallel {ranks}" if ranks > 1 else "") + (
            f"; pipeline parallel {stages}" if stages > 1 else "")
        plan = self.cache_plan
        log.info("weights: %s; KV cache: %d pages of %d tokens (%.0f MiB, %s%s); max_batch_size %d%s",
                 self.weights, plan.num_pages - 1, plan.page_size, plan.total_bytes / 2**20,
                 str(cache_dtype).removeprefix("torch."),
                 f", capped at what the batch can use of a {plan.budget_bytes / 2**20:.0f} MiB budget; "
                 "--kv-cache-memory sets it" if plan.capped_by_need else "", self.max_batch_size,
                 " (sized from the KV budget)" if plan.batch_auto else "")
        self.scheduler = Scheduler(
            self.page_manager, self.max_batch_size, config.max_num_batched_tokens, config.enable_chunked_prefill,
            self.eos_ids, self.sparse, config.max_loras,
        )
        self.sampler = Sampler(self.eos_ids, config.seed)
        self.speculator = Speculator(config.speculative_config, predictions=self.sparse is None)
        self.speculator.runner = self.runner if mtp else None  # chains the MTP layer after scheduling
        self.speculator.draft_model = DraftModel(draft, self.kv_cache, len(model.stage_cache_spec())) if draft else None
        self.outputs = OutputProcessor(tokenizer)
        self.kv = KVConnector(self.page_manager, self.kv_cache, config.kv_lease_timeout,  # prefill/decode split
                              exportable=self.tp_group is None)
        self.scheduler.on_finish = self.kv.on_finish
        self.recovery = Recovery(self.scheduler, self.page_manager, self.kv_cache, self.outputs, self.kv)
        self.rules = RequestRules(tokenizer, self.eos_ids, model.config.vocab_size, self.max_seq_len,
                                  self.page_manager, self.sparse, config.max_num_batched_tokens)
        runner, max_rank = self.runner, config.max_lora_rank  # no closure over self: an engine let go is freed at once
        self.loras = LoRAManager(lambda i, n, p, pre: runner.attach_adapter(i, n, p, max_rank, pre),
                                 runner.detach_adapter, self.scheduler.adapter_users, config.max_cpu_loras)
        for name, path in config.lora_adapters.items():
            self.add_lora(name, path, pinned=True)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        if stages > 1:
            from mlc.engine.pp_runner import Pipeline

            self.pipeline = Pipeline(self, config.pipeline_depth or stages)

    def add_lora(self, name: str, path: str, pinned: bool = False, prepared: PreparedAdapter | None = None) -> int:
        """Serve a PEFT LoRA adapter under `name` (between steps, at any time); requests pick it with `adapter_id`.
        Returns that id (never reused). `pinned`: never evicted for room (`engine/lora_manager.py`)."""
        if not name or name == self.model_name:
            raise ConfigError(f"LoRA adapter name {name!r} must be non-empty and differ from the base model's name",
                              field="lora_name")
        if self.config.compile:
            uncompile(self.model, f"LoRA adapter {name!r} loaded")
        return self.loras.add(name, path, pinned, prepared).adapter_id

    def prepare_lora(self, path: str) -> PreparedAdapter | None:
        """Read and check an adapter without touching the engine (safe off its thread): `add_lora(prepared=...)`
        then only writes it in."""
        return self.runner.prepare_adapter(path, self.config.max_lora_rank)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (a 409 `AdapterConflictError` while a running or waiting request uses it)."""
        self.loras.remove(name)

    @property
    def adapter_ids(self) -> dict[str, int]:
        return {name: e.adapter_id for name, e in list(self.loras.loaded.items())}

    @property
    def adapters(self) -> dict[str, LoRAAdapter]:
        return {name: e.info for name, e in list(self.loras.loaded.items())}

    def adapter_id(self, name: str | None) -> int:
        """0 for the base model (None or its own name), else the id of a loaded adapter."""
        if name in (None, "", self.model_name):
            return 0
        if name not in self.adapter_ids:
            known = ", ".join([self.model_name, *self.adapter_ids])
            raise ModelNotFoundError(f"model {name!r} is not served here; available: {known}",
                                     field="model")
        return self.adapter_ids[name]

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """`spec` compiled for this model's tokenizer (`RequestRules.compile_grammar`): a server compiles off its
        event loop before it adds the request."""
        return self.rules.compile_grammar(spec)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """A conversation under the model's chat template: its text and token ids (the one render-then-tokenize
        path, for the offline API and the server alike)."""
        from mlc.models.tokenizer import render_chat

        text = render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt)
        return text, self.encode(text, add_special_tokens=False)

    def check_token_ids(self, ids: list[int], field: str) -> None:
        self.rules.check_token_ids(ids, field)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, adapter_id: int = 0,
        validated: bool = False, fair_group: str | None = None,
    ) -> None:
        """Queue a request; `validated` skips `validate` when the caller (the server) already ran it; `fair_group`
        is an opaque id the waiting queue takes round-robin (see `Scheduler.add`)."""
        params = params or SamplingParams()
        if request_id in self.outputs.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not validated:
            self.validate(ids, params)
        adapter_key = self.loras.touch(adapter_id).key if adapter_id else 0
        grammar = self.compile_grammar(params.grammar) if params.grammar is not None else None
        seq = Sequence(request_id, ids, params, adapter_id=adapter_id, max_len=self.max_seq_len, grammar=grammar,
                       adapter_key=adapter_key, fair_group=fair_group)
        self.outputs.add(request_id, ids, params, seq)
        self.prompt_tokens += len(ids)
        self.scheduler.add(seq)

    def validate(self, ids: list[int], params: SamplingParams, context: int | None = None,
                 context_source: str = "the context limit") -> None:
        """Every rule a request must meet (`engine/request_rules.py`), raised as `add_request` would raise it,
        without adding it; safe from any thread."""
        self.rules.validate(ids, params, context, context_source)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """Stop a request now and free its pages."""
        self.drop_kv(request_id)  # a lease it held; a pending KV import becomes a request to end like any other
        req = self.outputs.requests.get(request_id)
        if req is None:
            return None
        req.pending_forks = 0
        for seq in req.seqs:
            self.scheduler.finish(seq, None if seq.is_finished else reason)
        req.finished_time = time.monotonic()
        out = self.outputs.output(req)
        self.outputs.forget(req)
        return out

    def fail_requests(self, error: Exception, request_ids: list[str]) -> list[RequestOutput]:
        """End requests that an error outside a step struck (finish_reason "error"), and check the engine."""
        return self.recovery.fail(error, request_ids, self.abort)

    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.outputs.requests

    def request_ids(self) -> list[str]:
        return list(self.outputs.requests)

    def check_alive(self) -> None:
        """Raise `EngineDeadError` if a tensor-parallel worker has exited, even with no step to run."""
        if self.tp_group is not None:
            self.tp_group.check_alive()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. A failure ends only the requests it touched, with finish_reason "error" and
        `RequestOutput.error` set, and the engine repairs itself; beyond repair it raises `EngineDeadError`
        (`engine/recovery.py`)."""
        self.expire_leases()
        if self.pipeline is not None:
            return self.pipeline.step()
        try:
            self.speculator.propose(self.scheduler.running)
            plan = self.scheduler.schedule()
            plan.scheduled = self.speculator.fill_drafts(plan.scheduled)
        except Exception as e:
            return self.recovery.step_failed(e, self.scheduler.running + list(self.scheduler.waiting)[:1], self.abort)
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                raise CapacityError("no waiting request fits the free KV pages; raise --kv-cache-memory")
            return []
        try:
            outputs = self._execute(plan)
        except EngineDeadError:
            raise
        except Exception as e:
            return self.recovery.step_failed(e, [s.seq for s in plan.scheduled], self.abort)
        self.recovery.step_succeeded()
        return outputs

    def _execute(self, plan: SchedulerOutput) -> list[RequestOutput]:
        self.runner.apply_copies(plan.copies)
        return self._finish_step(self.runner.run_isolating(plan.scheduled))

    def _finish_step(self, step: StepOutput) -> list[RequestOutput]:
        """What a step that ran leaves: caches advanced, forks, tokens sampled (and drafts verified), outputs."""
        now = time.monotonic()
        drafts = {s.seq.seq_id: s.num_draft for s in step.scheduled if s.completes}
        sampled: list[Sequence] = []
        rows: list[int] = []
        first_row: dict[int, int] = {}
        row = 0
        for seq in self.scheduler.advance(step.scheduled, step.prompt_logprobs, now):
            first_row[seq.seq_id] = row
            children = self._fork(self.outputs.request_of(seq), seq)
            sampled += [seq, *children]
            rows += [row] * (1 + len(children))  # forked samples read their parent's logits row
            row += 1 + drafts[seq.seq_id]  # a sequence's drafts have a logits row each
        self.scheduler.compact()
        touched: dict[str, Request] = {}
        failed = dict(step.failed)
        accepted: dict[int, int] = {}
        if sampled:
            self._sample(step.logits, sampled, rows, now, touched, failed)
            accepted = self._verify(step.logits, [(s, first_row[s.seq_id], drafts[s.seq_id]) for s in sampled
                                                  if drafts.get(s.seq_id)], now, touched, failed)
        if step.hidden is not None:  # the model's MTP layer drafts (models/mtp.py)
            self.speculator.mtp_pass(step, set(drafts), accepted, failed, len(self.scheduler.running))
        outputs = self.outputs.step_outputs(list(touched.values()), now)
        for rid, error in failed.items():  # culprits found by running them alone; the step itself went on
            outputs += self.recovery.fail(error, [rid], self.abort)
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], now: float,
                touched: dict[str, Request], failed: dict[str, Exception]) -> None:
        """One token for each sequence from its logits row: appended, stop ids and strings checked."""
        results, bad_rows = self.sampler.sample_isolating(logits[torch.tensor(rows)], seqs)
        failed.update(bad_rows)
        kept = [(s, r) for s, r in zip(seqs, results) if r is not None and s.request_id not in failed]
        self.scheduler.postprocess([s for s, _ in kept], [r for _, r in kept], now)
        self.generation_tokens += len(kept)
        for seq, _ in kept:
            touched[seq.request_id] = self.outputs.request_of(seq)
            if self.outputs.detokenize(seq, self.scheduler.is_stop_token(seq, seq.output_ids[-1])):
                self.scheduler.finish(seq, FinishReason.STOP)  # a stop string in its text

    def _verify(self, logits: torch.Tensor, verifying: list[tuple[Sequence, int, int]], now: float,
                touched: dict[str, Request], failed: dict[str, Exception]) -> dict[int, int]:
        """Speculative rounds (`engine/speculative.py`): a sequence whose token from row j equals its draft j
        samples row j+1 next; the rounds end where every sequence has missed, finished or used its drafts."""
        accepted = {seq.seq_id: 0 for seq, _, _ in verifying}
        going = verifying
        for j in range(max((d for _, _, d in verifying), default=0)):
            going = [(seq, row, d) for seq, row, d in going
                     if j < d and not seq.is_finished and seq.request_id not in failed
                     and seq.output_ids[-1] == seq.draft_ids[j]]
            if not going:
                break
            for seq, _, _ in going:
                accepted[seq.seq_id] = j + 1
            self._sample(logits, [seq for seq, _, _ in going], [row + j + 1 for _, row, _ in going], now, touched,
                         failed)
        for seq, _, d in verifying:
            self.speculator.record(seq, d, accepted[seq.seq_id])
            self.scheduler.accept(seq, accepted[seq.seq_id])
        return accepted

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """At the end of the prompt, the request's other samples start sharing the parent's pages."""
        if not req.pending_forks or parent.output_ids:
            return []
        children = self.scheduler.fork(parent, req.pending_forks)
        for child in children:
            self.outputs.add_sample(req, child)
        req.pending_forks = 0
        return children

    def waiting_samples(self) -> int:
        """Samples in the waiting queue, a prompt's `n - 1` samples still to fork counted too (safe from any thread:
        it only reads)."""
        return self.outputs.samples_waiting(list(self.scheduler.waiting))

    def stats(self) -> EngineStats:
        pm = self.page_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=pm.usage(), num_free_pages=pm.num_free_pages, num_pages=pm.usable_pages,
            prefix_cache_queries=pm.prefix_queries, prefix_cache_hits=pm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, spec=self.speculator.snapshot(),
            kv_transfer=dataclasses.replace(self.kv.stats), kv_leases=len(self.kv.leases),
            stage_busy=self.pipeline.utilization() if self.pipeline is not None else [],
        )
