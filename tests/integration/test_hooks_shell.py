"""post_inference hooks as operators write them: a shell line runs as written; request data reaches it only on stdin
and in MLC_* metadata variables, so text in a prompt never runs. The argv form, the timeout, the concurrency limit
and failure logging stay; failures are counted, never raised; the reference tutorial's section 6 line runs as
written."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import time

import pytest

from mlc.server.observability.hooks import HOOK_ENV, HookRunner, HooksConfig, hook_env

ATTACK = "$(touch {d}/pwned1); touch {d}/pwned2; `touch {d}/pwned3` && touch {d}/pwned4 | touch {d}/pwned5"


def record(tmp_path, **over) -> dict:
    base = {"time": "2026-01-01T00:00:00.000+00:00", "request_id": "gen-1", "client": "127.0.0.1",
            "method": "POST", "route": "/generate", "status": 200, "model": "smollm2-135m-instruct",
            "prompt_tokens": 7, "completion_tokens": 3, "finish_reason": "stop", "latency_ms": 12.5,
            "stripped_chars": 0, "prompt": ATTACK.format(d=tmp_path), "output": ATTACK.format(d=tmp_path)}
    return {**base, **over}


def run_all(config: HooksConfig, records: list[dict], timeout: float = 20.0) -> HookRunner:
    runner = HookRunner(config)
    runner.start()
    for r in records:
        runner.submit(r)
    runner.stop(timeout)
    return runner


def test_prompt_with_shell_syntax_runs_nothing(tmp_path):
    """The record (prompt and output included) arrives on stdin and the metadata in the environment; neither is
    ever part of the command, so `$(...)`, `;`, backquotes, `&&` and `|` in them stay text."""
    line = (f'cat > {tmp_path}/stdin.json; printf "%s\\n" "$MLC_REQUEST_ID" "$MLC_CLIENT" '
            f'"$MLC_MODEL" "$MLC_STATUS" "$MLC_PROMPT_TOKENS" "$MLC_COMPLETION_TOKENS" "$MLC_TIME" > {tmp_path}/env')
    hostile = record(tmp_path, request_id=ATTACK.format(d=tmp_path), model=f"m; touch {tmp_path}/pwned6")
    runner = run_all(HooksConfig(post_inference=line), [hostile])
    assert (runner.runs, runner.failures) == (1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env", "stdin.json"]  # no pwned* file
    assert json.loads((tmp_path / "stdin.json").read_text()) == hostile
    fields = (tmp_path / "env").read_text().rstrip("\n").split("\n")
    assert fields[0] == ATTACK.format(d=tmp_path)[:256] and fields[2] == f"m; touch {tmp_path}/pwned6"
    assert fields[1] == "127.0.0.1" and fields[3:6] == ["200", "7", "3"] and fields[6].startswith("2026-01-01")


def test_metadata_variables_never_carry_request_text(tmp_path):
    env = hook_env(record(tmp_path, request_id="id\nwith\x00control"), base={})
    assert set(env) == set(HOOK_ENV) and env["MLC_REQUEST_ID"] == "idwithcontrol"
    assert ATTACK.format(d=tmp_path) not in env.values() and "prompt" not in HOOK_ENV.values()
    assert env["MLC_FINISH_REASON"] == "stop" and env["MLC_LATENCY_MS"] == "12.5" and env["MLC_ROUTE"] == "/generate"


def test_shell_line_runs_exactly_as_written(tmp_path):
    """Like a cron line: the shell expands what the operator wrote (here $(date) in double quotes)."""
    line = f'echo "done at $(date +%Y) by $MLC_CLIENT" >> {tmp_path}/audit.log'
    run_all(HooksConfig(post_inference=line), [record(tmp_path), record(tmp_path)])
    year = time.strftime("%Y")
    assert (tmp_path / "audit.log").read_text() == f"done at {year} by 127.0.0.1\n" * 2


def test_argv_form_stays_and_gets_the_same_inputs(tmp_path):
    script = "import os, sys; open(sys.argv[1], 'w').write(os.environ['MLC_REQUEST_ID'] + sys.stdin.read())"
    hook = [sys.executable, "-c", script, str(tmp_path / "out")]
    runner = run_all(HooksConfig(post_inference=hook), [record(tmp_path)])
    assert runner.failures == 0
    text = (tmp_path / "out").read_text()
    assert text.startswith("gen-1{") and json.loads(text[len("gen-1"):])["status"] == 200


def test_several_hooks_mixed_forms(tmp_path):
    argv = [sys.executable, "-c", f"open({str(tmp_path / 'log')!r}, 'a').write('argv\\n')"]
    hooks = [f"echo shell >> {tmp_path}/log", argv]
    run_all(HooksConfig(post_inference=hooks), [record(tmp_path)])
    assert (tmp_path / "log").read_text() == "shell\nargv\n"


def test_timeout_kills_the_whole_hook_and_is_logged(tmp_path, caplog):
    line = f"sleep 30; touch {tmp_path}/late"
    runner = HookRunner(HooksConfig(post_inference=line, timeout_s=0.5))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mlc.server.observability.hooks"):
        assert runner.run_one(line, b"{}") is False
    assert time.monotonic() - start < 10 and runner.failures == 1
    assert "timed out after 0.5s and was killed" in caplog.text
    time.sleep(0.2)
    assert not (tmp_path / "late").exists()


def test_failure_is_logged_with_its_stderr(caplog):
    line = "echo broken >&2; exit 3"
    runner = HookRunner(HooksConfig(post_inference=line))
    with caplog.at_level(logging.WARNING, logger="mlc.server.observability.hooks"):
        assert runner.run_one(line, b"{}") is False
    assert "exited with 3" in caplog.text and "broken" in caplog.text


def test_concurrency_limit(tmp_path):
    """max_concurrent hooks run at once: two records meet only when two runs overlap."""
    line = (f'touch {tmp_path}/"$MLC_REQUEST_ID"; i=0; while [ "$(ls {tmp_path} | wc -l)" -lt 2 ]; do '
            f'i=$((i+1)); [ $i -gt 100 ] && exit 1; sleep 0.05; done')
    runner = run_all(HooksConfig(post_inference=line, max_concurrent=2),
                     [record(tmp_path, request_id="a"), record(tmp_path, request_id="b")])
    assert (runner.runs, runner.failures) == (2, 0)
    assert HookRunner(HooksConfig(post_inference=line)).config.max_concurrent == 1  # the default: one at a time


@pytest.mark.parametrize("bad", [0, 65])
def test_concurrency_bounds(bad):
    with pytest.raises(ValueError):
        HooksConfig(post_inference="true", max_concurrent=bad)


def test_hook_failures_are_counted_not_raised(tmp_path):
    runner = HookRunner(HooksConfig(post_inference=[["/nonexistent/hook"]], timeout_s=5))
    assert runner.run_one(["/nonexistent/hook"], b"{}") is False
    assert runner.run_one([sys.executable, "-c", "import sys; sys.exit(3)"], b"{}") is False
    assert runner.run_one([sys.executable, "-c", "import sys; sys.stdin.read()"], b"{}") is True
    assert runner.failures == 2 and runner.runs == 3


# the reference tutorial's section 6 hook line (its other lines: tests/unit/test_tutorial_fidelity.py)
def test_section_6_hook_line_is_accepted_and_runs_as_written(tmp_path):
    log = tmp_path / "logs/inference_audit.log"
    log.parent.mkdir()
    line = f"echo 'Inference done at $(date)' >> {log}"  # the tutorial's, with /workspace/logs -> tmp
    config = HooksConfig(**__import__("yaml").safe_load(textwrap.dedent(f'''
        post_inference: "{line}"
    ''')))
    assert config.post_inference == [line]
    assert HookRunner(config).run_one(line, b"{}") is True
    assert log.read_text() == "Inference done at $(date)\n"  # single quotes: sh prints it literally
