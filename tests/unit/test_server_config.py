"""Pure parts of the server's configuration: context bounds, hooks, API keys, CLI parsing."""

from __future__ import annotations

import pytest

from mlc.config.serve_config import ServeConfig
from mlc.errors import ConfigError, InvalidRequestError
from mlc.server.auth import check_authorization, is_open, keys_from_env
from mlc.server.observability.hooks import HooksConfig, load_hooks
from mlc.server.params import Limits, completion_budget, resolve_context


def test_context_defaults_to_the_model_limit():
    assert resolve_context(ServeConfig(), 8192, None, None).context == 8192


def test_context_from_request_profile_or_default_profile():
    cfg = ServeConfig(context_profiles={"qa": 4096, "default": 2048})
    assert resolve_context(cfg, 8192, 1000, None).context == 1000
    assert resolve_context(cfg, 8192, None, "qa").context == 4096
    assert resolve_context(cfg, 8192, None, None).context == 2048


@pytest.mark.parametrize("length,profile,field", [(9000, None, "context_length"), (None, "legal", "context_profile"),
                                                   (100, "qa", "context_profile")])
def test_bad_context_requests_name_the_field(length, profile, field):
    cfg = ServeConfig(context_profiles={"qa": 4096})
    with pytest.raises(InvalidRequestError) as e:
        resolve_context(cfg, 8192, length, profile)
    assert e.value.field == field


def test_completion_budget():
    """The default is cut to what the context leaves; the context rule itself is the engine's (test_engine_validate)."""
    limits = Limits(100, "context_length")
    assert completion_budget(10, None, limits, default=512) == 90
    assert completion_budget(10, 20, limits, default=512) == 20
    assert completion_budget(10, 91, limits, default=512) == 91  # refused by the engine's validate
    assert completion_budget(100, None, limits, default=512) == 1


def test_hooks_forms():
    assert HooksConfig(post_inference=["/bin/logger", "-t", "mlc"]).post_inference == [["/bin/logger", "-t", "mlc"]]
    assert HooksConfig(post_inference=[["/a"], ["/b", "x"]]).post_inference == [["/a"], ["/b", "x"]]
    # a string is a shell line, kept exactly as written (it runs through /bin/sh, like a cron line)
    assert HooksConfig(post_inference="/usr/bin/tee -a '/tmp/audit log'").post_inference == \
        ["/usr/bin/tee -a '/tmp/audit log'"]
    assert HooksConfig(post_inference=[["/a"], "echo $MLC_REQUEST_ID >> /tmp/x"]).post_inference == \
        [["/a"], "echo $MLC_REQUEST_ID >> /tmp/x"]
    assert HooksConfig().post_inference == []


@pytest.mark.parametrize("bad", ["echo 'unclosed >> /tmp/log", "  ", ["echo hi | tee x"], [["ok", "arg"], []],
                                 [1, 2]])
def test_broken_shell_lines_and_junk_are_refused(bad):
    with pytest.raises(ValueError):
        HooksConfig(post_inference=bad)


def test_load_hooks_reports_the_file(tmp_path):
    assert load_hooks(tmp_path / "absent.yaml").post_inference == []
    path = tmp_path / "config.yaml"
    path.write_text("hooks:\n  post_inference: \"echo 'done >> /tmp/log\"\n")
    with pytest.raises(ConfigError) as e:
        load_hooks(path)
    assert str(path) in e.value.message and "not a valid /bin/sh command line" in e.value.message


def test_config_errors_print_their_examples_verbatim(tmp_path, monkeypatch, capsys):
    """Rich markup used to eat `[cmd, arg]` out of the message."""
    from mlc.cli.main import main

    path = tmp_path / "config.yaml"
    path.write_text('hooks: "just a string"\n')
    monkeypatch.setenv("MLC_CONFIG", str(path))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "smollm2-135m-instruct"])
    assert e.value.code == 2
    assert "hooks: {post_inference: [cmd, arg]}" in capsys.readouterr().err


def test_authorization_header_checks():
    keys = ["k1", "k2"]
    assert check_authorization("Bearer k2", keys) is None
    assert check_authorization("bearer  k1 ", keys) is None
    assert "no Authorization" in check_authorization(None, keys)
    assert "not one of" in check_authorization("Bearer nope", keys)
    assert "Bearer <key>" in check_authorization("Basic k1", keys)


def test_keys_from_env_and_open_paths():
    assert keys_from_env(" a, b ,,c") == ["a", "b", "c"]
    assert keys_from_env("") == []
    assert is_open("/health") and is_open("/") and not is_open("/metrics") and not is_open("/v1/models")


def test_cli_context_profiles():
    from mlc.cli.serve import parse_profiles

    assert parse_profiles(["qa=4096", "legal=16384"]) == {"qa": 4096, "legal": 16384}
    with pytest.raises(ConfigError):
        parse_profiles(["qa:4096"])
