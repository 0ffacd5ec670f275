"""A model pulled from a hub (the Hugging Face Hub, a mirror at HF_ENDPOINT, or ModelScope) into the store.

The revision is resolved to a commit once and every file is fetched at that commit; free disk is checked against
the sizes the hub reports before the first byte; each file is downloaded into `$MLC_HOME/models/.partial-<name>-
<commit>` (kept when a pull stops, so the next one resumes) and checked against the hash the hub publishes before
it counts as done; the finished model is renamed into place with its manifest (a GGUF goes through the converter)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlc.config.paths import models_dir
from mlc.errors import DiskSpaceError, IntegrityError
from mlc.models.store.hub_files import RemoteFile, Selection, select_files
from mlc.models.store.hub_names import HubSpec
from mlc.models.store.manifest import read_manifest, write_manifest
from mlc.models.store.paths import is_pulled, store_path
from mlc.models.store.placing import PullResult, convert_into_store, current, move_into_store

INCOMPLETE = ".incomplete"  # inside a partial dir: files still arriving, not yet checked
LOCKS = ".locks"  # under $MLC_HOME/models: one lock file per model a pull is writing
DownloadProgress = Callable[[int, int, str], None]  # (bytes done, bytes in all, file)


@dataclass
class PendingPull:
    """What a pull is about to download, shown to `before_download` (which may stop it by raising)."""

    spec: HubSpec
    commit: str
    files: list[RemoteFile]
    total_bytes: int
    needed_bytes: int  # not on disk yet
    free_bytes: int
    partial: Path
    config: Path | None  # config.json, downloaded first where the model has one


def pull_hub(spec: HubSpec, include: tuple[str, ...] = (), force: bool = False,
             download_progress: DownloadProgress | None = None,
             before_download: Callable[[PendingPull], None] | None = None) -> PullResult:
    """`spec` into the store under `spec.store_name`; a no-op when the store holds the commit it resolves to (and
    `force` is not given). `force` also pulls past the free-disk check. Two pulls of one model wait for each other
    (a file lock), so they never write the same partial file."""
    from huggingface_hub.utils import WeakFileLock

    start = time.perf_counter()
    source = _source(spec)
    name = spec.store_name
    if not force and source.offline() and is_pulled(name) and same_model(spec, read_manifest(name).get("source") or {}):
        return PullResult(name, store_path(name), False, time.perf_counter() - start,
                          "offline: not checked against the hub")
    source.check_online(spec)
    commit, files = source.listing(spec)
    (models_dir() / LOCKS).mkdir(parents=True, exist_ok=True)
    with WeakFileLock(models_dir() / LOCKS / f"{name}.lock"):
        if not force and up_to_date(spec, commit, include):
            return PullResult(name, store_path(name), False, time.perf_counter() - start, f"commit {commit}")
        selection = select_files(spec.repo, files, include, spec.quant)
        final = _download_and_place(source, spec, commit, selection, include, force, download_progress,
                                    before_download)
    size = selection.total_bytes / 2**30
    return PullResult(name, final, True, time.perf_counter() - start,
                      f"commit {commit}, {len(selection.files)} files, {size:.2f} GiB")


def _download_and_place(source: Any, spec: HubSpec, commit: str, selection: Selection, include: tuple[str, ...],
                        force: bool, download_progress: DownloadProgress | None,
                        before_download: Callable[[PendingPull], None] | None) -> Path:
    """The selected files into the partial dir (config.json first, then `before_download`), then into the store."""
    partial = _partial_dir(spec.store_name, commit)
    held = _bytes_held(partial, selection.files)
    free = disk_free(partial)
    check_disk(spec, selection.total_bytes, held, free, force)
    counter = _Counter(download_progress, selection.total_bytes, held)
    hashes: dict[str, str] = {}
    config = next((f for f in selection.files if f.name == "config.json"), None)
    if config is not None:
        hashes[config.name] = _fetch_checked(source, spec, commit, config, partial, counter)
    if before_download is not None:
        before_download(PendingPull(spec, commit, selection.files, selection.total_bytes,
                                    selection.total_bytes - held, free, partial,
                                    partial / "config.json" if config is not None else None))
    for f in selection.files:
        if f.name not in hashes:
            hashes[f.name] = _fetch_checked(source, spec, commit, f, partial, counter)
    record = {"kind": spec.kind, "repo": spec.repo, "spec": str(spec), "revision": spec.revision, "commit": commit,
              "endpoint": source.endpoint(), "quant": spec.quant, "include": sorted(include)}
    if selection.gguf is not None:
        final = convert_into_store(spec.store_name, partial / selection.gguf.name, record, commit,
                                   hashes[selection.gguf.name])
        shutil.rmtree(partial, ignore_errors=True)
        return final
    _keep_only(partial, {f.name for f in selection.files})
    write_manifest(partial, spec.store_name, record, commit, known_sha256=hashes)
    return move_into_store(spec.store_name, partial)


def _source(spec: HubSpec) -> Any:
    """The module that talks to the spec's hub: `check_online`, `listing`, `fetch`, `endpoint`."""
    if spec.source == "modelscope":
        from mlc.models.store import modelscope_source

        return modelscope_source
    from mlc.models.store import hub

    return hub


def up_to_date(spec: HubSpec, commit: str, include: tuple[str, ...] = ()) -> bool:
    """The store holds this spec's model at `commit` (pulled with the same `--include`)."""
    if not is_pulled(spec.store_name):
        return False
    source = read_manifest(spec.store_name).get("source") or {}
    same = (source.get("kind"), source.get("repo"), source.get("commit"), source.get("quant"),
            source.get("include") or []) == (spec.kind, spec.repo, commit, spec.quant, sorted(include))
    return same and (spec.quant is None or current(spec.store_name))


def same_model(spec: HubSpec, source: dict[str, Any]) -> bool:
    """A store entry (its manifest's source) holds the spec's model: the same repo (any source for a short name)
    and the revision asked, named as pulled or by its commit (7 hex digits at least)."""
    if spec.revision is not None:
        commit = str(source.get("commit") or "")
        pinned = spec.revision == source.get("revision") or (len(spec.revision) >= 7 and commit.startswith(
            spec.revision))
        if not pinned:
            return False
    return spec.short is not None or (source.get("kind"), source.get("repo")) == (spec.kind, spec.repo)


def _partial_dir(name: str, commit: str) -> Path:
    """Where this commit's files gather; partial downloads of other commits of the same model cannot be resumed
    by this pull and are removed."""
    root = models_dir()
    tag = re.sub(r"[^\w.]", "_", commit)[:40]
    for old in root.glob(f".partial-{name}-*") if root.is_dir() else ():
        rest = old.name[len(f".partial-{name}-"):]
        if rest != tag and re.fullmatch(r"[\w.]+", rest):
            shutil.rmtree(old, ignore_errors=True)
    path = root / f".partial-{name}-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _bytes_held(partial: Path, files: list[RemoteFile]) -> int:
    held = 0
    for f in files:
        for path in (partial / f.name, partial / INCOMPLETE / f.name):
            if path.is_file():
                held += min(path.stat().st_size, f.size)
                break
    return held


def disk_free(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk(spec: HubSpec, total: int, held: int, free: int, force: bool) -> None:
    """Refuse, before the first byte, a pull whose files (as the hub sizes them) do not fit the free space."""
    need = total - held
    if need > free and not force:
        raise DiskSpaceError(
            f"{spec} needs {_gib(need)} more on the disk of {models_dir()} but {_gib(free)} is free (the hub reports "
            f"{_gib(total)} for the files to pull, {_gib(held)} already downloaded): free some space, move "
            "$MLC_HOME, or pass --force to try anyway")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class _Counter:
    """Bytes done over every file of the pull, for one progress bar."""

    def __init__(self, report: DownloadProgress | None, total: int, done: int):
        self.report, self.total, self.done, self.file = report, total, done, ""

    def add(self, n: int) -> None:
        self.done += n
        if self.report is not None:
            self.report(self.done, self.total, self.file)


def _fetch_checked(source: Any, spec: HubSpec, commit: str, f: RemoteFile, partial: Path, counter: _Counter) -> str:
    """`f` in the partial dir, checked; its sha256. A file finished and checked by an earlier run is kept."""
    final = partial / f.name
    if final.is_file() and final.stat().st_size == f.size:
        return f.sha256 or hashes_of(final)[0]
    part = partial / INCOMPLETE / f.name
    counter.file = f.name
    counter.add(0)
    source.fetch(spec, commit, f, part, counter.add)
    digest = check_file(spec, f, part)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, final)
    return digest


def hashes_of(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, in one read: LFS files are published by the first, others by the second."""
    sha256, blob = hashlib.sha256(), hashlib.sha1()
    blob.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest()


def check_file(spec: HubSpec, f: RemoteFile, path: Path) -> str:
    """The file's sha256, once it matches what the hub publishes; else its bytes are deleted and the pull stops."""
    sha256, blob = hashes_of(path)
    if f.sha256 is not None and sha256 != f.sha256:
        found = f"sha256 {sha256}, the hub publishes {f.sha256}"
    elif f.sha256 is None and f.blob_id is not None and blob != f.blob_id:
        found = f"git blob sha1 {blob}, the hub publishes {f.blob_id}"
    else:
        return sha256
    path.unlink()
    raise IntegrityError(f"{spec}: {f.name} does not match the hash the hub publishes ({found}); its bytes were "
                         "deleted and nothing entered the store: run the same command again (a second mismatch "
                         "means the hub or a proxy on the way serves corrupted data)")


def _keep_only(partial: Path, names: set[str]) -> None:
    """Only the pulled files stay in the dir that becomes the model (no leftovers of a downloader)."""
    for path in sorted(partial.rglob("*"), reverse=True):
        rel = path.relative_to(partial).as_posix()
        if path.is_file() and rel not in names:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
