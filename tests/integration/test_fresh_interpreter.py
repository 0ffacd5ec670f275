"""mlc in a fresh Python process: `from mlc import LLM, SamplingParams` without loading torch first, and a missing
optional extra named with the extra to install (no traceback)."""

from __future__ import annotations

import subprocess
import sys


def test_from_mlc_import_llm_and_sampling_params_without_loading_torch_first():
    code = ("import sys, mlc; assert 'torch' not in sys.modules; from mlc import LLM, SamplingParams; "
            "from mlc.engine.llm import LLM as L; assert LLM is L; print(SamplingParams(max_tokens=9).max_new_tokens)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "9"


def test_a_missing_optional_extra_says_which_to_install():
    code = "import sys; sys.modules['fastapi'] = None; from mlc.cli.main import main; main(['serve'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "install `mlc[serve]`" in out.stderr
