"""The defaults a user gets: a quantized GGUF served in its own bit width, the batch sized from the KV budget,
Poisson arrivals for `bench serve --request-rate`."""

from __future__ import annotations

import json

from mlc.bench.serve import arrival_gaps
from mlc.engine.memory import AUTO_MAX_BATCH, auto_batch_size, plan_cache
from mlc.models.loader import source_weight_dtypes


def _manifest(tmp_path, types):
    (tmp_path / "manifest.json").write_text(json.dumps({"conversion": {"tensor_types": types}}))
    return tmp_path


def test_q4_gguf_is_int4_with_an_8bit_head(tmp_path):
    body, head, why = source_weight_dtypes(_manifest(tmp_path, {"Q8_0": 1, "F32": 61, "Q4_1": 210}))
    assert (body, head) == ("int4", "int8") and "Q4_1" in why


def test_q8_and_f16_ggufs_keep_their_width(tmp_path):
    assert source_weight_dtypes(_manifest(tmp_path, {"Q8_0": 211, "F32": 61}))[:2] == ("int8", None)
    assert source_weight_dtypes(_manifest(tmp_path, {"F16": 211, "F32": 61}))[:2] == ("fp16", None)
    assert source_weight_dtypes(_manifest(tmp_path, {"Q4_K": 150, "Q6_K": 61, "F32": 61}))[:2] == ("int4", "int8")


def test_checkpoints_without_a_gguf_source_stay_as_they_are(tmp_path):
    assert source_weight_dtypes(tmp_path) is None  # an HF checkpoint: no store manifest
    assert source_weight_dtypes(_manifest(tmp_path, {"F32": 272})) is None


def test_auto_batch_size_follows_the_kv_budget():
    assert auto_batch_size(num_pages=1 + 32 * 4, page_size=16, max_seq_len=8192) == 4  # 512 tokens each
    assert auto_batch_size(num_pages=1 + 10_000, page_size=16, max_seq_len=8192) == AUTO_MAX_BATCH
    assert auto_batch_size(num_pages=2, page_size=16, max_seq_len=8192) == 1
    assert auto_batch_size(num_pages=1 + 64, page_size=16, max_seq_len=64) == 16  # short contexts fit more


def test_plan_cache_reports_the_batch_it_sized():
    plan = plan_cache(1024, 16, 64 * 2**20, 0.5, None, None, 8192)
    assert plan.batch_auto and plan.max_batch_size == auto_batch_size(plan.num_pages, 16, 8192)
    fixed = plan_cache(1024, 16, 64 * 2**20, 0.5, None, 4, 8192)
    assert not fixed.batch_auto and fixed.max_batch_size == 4


def test_poisson_gaps_are_seeded_and_average_one_over_the_rate():
    gaps = arrival_gaps(4000, 10.0, seed=1)
    assert gaps[0] == 0 and gaps == arrival_gaps(4000, 10.0, seed=1)
    assert abs(sum(gaps) / (len(gaps) - 1) - 0.1) < 0.01
    assert arrival_gaps(3, None, 0) == [0.0, 0.0, 0.0]
