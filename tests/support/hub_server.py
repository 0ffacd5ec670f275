"""A Hugging Face Hub in threads, for tests: repos served in the hub's own URL layout and headers, so that
huggingface_hub's real client code (`HfApi.model_info`, `get_hf_file_metadata`, `http_get`) runs end to end.

What it reproduces: the revision API (`GET /api/models/{repo}/revision/{rev}?blobs=true`: `sha`, `siblings` with
`size`, `blobId`, `lfs`), `HEAD`/`GET /{repo}/resolve/{rev}/{file}` (`X-Repo-Commit`, `ETag` = the git blob sha1 of a
regular file; for an LFS file a 302 to a CDN on another origin with `X-Linked-Etag` = its sha256 and
`X-Linked-Size`), `Range` -> 206 with `Content-Range`, and the error answers `hf_raise_for_status` reads
(`X-Error-Code` RepoNotFound / RevisionNotFound / EntryNotFound / GatedRepo; 401 without a token, 404 with one,
403 for a token without access; "Invalid credentials in Authorization header"). Faults: a body cut after N bytes,
a flipped byte, a CDN that answers 503.

What it does not: Xet storage (no `X-Xet-*` headers), the tree and paths-info APIs, redirects of renamed repos,
rate limits, gzip, signed CDN URLs that expire, HTTP keep-alive."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import types
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
REPO = "tiny-org/tiny-llama"
C1, C2, C3 = ("1" * 40, "2" * 40, "3" * 40)  # its commits: tag v1, main, and where main moves to
CHUNK = 8192  # huggingface_hub writes what arrives in chunks of this size (10 MiB unless a test says otherwise)
CUT = 4 * CHUNK  # bytes of model.safetensors (about 125 KB) sent before a cut: what arrived whole is kept


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> {file name: bytes}
    refs: dict[str, str]  # branch or tag -> commit sha
    gated: bool = False
    private: bool = False

    def commit_of(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


@dataclass
class Request:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    headers: dict[str, str]  # names in lower case


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    tokens: dict[str, set[str]] = field(default_factory=dict)  # token -> repos it may read (gated or private)
    cut_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the connection drops, once
    corrupt: set[str] = field(default_factory=set)  # files served with one byte flipped
    cdn_down: bool = False  # the CDN answers 503 (after a cut, too: `down_after_cut`)
    down_after_cut: bool = False
    log: list[Request] = field(default_factory=list)

    def start(self) -> FakeHub:
        self.hub = _serve(self, "hub")
        self.cdn = _serve(self, "cdn")
        return self

    def stop(self) -> None:
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def blob(self, sha256: str) -> tuple[str, bytes] | None:
        for repo in self.repos.values():
            for files in repo.commits.values():
                for name, data in files.items():
                    if hashlib.sha256(data).hexdigest() == sha256:
                        return name, data
        return None

    def requests(self, server: str, method: str = "GET") -> list[Request]:
        return [r for r in self.log if r.server == server and r.method == method]


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # a connection we cut on purpose
        return None


def _serve(hub: FakeHub, role: str) -> ThreadingHTTPServer:
    handler = type(f"{role.title()}Handler", (_Handler,), {"hub": hub, "role": role})
    server = _Server(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    role: str

    def log_message(self, *args) -> None:  # quiet
        return None

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def _route(self, body: bool) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.hub.log.append(Request(self.role, self.command, self.path, headers))
        path = urlsplit(self.path).path
        if self.role == "cdn":
            return self._cdn(path, body)
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
        if api:
            return self._revision(unquote(api.group(1)), unquote(api.group(2)))
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve:
            return self._resolve(unquote(resolve.group(1)), unquote(resolve.group(2)), unquote(resolve.group(3)), body)
        self._error(404, "", "Not Found")

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

    def _repo(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        """The repo and commit, or None after answering with the hub's error."""
        token = self._token()
        if token is not None and token not in self.hub.tokens:
            self._error(401, "", "Invalid credentials in Authorization header")
            return None
        repo = self.hub.repos.get(repo_id)
        allowed = token is not None and repo_id in self.hub.tokens[token]
        if repo is None or (repo.private and not allowed):
            self._error(404 if token else 401, "RepoNotFound", "Repository not found")
            return None
        commit = repo.commit_of(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo, commit

    def _revision(self, repo_id: str, rev: str) -> None:
        found = self._repo(repo_id, rev)
        if found is None:
            return
        repo, commit = found
        siblings = []
        for name, data in sorted(repo.commits[commit].items()):
            entry: dict = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        info = {"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                "gated": "manual" if repo.gated else False, "disabled": False, "siblings": siblings, "tags": []}
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, True)

    def _resolve(self, repo_id: str, rev: str, name: str, body: bool) -> None:
        found = self._repo(repo_id, rev)
        if found is None:
            return
        repo, commit = found
        token = self._token()
        if repo.gated and (token is None or repo_id not in self.hub.tokens[token]):
            if token is None:
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                   "to it and be authenticated to access it. Please log in.")
            return self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the "
                               "authorized list.")
        data = repo.commits[commit].get(name)
        if data is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist on {rev}", commit)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if name.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            headers |= {"Location": f"{self.hub.cdn_url}/blobs/{sha256}", "X-Linked-Etag": f'"{sha256}"',
                        "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_sha1(b"pointer " + data[:8])}"'}
            return self._send(302, b"", headers, body)
        headers["ETag"] = f'"{git_blob_sha1(data)}"'
        self._content(name, data, headers, body)

    def _cdn(self, path: str, body: bool) -> None:
        found = self.hub.blob(path.removeprefix("/blobs/"))
        if self.hub.cdn_down or found is None:
            return self._error(503 if found else 404, "", "unavailable")
        name, data = found
        self._content(name, data, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}, body)

    def _content(self, name: str, data: bytes, headers: dict[str, str], body: bool) -> None:
        if name in self.hub.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if ranged and body:
            start = int(ranged.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = self.hub.cut_after.pop(name, None) if body else None
        self._send(206 if ranged and body else 200, data[start:], headers, body, cut)
        if cut is not None and self.hub.down_after_cut:
            self.hub.cdn_down = True

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        headers = {"X-Error-Message": message, "Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, json.dumps({"error": message}).encode(), headers, self.command != "HEAD")

    def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool, cut: int | None = None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not body:
            return
        if cut is None:
            self.wfile.write(data)
            return
        self.wfile.write(data[:cut])  # then the connection drops mid-body
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True


def tiny_repo_files(out: Path) -> dict[str, bytes]:
    """A tiny llama checkpoint's files, plus two a pull leaves alone by default (a README, a pickle in a folder)."""
    from tests.support.tiny_llama import build_tiny_llama

    model = build_tiny_llama(out / "model")
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    return {**files, "README.md": b"# tiny\n", "original/consolidated.pth": b"not pulled by default"}


def serve_tiny_repo(files: dict[str, bytes], tmp_path: Path, monkeypatch) -> FakeHub:
    """The hub at HF_ENDPOINT with REPO at three commits, online, no token, a fresh store and HF cache; everything
    set through `monkeypatch`, so nothing leaks into other tests. Stop it with `.stop()`."""
    import huggingface_hub.file_download as file_download
    from huggingface_hub import constants

    from mlc.models.store import hub

    v1 = {**files, "config.json": files["config.json"].replace(b"{", b'{"revision_note": "v1",', 1)}
    moved = {**files, "README.md": b"# moved on\n"}
    server = FakeHub({REPO: Repo({C1: v1, C2: files, C3: moved}, {"main": C2, "v1": C1})},
                     tokens={"good-token": {REPO, "tiny-org/gated"}, "other-token": set()}).start()
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLC_CPU_KERNELS", "0")  # torch's ops: no kernel build under this test's $MLC_HOME
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda s: None))  # http_get's retry wait
    monkeypatch.setattr(hub, "RETRY_WAIT_S", 0.0)
    return server
