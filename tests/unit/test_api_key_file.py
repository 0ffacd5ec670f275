"""The API key file (--api-key-file): names and SHA-256 hashes with optional limits, errors that name the line and
the field, matching by hash beside plain --api-key keys, reload keeping the old keys on a bad file, `mlc-cli keys`."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from mlc.cli import keys as keys_cli
from mlc.errors import ConfigError
from mlc.server.keys import KeyRing, hash_key, load_key_file, parse_key_file

ALICE, BOB = "mlc-alice-secret", "mlc-bob-secret"
FILE = f"""\
keys:
  - name: alice
    key_sha256: {hash_key(ALICE)}
    requests_per_minute: 60
    tokens_per_minute: 20000
    max_concurrent: 4
  - name: bob
    key_sha256: {hash_key(BOB)}
"""


def test_yaml_and_json_files_parse_with_their_limits(tmp_path):
    entries = parse_key_file(FILE, "keys.yaml")
    assert [(e.name, e.requests_per_minute, e.tokens_per_minute, e.max_concurrent) for e in entries] == [
        ("alice", 60, 20000, 4), ("bob", None, None, None)]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "carol", "key_sha256": hash_key("c"), "max_concurrent": 2}]))
    assert [(e.name, e.max_concurrent) for e in load_key_file(path)] == [("carol", 2)]


@pytest.mark.parametrize("text,expected", [
    (FILE.replace("requests_per_minute: 60", "requests_per_minute: -1"), "keys.yaml:4: field 'requests_per_minute'"),
    (FILE.replace("    key_sha256: " + hash_key(BOB), "    key_sha256: abc"), "keys.yaml:8: field 'key_sha256'"),
    (FILE.replace("max_concurrent: 4", "max_concurent: 4"), "keys.yaml:6: field 'max_concurent'"),
    (FILE.replace("name: bob", "name: alice"), "keys.yaml:7: the name 'alice' is used twice"),
    (FILE.replace(hash_key(BOB), hash_key(ALICE)), "keys.yaml:8: key 'bob' has the same key_sha256"),
    ("- name: x\n  key: plain-secret\n", "keys.yaml:2: a plain 'key' is not stored"),
    ("keys: [a, b", "keys.yaml:1: not valid YAML or JSON"),
    ("name: x\n", "expected a list of keys"),
])
def test_a_bad_file_names_the_line_and_the_field(text, expected):
    with pytest.raises(ConfigError) as e:
        parse_key_file(text, "keys.yaml")
    assert expected in e.value.message, e.value.message


def test_keys_match_by_hash_beside_plain_keys(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    ring = KeyRing(["plain-key"], str(path))
    alice = ring.match(ALICE)
    assert alice is not None and alice.name == "alice" and alice.entry.max_concurrent == 4
    plain = ring.match("plain-key")
    assert plain is not None and plain.name is None  # a plain key: unnamed, unlimited
    assert ring.match(hash_key(ALICE)) is None  # the stored hash is not a key
    assert ring.match("nope") is None


def test_reload_takes_a_good_file_and_keeps_the_old_keys_on_a_bad_one(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    ring = KeyRing([], str(path))
    path.write_text(FILE.replace("name: bob", "name: robert"))
    assert ring.reload() and ring.match(BOB).name == "robert"
    path.write_text("keys:\n  - name: x\n    key_sha256: 12\n")
    assert not ring.reload()
    assert ring.match(BOB).name == "robert"
    assert "keeping the 2 key(s) in use" in caplog.text and "key_sha256" in caplog.text


def test_a_missing_file_fails_at_start(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        KeyRing([], str(tmp_path / "absent.yaml"))


@pytest.fixture
def app() -> typer.Typer:
    cli = typer.Typer()
    keys_cli.register(cli)
    return cli


def test_keys_add_prints_the_key_once_and_appends_its_hash(tmp_path, app):
    path = tmp_path / "keys.yaml"
    runner = CliRunner()
    for name in ("alice", "bob"):
        r = runner.invoke(app, ["keys", "add", name, "--file", str(path), "--rpm", "30", "--max-concurrent", "2"])
        assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[-1]
    assert key.startswith("mlc-") and key not in path.read_text()
    entries = load_key_file(path)
    assert [(e.name, e.requests_per_minute, e.max_concurrent) for e in entries] == [("alice", 30, 2), ("bob", 30, 2)]
    assert KeyRing([], str(path)).match(key).name == "bob"
    r = runner.invoke(app, ["keys", "add", "alice", "--file", str(path)])
    assert r.exit_code != 0 and len(load_key_file(path)) == 2  # a duplicate name leaves the file as it was


def test_keys_hash_prints_the_entry_for_an_existing_key(app):
    r = CliRunner().invoke(app, ["keys", "hash", "team-a", "--tpm", "5000"], input="my-old-key\n")
    assert r.exit_code == 0, r.output
    assert parse_key_file(r.stdout, "stdout")[0].model_dump(exclude_none=True) == {
        "name": "team-a", "key_sha256": hash_key("my-old-key"), "tokens_per_minute": 5000}
