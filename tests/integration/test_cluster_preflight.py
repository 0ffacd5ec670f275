"""`mlc-cli deploy` against a real local Ray head that cannot hold what the cluster config asks for: one clear
error, exit code 10, and the head it started is stopped again (nothing half-started). Fast enough to run always."""

from __future__ import annotations

import yaml

from tests.integration.test_cluster import cli
from tests.support.server_process import free_port


def test_too_large_an_ask_fails_before_anything_starts_and_leaves_nothing_running(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "mlc-home"))  # where the local head's record would be
    port = free_port()
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "model": "smollm2-135m-instruct", "hardware": "cpu", "ray_address": f"local:{port}", "nodes": ["localhost"],
        "devices_per_node": 2, "data_parallel_size": 2, "port": free_port(), "serving": {"cpus_per_replica": 64}}))
    result = cli("deploy", "--cluster-config", str(config), timeout=180, env={"MLC_HOME": str(tmp_path / "mlc-home")})
    assert result.returncode == 10, result.stdout + result.stderr
    assert "the cluster cannot hold 2 replica(s): CPU: needs 128" in result.stderr
    assert "Traceback" not in result.stderr
    from mlc.cluster.ray_runtime import head_record_path, reachable

    assert not reachable(f"127.0.0.1:{port}") and not head_record_path(port).exists()  # the head it started is gone
