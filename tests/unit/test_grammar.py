"""Structured outputs in the engine: grammars compiled once per spec, clear errors for what cannot compile, the
sampler's mask on constrained rows only (batched with free ones), and the forced tool-call grammars of each format."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from mlc.engine.grammar import GrammarCompiler, GrammarSpec, advance
from mlc.engine.sampler import Sampler
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import Sequence
from mlc.errors import InvalidRequestError
from tests.support.tiny_glm import build_glm_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "pet": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "pet", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_glm_tokenizer(tmp_path_factory.mktemp("glmtok"), tags=True)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, {tok.eos_token_id}, len(tok))


def test_each_spec_compiles_once(compiler):
    a = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    reordered = json.loads(json.dumps(SCHEMA, sort_keys=True))
    before = compiler.compiled
    assert compiler.compile(GrammarSpec.json_schema(reordered)) is a
    assert compiler.compiled == before and compiler.hits >= 1
    assert compiler.compile(GrammarSpec.json_schema(SCHEMA, strict=False)) is not a  # another spec, another grammar


@pytest.mark.parametrize("spec,field,words", [
    (GrammarSpec.json_schema({"type": "strin"}), "response_format.json_schema.schema", "strin"),
    (GrammarSpec("regex", "(unclosed"), "guided_regex", "compile"),
    (GrammarSpec("grammar", "start: undefined_rule"), "structured_outputs.grammar", "compile"),
    (GrammarSpec.json_schema({"type": "string", "format": "no-such-format"}), "guided_json", "format"),
])
def test_what_cannot_compile_is_a_400_naming_the_field(compiler, spec, field, words):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(dataclasses.replace(spec, field=field))
    assert e.value.field == field and words in e.value.message


def _decode_greedy(compiler, tok, spec: GrammarSpec, steps: int = 120, seed: int = 0, **params) -> tuple[str, Sequence]:
    """Sample from random logits under the grammar, batched with an unconstrained sequence each step."""
    grammar = compiler.compile(spec)
    sampler = Sampler({tok.eos_token_id}, seed=seed)
    guided = Sequence("g", [1, 2], SamplingParams(max_new_tokens=steps, grammar=spec, **params), grammar=grammar)
    free = Sequence("f", [1, 2], SamplingParams(max_new_tokens=steps, temperature=0.0))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(2, len(tok), generator=gen) * 4
        (t_free, _), (t_guided, _) = sampler(logits, [free, guided])
        assert t_free == int(logits[0].argmax())  # the free row is untouched by its neighbour's grammar
        if t_guided == tok.eos_token_id:
            break
        guided.output_ids.append(t_guided)  # as Scheduler.postprocess appends it, moving the matcher on
        advance(guided.matcher, t_guided)
    return tok.decode(guided.output_ids), guided


@pytest.mark.parametrize("seed", range(6))
def test_sampled_json_always_validates(compiler, tok, seed):
    text, _ = _decode_greedy(compiler, tok, GrammarSpec.json_schema(SCHEMA), seed=seed,
                             temperature=1.0 if seed % 2 else 0.0, top_p=0.9)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_grammar(compiler, tok):
    text, _ = _decode_greedy(compiler, tok, GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}"))
    assert len(text) == 6 and text[3] == "-" and text[:3].isdigit()
    text, _ = _decode_greedy(compiler, tok, GrammarSpec.choice(["Paris", "北京"]), temperature=1.0)
    assert text in ("Paris", "北京")
    text, _ = _decode_greedy(compiler, tok, GrammarSpec("grammar", 'root ::= "yes" | "no"'))  # GBNF
    assert text in ("yes", "no")


def test_grammar_beats_min_tokens(compiler, tok):
    text, seq = _decode_greedy(compiler, tok, GrammarSpec.choice(["ok"]), min_new_tokens=20)
    assert text == "ok" and len(seq.output_ids) < 20


def test_a_batch_without_grammar_never_reaches_the_grammar_code(tok):
    sampler = Sampler({tok.eos_token_id})
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=0.0)) for i in range(3)]
    sampler(torch.randn(3, len(tok)), seqs)
    assert sampler.grammars._executor is None and all(s.matcher is None for s in seqs)
