"""Speculative decoding with a GLM-4.5 or GLM-5 checkpoint's own MTP layer (`{"method": "mtp"}`, models/mtp.py).

The output is never the drafter's business: greedy decoding with MTP drafts is transformers' greedy (fp32) and the
plain engine's (bf16, int8). The drafts themselves are transformers' `MtpModel`'s, step after step, where the
engine computes the layer over its own paged cache: across prompt chunks, after a prefix-cache hit and (GLM-4.5) in
a batch. GLM-5's indexer picks its keys by hard top-k, so fp32 rounding that differs with the batch or the prompt's
chunks can change a GLM-5 draft; its drafts are checked one whole prompt at a time. A synthetic MTP layer that
repeats the trunk's last layer is accepted far above chance."""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4MoeForCausalLM, GlmMoeDsaForCausalLM

from mlc.config.engine_config import EngineConfig
from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import Sequence
from mlc.engine.speculative import DraftState
from mlc.errors import ConfigError
from mlc.models.loader import check_mtp_checkpoint
from tests.numerics.test_decode_parity import PAGE_SIZE, build_checkpoint, greedy, hf_greedy, prompts
from tests.support.tiny_mtp import add_mtp_layer, reference_drafts, reference_mtp

MTP = {"method": "mtp"}


ARCHS = {"glm4_moe": Glm4MoeForCausalLM, "glm_moe_dsa": GlmMoeDsaForCausalLM}


def _checkpoint(tmp_path_factory, arch: str, copy_last_layer: bool = False):
    path = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
    add_mtp_layer(ARCHS[arch].from_pretrained(path, dtype=torch.float32), path, copy_last_layer=copy_last_layer)
    hf = ARCHS[arch].from_pretrained(path, dtype=torch.float32).eval()
    hf.config._experts_implementation = "eager"
    return path, hf, reference_mtp(hf)


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "glm4_moe")


@pytest.fixture(scope="module")
def copied_mtp(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "glm4_moe", copy_last_layer=True)


@pytest.fixture(scope="module")
def glm5_mtp(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "glm_moe_dsa")


def checked_drafts(llm: LLM, hf, mtp, batch: list[list[int]], max_tokens: int = 16) -> int:
    """Run `batch` on the engine step by step, noting each draft the MTP layer leaves after a step; each must be
    the one transformers' MTP layer gives at that point. Returns how many drafts were checked."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    seqs: dict[str, Sequence] = {}
    drafts: dict[str, dict[int, int]] = {}  # request -> outputs so far -> draft left then
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            seqs[seq.request_id] = seq
            state = seq.drafter
            if isinstance(state, DraftState) and state.mtp_next is not None and seq.num_uncomputed == 1:
                drafts.setdefault(seq.request_id, {})[len(seq.output_ids)] = state.mtp_next
    for rid, got in drafts.items():
        seq = seqs[rid]
        want = reference_drafts(hf, mtp, seq.prompt_ids, seq.output_ids)
        assert got == {k: want[k - 1] for k in got}, (rid, got, want)
    return sum(len(d) for d in drafts.values())


@pytest.mark.parametrize("which", ["random_mtp", "copied_mtp", "glm5_mtp"])
def test_fp32_greedy_with_mtp_drafts_is_transformers_greedy(which, request):
    path, hf, _ = request.getfixturevalue(which)
    batch = prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p) for p in batch]
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=MTP)
    assert greedy(llm, batch) == want
    assert [greedy(llm, [p])[0] for p in batch] == want
    stats = llm.engine.speculator.stats
    assert stats.proposals > 0, stats
    pm = llm.engine.page_manager
    assert pm.num_free_pages == pm.usable_pages  # rejected drafts' pages all came back


@pytest.mark.parametrize("which", ["copied_mtp", "glm5_mtp"])
def test_chained_mtp_drafts_change_no_token(which, request):
    """Three drafts a step: the layer again on its own guess and output (vLLM's chaining), writing its cache where
    the verify rows will; the output stays transformers' greedy, and later positions are accepted too."""
    path, hf, _ = request.getfixturevalue(which)
    batch = prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p) for p in batch]
    chained = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=chained)
    assert greedy(llm, batch) == want
    assert [greedy(llm, [p])[0] for p in batch] == want
    stats = llm.engine.speculator.stats
    assert stats.drafted_at[1] > 0
    if which == "copied_mtp":
        assert stats.accepted_at[1] > 0, stats
    pm = llm.engine.page_manager
    assert pm.num_free_pages == pm.usable_pages


def test_mtp_drafts_are_transformers_mtp_layer_in_a_batch_and_across_prompt_chunks(random_mtp):
    path, hf, mtp = random_mtp
    batch = prompts(hf.config.vocab_size)
    # 16 tokens a step: the 31-token prompt is computed in two chunks beside the others' decoding
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=MTP, max_num_batched_tokens=16)
    assert checked_drafts(llm, hf, mtp, batch) >= 6


def test_glm5_mtp_drafts_are_transformers_mtp_layer(glm5_mtp):
    path, hf, mtp = glm5_mtp
    checked = 0
    for p in prompts(hf.config.vocab_size):  # one at a time, each prompt in one piece, as transformers runs it
        llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=MTP)
        checked += checked_drafts(llm, hf, mtp, [p])
    assert checked >= 6


def test_mtp_drafts_after_a_prefix_cache_hit(copied_mtp):
    path, hf, mtp = copied_mtp
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(7, hf.config.vocab_size, (3 * PAGE_SIZE + 5,), generator=gen).tolist()
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=MTP)
    first = checked_drafts(llm, hf, mtp, [prompt])
    pm = llm.engine.page_manager
    hits = pm.prefix_hits
    again = checked_drafts(llm, hf, mtp, [prompt])
    # three full pages are cached; the last one found is recomputed, so its last MTP slot is this prompt's own
    assert pm.prefix_hits - hits == 2
    assert first > 0 and again > 0


def test_a_synthetic_mtp_layer_is_accepted_far_above_chance(copied_mtp):
    path, hf, _ = copied_mtp
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=MTP)
    greedy(llm, prompts(hf.config.vocab_size))
    stats = llm.engine.speculator.stats
    chance = 1 / hf.config.vocab_size
    assert stats.drafted >= 20 and stats.acceptance_rate > 50 * chance, stats


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(weight_dtype="int8")], ids=["bf16", "int8"])
def test_default_path_mtp_decode_is_the_plain_engines(copied_mtp, options):
    path, hf, _ = copied_mtp
    batch = prompts(hf.config.vocab_size)
    want = greedy(LLM(str(path), page_size=PAGE_SIZE, **options), batch, logprobs=2)
    spec = LLM(str(path), page_size=PAGE_SIZE, speculative_config=MTP, **options)
    assert greedy(spec, batch, logprobs=2) == want
    assert spec.engine.speculator.stats.accepted > 0


def test_mtp_is_refused_clearly_where_there_is_no_mtp_layer(tmp_path_factory, random_mtp):
    plain = build_checkpoint("glm4_moe", tmp_path_factory.mktemp("no-mtp"))  # config declares one, weights have none
    with pytest.raises(ConfigError, match="eh_proj"):
        LLM(str(plain), dtype="fp32", speculative_config=MTP)
    llama = build_checkpoint("llama", tmp_path_factory.mktemp("llama-no-mtp"))
    with pytest.raises(ConfigError, match="ngram"):
        LLM(str(llama), dtype="fp32", speculative_config=MTP)
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(model=str(random_mtp[0]), speculative_config=MTP, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="compiled"):
        check_mtp_checkpoint(random_mtp[0], random_mtp[1].config, None, compiled=True)
