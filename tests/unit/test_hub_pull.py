"""`models pull` from a hub, against a Hugging Face Hub served in this process (tests/support/hub_server.py) so that
huggingface_hub's own client code runs end to end: a pull and its manifest, a no-op second pull, a pinned revision,
a resume after a cut connection, a corrupted byte, 401/403/404, a full disk, pickles refused, a GGUF by quant, the
offline line, and what `--pull` changes for the commands that resolve a model."""

from __future__ import annotations

import hashlib
import json
import resource
import signal
from pathlib import Path

import pytest

from mlc.config.paths import mlc_home
from mlc.errors import AuthError, DiskSpaceError, IntegrityError, ModelFormatError, ModelNotFoundError, NetworkError
from mlc.models import store
from mlc.models.store import hub_pull
from tests.support.hub_server import C1, C2, C3, CUT, REPO, Repo, serve_tiny_repo, tiny_repo_files
from tests.support.store_fakes import flip_byte


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, bytes]:
    return tiny_repo_files(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fake_hub(tiny, tmp_path, monkeypatch):
    server = serve_tiny_repo(tiny, tmp_path, monkeypatch)
    yield server
    server.stop()


def models(home: Path) -> list[str]:
    """What the store dir holds, but its lock files."""
    root = home / "models"
    return sorted(p.name for p in root.iterdir() if p.name != hub_pull.LOCKS) if root.is_dir() else []


def home() -> Path:
    return mlc_home()


def test_pull_records_the_commit_serves_and_a_second_pull_is_a_no_op(fake_hub, tiny, monkeypatch):
    from mlc.engine.llm import LLM
    from mlc.engine.sampling_params import SamplingParams

    monkeypatch.setenv("HF_TOKEN", "good-token")
    result = store.pull(REPO)
    assert result.converted and result.name == "tiny-org--tiny-llama" and f"commit {C2}" in result.detail
    manifest = store.read_manifest(result.name)
    assert manifest["revision"] == C2
    assert manifest["source"] | {"endpoint": None} == {
        "kind": "hf-hub", "repo": REPO, "spec": REPO, "revision": None, "commit": C2, "endpoint": None,
        "quant": None, "include": []}
    pulled = sorted(manifest["files"])
    assert pulled == sorted(n for n in tiny if n not in ("README.md", "original/consolidated.pth"))
    assert manifest["files"]["model.safetensors"]["sha256"] == hashlib.sha256(tiny["model.safetensors"]).hexdigest()
    assert store.verify(result.name) and models(home()) == [result.name]  # no partial dir left behind
    hub_gets = [r for r in fake_hub.log if r.server == "hub"]
    assert all(r.headers.get("authorization") == "Bearer good-token" for r in hub_gets)
    assert fake_hub.requests("cdn") and not any("authorization" in r.headers for r in fake_hub.log
                                                if r.server == "cdn")  # the token never leaves the hub
    assert all(C2 in r.path for r in hub_gets if "/resolve/" in r.path)

    text = LLM(model=REPO, kv_cache_memory="8MiB", max_seq_len=64).generate(
        ["Hello"], SamplingParams(max_new_tokens=4, temperature=0))[0].outputs[0]
    assert len(text.token_ids) == 4

    before = len(fake_hub.log)
    again = store.pull(REPO)
    assert not again.converted and again.path == result.path
    assert [r.path.split("?")[0] for r in fake_hub.log[before:]] == [f"/api/models/{REPO}/revision/main"]


def test_a_pinned_revision_never_moves(fake_hub, tiny):
    pinned = store.pull(f"{REPO}@v1")
    assert store.read_manifest(pinned.name)["source"]["commit"] == C1
    assert json.loads((pinned.path / "config.json").read_text())["revision_note"] == "v1"
    assert all(C1 in r.path for r in fake_hub.log if "/resolve/" in r.path)
    assert store.resolve_model_dir(f"{REPO}@v1") == pinned.path == store.resolve_model_dir(f"{REPO}@{C1[:8]}")
    with pytest.raises(ModelNotFoundError, match=rf"models pull {REPO}@v2"):
        store.resolve_model_dir(f"{REPO}@v2")
    flip_byte(pinned.path / "model.safetensors", 100)
    with pytest.raises(IntegrityError, match=rf"run `mlc-cli models pull {REPO}@v1 --force` to download it again"):
        store.verify(pinned.name)

    def branch_moves(pending):  # main moves on once the pull has resolved it
        fake_hub.repos[REPO].refs["main"] = C3

    main = store.pull(f"{REPO}", include=("README.md",), before_download=branch_moves)
    assert store.read_manifest(main.name)["source"]["commit"] == C2
    assert (main.path / "README.md").read_bytes() == tiny["README.md"]  # C2's, not the moved branch's


def test_a_cut_connection_resumes_with_a_range_request(fake_hub, tiny):
    fake_hub.cut_after["model.safetensors"] = CUT
    result = store.pull(REPO)
    gets = [r for r in fake_hub.requests("cdn") if r.path.startswith("/blobs/")]
    assert [r.headers.get("range") for r in gets] == [None, f"bytes={CUT}-"]
    assert (result.path / "model.safetensors").read_bytes() == tiny["model.safetensors"]
    store.verify(result.name)


def test_a_network_that_stays_down_keeps_the_partial_and_the_next_pull_resumes(fake_hub, tiny):
    fake_hub.cut_after["model.safetensors"] = CUT
    fake_hub.down_after_cut = True
    with pytest.raises(NetworkError, match=r"3 tries\); the 32,768 bytes of model.safetensors downloaded so far are "
                                           r"kept in .*: run the same command again to resume"):
        store.pull(REPO)
    assert not store.is_pulled("tiny-org--tiny-llama")
    [partial] = [home() / "models" / name for name in models(home())]
    assert partial.name == f".partial-tiny-org--tiny-llama-{C2}"
    assert (partial / hub_pull.INCOMPLETE / "model.safetensors").stat().st_size == CUT
    assert "tiny-org--tiny-llama" not in [e.name for e in store.list_models()]
    fake_hub.cdn_down = fake_hub.down_after_cut = False
    start = len(fake_hub.log)
    result = store.pull(REPO)
    gets = [r for r in fake_hub.log[start:] if r.server == "cdn" and r.path.startswith("/blobs/")]
    assert [r.headers.get("range") for r in gets] == [f"bytes={CUT}-"]
    assert (result.path / "model.safetensors").read_bytes() == tiny["model.safetensors"]


@pytest.mark.parametrize("name,published", [("model.safetensors", "sha256"), ("tokenizer.json", "git blob sha1")])
def test_a_corrupted_byte_is_refused_and_nothing_enters_the_store(fake_hub, name, published):
    fake_hub.corrupt.add(name)
    with pytest.raises(IntegrityError, match=rf"{name} does not match the hash the hub publishes \({published} .*its "
                                             "bytes were deleted and nothing entered the store"):
        store.pull(REPO)
    assert models(home()) == [f".partial-tiny-org--tiny-llama-{C2}"]
    assert not (home() / "models" / f".partial-tiny-org--tiny-llama-{C2}" / hub_pull.INCOMPLETE / name).exists()
    fake_hub.corrupt.clear()
    store.verify(store.pull(REPO).name)


def test_gated_and_private_repos_say_which_and_what_to_do(fake_hub, tiny, monkeypatch):
    fake_hub.repos["tiny-org/gated"] = Repo({C2: tiny}, {"main": C2}, gated=True)
    page = f"{fake_hub.url}/tiny-org/gated"
    with pytest.raises(AuthError, match=rf"gated \(HTTP 401, no token sent\): accept the licence at {page} and set "
                                        r"HF_TOKEN"):
        store.pull("tiny-org/gated")
    monkeypatch.setenv("HF_TOKEN", "other-token")
    with pytest.raises(AuthError, match=rf"no access yet \(HTTP 403\): accept the licence at {page} with that acc"):
        store.pull("tiny-org/gated")
    monkeypatch.setenv("HF_TOKEN", "expired-token")
    with pytest.raises(AuthError, match="refused the token .* invalid or expired"):
        store.pull(REPO)
    assert not fake_hub.requests("cdn") and models(home()) == [f".partial-tiny-org--gated-{C2}"]


def test_unknown_repo_and_unknown_revision(fake_hub, monkeypatch):
    with pytest.raises(ModelNotFoundError, match=r"nobody/absent was not found on .*if it is private, set HF_TOKEN"):
        store.pull("nobody/absent")
    with pytest.raises(ModelNotFoundError, match=rf"{REPO} has no revision 'nope' on "):
        store.pull(f"{REPO}@nope")
    monkeypatch.setenv("HF_TOKEN", "good-token")
    with pytest.raises(ModelNotFoundError, match=r"nobody/absent was not found .*may be private and not shared"):
        store.pull("nobody/absent")
    assert fake_hub.requests("hub")[-1].path.startswith("/api/models/nobody/absent/revision/main")
    assert models(home()) == []


def test_too_little_disk_is_refused_before_the_first_byte(fake_hub, tiny, monkeypatch):
    monkeypatch.setattr(hub_pull, "disk_free", lambda path: 1000)
    total = sum(len(v) for k, v in tiny.items() if k not in ("README.md", "original/consolidated.pth"))
    with pytest.raises(DiskSpaceError, match=rf"needs {total / 2**30:.2f} GiB more .* but 0.00 GiB is free .* pass "
                                             "--force"):
        store.pull(REPO)
    assert not [r for r in fake_hub.log if "/resolve/" in r.path or r.server == "cdn"]
    assert store.pull(REPO, force=True).converted


def test_a_disk_that_fills_up_mid_download_keeps_what_arrived(fake_hub):
    """A file-size limit (RLIMIT_FSIZE) stands in for a full disk: the write fails as it would on one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * CUT, hard))  # well above what pytest writes meanwhile
    try:
        with pytest.raises(DiskSpaceError, match=r"disk filled up while downloading model.safetensors .* the 65,536 "
                                                 r"bytes downloaded are kept .* run the same command again to resume"):
            store.pull(REPO)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert not store.is_pulled("tiny-org--tiny-llama")
    assert store.pull(REPO).converted


def test_a_repo_of_pickles_is_refused_with_the_reason(fake_hub, tiny):
    fake_hub.repos["tiny-org/pickled"] = Repo(
        {C2: {"config.json": tiny["config.json"], "pytorch_model.bin": b"\x80\x02pickle"}}, {"main": C2})
    with pytest.raises(ModelFormatError, match=r"only pickled PyTorch weights \(pytorch_model.bin\) .* loading a "
                                               "pickle runs code from the file"):
        store.pull("tiny-org/pickled")
    assert not [r for r in fake_hub.log if "/resolve/" in r.path] and models(home()) == []


def test_a_gguf_is_picked_by_its_quant_and_a_missing_one_lists_the_rest(fake_hub, tmp_path):
    from tests.support.gguf_files import write_tiny_llama_gguf

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    gguf = (tmp_path / "tiny.gguf").read_bytes()
    files = {"tiny-Q8_0.gguf": gguf, "tiny-Q4_K_M-00001-of-00002.gguf": b"GGUF1", "README.md": b"#",
             "tiny-Q4_K_M-00002-of-00002.gguf": b"GGUF2", "mmproj-tiny-F16.gguf": b"GGUF3"}
    fake_hub.repos["tiny-org/tiny-GGUF"] = Repo({C2: files}, {"main": C2})
    result = store.pull("tiny-org/tiny-GGUF:q8_0")
    assert result.name == "tiny-org--tiny-GGUF--Q8_0"
    assert (result.path / "model.gguf").read_bytes() == gguf and (result.path / "config.json").is_file()
    source = store.read_manifest(result.name)["source"]
    assert (source["quant"], source["commit"]) == ("q8_0", C2)
    store.verify(result.name)
    assert store.resolve_model_dir("tiny-org/tiny-GGUF:q8_0") == result.path
    with pytest.raises(ModelNotFoundError, match=r"no GGUF with quant 'Q5_K_S' \(available: Q4_K_M \(split in 2\), "
                                                 r"Q8_0\); write tiny-org/tiny-GGUF:QUANT"):
        store.pull("tiny-org/tiny-GGUF:Q5_K_S")
    with pytest.raises(ModelFormatError, match=r"is split in 2 files .*llama-gguf-split --merge"):
        store.pull("tiny-org/tiny-GGUF:Q4_K_M")


def test_offline_mode_says_what_to_unset(fake_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(NetworkError, match=r"HF_HUB_OFFLINE .* is set, .* unset it"):
        store.pull(REPO)
    assert fake_hub.log == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    store.pull(f"{REPO}@v1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    held = store.pull(f"{REPO}@v1")  # in the store: nothing to download, said so
    assert not held.converted and held.detail == "offline: not checked against the hub"
    with pytest.raises(NetworkError, match="HF_HUB_OFFLINE"):
        store.pull(f"{REPO}@main")


def test_a_hub_id_resolves_only_from_this_machine_and_a_local_path_wins(fake_hub, tiny, tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match=rf"{REPO} is not on this machine: .* run `mlc-cli models pull "
                                                 rf"{REPO}` first, or pass --pull"):
        store.resolve_model_dir(REPO)
    assert fake_hub.log == []  # resolving never downloads
    store.pull(REPO)
    assert store.resolve_model_dir(REPO) == home() / "models" / "tiny-org--tiny-llama"
    local = tmp_path / "cwd" / REPO  # a local directory of the same spelling wins
    local.mkdir(parents=True)
    (local / "config.json").write_bytes(tiny["config.json"])
    monkeypatch.chdir(tmp_path / "cwd")
    assert store.resolve_model_dir(REPO) == Path(REPO)


def test_a_glm_short_name_pulls_into_the_store_name_the_presets_use(fake_hub, tiny):
    from mlc.cluster.presets import find_preset, weights_dir

    spec = store.parse_spec("glm-4-9b")
    assert (spec.repo, spec.revision, spec.store_name) == ("zai-org/glm-4-9b-chat-hf", None, "glm-4-9b")
    assert store.parse_spec("modelscope:glm-5").repo == "ZhipuAI/GLM-5"
    fake_hub.repos["zai-org/glm-4-9b-chat-hf"] = Repo({C2: tiny}, {"main": C2})
    result = store.pull("glm-4-9b")
    assert result.path == weights_dir(find_preset("glm4-9b")) == store.resolve_model_dir("glm-4-9b")
    assert store.read_manifest("glm-4-9b")["source"]["repo"] == "zai-org/glm-4-9b-chat-hf"
