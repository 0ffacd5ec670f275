"""`bench fairness` end to end on a short run (the goal's figure comes from the full command, not from here): the
key file it writes is one the server takes, each round floods with a fresh key whose minute is empty, the flood
meets 429s past its limit, and the quiet key's TTFTs are measured alone and beside the flood."""

from __future__ import annotations

import pytest

from mlc.bench.key_fairness import FairnessConfig, run_fairness, write_key_file
from mlc.server.keys import hash_key, load_key_file


def test_the_key_file_holds_a_quiet_key_and_a_flood_key_a_round(tmp_path):
    quiet, floods = write_key_file(tmp_path / "keys.yaml", rounds=2, flood_limit=6)
    entries = load_key_file(tmp_path / "keys.yaml")
    assert [e.name for e in entries] == ["quiet", "flood0", "flood1"]
    assert [e.key_sha256 for e in entries] == [hash_key(k) for k in (quiet, *floods)]
    assert entries[0].requests_per_minute is None and {e.requests_per_minute for e in entries[1:]} == {6}
    assert quiet not in (tmp_path / "keys.yaml").read_text()
    assert (tmp_path / "keys.yaml").stat().st_mode & 0o077 == 0


@pytest.mark.slow
def test_a_short_fairness_run_floods_past_the_limit_and_times_the_quiet_key(tmp_path):
    cfg = FairnessConfig(out_dir=tmp_path, flood_limit=6, rounds=2, seconds=9.0, max_tokens=4)
    result = run_fairness(cfg, progress=print)
    for r in result["rounds"]:
        # 60 a minute sent for 9 s: the first 6 in the minute pass, the rest get 429, in each round (a fresh key)
        assert r["flood_statuses"].get("200") == 6 and r["flood_statuses"].get("429", 0) >= 2
        assert len(r["alone_s"]) >= 9 and len(r["flooded_s"]) >= 9
    assert result["quiet_alone"]["p99_ttft_s"] > 0 and result["p99_ratio"] > 0
    assert "flood_keys" not in result["config"] and "quiet_key" not in result["config"]
