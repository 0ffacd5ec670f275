"""ModelScope as a second source (`modelscope:ORG/NAME`, `--source modelscope`) for users who cannot reach the
Hugging Face Hub, through its SDK where it is installed (`pip install 'mlc[modelscope]'`): `modelscope_hub`, the
client that `modelscope` (1.3x on) delegates its hub calls to.

Its file list gives each file's size and sha256; each file is downloaded into a staging dir of ours with the
sha256 and size to expect (the SDK resumes its own partial file and checks both), and `hub_pull` checks the sha256
again. ModelScope's file list names no commit id, so the revision is recorded as it was given."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlc.errors import AuthError, ConfigError, IntegrityError, ModelNotFoundError, NetworkError
from mlc.models.store.hub import one_line
from mlc.models.store.hub_files import RemoteFile
from mlc.models.store.hub_names import HubSpec

DEFAULT_ENDPOINT = "https://www.modelscope.cn"
NETWORK_ERRORS = ("NetworkError", "RequestTimeoutError", "ConnectionError", "Timeout", "ReadTimeout", "ServerError",
                  "RateLimitError")  # the SDK's names (and requests' beneath it), not builtins


def endpoint() -> str:
    return (os.environ.get("MODELSCOPE_ENDPOINT") or os.environ.get("MODELSCOPE_DOMAIN") or DEFAULT_ENDPOINT).rstrip(
        "/")


def offline() -> bool:
    return False  # ModelScope has no offline switch of its own to honour


def check_online(spec: HubSpec) -> None:
    """The SDK is importable (an optional extra)."""
    try:
        import modelscope_hub.api  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"pulling {spec} needs ModelScope's SDK, which is not installed ({e}): pip install "
                          "'mlc[modelscope]' (or pip install modelscope), or pull from the Hugging Face Hub or a "
                          "mirror instead (HF_ENDPOINT=<mirror URL> mlc-cli models pull ORG/NAME)") from None


def _api() -> Any:
    """The SDK's client; the endpoint given here when the environment names one (its default configuration is made
    once per process)."""
    from modelscope_hub.api import HubApi

    named = os.environ.get("MODELSCOPE_ENDPOINT") or os.environ.get("MODELSCOPE_DOMAIN")
    return HubApi(endpoint=endpoint()) if named else HubApi()


def listing(spec: HubSpec) -> tuple[str, list[RemoteFile]]:
    """(revision, files): the revision stands for the commit, which ModelScope's file list does not name."""
    with modelscope_errors(spec):
        raw = _api().list_repo_files(spec.repo, "model", revision=spec.branch, recursive=True)
    files = [RemoteFile(f.path, int(f.size or 0), f.sha256 or None) for f in raw if not f.is_dir]
    return spec.branch, files


def fetch(spec: HubSpec, commit: str, f: RemoteFile, part: Path, on_bytes: Callable[[int], None]) -> None:
    """`f` into `part` through the SDK, which resumes from what it kept in the staging dir beside `part` and checks
    the size and sha256 the list gave; its bytes reach `on_bytes` (its own bar stays off)."""
    from modelscope_hub import ProgressCallback

    class Bytes(ProgressCallback):
        def update(self, size: int) -> None:
            on_bytes(size)

    staging = part.with_name(part.name + ".modelscope")
    with modelscope_errors(spec), _sdk_bar_off():
        path = _api().downloader.download_file(spec.repo, "model", f.name, revision=commit, local_dir=staging,
                                                expected_sha256=f.sha256, file_size=f.size, progress_callbacks=[Bytes])
    part.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(path), part)
    shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _sdk_bar_off() -> Iterator[None]:
    """The SDK's single-stream download draws a tqdm bar it has no switch for: off while ours shows the bytes."""
    from modelscope_hub import _download

    drawn = getattr(_download, "tqdm", None)
    if drawn is None:
        yield
        return
    _download.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        _download.tqdm = drawn


@contextmanager
def modelscope_errors(spec: HubSpec) -> Iterator[None]:
    """The SDK's exceptions as mlc errors (matched by class name and HTTP status: they moved between versions)."""
    where = endpoint()
    try:
        yield
    except Exception as e:
        name, status = type(e).__name__, _status(e)
        if name == "NotExistError" or status == 404:
            raise ModelNotFoundError(f"{spec.repo} (revision {spec.branch}) was not found on {where}: check the name "
                                     "and the revision") from None
        if name == "AuthenticationError" or status == 401:
            raise AuthError(f"{where} wants a token for {spec.repo}: set MODELSCOPE_API_TOKEN (or run `modelscope "
                            "login`), then pull again") from None
        if name == "PermissionDeniedError" or status == 403:
            raise AuthError(f"your ModelScope account may not read {spec.repo}: accept its licence at "
                            f"{where}/models/{spec.repo} with that account, then pull again") from None
        if name in ("FileIntegrityError", "FileSizeMismatchError"):
            raise IntegrityError(f"{spec}: a file does not match the size or sha256 ModelScope publishes "
                                 f"({one_line(e)}); nothing entered the store: run the same command again") from None
        if isinstance(e, (ConnectionError, TimeoutError)) or name in NETWORK_ERRORS:
            raise NetworkError(f"cannot reach {where} for {spec} ({name}: {one_line(e)}); what was downloaded is "
                               "kept, run the same command again to resume") from None
        raise


def _status(e: Any) -> int:
    for holder in (e, getattr(e, "response", None)):
        status = getattr(holder, "status_code", None)
        if isinstance(status, int):
            return status
    return 0
