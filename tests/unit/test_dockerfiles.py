"""The container images in docker/ (no Docker needed): every base image pinned by a versioned tag and a digest
(or openly marked DIGEST-UNVERIFIED), the torch pin equal to the Makefile's, every COPY source present in the build
context, the serve entrypoint; and the cluster file's `image` turned into each node's `docker run` line."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from mlc.cluster.container import docker_run, store_note, volumes
from mlc.cluster.resources import raylets
from mlc.config.cluster_config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
MARKER = "DIGEST-UNVERIFIED"
# Base images pinned by tag only because no digest could be found or checked (see the note above their FROM).
# Pinning one means adding its digest, deleting the marker, and removing it from this set.
UNVERIFIED = {"Dockerfile.ascend"}
FROM_RE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._/-]*)(?::(?P<tag>\w[\w.-]*))?"
                     r"(?:@sha256:(?P<digest>[0-9a-f]{64}))?$")


def instructions(path: Path) -> list[tuple[str, str, list[str]]]:
    """(INSTRUCTION, arguments, the comment lines right above it) with continuation lines joined."""
    out, comments, pending = [], [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            comments = comments + [line] if line.startswith("#") else []
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip(), comments))
            comments, pending = [], ""
    return out


def base_images(path: Path) -> list[tuple[str, list[str]]]:
    """Each FROM's image (global ARG defaults substituted, stage names and flags dropped) and its comment lines."""
    args, stages, images = {}, set(), []
    for word, rest, comments in instructions(path):
        if word == "ARG" and not images:
            name, _, default = rest.partition("=")
            args[name] = default
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            if len(parts) == 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
            if image not in stages:
                images.append((image, comments))
    return images


def arg_default(path: Path, name: str) -> str:
    return next(rest.partition("=")[2] for word, rest, _ in instructions(path)
                if word == "ARG" and rest.partition("=")[0] == name)


def test_the_three_images_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.ascend", "Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_pinned_by_version_and_digest(path):
    images = base_images(path)
    assert images, f"{path.name} has no FROM"
    for image, comments in images:
        match = FROM_RE.match(image)
        assert match, f"{path.name}: unparsable FROM {image!r}"
        tag, digest = match["tag"], match["digest"]
        assert tag and tag != "latest", f"{path.name}: {image} must name a tag, never latest"
        assert re.search(r"\d+\.\d+", tag), f"{path.name}: tag {tag!r} is not a versioned/dated tag"
        note = "\n".join(comments)
        assert "docker buildx imagetools inspect " + image.split("@")[0] in note, \
            f"{path.name}: the comment above FROM must give the command that re-verifies {image}"
        if digest:
            assert MARKER not in note, f"{path.name}: stale {MARKER} marker above a FROM that has a digest"
        else:
            assert MARKER in note, f"{path.name}: {image} has no @sha256 digest and no {MARKER} marker"
    unverified = {path.name for _, c in images if MARKER in "\n".join(c)}
    assert unverified == ({path.name} & UNVERIFIED)


def test_torch_pin_matches_the_makefile():
    spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert spec, "the Makefile's TORCH_SPEC pin moved; update this test"
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        assert arg_default(DOCKER / name, "TORCH_VERSION") == spec.group(1), name
    assert arg_default(DOCKER / "Dockerfile.cpu", "TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    ascend = DOCKER / "Dockerfile.ascend"  # torch_npu pins torch to its own version
    assert arg_default(ascend, "TORCH_NPU_VERSION").startswith(arg_default(ascend, "TORCH_VERSION"))


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `rel` out of the build context (the pattern forms the file uses)."""
    parts = rel.split("/")
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(Path(p).match(pattern[3:]) for p in parts):
                return True
        elif parts[0] == pattern or Path(parts[0]).match(pattern):
            return True
    return False


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_files_exist_and_reach_the_build_context(path):
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copies = [rest for word, rest, _ in instructions(path) if word in ("COPY", "ADD")]
    assert copies
    for rest in copies:
        sources = [p for p in shlex.split(rest) if not p.startswith("--")][:-1]
        assert "--from" not in rest and sources
        for src in sources:
            assert (ROOT / src).exists(), f"{path.name}: COPY {src} is not in the repository"
            assert not ignored(src, patterns), f"{path.name}: .dockerignore keeps {src} out of the build context"
    for needed in (".venv", "tests", "models", "**/__pycache__"):  # what must stay out of the context
        assert needed in patterns


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_serves_on_port_8000_with_extras_that_exist(path):
    found = {word: rest for word, rest, _ in instructions(path)}
    entry = json.loads(found["ENTRYPOINT"])  # exec form
    assert entry[:6] == ["mlc-env", "mlc-cli", "serve", "--host", "0.0.0.0", "--port"] and entry[6] == "8000"
    assert found["EXPOSE"] == "8000" and "/mlc/models" in found["VOLUME"] and "MLC_HOME=/mlc" in found["ENV"]
    device = {"Dockerfile.cpu": [], "Dockerfile.cuda": ["--device", "cuda"], "Dockerfile.ascend": ["--device", "npu"]}
    assert entry[7:] == device[path.name]
    extras = re.search(r"\[project\.optional-dependencies\](.*?)\n\[", (ROOT / "pyproject.toml").read_text(), re.S)
    defined = set(re.findall(r"^(\w+) = ", extras.group(1), re.M))
    assert set(arg_default(path, "MLC_EXTRAS").split(",")) <= defined
    assert "COPY --chmod=0755 docker/mlc-env.sh /usr/local/bin/mlc-env" in path.read_text()


# the cluster file's image
DIGEST = "ab" * 32
SPLIT = {"model": "glm-4-9b", "hardware": "nvidia-h200", "nodes": ["a", "b"], "devices_per_node": 8,
         "tensor_parallel_size": 4, "pools": {"inference": ["a", {"host": "b", "devices": [0, 1, 2, 3]}],
                                             "training": [{"host": "b", "devices": [4, 5, 6, 7]}]},
         "image": "registry.example.com/mlc:20260920-cuda", "image_sha256": DIGEST,
         "mounts": {"models": "/mlc/models:ro"}, "env": {"NCCL_DEBUG": "WARN"}}


def test_each_raylet_runs_in_the_pinned_image_with_its_own_devices(tmp_path):
    cfg = ClusterConfig(**SPLIT)
    assert cfg.image_ref == f"registry.example.com/mlc:20260920-cuda@sha256:{DIGEST}"
    head, b_inf, b_train = (shlex.split(docker_run(r, cfg, "cuda", "a:6379", 6379, tmp_path))
                            for r in raylets(cfg, "cuda"))
    assert head[:3] == ["docker", "run", "-d"] and "--network=host" in head
    assert head[head.index("--gpus") + 1] == '"device=0,1,2,3,4,5,6,7"'
    assert "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=mlc.cluster.proxy_headers:middlewares" in head
    assert head[head.index("--entrypoint") + 1:head.index("--entrypoint") + 4] == ["mlc-env", cfg.image_ref, "ray"]
    assert head[-1] == "--block" and "--head" in head
    assert b_inf[b_inf.index("--gpus") + 1] == '"device=0,1,2,3"'
    assert b_inf[b_inf.index("--name") + 1] == "mlc-ray-inference"
    assert b_train[b_train.index("--gpus") + 1] == '"device=4,5,6,7"'
    assert b_train[b_train.index("--name") + 1] == "mlc-ray-training"
    assert '--resources={"mlc_training": 4}' in b_train and "--address=a:6379" in b_train
    for line in (head, b_inf, b_train):
        assert not any(a.startswith("CUDA_VISIBLE_DEVICES") for a in line)  # the container shows only its GPUs
        assert f"{tmp_path / 'models'}:/mlc/models:ro" in line and "NCCL_DEBUG=WARN" in line
        assert not any("mlc-runs" in a for a in line)  # the default storage ~/mlc-runs is no shared absolute path
    assert store_note(cfg) is None


def test_npu_nodes_get_their_davinci_devices_and_the_host_driver():
    cfg = ClusterConfig(**{**SPLIT, "hardware": "ascend-910b", "image_sha256": None, "mounts": {},
                           "image": "registry.example.com/mlc:20260920-ascend",
                           "training": {"storage": "/mnt/shared/mlc-runs"}})
    line = docker_run(raylets(cfg, "npu")[2], cfg, "npu", "a:6379")
    assert "--device /dev/davinci4 --device /dev/davinci5 --device /dev/davinci6 --device /dev/davinci7 " in line
    assert "/dev/davinci0 " not in line and "--device /dev/davinci_manager" in line
    assert "-v /usr/local/Ascend/driver/lib64/:/usr/local/Ascend/driver/lib64/:ro" in line
    assert "-v /mnt/shared/mlc-runs:/mnt/shared/mlc-runs" in line
    assert "\"NPU\": 4" in line and "registry.example.com/mlc:20260920-ascend ray start" in line
    assert "/mlc/models" in store_note(cfg)
    assert volumes(cfg.model_copy(update={"mounts": {"/runs": "/mnt/shared"}}), Path("/")) == {"/runs": "/mnt/shared"}


@pytest.mark.parametrize("change, message", [
    ({"image_sha256": DIGEST, "image": None}, "image_sha256 pins `image`"),
    ({"image": "mlc@sha256:" + "cd" * 32, "image_sha256": DIGEST}, "keep one of them"),
    ({"mounts": {"/data": "relative/path"}}, "must be absolute"),
    ({"image": "mlc:latest"}, "latest"),
])
def test_bad_image_settings_are_refused_with_what_to_do(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ClusterConfig(**{**SPLIT, **change})
