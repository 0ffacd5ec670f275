"""Around a hub pull: which files a repo's listing gives (llama.cpp's quant match, pickles, `--include`), ModelScope
through its SDK (missing, and a stand-in for its two calls), and the commands: `models pull`'s lines and exit codes,
`plan --pull`, and `--pull` on the engine commands, train and plan."""

from __future__ import annotations

import hashlib
import sys
import types

import pytest
from typer.testing import CliRunner

from mlc.errors import ConfigError, IntegrityError, ModelFormatError, ModelNotFoundError
from mlc.models import store
from mlc.models.store.hub_files import RemoteFile, select_files
from tests.support.hub_server import C2, CUT, REPO, serve_tiny_repo, tiny_repo_files


def listing(*names: str) -> list[RemoteFile]:
    return [RemoteFile(n, 10 + i) for i, n in enumerate(names)]


def picked(files: list[RemoteFile], include: tuple[str, ...] = (), quant: str | None = None) -> list[str]:
    return [f.name for f in select_files("org/repo", files, include, quant).files]


def test_the_serving_files_config_first_and_include_adds_more():
    files = listing("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors",
                    "model.safetensors.index.json", "tokenizer.json", "README.md", "config.json", "original/x.pth")
    assert picked(files)[0] == "config.json"
    assert sorted(picked(files)) == ["config.json", "model-00001-of-00002.safetensors",
                                     "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                     "tokenizer.json"]
    assert {"README.md", "original/x.pth"} <= set(picked(files, ("README.md", "original/*")))
    with pytest.raises(ModelFormatError, match="no config.json at its top level"):
        picked(listing("model.safetensors", "tokenizer.json"))
    with pytest.raises(ModelFormatError, match="no weights mlc reads"):
        picked(listing("config.json", "README.md"))


def test_gguf_quants_match_as_llama_cpp_matches_them():
    files = listing("m-Q4_K.gguf", "m-Q4_K_M.gguf", "sub/m-Q8_0.gguf", "mmproj-m-Q8_0.gguf", "m-IQ4_XS-imatrix.gguf")
    assert picked(files, quant="q4_k_m") == ["m-Q4_K_M.gguf"]
    assert picked(files, quant="Q4_K") == ["m-Q4_K.gguf"]  # Q4_K is not a prefix match of Q4_K_M
    assert picked(files, quant="Q8_0") == ["sub/m-Q8_0.gguf"]  # never the vision projector
    assert picked(files) == ["m-Q4_K_M.gguf"]  # no safetensors and no quant: llama.cpp's default, Q4_K_M
    assert picked(listing("m-F16.gguf", "m-BF16.gguf")) == ["m-F16.gguf"]  # else the first
    assert picked(listing("m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf", "m-BF16.gguf"),
                  quant="BF16") == ["m-BF16.gguf"]
    assert picked(listing("m-Q8_0.gguf", "m-Q4_K_M.gguf", "README.md"), ("README.md",), "Q8_0") == [
        "m-Q8_0.gguf", "README.md"]


@pytest.fixture
def fake_modelscope(monkeypatch, tmp_path):
    """A stand-in for the two calls of ModelScope's SDK (`modelscope_hub`) a pull makes, for machines without the
    SDK: the file list with sizes and sha256, and one file into a local dir (the SDK would check the sha256 itself;
    this one does not, so mlc's own check is what a bad byte meets)."""
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    repo = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights" * 100, "README.md": b"#"}
    served = dict(repo)

    class NotExistError(Exception):
        pass

    class Downloader:
        def download_file(self, repo_id, repo_type, file_path, revision=None, local_dir=None, expected_sha256=None,
                          file_size=None, progress_callbacks=()):
            path = local_dir / file_path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(served[file_path])
            for callback in progress_callbacks:
                callback(file_path, file_size).update(len(served[file_path]))
            return path

    class HubApi:
        downloader = Downloader()

        def list_repo_files(self, repo_id, repo_type, revision=None, recursive=True):
            if repo_id != "ZhipuAI/glm-4-9b-chat-hf" or revision != "master":
                raise NotExistError(repo_id)
            return [types.SimpleNamespace(path=n, size=len(d), sha256=hashlib.sha256(d).hexdigest(), is_dir=False)
                    for n, d in repo.items()]

    class ProgressCallback:
        def __init__(self, filename, file_size):
            self.filename, self.file_size = filename, file_size

    sdk, api = types.ModuleType("modelscope_hub"), types.ModuleType("modelscope_hub.api")
    sdk.ProgressCallback, api.HubApi = ProgressCallback, HubApi  # type: ignore[attr-defined]
    sdk._download = types.ModuleType("modelscope_hub._download")  # type: ignore[attr-defined]
    for name, module in (("modelscope_hub", sdk), ("modelscope_hub.api", api),
                         ("modelscope_hub._download", sdk._download)):  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, module)
    return served


def test_modelscope_without_its_sdk_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(sys.modules, "modelscope_hub", None)
    for name in ("modelscope:ZhipuAI/GLM-4.5", "glm-4.5"):
        with pytest.raises(ConfigError, match=r"needs ModelScope's SDK, which is not installed .*pip install "
                                              r"'mlc\[modelscope\]'"):
            store.pull(name, source="modelscope")
    with pytest.raises(ConfigError, match="names modelscope but --source says hf"):
        store.pull("modelscope:ZhipuAI/GLM-4.5", source="hf")


def test_modelscope_pulls_through_its_sdk_and_checks_the_published_sha256(fake_modelscope):
    result = store.pull("modelscope:glm-4-9b")
    assert result.name == "glm-4-9b" and sorted(store.read_manifest("glm-4-9b")["files"]) == [
        "config.json", "model.safetensors"]
    source = store.read_manifest("glm-4-9b")["source"]
    assert (source["kind"], source["repo"], source["commit"]) == ("modelscope", "ZhipuAI/glm-4-9b-chat-hf", "master")
    assert not store.pull("modelscope:glm-4-9b").converted
    fake_modelscope["model.safetensors"] = b"Weights" + b"weights" * 99
    with pytest.raises(IntegrityError, match="model.safetensors does not match the hash the hub publishes"):
        store.pull("modelscope:glm-4-9b", force=True)
    with pytest.raises(ModelNotFoundError, match=r"ZhipuAI/GLM-5 \(revision master\) was not found"):
        store.pull("modelscope:glm-5")


def test_modelscope_sdk_itself_against_a_served_modelscope(monkeypatch, tmp_path, capfd):
    """ModelScope's own SDK end to end, where it is installed (`mlc[modelscope]`); skipped elsewhere."""
    pytest.importorskip("modelscope_hub")
    import modelscope_hub.config

    from tests.support.modelscope_server import FakeModelScope

    weights = bytes(range(256)) * 40
    server = FakeModelScope({"ZhipuAI/tiny": {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights,
                                              "pytorch_model.bin": b"pickle"}}).start()
    for name, value in (("MLC_HOME", tmp_path / "home"), ("MODELSCOPE_ENDPOINT", server.url),
                        ("MODELSCOPE_CACHE", tmp_path / "ms-cache"), ("MODELSCOPE_HOME", tmp_path / "ms-home")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    monkeypatch.setattr(modelscope_hub.config, "_default_config", None)
    try:
        result = store.pull("modelscope:ZhipuAI/tiny")
        assert (result.path / "model.safetensors").read_bytes() == weights
        assert sorted(store.read_manifest(result.name)["files"]) == ["config.json", "model.safetensors"]
        assert any("/repo/files?" in p for p in server.log) and any("FilePath=model.safetensors" in p
                                                                     for p in server.log)
        assert "%|" not in capfd.readouterr().err  # the SDK's own bar stays off: the bytes come to ours
        server.corrupt.add("model.safetensors")
        with pytest.raises(IntegrityError, match="does not match the size or sha256 ModelScope publishes"):
            store.pull("modelscope:ZhipuAI/tiny", force=True)
        with pytest.raises(ModelNotFoundError, match=r"ZhipuAI/absent \(revision master\) was not found on "):
            store.pull("modelscope:ZhipuAI/absent")
    finally:
        server.stop()


@pytest.fixture
def fake_hub(tmp_path_factory, tmp_path, monkeypatch):
    server = serve_tiny_repo(tiny_repo_files(tmp_path_factory.mktemp("tiny")), tmp_path, monkeypatch)
    yield server
    server.stop()


def run(argv: list[str]) -> int:
    """`mlc-cli ARGV` in this process; its exit code."""
    from mlc.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return int(exit_.value.code or 0)


def test_models_pull_prints_a_plan_line_then_one_result_line(fake_hub, capsys):
    fake_hub.cut_after["model.safetensors"] = CUT
    assert run(["models", "pull", REPO]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [out.strip()] and out.startswith(f"tiny-org--tiny-llama: pulled commit {C2}, 6 files")
    assert f"plan: {REPO} (llama, 0.00B parameters, 0.00 GiB to pull) fits " in err
    resumed = [line for line in err.splitlines() if line.startswith("note: Error while downloading")]
    assert len(resumed) == 1 and resumed[0].endswith("Trying to resume download...")  # one line, above the bar
    assert run(["models", "pull", REPO, "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("tiny-org--tiny-llama: already in the store")


@pytest.mark.parametrize("argv,code,line", [
    (["models", "pull", "nobody/absent"], 3, "nobody/absent was not found on http://127.0.0.1:"),
    (["models", "pull", f"{REPO}:Q4_K_M"], 3, f"{REPO} has no GGUF with quant 'Q4_K_M' (it has no GGUF files)"),
    (["plan", "-m", REPO], 3, f"for a hub id, `mlc-cli plan -m {REPO} --pull` reads its config.json from the hub"),
])
def test_a_bad_pull_is_one_line_and_its_exit_code(fake_hub, capsys, argv, code, line):
    assert run(argv) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and line in err, err


def test_plan_pull_reads_only_the_config(fake_hub, capsys):
    assert run(["plan", "-m", REPO, "--pull", "--json"]) == 0
    out, err = capsys.readouterr()
    assert '"model_type": "llama"' in out and "config.json from the hub" in err
    assert [r.path.rsplit("/", 1)[-1] for r in fake_hub.requests("hub") if "/resolve/" in r.path] == ["config.json"]
    assert not any(e.pulled for e in store.list_models())  # nothing entered the store


def test_pull_asked_pulls_what_is_not_here_and_nothing_else(fake_hub, capsys):
    from mlc.cli.pulling import pull_if_asked

    pull_if_asked(REPO, pull=False)
    assert fake_hub.log == []
    pull_if_asked(REPO, pull=True)
    assert "not on this machine: pulling it first (--pull)" in capsys.readouterr().err
    assert store.resolve_model_dir(REPO).name == "tiny-org--tiny-llama"
    calls = len(fake_hub.log)
    pull_if_asked(REPO, pull=True)  # there now: nothing is asked of the hub
    assert len(fake_hub.log) == calls


def test_every_command_that_resolves_a_model_takes_pull(fake_hub):
    from mlc.cli.engine_options import EngineArgs
    from mlc.cli.main import _register_all, app

    _register_all()
    for path in (["serve"], ["generate"], ["chat"], ["train"], ["plan"], ["bench", "offline"]):
        text = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"}).output
        assert "--pull" in text, path
    EngineArgs(flags={"model": REPO}, pull=False).load()
    assert fake_hub.log == []
    assert EngineArgs(flags={"model": REPO}, pull=True).load().model == REPO
    assert store.is_pulled("tiny-org--tiny-llama")
