"""One place for each request rule: `LLMEngine.validate` (the server calls it once, through its engine client, and
maps the field names to the API's)."""

from __future__ import annotations

import pytest

from mlc.config.engine_config import EngineConfig
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ContextLengthError, InvalidRequestError, RequestTooLargeError
from tests.support.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("validate") / "model")
    return LLMEngine(EngineConfig(model=str(model_dir)), kv_cache_memory="64KiB", page_size=16)


def refused(engine, ids, params, *args) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        engine.validate(ids, params, *args)
    return e.value


def test_prompt_and_token_fields_stay_inside_the_vocabulary(engine):
    vocab = engine.model.config.vocab_size
    assert refused(engine, [], SamplingParams()).field == "prompt"
    err = refused(engine, [1, vocab], SamplingParams(max_new_tokens=2))
    assert err.field == "prompt" and str(vocab - 1) in err.message
    err = refused(engine, [1], SamplingParams(max_new_tokens=2, stop_token_ids=[5, vocab]))
    assert err.field == "stop_token_ids"
    for top_k in (vocab + 1, 10**12):
        err = refused(engine, [1], SamplingParams(max_new_tokens=2, top_k=top_k))
        assert err.field == "top_k" and str(vocab) in err.message
    engine.validate([1], SamplingParams(max_new_tokens=2, top_k=vocab, stop_token_ids=[0, vocab - 1]))


def test_the_context_bound_names_the_field_and_how_much_fits(engine):
    source = "context_length of 100 tokens"
    engine.validate([1] * 10, SamplingParams(max_new_tokens=90), 100, source)
    err = refused(engine, [1] * 10, SamplingParams(max_new_tokens=91), 100, source)
    assert isinstance(err, ContextLengthError) and err.field == "max_new_tokens"
    assert "at most 90" in err.message and source in err.message
    err = refused(engine, [1] * 100, SamplingParams(max_new_tokens=1), 100, source)
    assert err.field == "prompt" and "shorten the prompt" in err.message
    err = refused(engine, [1] * 10, SamplingParams(max_new_tokens=engine.max_seq_len))  # the model's own limit
    assert str(engine.max_seq_len) in err.message


def test_a_request_larger_than_the_cache_is_refused(engine):
    pages = engine.page_manager.usable_pages
    err = refused(engine, [1] * 16, SamplingParams(max_new_tokens=pages * 16))
    assert isinstance(err, RequestTooLargeError) and "raise --kv-cache-memory" in err.message


def test_n_samples_are_counted_against_the_cache_sharing_the_prompts_full_pages(engine):
    pages = engine.page_manager.usable_pages  # 64 KiB of the tiny model's pages
    prompt = [1] * 32  # two full pages, shared by every sample
    each = (pages - 2) // 3  # pages each of 3 samples may add
    engine.validate(prompt, SamplingParams(max_new_tokens=each * 16, n=3))
    err = refused(engine, prompt, SamplingParams(max_new_tokens=each * 16 + 16, n=3))
    assert isinstance(err, RequestTooLargeError) and f"for its 3 samples but the cache holds {pages}" in err.message
    assert "or lower n" in err.message
    engine.validate(prompt, SamplingParams(max_new_tokens=each * 16 + 16, n=1))  # one sample of it fits
