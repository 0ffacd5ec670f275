"""A ModelScope hub in a thread, for the tests that run ModelScope's own SDK (`modelscope_hub`) against it where the
SDK is installed: the two calls a pull makes, in ModelScope's URL layout.

What it reproduces: the file list (`GET /api/v1/models/{repo}/repo/files?Revision=&Recursive=`: `Path`, `Size`,
`Sha256`, `Type` in `Data.Files`), one file (`GET /api/v1/models/{repo}/repo?Revision=&FilePath=`, `Range` -> 206),
404 for an unknown repo. What it does not: logins and cookies, the region probe (answered 404), CDN redirects,
revisions other than the branch it is given, parallel ranged downloads of large files."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class FakeModelScope:
    repos: dict[str, dict[str, bytes]]  # repo -> {file: bytes} on `master`
    corrupt: set[str] = field(default_factory=set)  # files served with one byte flipped
    log: list[str] = field(default_factory=list)

    def start(self) -> FakeModelScope:
        handler = type("ModelScopeHandler", (_Handler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    hub: FakeModelScope

    def log_message(self, *args) -> None:
        return None

    def do_GET(self) -> None:
        self.hub.log.append(self.path)
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        route = re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)/repo(/files)?", url.path)
        files = self.hub.repos.get(unquote(route.group(1))) if route else None
        if files is None or query.get("Revision", "master") != "master":
            return self._send(404, json.dumps({"Code": 10010205, "Message": "not found", "Success": False}).encode())
        if route and route.group(2):
            listed = [{"Name": n, "Path": n, "Size": len(d), "Sha256": hashlib.sha256(d).hexdigest(), "Type": "blob",
                       "Revision": "master"} for n, d in sorted(files.items())]
            body = {"Code": 200, "Success": True, "Data": {"Files": listed}}
            return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        name = query.get("FilePath", "")
        if name not in files:
            return self._send(404, b"{}")
        data = files[name]
        if name in self.hub.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if not ranged:
            return self._send(200, data, {"Accept-Ranges": "bytes"})
        start = int(ranged.group(1))
        end = int(ranged.group(2)) if ranged.group(2) else len(data) - 1
        self._send(206, data[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}",
                                              "Accept-Ranges": "bytes"})

    do_HEAD = do_GET

    def _send(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
