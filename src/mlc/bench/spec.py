"""`bench spec`: speculative decoding measured as a user meets it, on this machine, in one run.

Servers, started together and run in alternating order: our server on its defaults, the same with
`--speculative-config`, and where the model comes from a GGUF file llama-server on the same file, plain and with its
own n-gram drafting (`--spec-type ngram-simple`, its defaults). Workloads, greedy, streamed:
  summarize   a section of the GPL-3 text, summarized quoting its sentences (input-grounded)
  code edit   a Python module of this project with one function renamed, returned whole (input-grounded)
  quote       a passage of the text, asked back word for word (input-grounded)
  chat        the built-in open-ended prompts at concurrency 1 and at concurrency 32
At concurrency 1 the figure is a stream's decode speed (tokens/s after its first token, from the mean time per
output token), at 32 the output tokens/s of all streams together; our speculative server's draft counters (from
/metrics) give the acceptance. Before the servers start, `verify_cost` times one model step of one sequence carrying
1..16 tokens at a short and a long context in this process: the cost of verifying k drafts, which sets
`num_speculative_tokens`.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mlc.bench import peers
from mlc.bench.compare import _chat, _level, long_text, words_for_tokens
from mlc.bench.serve import BenchConfig, load_prompts

SPEC_DEFAULT = '{"method": "ngram"}'
LLAMA_SPEC = ["--spec-type", "ngram-simple"]
CODE = Path(__file__).with_name("stats.py")  # a module of ours: code a user might ask to edit


@dataclass
class SpecBenchConfig:
    model: str
    out_dir: Path
    speculative_config: str = SPEC_DEFAULT
    requests: int = 3  # per input-grounded workload
    max_tokens: int = 192
    chat_requests: int = 32
    chat_max_tokens: int = 64
    llama_server: Path | None = None
    build_llama: bool = True
    threads: int | None = None
    curve_contexts: list[int] = field(default_factory=lambda: [512, 4096])
    curve_tokens: list[int] = field(default_factory=lambda: [1, 2, 4, 6, 8, 12, 16])


def verify_cost(model: str, contexts: list[int], tokens: list[int], repeats: int = 7) -> dict:
    """Median time of a model step of one decoding sequence carrying k tokens (its next token and k-1 drafts),
    for each context length: {context: {k: ms}}."""
    import torch

    from mlc.config.engine_config import EngineConfig
    from mlc.engine.llm_engine import LLMEngine
    from mlc.engine.sampling_params import SamplingParams
    from mlc.engine.sequence import ScheduledSeq, Sequence

    engine = LLMEngine(EngineConfig(model=model, max_seq_len=max(contexts) + max(tokens) + 16))
    vocab = engine.model.config.vocab_size
    out: dict = {}
    for context in contexts:
        gen = torch.Generator().manual_seed(context)
        ids = torch.randint(100, vocab - 100, (context + 1,), generator=gen).tolist()
        seq = Sequence("curve", ids[:context], SamplingParams(max_new_tokens=64))
        engine.page_manager.grow(seq, context + max(tokens) + 1)
        done = 0
        while done < context:  # fill the cache as prefill does
            k = min(engine.config.max_num_batched_tokens, context - done)
            engine.runner.run([ScheduledSeq(seq, k)])
            seq.num_cached = seq.num_cache_entries = done = done + k
        seq.output_ids = ids[context:]
        row: dict[int, float] = {}
        for k in tokens:
            seq.draft_ids = ids[: k - 1]
            step = [ScheduledSeq(seq, k, k - 1)]
            engine.runner.run(step)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                engine.runner.run(step)
                times.append((time.perf_counter() - t) * 1000)
            row[k] = statistics.median(times)
        engine.page_manager.free(seq)
        out[context] = row
    return out


def workloads(tokenizer) -> dict[str, list[list[dict]]]:
    text = long_text()
    section = words_for_tokens(text, 900, tokenizer)
    code = CODE.read_text(encoding="utf-8")
    name = re.findall(r"^def (\w+)", code, re.M)[0]
    paragraphs = [p for p in text.split("\n\n") if 300 < len(p) < 1200]
    ask = lambda content: [{"role": "user", "content": content}]  # noqa: E731
    return {
        "summarize": [ask(f"Section {i + 1}.\n{section}\n\nSummarize this section, quoting its key sentences "
                          "word for word.") for i in range(3)],
        "code edit": [ask(f"File {i + 1}.\n```python\n{code}\n```\nRename the function `{name}` to "
                          f"`{name}_v{i + 2}` everywhere and return the whole file.") for i in range(3)],
        "quote": [ask(f"Text:\n{text[:3000]}\n\nCopy this paragraph from the text exactly as it is written:\n"
                      f"{p[:80]}...") for p in paragraphs[:3]],
    }


async def _spec_counters(url: str) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(url + "/metrics")).text
    get = lambda name: sum(float(m) for m in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M))  # noqa
    return get("mlc:spec_decode_num_draft_tokens"), get("mlc:spec_decode_num_accepted_tokens")


def run_workloads(cfg: SpecBenchConfig, servers: list[peers.RunningServer], tokenizer, progress) -> dict:
    """{workload: {label: {"tok_s", "output_tokens", "acceptance"?}}}, servers alternating in order."""
    ids = {s.spec.label: httpx.get(s.spec.url + "/v1/models", timeout=30).json()["data"][0]["id"] for s in servers}
    grounded = workloads(tokenizer)
    chats = load_prompts("builtin")
    plan = [(name, convs[: cfg.requests], 1, cfg.max_tokens) for name, convs in grounded.items()]
    plan += [("chat c=1", chats[: cfg.chat_requests // 4], 1, cfg.chat_max_tokens),
             ("chat c=32", (chats * 4)[: cfg.chat_requests], 32, cfg.chat_max_tokens)]
    results: dict[str, dict] = {}
    for i, (name, convs, concurrency, max_tokens) in enumerate(plan):
        for s in servers if i % 2 == 0 else list(reversed(servers)):
            bodies = [{**_chat(ids[s.spec.label], c, max_tokens), "ignore_eos": False} for c in convs]
            before = asyncio.run(_spec_counters(s.spec.url)) if s.spec.label.startswith("mlc") else None
            bcfg = BenchConfig(url=s.spec.url, concurrency=[concurrency], num_prompts=len(bodies),
                               max_tokens=max_tokens)
            rep = asyncio.run(_level(s.spec.url, bodies, concurrency, bcfg))
            decode = 1000 / rep.tpot_ms.mean if rep.tpot_ms.count and rep.tpot_ms.mean else 0.0
            row = {"tok_s": decode if concurrency == 1 else rep.output_tok_s, "decode_tok_s": decode,
                   "output_tok_s": rep.output_tok_s, "output_tokens": rep.output_tokens, "failed": rep.failed}
            if before is not None:
                drafted, accepted = (a - b for a, b in zip(asyncio.run(_spec_counters(s.spec.url)), before))
                if drafted:
                    row["acceptance"] = accepted / drafted
            results.setdefault(name, {})[s.spec.label] = row
            progress(f"{s.spec.label}: {name}: {row['tok_s']:.1f} tok/s"
                     + (f", {row['acceptance']:.0%} of drafts accepted" if "acceptance" in row else ""))
    return results


def run_spec(cfg: SpecBenchConfig, progress=print) -> dict:
    """The verify-cost curve, then every workload on every server; writes spec.json and spec.md."""
    import json
    import os
    from contextlib import ExitStack

    from mlc.bench import llama_cpp
    from mlc.bench.compare_run import machine
    from mlc.bench.gguf_source import gguf_of
    from mlc.models.store import resolve_model_dir
    from mlc.models.tokenizer import load_tokenizer

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
                    "machine": machine(), "notes": []}
    progress("timing one step with 1..16 tokens of one sequence")
    result["verify_cost_ms"] = verify_cost(cfg.model, cfg.curve_contexts, cfg.curve_tokens)
    specs = [peers.ours(cfg.model, cfg.out_dir),
             peers.ours(cfg.model, cfg.out_dir, ["--speculative-config", cfg.speculative_config])]
    gguf = gguf_of(cfg.model)
    if gguf is None:
        result["notes"].append(f"llama.cpp skipped: {cfg.model} does not come from a GGUF file")
    else:
        peer, note = llama_cpp.locate(cfg.llama_server, cfg.build_llama, progress)
        result["notes"].append(note)
        if peer is not None:
            threads = cfg.threads or len(os.sched_getaffinity(0))
            plain = peers.llama(peer.server, gguf, cfg.out_dir, threads, 32, 32 * 2048)
            drafting = peers.llama(peer.server, gguf, cfg.out_dir, threads, 32, 32 * 2048)
            drafting.argv += LLAMA_SPEC
            drafting.label += " " + " ".join(LLAMA_SPEC)
            specs += [plain, drafting]
    with ExitStack() as stack:
        running = []
        for spec in specs:
            progress(f"starting {spec.label}")
            running.append(stack.enter_context(peers.RunningServer(spec)))
        tokenizer = load_tokenizer(resolve_model_dir(cfg.model))
        result["workloads"] = run_workloads(cfg, running, tokenizer, progress)
    result["servers"] = [s.label for s in specs]
    (cfg.out_dir / "spec.json").write_text(json.dumps(result, indent=2) + "\n")
    (cfg.out_dir / "spec.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    servers = result["servers"]
    ours, ours_spec = servers[0], servers[1]
    llama_spec = servers[3] if len(servers) > 3 else None
    lines = ["# bench spec", "", f"machine: {result['machine']}", ""]
    head = ["workload", *servers, "spec / plain (ours)"] + (["ours spec / llama.cpp n-gram"] if llama_spec else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in result["workloads"].items():
        cells = [name]
        for label in servers:
            r = rows.get(label, {})
            acc = f" ({r['acceptance']:.0%} acc.)" if "acceptance" in r else ""
            cells.append(f"{r.get('tok_s', float('nan')):.1f}{acc}")
        cells.append(f"{rows[ours_spec]['tok_s'] / rows[ours]['tok_s']:.2f}x")
        if llama_spec:
            cells.append(f"{rows[ours_spec]['tok_s'] / rows[llama_spec]['tok_s']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "tokens/s: one stream's decode speed at concurrency 1, all streams' output at 32", "",
              "Verify cost: ms of one step of one sequence carrying k tokens (k-1 drafts), and its ratio to k=1",
              ""]
    for context, row in result["verify_cost_ms"].items():
        base = row[min(row, key=int)]
        lines.append(f"- context {context}: " + ", ".join(f"k={k} {ms:.1f} ms ({ms / base:.2f}x)"
                                                            for k, ms in row.items()))
    notes = result.get("notes") or []
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else [])) + "\n"
