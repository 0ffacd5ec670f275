"""`bench kv`: what each KV-cache dtype and sparse-KV ratio costs and saves on one model, all from one run.

For every (dtype, ratio): KV bytes per token (per layer and total, from the stores themselves), how many sequences
of `capacity_context` tokens fit in a fixed budget (the engine's own page plan, PageManager and sparse policy,
sequences grown chunk by chunk), batch-1 decode tok/s right after the long text (so at its full context, where the
cache's read cost shows), and quality against fp32 full KV through the engine (mlc.bench.quality): perplexity of
the long text with chunked prefill, greedy agreement, needle retrieval. One model load serves every configuration.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlc.config.engine_config import SparseKVConfig
from mlc.errors import ConfigError

DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")
RATIOS = (1.0, 0.5, 0.25, 0.1)


@dataclass
class KVBenchPlan:
    model: str = "smollm2-135m-instruct"
    dtypes: tuple[str, ...] = DTYPES
    ratios: tuple[float, ...] = RATIOS
    extra: tuple[tuple[str, float], ...] = ()  # (dtype, ratio) pairs run besides the dtypes x ratios grid
    # sparse policy: the tutorial keeps 4K whole past 8K; smaller here, so the 1-7K-token prompts a CPU run can
    # afford are thinned (an 8K-context model)
    window: int = 512
    min_context: int = 1024
    sink_tokens: int = 4
    page_size: int = 16
    budget_bytes: int = 2**30
    capacity_context: int = 8192
    chunk: int = 512
    ppl_tokens: int | None = None  # None: the whole long text
    decode_tokens: int = 32
    agreement_prompts: int = 32
    agreement_prompt_len: int = 1280  # past min_context, so sparse KV is in play
    agreement_new_tokens: int = 32
    needle_contexts: tuple[int, ...] = (2048, 4096, 7168)
    needle_trials: int = 3
    quality: bool = True  # agreement and needles (perplexity and decode speed run whenever `speed` does)
    speed: bool = True  # perplexity pass + timed decode; False with quality False: memory and capacity only

    @classmethod
    def quick(cls, **overrides) -> KVBenchPlan:
        """About 2 minutes a configuration on 1 busy CPU core: 4K tokens of text, 8 prompts, needles at 2K/4K."""
        small = dict(ppl_tokens=4096, agreement_prompts=8, agreement_new_tokens=16, needle_contexts=(2048, 4096),
                     needle_trials=2, decode_tokens=16)
        return cls(**{**small, **overrides})

    def sparse(self, ratio: float) -> SparseKVConfig | None:
        if ratio >= 1.0:
            return None
        return SparseKVConfig(window=self.window, ratio=ratio, min_context=self.min_context,
                              sink_tokens=self.sink_tokens)

    def configs(self) -> list[tuple[str, float]]:
        grid = [(d, r) for d in self.dtypes for r in self.ratios]
        return grid + [p for p in dict.fromkeys(self.extra) if p not in grid]

    def check(self) -> None:
        bad = [d for d in (*self.dtypes, *(d for d, _ in self.extra)) if d not in DTYPES]
        if bad:
            raise ConfigError(f"--dtypes: {', '.join(bad)} unknown; pick from {', '.join(DTYPES)}")
        ratios = (*self.ratios, *(r for _, r in self.extra))
        if not self.ratios or any(not 0.0 < r <= 1.0 for r in ratios):
            raise ConfigError("--ratios: every ratio must be in (0, 1], e.g. 1,0.5,0.25,0.1")


@dataclass
class KVBenchRow:
    dtype: str
    ratio: float
    bytes_per_token: int
    bytes_per_token_layer: list[int]
    entries_at_capacity_context: int  # cache entries one sequence of capacity_context tokens keeps
    max_sequences: int
    decode_tok_s: float | None = None
    perplexity: float | None = None
    perplexity_delta_pct: float | None = None
    agreement: float | None = None
    needle: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return self.dtype if self.ratio >= 1 else f"{self.dtype} r={self.ratio:g}"


@dataclass
class KVBenchReport:
    plan: KVBenchPlan
    rows: list[KVBenchRow]
    reference_bytes_per_sequence: int  # fp32 full KV, one sequence of capacity_context tokens
    load_average: tuple[float, float, float] | None = None

    def memory_saved(self, row: KVBenchRow) -> float:
        """Fraction of fp32 full KV's bytes per sequence of capacity_context tokens that this row saves."""
        return 1.0 - row.bytes_per_token * row.entries_at_capacity_context / self.reference_bytes_per_sequence

    def to_json(self) -> dict:
        out = asdict(self)
        for r, row in zip(out["rows"], self.rows):
            r["label"], r["memory_saved"] = row.label, self.memory_saved(row)
        return out

    @classmethod
    def from_json(cls, data: dict) -> KVBenchReport:
        """The inverse of `to_json` (re-plot or merge earlier runs)."""
        plan = dict(data["plan"])
        plan["extra"] = tuple(tuple(p) for p in plan.get("extra", ()))
        for key in ("dtypes", "ratios", "needle_contexts"):
            plan[key] = tuple(plan[key])
        rows = []
        for r in data["rows"]:
            r = {k: v for k, v in r.items() if k not in ("label", "memory_saved")}
            r["needle"] = {int(k): v for k, v in r.get("needle", {}).items()}
            rows.append(KVBenchRow(**r))
        load = data.get("load_average")
        return cls(KVBenchPlan(**plan), rows, data["reference_bytes_per_sequence"], tuple(load) if load else None)


def capacity(spec, dtype, plan: KVBenchPlan, ratio: float) -> tuple[int, int]:
    """(sequences of `capacity_context` tokens that fit at once in `budget_bytes`, entries one keeps), with the
    engine's page plan and allocator; each sequence grows `chunk` tokens a step and is compacted between steps."""
    import torch

    from mlc.engine.kv_cache import KVCache
    from mlc.engine.memory import plan_cache
    from mlc.engine.page_manager import PageManager
    from mlc.engine.sampling_params import SamplingParams
    from mlc.engine.sequence import Sequence
    from mlc.engine.sparse_kv import SparseKV

    bpt = KVCache.bytes_per_token_for(spec, dtype)
    pages = plan_cache(bpt, plan.page_size, plan.budget_bytes, 0.5, torch.device("cpu"), 1, plan.capacity_context)
    if pages.num_pages < 2:
        return 0, plan.capacity_context
    pm = PageManager(pages.num_pages, plan.page_size, enable_prefix_caching=False)
    cfg = plan.sparse(ratio)
    sparse = SparseKV(cfg, pm, None) if cfg else None
    fitted, entries = 0, plan.capacity_context
    while True:
        seq = Sequence("capacity", [0] * plan.capacity_context, SamplingParams())
        while seq.num_cached < plan.capacity_context:
            k = min(plan.chunk, plan.capacity_context - seq.num_cached)
            if not pm.can_grow(seq, seq.num_cache_entries + k):
                return fitted, entries
            pm.grow(seq, seq.num_cache_entries + k)
            seq.num_cached += k
            seq.num_cache_entries += k
            if sparse:
                sparse.compact([seq])
        fitted, entries = fitted + 1, seq.num_cache_entries


def run_kv_bench(plan: KVBenchPlan, on_row=None) -> KVBenchReport:
    """Every (dtype, ratio) of the plan; fp32 full KV runs first as the quality reference even when not asked for."""
    import torch

    from mlc.config.engine_config import EngineConfig
    from mlc.engine.kv_cache import KVCache, kv_dtype
    from mlc.engine.llm import LLM
    from mlc.engine.llm_engine import LLMEngine

    plan.check()
    base = LLMEngine(EngineConfig(model=plan.model, kv_cache_memory="8MiB", max_batch_size=1))
    model, tok = base.model, base.tokenizer
    spec = model.kv_cache_spec()
    max_len = int(getattr(model.config, "max_position_embeddings", 8192))
    configs = plan.configs()
    reference = ("fp32", 1.0)
    order = [reference] + [c for c in configs if c != reference]
    rows: list[KVBenchRow] = []
    refs: dict = {}
    for dtype, ratio in order:
        start = time.monotonic()
        torch_dtype = kv_dtype(dtype, model.dtype)
        fitted, kept = capacity(spec, torch_dtype, plan, ratio)
        row = KVBenchRow(dtype, ratio, KVCache.bytes_per_token_for(spec, torch_dtype),
                         KVCache.layer_bytes_per_token_for(spec, torch_dtype), kept, fitted)
        if plan.quality or plan.speed:
            engine = LLMEngine(base.config, model=model, tokenizer=tok, kv_cache_dtype=dtype,
                               sparse_kv=plan.sparse(ratio), kv_cache_memory=plan.budget_bytes, max_batch_size=8,
                               enable_prefix_caching=False, max_num_batched_tokens=plan.chunk, max_seq_len=max_len,
                               page_size=plan.page_size)
            _measure(row, LLM(engine=engine), plan, refs, max_len)
        row.seconds = time.monotonic() - start
        if (dtype, ratio) in configs:
            rows.append(row)
            if on_row:
                on_row(row)
    ref_bpt = KVCache.bytes_per_token_for(spec, torch.float32)
    return KVBenchReport(plan, rows, ref_bpt * plan.capacity_context, _load_average())


def _measure(row: KVBenchRow, llm, plan: KVBenchPlan, refs: dict, max_len: int) -> None:
    """Perplexity and decode speed (one pass over the long text), then agreement and needles unless speed only.
    The first call is the fp32 full-KV reference: it fills `refs`."""
    from mlc.bench import quality

    text = quality.long_text_ids(llm, plan.ppl_tokens)[: max_len - plan.decode_tokens]
    scored = quality.score_text(llm, text, plan.chunk, plan.decode_tokens)
    row.perplexity, row.decode_tok_s = quality.perplexity_of(scored.logprobs), scored.decode_tokens_per_s
    refs.setdefault("ppl", row.perplexity)
    row.perplexity_delta_pct = 100.0 * (row.perplexity / refs["ppl"] - 1.0)
    if not plan.quality:
        return
    prompts = quality.agreement_prompts(llm, plan.agreement_prompts, plan.agreement_prompt_len)
    if "tokens" not in refs:
        refs["tokens"] = quality.greedy_tokens(llm, prompts, plan.agreement_new_tokens, plan.chunk)
    row.agreement = quality.greedy_agreement(llm, prompts, refs["tokens"], plan.agreement_new_tokens)
    row.needle = quality.needle_scores(llm, plan.needle_contexts, plan.needle_trials)


def _load_average() -> tuple[float, float, float] | None:
    import os

    try:
        return os.getloadavg()
    except OSError:
        return None


def plot_tradeoff(report: KVBenchReport, path: Path) -> Path:
    """Memory saved (per sequence of capacity_context tokens, vs fp32 full KV) against quality lost: perplexity
    increase (left) and needle retrieval (right). One colour per dtype, one marker per sparse ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.perplexity is not None]
    if not rows:
        raise ConfigError("the trade-off plot needs quality numbers (drop --no-quality)")
    colors = dict(zip(DTYPES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")))
    markers = {1.0: "o", 0.5: "s", 0.25: "^", 0.1: "X"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    for r in rows:
        x = 100 * report.memory_saved(r) + (1.0 if r.dtype == "bf16" else 0.0)  # bf16 sits on fp16: nudge it
        style = dict(color=colors.get(r.dtype, "k"), marker=markers.get(r.ratio, "D"), s=70, edgecolor="k",
                     linewidth=0.5, zorder=3)
        left.scatter(x, r.perplexity_delta_pct, **style)
        offset = (5, -10) if r.dtype == "bf16" else (5, 4)
        left.annotate(r.label, (x, r.perplexity_delta_pct), textcoords="offset points", xytext=offset, fontsize=7)
        needle = sum(r.needle.values()) / len(r.needle) if r.needle else math.nan
        right.scatter(x, 100 * needle, **style)
    ctx = report.plan.capacity_context
    left.set(xlabel=f"KV memory saved per {ctx}-token sequence vs fp32 full KV (%; bf16 drawn 1 point right)",
             ylabel="perplexity increase vs fp32 full KV (%)", title="memory saved vs perplexity lost")
    contexts = "/".join(f"{c // 1024}K" for c in report.plan.needle_contexts)
    right.set(xlabel=f"KV memory saved per {ctx}-token sequence vs fp32 full KV (%)",
              ylabel=f"needle retrieval, mean over {contexts} (%)", title="memory saved vs needle retrieval",
              ylim=(-5, 105))
    for ax in (left, right):
        ax.set_xlim(-3, 103)
        ax.grid(True, alpha=0.3)
        ax.axhline(0 if ax is left else 100, color="grey", linewidth=0.8)
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=d) for d, c in colors.items()
               if any(r.dtype == d for r in rows)]
    handles += [plt.Line2D([], [], color="grey", marker=m, linestyle="", label=f"ratio {k:g}")
                for k, m in markers.items() if any(r.ratio == k for r in rows)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    p = report.plan
    fig.suptitle(f"bench kv: {p.model}; sparse window {p.window}, min_context {p.min_context}, "
                 f"sinks {p.sink_tokens}; perplexity on {p.ppl_tokens or 'all'} tokens of Genesis (KJV)")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
