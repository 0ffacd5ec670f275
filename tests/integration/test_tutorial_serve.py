"""The reference tutorial's serving steps, end to end on one real `mlc-cli serve` process:

- 4.2 `mindie --model=... --device_id=0 --port=8080 --max_batch_size=8 --max_seq_len=16384
  --enable_paged_attention=true --kv_cache_dtype=fp16`, plus 4.4's `--kv_cache_compression_ratio=0.5`, given to
  `mlc-cli serve` as written (the model is ours: the tutorial's .om is refused, see
  tests/unit/test_tutorial_fidelity.py);
- 4.4 `ASCEND_ALLOC_MEM=1` and `ASCEND_MAX_MEM` in the environment (64 MB instead of 28000: this is a CPU box);
- 4.2 `/health` and the `/generate` curl bodies of 4.2 and 5.4;
- 6 the `post_inference` hook line in the user config, beside an argv hook that records stdin and the MLC_* variables,
  and a prompt full of shell syntax that must run nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.support.server_process import MODEL, ServerProcess, free_port, wait_for

MINDIE_FLAGS = ["--device_id=0", "--max_batch_size=8", "--max_seq_len=16384", "--enable_paged_attention=true",
                "--kv_cache_dtype=fp16", "--kv_cache_compression_ratio=0.5"]
TUTORIAL_HOOK = "echo 'Inference done at $(date)' >> {log}"
RECORDER = ('cat >> {d}/stdin.jsonl; '
            'echo "$MLC_REQUEST_ID $MLC_CLIENT $MLC_STATUS $MLC_COMPLETION_TOKENS" >> {d}/meta.log')
ATTACK = "$(touch {d}/pwned1); touch {d}/pwned2; `touch {d}/pwned3` | touch {d}/pwned4"


class TutorialServer(ServerProcess):
    """ServerProcess with the tutorial's command line instead of the suite's base arguments."""

    def __init__(self, tmp, args: list[str], env: dict[str, str]):
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self.health_seen, self.while_loading = [], None
        child_env = {k: v for k, v in os.environ.items() if k != "MLC_API_KEY"}
        child_env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                          "TOKENIZERS_PARALLELISM": "false", **env})
        cmd = [sys.executable, "-m", "mlc.cli.main", "serve", f"--model={MODEL}", f"--port={self.port}", *args]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, env=child_env, stdout=self._log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tutorial")
    (tmp / "logs").mkdir()
    hooks = [TUTORIAL_HOOK.format(log=tmp / "logs/inference_audit.log"), ["/bin/sh", "-c", RECORDER.format(d=tmp)]]
    (tmp / "config.yaml").write_text(json.dumps({"hooks": {"post_inference": hooks, "timeout_s": 20}}))
    env = {"ASCEND_ALLOC_MEM": "1", "ASCEND_MAX_MEM": "64", "MLC_CONFIG": str(tmp / "config.yaml")}
    srv = TutorialServer(tmp, [*MINDIE_FLAGS, "--audit-log", str(tmp / "audit.jsonl"), "--audit-log-content",
                               "--no-access-log"], env)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def test_the_mindie_line_starts_the_server_and_says_what_each_flag_became(server):
    log = server.log()
    assert "note: --device_id 0 -> --device " in log
    assert "note: --kv_cache_compression_ratio 0.5 (of fp16) -> --kv-cache-dtype int8" in log
    assert "note: --max_seq_len=16384 -> --max-seq-len 16384" in log
    assert "note: --enable_paged_attention true -> nothing to change" in log
    assert "note: ASCEND_MAX_MEM=64 -> --kv-cache-memory 64MB" in log
    assert "note: ASCEND_ALLOC_MEM=1 -> nothing to change" in log
    assert "2 post_inference hook(s)" in log
    assert httpx.get(server.url + "/health").json() == {"status": "healthy"}  # 4.2: 返回 {"status":"healthy"}


def test_the_tutorial_curl_bodies(server):
    body = {"prompt": "请用中文总结以下法律条款：《民法典》第1024条...", "max_new_tokens": 512, "temperature": 0.7}
    r = generate(server, {**body, "max_new_tokens": 24})  # 4.2's body; 24 tokens keep the test short on a CPU
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = generate(server, {"prompt": "test", "max_new_tokens": 10})  # 5.4
    assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 10


def test_hooks_run_as_written_and_a_hostile_prompt_runs_nothing(server):
    tmp = server.tmp
    attack = ATTACK.format(d=tmp)
    r = generate(server, {"prompt": attack, "max_new_tokens": 2})
    assert r.status_code == 200
    rid = r.json()["id"]
    meta = wait_for(lambda: rid in (tmp / "meta.log").read_text() if (tmp / "meta.log").exists() else False, 30)
    assert meta, server.log()
    assert not any(tmp.glob("pwned*"))
    records = [json.loads(line) for line in (tmp / "stdin.jsonl").read_text().splitlines()]
    mine = next(x for x in records if x["request_id"] == rid)
    assert mine["prompt"] == attack and mine["route"] == "/generate"
    line = next(x for x in (tmp / "meta.log").read_text().splitlines() if x.startswith(rid))
    assert line.split()[1:3] == ["127.0.0.1", "200"]
    audit = (tmp / "logs/inference_audit.log").read_text().splitlines()
    assert len(audit) >= 1 and set(audit) == {"Inference done at $(date)"}
