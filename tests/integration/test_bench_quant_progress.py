"""`bench quant`'s progress callback: each variant reported as it lands (each variant runs in a child process)."""

from __future__ import annotations

import pytest

from tests.support.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_bench_quant_reports_each_variant_as_it_lands(base):
    from mlc.bench.quant import parse_variant, run_quant_bench

    seen = []
    report = run_quant_bench(str(base), [parse_variant("int8")], decode_tokens=4, repeats=1, plan=None,
                             with_peer=False, on_variant=seen.append)
    assert [v.label for v in seen] == [v.label for v in report.variants] and len(seen) == 1
    assert seen[0].decode_b1_tok_s > 0
