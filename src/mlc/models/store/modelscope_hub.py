"""ModelScope as a second source (`modelscope:ORG/NAME`, `--source modelscope`) for users who cannot reach the
Hugging Face Hub, through its own SDK where it is installed (`pip install 'mlc[modelscope]'`).

The SDK lists the files (sizes, and the sha256 of each where its version reports it), downloads one file at a time
into a staging dir of ours (resuming its own partial files) and checks it; `hub_pull` checks the sha256 again where
the list carried one. ModelScope's file list names no commit id, so the revision is recorded as it was given."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlc.errors import AuthError, ConfigError, IntegrityError, ModelNotFoundError, NetworkError
from mlc.models.store.hub_files import RemoteFile
from mlc.models.store.hub_names import HubSpec

DEFAULT_ENDPOINT = "https://www.modelscope.cn"
NETWORK_ERRORS = ("ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout")  # requests' names (not builtins)


def endpoint() -> str:
    return (os.environ.get("MODELSCOPE_ENDPOINT") or os.environ.get("MODELSCOPE_DOMAIN") or DEFAULT_ENDPOINT).rstrip(
        "/")


def offline() -> bool:
    return False  # ModelScope has no offline switch of its own to honour


def check_online(spec: HubSpec) -> None:
    """The SDK is importable (an optional extra)."""
    try:
        import modelscope.hub.api  # noqa: F401
        import modelscope.hub.file_download  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"pulling {spec} needs ModelScope's SDK, which is not installed ({e}): pip install "
                          "'mlc[modelscope]' (or pip install modelscope), or pull from the Hugging Face Hub or a "
                          "mirror instead (HF_ENDPOINT=<mirror URL> mlc-cli models pull ORG/NAME)") from None


def listing(spec: HubSpec) -> tuple[str, list[RemoteFile]]:
    """(revision, files): the revision stands for the commit, which ModelScope's file list does not name."""
    from modelscope.hub.api import HubApi

    with modelscope_errors(spec):
        raw = HubApi().get_model_files(spec.repo, revision=spec.branch, recursive=True)
    files = [RemoteFile(str(f["Path"]), int(f.get("Size") or 0), f.get("Sha256") or None)
             for f in raw if f.get("Type", "blob") != "tree"]
    return spec.branch, files


def fetch(spec: HubSpec, commit: str, f: RemoteFile, part: Path, on_bytes: Callable[[int], None]) -> None:
    """`f` into `part` through the SDK (which resumes from what it kept in the staging dir beside `part`)."""
    from modelscope.hub.file_download import model_file_download

    staging = part.with_name(part.name + ".modelscope")
    with modelscope_errors(spec):
        path = model_file_download(spec.repo, f.name, revision=commit, local_dir=str(staging))
    part.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(path), part)
    shutil.rmtree(staging, ignore_errors=True)
    on_bytes(f.size)


@contextmanager
def modelscope_errors(spec: HubSpec) -> Iterator[None]:
    """The SDK's exceptions (its classes differ between versions: matched by name and HTTP status) as mlc errors."""
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
            raise IntegrityError(f"{spec}: ModelScope's SDK found a file that does not match its published hash "
                                 f"({e}); run the same command again") from None
        if isinstance(e, (ConnectionError, TimeoutError)) or name in NETWORK_ERRORS:
            raise NetworkError(f"cannot reach {where} for {spec} ({name}: {e}); what was downloaded is kept, run "
                               "the same command again to resume") from None
        raise


def _status(e: Any) -> int:
    return int(getattr(getattr(e, "response", None), "status_code", 0) or 0)
