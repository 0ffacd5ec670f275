"""The server's run-time LoRA routes (issue 31): vLLM's load/unload routes behind --enable-lora-loading, the
--lora-dir resolver, /v1/models with `parent`, the admin key, the path rules, and every bad input of the issue
answered with a 4xx that names the problem while the loaded adapters keep serving. In process (TestClient)."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from mlc.bench.lora_synth import write_random_adapter
from mlc.config.engine_config import EngineConfig
from mlc.config.serve_config import ServeConfig
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.server.app import create_app
from tests.support.tiny_llama import build_tiny_llama

PROMPT = [5, 9, 33, 70, 12, 8]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_srv")
    base = build_tiny_llama(root / "base")
    lora_dir = root / "adapters"
    write_random_adapter(lora_dir / "alpha", base, rank=8, seed=1, std=0.3)
    write_random_adapter(lora_dir / "beta", base, rank=4, seed=2, std=0.3, targets=("q_proj", "v_proj"))
    write_random_adapter(lora_dir / "big", base, rank=32, seed=3)
    write_random_adapter(root / "outside", base, rank=8, seed=4)
    (lora_dir / "escape").symlink_to(root / "outside")
    weird = write_random_adapter(lora_dir / "weird", base, seed=5, targets=("q_proj",))
    raw = (weird / "adapter_model.safetensors").read_bytes().replace(b"q_proj", b"x_proj")
    (weird / "adapter_model.safetensors").write_bytes(raw)
    other = root / "other_base"
    other.mkdir()
    cfg = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg | {"hidden_size": 48, "head_dim": 8}))
    write_random_adapter(lora_dir / "wrongbase", other, seed=6)
    (lora_dir / "binonly").mkdir()
    (lora_dir / "binonly" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (lora_dir / "binonly" / "adapter_model.bin").write_bytes(b"\0" * 64)
    (lora_dir / "badjson").mkdir()
    (lora_dir / "badjson" / "adapter_config.json").write_text("{not json")
    (lora_dir / "empty").mkdir()
    return base, lora_dir, root


def client(base, **cfg):
    config = ServeConfig(engine=EngineConfig(model=str(base), kv_cache_memory="8MiB", max_lora_rank=16),
                         served_model_name="tiny", **cfg)
    return TestClient(create_app(config, engine_factory=lambda c: LLMEngine(c.engine)))


def healthy(c):
    deadline = time.monotonic() + 60
    while c.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return c


def greedy(c, model, headers=None, max_tokens=8):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = c.post("/v1/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def engine_only(base, path):
    eng = LLMEngine(EngineConfig(model=str(base), kv_cache_memory="8MiB", lora_adapters={"x": str(path)}))
    eng.add_request("r", PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), adapter_id=1)
    while True:
        for out in eng.step():
            if out.finished:
                return out.outputs[0].text


def test_loading_is_off_unless_enabled(tree):
    base, lora_dir, _ = tree
    with client(base, lora_dirs=[str(lora_dir)]) as c:
        r = healthy(c).post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": "alpha"})
        assert r.status_code == 403 and "--enable-lora-loading" in r.json()["error"]["message"]


def test_load_list_serve_unload_and_resolve_on_first_use(tree):
    base, lora_dir, _ = tree
    with client(base, enable_lora_loading=True, lora_dirs=[str(lora_dir)]) as c:
        healthy(c)
        plain = greedy(c, "tiny")
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(lora_dir / "alpha")})
        assert r.status_code == 200 and r.json()["parent"] == "tiny" and r.json()["rank"] == 8
        models = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("a", "tiny")]
        tuned = greedy(c, "a")
        assert tuned != plain and tuned == engine_only(base, lora_dir / "alpha")
        assert greedy(c, "beta") == engine_only(base, lora_dir / "beta")  # --lora-dir/beta, loaded on first use
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {"tiny", "a", "beta"}
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200
        r = c.post("/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404
        assert greedy(c, "tiny") == plain


BAD = [  # (body, status, words in the message)
    ({"lora_name": "x", "lora_path": "nope"}, 400, "not a directory"),
    ({"lora_name": "x", "lora_path": "empty"}, 400, "adapter_config.json"),
    ({"lora_name": "x", "lora_path": "badjson"}, 400, "not valid JSON"),
    ({"lora_name": "x", "lora_path": "binonly"}, 400, "safetensors"),
    ({"lora_name": "x", "lora_path": "big"}, 400, "--max-lora-rank 16"),
    ({"lora_name": "x", "lora_path": "weird"}, 400, "x_proj"),
    ({"lora_name": "x", "lora_path": "wrongbase"}, 400, "another base"),
    ({"lora_name": "keep", "lora_path": "beta"}, 409, "already loaded"),
    ({"lora_name": "tiny", "lora_path": "beta"}, 400, "base model"),
    ({"lora_name": "../x", "lora_path": "beta"}, 400, "lora_name"),
    ({"lora_name": "x", "lora_path": "../outside"}, 403, "'..'"),
    ({"lora_name": "x", "lora_path": "escape"}, 403, "outside the allowed"),
    ({"lora_name": "x", "lora_path": "/tmp"}, 403, "outside the allowed"),
    ({"lora_name": "x"}, 400, "lora_path"),
]


def test_every_bad_load_is_a_4xx_naming_it_and_the_loaded_adapter_keeps_serving(tree):
    base, lora_dir, _ = tree
    with client(base, enable_lora_loading=True, lora_dirs=[str(lora_dir)]) as c:
        healthy(c)
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "keep", "lora_path": "alpha"}).status_code == 200
        before = greedy(c, "keep")
        for body, status, words in BAD:
            r = c.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
            assert greedy(c, "keep") == before
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "keep"]
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
        assert r.status_code == 404 and "never" in r.json()["error"]["message"]
        assert greedy(c, "keep") == before


def test_unloading_an_adapter_in_use_is_a_409(tree):
    base, lora_dir, _ = tree
    with client(base, enable_lora_loading=True, lora_dirs=[str(lora_dir)]) as c:
        healthy(c)
        c.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": "alpha"})
        body = {"model": "busy", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # the request runs
            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
            assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
            assert sum(1 for _ in lines) > 10  # the stream went on to its end
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200


def test_adapter_routes_need_the_admin_key_when_keys_are_set(tree):
    base, lora_dir, _ = tree
    load = {"lora_name": "a", "lora_path": "alpha"}
    user, admin = {"Authorization": "Bearer u"}, {"Authorization": "Bearer adm"}
    with client(base, enable_lora_loading=True, lora_dirs=[str(lora_dir)], api_keys=["u"]) as c:
        r = healthy(c).post("/v1/load_lora_adapter", json=load, headers=user)
        assert r.status_code == 401 and "--admin-api-key" in r.json()["error"]["message"]
    with client(base, enable_lora_loading=True, lora_dirs=[str(lora_dir)], api_keys=["u"],
                admin_api_keys=["adm"]) as c:
        healthy(c)
        assert c.post("/v1/load_lora_adapter", json=load, headers=user).status_code == 401
        assert c.post("/v1/load_lora_adapter", json=load).status_code == 401
        assert c.post("/v1/load_lora_adapter", json=load, headers=admin).status_code == 200
        assert greedy(c, "a", headers=user)
        assert c.post("/v1/completions", json={"model": "a", "prompt": PROMPT}, headers=admin).status_code == 401


def test_no_allowed_directory_means_no_loading(tree):
    base, lora_dir, _ = tree
    with client(base, enable_lora_loading=True) as c:
        r = healthy(c).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(lora_dir / "alpha")})
        assert r.status_code == 403 and "--lora-dir" in r.json()["error"]["message"]


def test_cli_lists_loads_and_unloads_through_the_routes(tree, monkeypatch):
    import httpx
    from typer.testing import CliRunner

    from mlc.cli.lora import lora_app

    base, lora_dir, _ = tree
    with client(base, enable_lora_loading=True, lora_dirs=[str(lora_dir)]) as c:
        healthy(c)
        monkeypatch.setattr(httpx, "request", lambda method, url, timeout=None, **kw: c.request(method, url, **kw))
        runner = CliRunner()
        url = ["--url", "http://testserver"]
        loaded = runner.invoke(lora_app, ["load", "cli", "alpha", *url])
        assert loaded.exit_code == 0 and "loaded cli (rank 8, on tiny)" in loaded.output
        listed = runner.invoke(lora_app, ["list", *url], env={"COLUMNS": "200"})
        assert listed.exit_code == 0 and "cli" in listed.output and "tiny" in listed.output
        again = runner.invoke(lora_app, ["load", "cli", "alpha", *url])
        assert again.exit_code != 0 and "409" in str(again.exception) and "already loaded" in str(again.exception)
        bad = runner.invoke(lora_app, ["load", "cli", "big", "--replace", *url])  # rank 32 > 16: refused
        assert bad.exit_code != 0 and "--max-lora-rank" in str(bad.exception)
        assert "alpha" in runner.invoke(lora_app, ["list", *url], env={"COLUMNS": "200"}).output  # the old one stays
        assert runner.invoke(lora_app, ["load", "cli", "beta", "--replace", *url]).exit_code == 0
        assert "beta" in runner.invoke(lora_app, ["list", *url], env={"COLUMNS": "200"}).output
        assert runner.invoke(lora_app, ["unload", "cli", *url]).exit_code == 0
        assert "no LoRA adapters loaded" in runner.invoke(lora_app, ["list", *url]).output
