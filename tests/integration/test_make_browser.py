"""`make test` on a machine without Debian's chromium and without a way to install it (no root, no apt-get): the
Makefile says in one line what to run, and the web UI's browser tests are skipped with that command, not errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_chromium_the_browser_step_says_what_to_run(tmp_path):
    out = subprocess.run(["make", "-s", "browser", f"CHROMIUM={tmp_path / 'chromium'}", "APT_GET="], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [
        f"note: no {tmp_path / 'chromium'}: the web UI tests will be skipped; to run them: "
        "sudo apt-get install -y chromium"]


def test_without_chromium_the_web_ui_tests_skip_and_the_run_is_green(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/integration/test_web_ui.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MLC_CHROMIUM": str(tmp_path / "chromium")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 skipped" in out.stdout and "error" not in out.stdout.lower()
    assert "run `make browser` as root, or: sudo apt-get install -y chromium" in out.stdout
