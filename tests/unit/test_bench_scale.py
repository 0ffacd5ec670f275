"""`bench scale`'s report (`bench/scale_report.py`): the ladder's table, its goals checked rung by rung, the MoE
rung against a dense rung reading as many bytes, the plots; and the pieces the ladder runs on (the rung names, the
synthetic files, a server's peak RSS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlc.bench.peers import RunningServer, ServerSpec
from mlc.bench.scale import DEFAULT_RUNGS, LARGE_RUNGS, check_rungs
from mlc.bench.scale_report import goals, markdown, moe_efficiency, write_plots
from mlc.errors import ConfigError
from mlc.models.synth import MIXES, SHAPES, synthesize


def _server(tok_s: dict, roofline: float, prefill: dict, rss: float, quiet: float, loaded: float) -> dict:
    return {"tok_s": tok_s, "roofline": roofline, "prefill_tok_s": prefill, "peak_rss_bytes": rss,
            "background": {"quiet_tok_s": quiet, "loaded_tok_s": loaded}, "tpot_ms_c1": 1000 / tok_s["1"]}


def _rung(arch: str, params: float, active: float, bpt: float, ours: dict, peer: dict) -> dict:
    return {"arch": arch, "like": "a real model", "params": params, "active_params": active,
            "bytes_per_token": bpt, "types": "Q4_0 (100 Q4_0)", "read_gb_s": 30.0,
            "servers": {"mlc": ours, "llama.cpp": peer}}


def result() -> dict:
    """Two dense rungs and a MoE rung, keyed as JSON keeps them (level and length keys as strings)."""
    return {
        "machine": {"cpu": "a CPU", "cores": 2, "flags": ["avx2"], "time": "now"},
        "config": {"concurrency": [1, 8, 32], "prefill_tokens": [512, 4096], "background_load": 0.05,
                   "quant": "Q4_0"},
        "notes": ["llama-server from somewhere"],
        "rungs": {
            "llama-1B": _rung("llama", 1.24e9, 1.24e9, 0.7e9,
                              _server({"1": 40.0, "8": 150.0, "32": 300.0}, 0.93, {"512": 300.0, "4096": 200.0},
                                      1.0e9, 40.0, 39.5),
                              _server({"1": 30.0, "8": 90.0, "32": 150.0}, 0.70, {"512": 250.0, "4096": 100.0},
                                      0.95e9, 30.0, 29.0)),
            "llama-3B": _rung("llama", 3.2e9, 3.2e9, 1.8e9,
                              _server({"1": 12.0, "8": 50.0, "32": 80.0}, 0.72, {"512": 100.0, "4096": 80.0},
                                      2.5e9, 12.0, 11.0),
                              _server({"1": 11.5, "8": 30.0, "32": 60.0}, 0.69, {"512": 90.0, "4096": 60.0},
                                      2.0e9, 11.5, 11.4)),
            "glm4moe-2B": _rung("glm4moe", 2.5e9, 0.94e9, 0.35e9,
                                _server({"1": 60.0, "8": 120.0, "32": 200.0}, 0.7, {"512": 200.0, "4096": 120.0},
                                        3.3e9, 60.0, 59.0),
                                _server({"1": 50.0, "8": 80.0, "32": 100.0}, 0.58, {"512": 200.0, "4096": 100.0},
                                        2.8e9, 50.0, 49.0)),
        },
    }


def test_the_table_has_a_row_per_rung_with_the_ratios_roofline_rss_and_load_cost():
    table = markdown(result())
    row = next(line for line in table.splitlines() if line.startswith("| llama-1B |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:4] == ["1.24B (0.70 GB)", "Q4_0"]
    assert cells[4:7] == ["1.33x (40.0 / 30.0)", "1.67x (150.0 / 90.0)", "2.00x (300.0 / 150.0)"]
    assert cells[7] == "93% / 70% of 30.0 GB/s"
    assert cells[8:10] == ["1.20x", "2.00x"]  # prefill at 512 and 4096 tokens
    assert cells[10] == "1.00 / 0.95" and cells[11] == "1% / 3%"


def test_each_goal_names_the_rungs_that_miss_it():
    lines = goals(result())
    assert "- c=1 >= 1.1x llama.cpp (dense): missed on llama-3B" in lines  # 12.0 / 11.5 = 1.04x
    assert "- c=8 >= 1.5x llama.cpp (dense): met on llama-1B, llama-3B" in lines
    assert "- c=1 at >= 80% of the memory roofline from 1.5B up: missed on llama-3B" in lines  # 1B is below 1.4B
    assert "- 4096-token prefill >= 1.5x llama.cpp: missed on llama-3B, glm4moe-2B" in lines  # 1.33x, 1.20x
    assert "- peak RSS at most 10% above llama.cpp's: missed on llama-3B, glm4moe-2B" in lines
    assert "- 5% of a core in the background costs c=1 at most 3%: missed on llama-3B" in lines  # 8.3%


def test_a_moe_rung_is_held_to_the_dense_rung_reading_the_nearest_bytes_per_token():
    r = result()
    # nearest dense rung: llama-1B (0.7 GB at 40 tok/s = 28 GB/s); at 0.35 GB a token that gives 80 tok/s
    assert moe_efficiency(r, "glm4moe-2B", "mlc") == pytest.approx(60.0 / 80.0)
    assert moe_efficiency(r, "glm4moe-2B", "llama.cpp") == pytest.approx(50.0 / 60.0)
    assert any(line.startswith("- MoE glm4moe-2B c=1 against a dense rung") and "mlc 0.75x" in line
               for line in goals(r))


def test_the_plots_are_written_per_level_and_per_measure(tmp_path):
    paths = write_plots(result(), tmp_path)
    assert [p.name for p in paths] == ["scale-c1.png", "scale-c8.png", "scale-c32.png", "scale-roofline.png",
                                       "scale-prefill.png", "scale-rss.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_rungs_are_checked_before_anything_runs():
    check_rungs(list(DEFAULT_RUNGS) + list(LARGE_RUNGS))
    with pytest.raises(ConfigError, match="unknown rung\\(s\\) llama-2B; known: llama-135M, llama-360M"):
        check_rungs(["llama-1B", "llama-2B"])


def test_the_new_rungs_have_their_sizes():
    sizes = {k: round(SHAPES[k].params() / 1e9, 2) for k in ("llama-360M", "glm4-0.5B", "glm4-3B")}
    assert sizes == {"llama-360M": 0.36, "glm4-0.5B": 0.53, "glm4-3B": 3.28}


def test_a_mix_without_llama_quantize_is_refused_and_leaves_no_file(tmp_path):
    assert "Q4_K_M" in MIXES
    with pytest.raises(ConfigError, match="Q4_K_M is a llama-quantize mix: it needs llama.cpp's llama-quantize"):
        synthesize(SHAPES["llama-135M"], "q4_k_m", tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


class _Alive:
    pid = os.getpid()

    @staticmethod
    def poll():
        return None


def test_peak_rss_reads_the_process_high_water_mark():
    server = RunningServer(ServerSpec("this process", [], 0, Path("/dev/null")))
    assert server.peak_rss_bytes() is None  # not started
    server.proc = _Alive()  # type: ignore[assignment]
    hwm = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/self/status").read_text().splitlines()
               if ln.startswith("VmHWM:"))
    assert server.peak_rss_bytes() >= hwm > 50e6
