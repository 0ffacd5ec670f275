"""Fuzz the live server with schemathesis (examples, coverage and fuzzing phases, a few cases per operation), from
its own /openapi.json and from OpenAI's published spec trimmed to the served operations (`tests/support/openai_spec`,
model pinned to the served id): no request may get a 5xx, and every answer must match the schema, ours and OpenAI's.

The server runs with a small context and completion budget so that generated requests that pass validation finish
in well under a second; a longer --request-timeout keeps a busy moment from turning into a 504.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.support.openai_spec import pinned
from tests.support.server_process import ServerProcess

SERVER_ARGS = ["--max-seq-len", "64", "--max-batch-size", "4", "--max-queue", "8", "--default-max-tokens", "4",
               "--request-timeout", "60"]
CHECKS = "not_a_server_error,response_schema_conformance"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz"), SERVER_ARGS)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def schemathesis(spec: str, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", spec, "--checks", CHECKS,
           "--phases", "examples,coverage,fuzzing", "--max-examples", "5", "--seed", "10", "--workers", "1",
           "--request-timeout", "60", "--report", "json", "--report-json-path", str(report), *extra]
    # cwd: schemathesis and hypothesis keep their caches in the working directory, not in the repository
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    result = json.loads(report.read_text())
    ops, cases = result["operations"], result["test_cases"]
    print(f"\nschemathesis {result['schemathesis_version']}: {ops['tested']}/{ops['total']} operations, "
          f"{cases['generated']} requests, {cases['with_failures']} failing ({cases['unique_failures']} unique), "
          f"{len(result['errors'])} errors in {result['running_time']:.1f}s; "
          f"schema-valid data rejected by the server on: {result['warnings']['validation_mismatch'] or 'none'}")
    assert proc.returncode == 0 and not result["failures"] and not result["errors"], proc.stdout[-10000:]
    return proc, result


def test_schemathesis_finds_no_server_error_and_no_schema_drift(server, tmp_path):
    _, result = schemathesis(server.url + "/openapi.json", tmp_path)
    ops, cases = result["operations"], result["test_cases"]
    assert ops["tested"] == ops["total"] >= 11 and cases["generated"] > 100
    assert "Traceback" not in server.log()


def test_openai_published_spec_finds_no_server_error_and_no_schema_violation(server, tmp_path):
    """OpenAI's own request and response schemas: what the spec calls valid gets 200 or a 400 naming the field,
    and every 200 matches OpenAI's response schema."""
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    spec = tmp_path / "openai-served.json"
    spec.write_text(json.dumps(pinned(model)))
    _, result = schemathesis(str(spec), tmp_path, "--url", server.url + "/v1")
    ops, cases = result["operations"], result["test_cases"]
    assert ops["tested"] == ops["total"] == 4 and cases["generated"] > 50
    assert "Traceback" not in server.log()
