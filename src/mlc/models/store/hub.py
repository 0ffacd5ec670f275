"""The Hugging Face Hub (or a mirror at `HF_ENDPOINT`) through `huggingface_hub`'s own client: a revision resolved
to its commit with every file's size and published hashes (`HfApi.model_info(files_metadata=True)`), and one file
fetched at that commit, resuming a partial download.

Files are fetched with `huggingface_hub.file_download.http_get` into a file of ours rather than with
`hf_hub_download`: since huggingface_hub 2.x the latter writes to a process-unique temporary file and deletes it
when a download fails, so an interrupted download of a 5 GB shard would start over; `http_get` resumes from the
bytes we keep (`Range`). Xet-backed repos are served the same way, through the hub's HTTP bridge."""

from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from mlc.errors import AuthError, DiskSpaceError, IntegrityError, MlcError, ModelNotFoundError, NetworkError
from mlc.models.store.hub_files import RemoteFile
from mlc.models.store.hub_names import HubSpec

ATTEMPTS = 3  # tries of one file, each resuming where the last stopped (huggingface_hub retries inside each too)
RETRY_WAIT_S = 2.0
TIMEOUT_S = 30.0
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, over a file-size limit
OnBytes = Callable[[int], None]


def endpoint() -> str:
    """`HF_ENDPOINT` read now (a mirror for users who cannot reach the Hub), else huggingface_hub's."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def check_online(spec: HubSpec) -> None:
    if offline():
        raise NetworkError(f"cannot pull {spec}: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so the hub is not "
                           "contacted; unset it for this command (`env -u HF_HUB_OFFLINE mlc-cli models pull ...`)")


def listing(spec: HubSpec) -> tuple[str, list[RemoteFile]]:
    """(commit, files) of the spec's revision: the commit every download then names, so a branch that moves during
    the pull cannot mix two versions of the model."""
    from huggingface_hub import HfApi

    with hub_errors(spec):
        info = HfApi(endpoint=endpoint()).model_info(spec.repo, revision=spec.branch, files_metadata=True,
                                                     timeout=TIMEOUT_S)
    if not info.sha:
        raise NetworkError(f"{endpoint()} answered for {spec} without a commit sha; it does not look like a Hugging "
                           "Face Hub endpoint (check HF_ENDPOINT)")
    files = [RemoteFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
             for s in info.siblings or []]
    return info.sha, files


def fetch(spec: HubSpec, commit: str, f: RemoteFile, part: Path, on_bytes: OnBytes) -> None:
    """`f` at `commit` into `part`, appending to what `part` already holds; checked against the hub's HEAD
    (commit, size) first. Transport errors and 5xx answers are retried, resuming each time."""
    from huggingface_hub import hf_hub_url

    url = hf_hub_url(spec.repo, f.name, revision=commit, endpoint=endpoint())
    part.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            _check_head(spec, url, commit, f)
            _http_get(spec, url, part, f.size, on_bytes)
            return
        except NetworkError as e:
            if attempt == ATTEMPTS:
                held = part.stat().st_size if part.exists() else 0
                raise NetworkError(f"{e.message} ({ATTEMPTS} tries); the {held:,} bytes of {f.name} downloaded so "
                                   f"far are kept in {part.parent}: run the same command again to resume") from None
            time.sleep(RETRY_WAIT_S * attempt)


def _check_head(spec: HubSpec, url: str, commit: str, f: RemoteFile) -> None:
    """The hub's HEAD of the file agrees with the listing: the same commit, the same size."""
    from huggingface_hub import get_hf_file_metadata

    with hub_errors(spec):
        meta = get_hf_file_metadata(url, timeout=TIMEOUT_S)
    if meta.commit_hash != commit:
        raise IntegrityError(f"{endpoint()} served {f.name} from commit {meta.commit_hash} when asked for {commit}: "
                             "it does not honour pinned revisions, so the pull stopped (check HF_ENDPOINT)")
    if meta.size is not None and meta.size != f.size:
        raise IntegrityError(f"{spec}: {f.name} is {meta.size} bytes by its download headers but {f.size} by the "
                             "repo's file list; the pull stopped before downloading it")


def _http_get(spec: HubSpec, url: str, part: Path, size: int, on_bytes: OnBytes) -> None:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    held = part.stat().st_size if part.exists() else 0
    if held > size:  # not a prefix of this file: start over
        part.unlink()
        held = 0
    with hub_errors(spec):
        try:
            with open(part, "ab") as out:
                http_get(url, out, resume_size=held, headers=build_hf_headers(), expected_size=size,
                         tqdm_class=cast(Any, functools.partial(_ByteCounter, on_bytes)))
        except OSError as e:
            if getattr(e, "response", None) is not None or isinstance(e, ConnectionError):
                raise  # an HTTP error answer (HfHubHTTPError is an OSError too) or offline: hub_errors says which
            if e.errno in DISK_FULL:
                raise DiskSpaceError(f"the disk filled up while downloading {part.name} for {spec} ({e.strerror}); the "
                                     f"{part.stat().st_size:,} bytes downloaded are kept in {part.parent}: free some "
                                     "space and run the same command again to resume") from None
            if e.errno is not None:
                raise MlcError(f"cannot write {part} ({e.strerror}); check that $MLC_HOME is writable") from None
            part.unlink(missing_ok=True)  # http_get's size check: the bytes that came are not this file
            raise IntegrityError(f"{spec}: {part.name} did not arrive whole ({one_line(e)}); the partial file was "
                                 "removed, run the same command again") from None


def _ignore(n: int) -> None:
    return None


class _ByteCounter:
    """The progress bar `http_get` drives (its `tqdm_class`): bytes go to our callback, nothing is printed."""

    def __init__(self, on_bytes: OnBytes, **_: Any) -> None:
        self.on_bytes = on_bytes

    def __enter__(self) -> _ByteCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        self.on_bytes(int(n or 0))


def fetch_config(spec: HubSpec) -> Path:
    """config.json alone into the HF cache, under the revision's name (its ref records the commit), which is what
    `plan --pull` reads."""
    from huggingface_hub import hf_hub_download

    from mlc.models.store.hf import hf_cache_dir

    check_online(spec)
    _, files = listing(spec)
    if "config.json" not in {f.name for f in files}:
        raise ModelNotFoundError(f"{spec} has no config.json at its top level, so there is nothing to plan from")
    with hub_errors(spec):
        path = hf_hub_download(spec.repo, "config.json", revision=spec.branch, cache_dir=hf_cache_dir(),
                               endpoint=endpoint(), tqdm_class=cast(Any, functools.partial(_ByteCounter, _ignore)))
    return Path(path)


@contextmanager
def hub_errors(spec: HubSpec) -> Iterator[None]:
    """huggingface_hub's exceptions as mlc errors of one line that say what to do."""
    from huggingface_hub import errors as hf
    from huggingface_hub import get_token

    where = endpoint()
    try:
        yield
    except hf.OfflineModeIsEnabled:
        check_online(spec)
        raise
    except hf.GatedRepoError as e:
        raise AuthError(_gated(spec, where, _status(e), get_token() is not None)) from None
    except hf.RevisionNotFoundError:
        raise ModelNotFoundError(f"{spec.repo} has no revision {spec.branch!r} on {where}: give a branch, tag or "
                                 f"commit of the repo ({spec.url(where)} lists its branches and tags)") from None
    except hf.RemoteEntryNotFoundError as e:
        raise ModelNotFoundError(f"{spec}: a file the repo lists is missing on {where} ({e.response.url})") from None
    except (hf.RepositoryNotFoundError, hf.DisabledRepoError):
        token = get_token() is not None
        private = ("it may be private and not shared with your token" if token else
                   "if it is private, set HF_TOKEN (or run `hf auth login`) and pull again")
        raise ModelNotFoundError(f"{spec.repo} was not found on {where}: check the name ({private})") from None
    except hf.HfHubHTTPError as e:
        status = _status(e)
        if status == 401:
            raise AuthError(f"{where} refused the token (HF_TOKEN or `hf auth login`) for {spec.repo}: it is invalid "
                            "or expired; make a new one at https://huggingface.co/settings/tokens") from None
        if status == 403:
            raise AuthError(f"your token may not read {spec.repo} on {where} (403): give it read access to the repo "
                            "(fine-grained tokens list the repos they reach) and pull again") from None
        raise NetworkError(f"{where} answered {status} for {spec}; the hub may be down, try again later") from None
    except hf.HTTPError as e:  # httpx2's base class (huggingface_hub's errors module imports it): transport errors
        raise NetworkError(f"cannot reach {where} for {spec}: {type(e).__name__}: {one_line(e)}; check the network, "
                           "set HF_ENDPOINT to a mirror you can reach, or pull from ModelScope (modelscope:ORG/NAME)"
                           ) from None


def one_line(e: Exception) -> str:
    """An exception's text on one line (an error message is one line), at most 300 characters."""
    return " ".join(str(e).split())[:300]


def _status(e: Any) -> int:
    response = getattr(e, "response", None)
    return int(getattr(response, "status_code", 0) or 0)


def _gated(spec: HubSpec, where: str, status: int, token: bool) -> str:
    page = spec.url(where)
    if status == 403 or token:
        return (f"{spec.repo} is gated and the account of your token has no access yet (HTTP {status}): accept the "
                f"licence at {page} with that account (some repos approve requests by hand), then pull again")
    return (f"{spec.repo} is gated (HTTP {status}, no token sent): accept the licence at {page} and set HF_TOKEN "
            "(or run `hf auth login`), then pull again")
