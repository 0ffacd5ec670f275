"""What structured outputs cost per engine step: the (greedy) sampler on random logits of the model's
vocabulary, with every row, one row or no row under a JSON Schema grammar, at several batch sizes. The model itself
never runs, so the numbers are the grammar's own overhead (mask fill, apply, accept), not a generation speed.

    python -m mlc.bench.grammar [--model smollm2-135m-instruct] [--batch 1 --batch 16] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mlc.engine.grammar import GrammarCompiler, GrammarSpec, advance
from mlc.engine.sampler import Sampler
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import Sequence

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}},
    "required": ["name", "age", "tags", "address"]}


def _seqs(batch: int, constrained: int, grammar) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=10_000, temperature=0.0,
                                                        grammar=grammar.spec if i < constrained else None),
                     grammar=grammar if i < constrained else None)
            for i in range(batch)]


def step_ms(sampler: Sampler, seqs: list[Sequence], vocab: int, steps: int, eos: set[int]) -> float:
    """Median milliseconds of one sampler call over `steps` steps (tokens fed back; a finished row restarts)."""
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(len(seqs), vocab, generator=gen) * 3
        t0 = time.perf_counter()
        results = sampler(logits, seqs)
        times.append(time.perf_counter() - t0)
        for i, (token, _) in enumerate(results):
            if token in eos:
                seqs[i] = Sequence(seqs[i].request_id, [1, 2, 3], seqs[i].params, grammar=seqs[i].grammar)
            else:  # what Scheduler.postprocess does with a token
                seqs[i].output_ids.append(token)
                matcher = seqs[i].matcher
                if matcher is not None:
                    advance(matcher, token)
    return 1000 * statistics.median(times)


def measure(model: str, batches: list[int], steps: int) -> dict:
    from mlc.models.store import resolve_model_dir
    from mlc.models.tokenizer import load_tokenizer

    path = resolve_model_dir(model)
    tokenizer = load_tokenizer(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    eos = {tokenizer.eos_token_id}
    compiler = GrammarCompiler(tokenizer, eos, vocab)
    t0 = time.perf_counter()
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    first_ms = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    compiler.compile(GrammarSpec.json_schema(SCHEMA))
    cached_ms = 1000 * (time.perf_counter() - t0)
    rows = {}
    for batch in batches:
        sampler = Sampler(eos)
        step_ms(sampler, _seqs(batch, batch, grammar), vocab, 5, eos)  # warm the lexer caches
        # a shared machine is noisy: each figure is the best of three medians
        free = min(step_ms(Sampler(eos), _seqs(batch, 0, grammar), vocab, steps, eos) for _ in range(3))
        one = min(step_ms(sampler, _seqs(batch, 1, grammar), vocab, steps, eos) for _ in range(3))
        every = min(step_ms(sampler, _seqs(batch, batch, grammar), vocab, steps, eos) for _ in range(3))
        rows[batch] = {"no_grammar_ms": round(free, 3), "one_row_ms": round(one, 3), "all_rows_ms": round(every, 3),
                       "overhead_all_rows_ms": round(every - free, 3)}
    return {"model": model, "vocab": vocab, "first_compile_ms (tokenizer + grammar)": round(first_ms, 1),
            "cached_compile_ms": round(cached_ms, 3), "per_step": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.model, args.batch or [1, 16], args.steps), indent=2))


if __name__ == "__main__":
    main()
