"""The containers' entrypoint wrapper docker/mlc-env.sh (no Docker needed): executable bash that runs the command it
is given."""

from __future__ import annotations

import subprocess
from pathlib import Path

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def test_the_env_script_is_executable_bash_that_runs_its_arguments():
    script = DOCKER / "mlc-env.sh"
    assert script.stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run([str(script), "echo", "ran", "it"], capture_output=True, text=True, check=True)
    assert out.stdout == "ran it\n"
