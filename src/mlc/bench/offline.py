"""`bench offline`: our engine against transformers `generate`, measured in the same run on the same prompts.

Both sides produce exactly `max_new_tokens` per prompt (EOS ignored) with greedy decoding, so output tok/s compare
like for like. Peak RSS is read after our phase, before transformers loads anything.
"""

from __future__ import annotations

import gc
import resource
import time
from dataclasses import asdict, dataclass, field

import torch

from mlc.bench.prompts import chat_prompts
from mlc.config.engine_config import EngineConfig


@dataclass
class Measure:
    label: str
    requests: int
    output_tokens: int
    seconds: float
    ttft_s: float | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


@dataclass
class OfflineReport:
    model: str
    num_prompts: int
    max_new_tokens: int
    ours_batch: Measure
    ours_single: Measure
    peer_batch: Measure | None
    peer_single: Measure | None
    peer_batch_size: int
    ours_peak_rss_mib: float
    config: dict = field(default_factory=dict)
    outputs_agree: float | None = None  # fraction of prompts whose greedy tokens equal transformers' (batch 1)
    weights: str = ""  # what our weights ran as (LLMEngine.weights)
    max_batch_size: int = 0  # the batch size in force (sized from the KV budget unless given)

    def ratio(self, which: str) -> float | None:
        ours, peer = getattr(self, f"ours_{which}"), getattr(self, f"peer_{which}")
        return None if peer is None or not peer.tok_s else ours.tok_s / peer.tok_s

    def to_json(self) -> dict:
        d = asdict(self)
        for key in ("ours_batch", "ours_single", "peer_batch", "peer_single"):
            if d[key] is not None:
                d[key]["tok_s"] = getattr(self, key).tok_s
        d["ratio_batch"], d["ratio_single"] = self.ratio("batch"), self.ratio("single")
        return d


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _decode_rate(out, n_tokens: int) -> float:
    """Single-request decode tok/s: tokens after the first over the time after the first."""
    times = out.metrics.token_times
    return (n_tokens - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def run_ours(config: EngineConfig, prompts: list[list[dict]], max_new_tokens: int):
    from mlc.engine.llm import LLM
    from mlc.engine.sampling_params import SamplingParams

    llm = LLM(config=config)
    ids = [llm.render_chat(p) for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(ids[:2], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm up kernels and allocator
    start = time.perf_counter()
    outs = llm.generate(ids, params)
    batch = Measure("mlc engine", len(ids), sum(len(o.outputs[0].token_ids) for o in outs),
                    time.perf_counter() - start)
    start = time.perf_counter()
    one = llm.generate(ids[0], params)[0]
    elapsed = time.perf_counter() - start
    rate = _decode_rate(one, len(one.outputs[0].token_ids))
    single = Measure("mlc engine, batch 1 decode", 1, len(one.outputs[0].token_ids) - 1,
                     (len(one.outputs[0].token_ids) - 1) / rate if rate else elapsed, one.metrics.ttft)
    greedy_one = [llm.generate(i, SamplingParams(max_new_tokens=32, temperature=0.0))[0].outputs[0].token_ids
                  for i in ids[:5]]
    model_dir = llm.engine.model.model_dir
    engine_facts = {"weights": llm.engine.weights, "max_batch_size": llm.engine.max_batch_size}
    del llm
    gc.collect()
    return batch, single, ids, greedy_one, model_dir, engine_facts


def run_peer(model_dir, ids: list[list[int]], max_new_tokens: int, batch_size: int, greedy_ref: list[list[int]]):
    """transformers `generate` in fp32: static batches (left-padded), then one prompt alone."""
    from transformers import AutoTokenizer

    from mlc.models.hf_checkpoint import transformers_model

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers_model(model_dir).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=pad)

    def batch_inputs(chunk):
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        return input_ids, mask

    with torch.inference_mode():
        warm_ids, warm_mask = batch_inputs(ids[:2])
        model.generate(warm_ids, attention_mask=warm_mask, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        start = time.perf_counter()
        produced = 0
        for i in range(0, len(ids), batch_size):
            input_ids, mask = batch_inputs(ids[i : i + batch_size])
            out = model.generate(input_ids, attention_mask=mask, **kw)
            produced += (out.shape[1] - input_ids.shape[1]) * input_ids.shape[0]
        batch = Measure(f"transformers generate, batches of {batch_size}", len(ids), produced,
                        time.perf_counter() - start)
        input_ids, mask = batch_inputs(ids[:1])
        start = time.perf_counter()
        first = model.generate(input_ids, attention_mask=mask, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
        t_first = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, **kw)
        elapsed = time.perf_counter() - start
        n = out.shape[1] - input_ids.shape[1]
        single = Measure("transformers, batch 1 decode", 1, n - 1, max(elapsed - t_first, 1e-9), t_first)
        del first
        agree = 0
        for p, ref in zip(ids[:5], greedy_ref):
            o = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=pad,
                               eos_token_id=tok.eos_token_id)
            agree += o[0, len(p):].tolist() == ref
    return batch, single, agree / max(1, len(greedy_ref))


def run_offline(config: EngineConfig, num_prompts: int = 32, max_new_tokens: int = 128,
                peer_batch_size: int = 8, with_peer: bool = True) -> OfflineReport:
    prompts = chat_prompts(num_prompts)
    batch, single, ids, greedy_one, model_dir, facts = run_ours(config, prompts, max_new_tokens)
    rss = peak_rss_mib()
    peer_batch = peer_single = agree = None
    if with_peer:
        peer_batch, peer_single, agree = run_peer(model_dir, ids, max_new_tokens, peer_batch_size, greedy_one)
    return OfflineReport(config.model, num_prompts, max_new_tokens, batch, single, peer_batch, peer_single,
                         peer_batch_size, rss, config.model_dump(), agree, **facts)
