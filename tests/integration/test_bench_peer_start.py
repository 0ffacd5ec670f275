"""A benchmarked llama-server that crashes while starting: the error says which server, its exit and its log (no
traceback), and `without_repacking` gives the `--no-repack` retry that `bench compare` runs (llama.cpp's repacked
CPU weight layouts crash at start on some AMX CPUs)."""

from __future__ import annotations

import sys

import pytest

from mlc.bench import peers

FAKE = """#!{python}
import http.server, os, signal, sys
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{{}}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_crash_at_start_is_reported_and_the_no_repack_retry_starts(tmp_path):
    server = tmp_path / "llama-server"
    server.write_text(FAKE.format(python=sys.executable))
    server.chmod(0o755)
    spec = peers.llama(server, tmp_path / "m.gguf", tmp_path, threads=1, parallel=1, context=1024)
    with pytest.raises(peers.ServerStartError) as crash:
        with peers.RunningServer(spec, start_timeout_s=30):
            pass
    assert crash.value.crashed and crash.value.returncode == -11
    assert spec.label in str(crash.value) and str(spec.log) in str(crash.value)
    retry = peers.without_repacking(spec)
    assert retry.argv[-1] == "--no-repack" and retry.label.endswith("--no-repack") and retry.port != spec.port
    assert retry.argv[retry.argv.index("--port") + 1] == str(retry.port)
    with peers.RunningServer(retry, start_timeout_s=30) as running:
        assert running.proc.poll() is None
    assert running.proc.poll() is not None  # stopped on exit
