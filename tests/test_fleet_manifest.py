"""`corral fleet manifest`: smg's discovery file from real corral nodes on 127.0.0.2 and .3
(command children of tests/scripted_member.py: none starts, /v1/models lists them cold)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import yaml

from conftest import Corral, CorralFactory, wait_until

STUB = Path(__file__).parent / "scripted_member.py"


def stub(name: str, folder: Path) -> dict[str, Any]:
    return {"backend": "command", "health": "/health",
            "command": [sys.executable, "-S", str(STUB), "--port", "${PORT}", "--reply", name,
                        "--record", str(folder / f"{name}.jsonl")]}


def node_config(names: list[str], folder: Path) -> dict[str, Any]:
    return {"defaults": {"ttl": 300, "stop_grace": 5},
            "models": {name: stub(name, folder) for name in names}}


def fleet(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "fleet", "manifest",
                           *args], capture_output=True, text=True, timeout=60, **kwargs)


def workers(node: Corral, *names: str) -> list[dict[str, str]]:
    return [{"url": f"{node.url}/w/{quote(n, safe='')}", "model_id": n} for n in names]


def test_the_manifest_has_one_worker_per_node_and_model(start_corral: CorralFactory,
                                                         tmp_path: Path) -> None:
    n2 = start_corral(node_config(["alpha", "org/m:q4"], tmp_path), host="127.0.0.2")
    n3 = start_corral(node_config(["beta"], tmp_path), host="127.0.0.3")
    out = tmp_path / "workers.json"
    done = fleet(n2.url, n3.url, "--out", str(out))
    assert done.returncode == 0, done.stderr
    # smg 1.13's manifest: version 1, workers with only fields it knows (it refuses others);
    # a name with / and : quoted whole into the mount's path.
    expected = {"version": 1, "workers": [*workers(n2, "alpha", "org/m:q4"),
                                          *workers(n3, "beta")]}
    assert json.loads(out.read_text()) == expected
    assert f"{n2.url}/w/org%2Fm%3Aq4" in out.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".workers.json.")]

    # Unchanged fleet, unchanged file: not even rewritten (smg re-reads on every change).
    before = out.stat().st_mtime_ns
    again = fleet(n2.url, n3.url, "--out", str(out))
    assert again.returncode == 0 and out.stat().st_mtime_ns == before
    assert "wrote" not in again.stderr

    # Without --out it prints the same manifest; a node that does not answer is left out
    # and said so, the others still listed.
    printed = fleet(n3.url, "http://127.0.0.3:1")
    assert printed.returncode == 0
    assert json.loads(printed.stdout) == {"version": 1, "workers": workers(n3, "beta")}
    assert "http://127.0.0.3:1: left out" in printed.stderr


def test_no_node_answering_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "workers.json"
    done = fleet("http://127.0.0.2:1", "127.0.0.3:1", "--out", str(out))
    assert done.returncode == 1
    assert "no node answered" in done.stderr and not out.exists()
    assert fleet("http://127.0.0.2:1", "--watch").returncode == 2  # --watch needs --out


def test_watch_follows_a_reload_and_a_node_gone(start_corral: CorralFactory,
                                                 tmp_path: Path) -> None:
    n2 = start_corral(node_config(["alpha"], tmp_path), host="127.0.0.2")
    n3 = start_corral(node_config(["beta"], tmp_path), host="127.0.0.3")
    out = tmp_path / "workers.json"
    watcher = subprocess.Popen(
        [sys.executable, "-m", "corral.supervisor.cli", "fleet", "manifest", n2.url, n3.url,
         "--out", str(out), "--watch", "--interval", "0.2"],
        stderr=subprocess.PIPE, text=True)
    # A reader like smg's: every read of the file, at any moment, is a whole manifest.
    reads: list[dict[str, Any]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                text = out.read_text()
            except FileNotFoundError:
                continue
            reads.append(json.loads(text))  # a partial file would raise here

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        def listed() -> list[dict[str, str]]:
            return json.loads(out.read_text())["workers"] if out.exists() else []

        wait_until(lambda: listed() == [*workers(n2, "alpha"), *workers(n3, "beta")])

        # A node's models change (a config reload): the file follows.
        n2.config_path.write_text(yaml.safe_dump(node_config(["alpha", "gamma"], tmp_path)))
        assert n2.http.post("/admin/reload", timeout=60).status_code == 200
        wait_until(lambda: listed() == [*workers(n2, "alpha", "gamma"), *workers(n3, "beta")])

        # A node gone: its workers leave the file, so the router stops sending there.
        n3.proc.send_signal(signal.SIGTERM)
        n3.proc.wait(30)
        wait_until(lambda: listed() == workers(n2, "alpha", "gamma"))
    finally:
        stop.set()
        reader.join(5)
        watcher.send_signal(signal.SIGTERM)
        _, stderr = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, stderr
    assert f"{n3.url}: left out of the manifest" in stderr
    assert reads and all(r["version"] == 1 for r in reads)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".workers.json.")]


class _Hostile(http.server.BaseHTTPRequestHandler):
    """A node that answers /v1/models with what its path's first part names (the test's URL is
    http://host:port/<kind>, which the manifest keeps as the node's base)."""

    # The Authorization headers /elsewhere got (a redirect's target).
    keys_elsewhere: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        kind = self.path.split("/")[1]
        if kind == "redirect":  # to another server's model list (here the same one's)
            self.send_response(302)
            self.send_header("Location", "/elsewhere/v1/models")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if kind == "elsewhere":
            self.keys_elsewhere.append(self.headers.get("Authorization"))
            body = json.dumps({"object": "list", "data": [{"id": "theirs"}]}).encode()
        elif kind == "good":
            body = json.dumps({"object": "list", "data": [{"id": "ours"}]}).encode()
        elif kind == "deep":  # valid JSON nested deeper than Python's stack
            body = b"[" * 200_000 + b"]" * 200_000
        else:  # "huge": a real model list, over 16 MiB
            body = json.dumps({"object": "list", "data": [
                {"id": f"m{i:07d}", "object": "model", "pad": "x" * 200}
                for i in range(80_000)]}).encode()
        if kind == "driphead":  # a status line, then a header a byte now and then
            with contextlib.suppress(OSError):
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                for _ in range(100):
                    self.wfile.write(b"a")
                    self.wfile.flush()
                    time.sleep(0.5)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if kind == "drip":  # the head at once, then a byte now and then, never the end
            self.send_header("Content-Length", "1000")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(100):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.5)
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serving(tls: ssl.SSLContext | None = None) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl, as an operator makes one)."""
    cert, key = folder / "node.crt", folder / "node.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_a_hostile_node_is_left_out_and_crashes_nothing(tmp_path: Path) -> None:
    """A node whose /v1/models is nested too deep, too large, or never ends (its body, or its
    head, dripped a byte at a time, over HTTP or HTTPS) is left out, said on stderr, with no
    traceback (a watcher would have died on the first, filled its memory on the second and
    hung, SIGTERM included, on the others)."""
    cert, key = _certificate(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server, secure = _serving(), _serving(tls)
    # The node's certificate is trusted as an operator would make it trusted.
    trusting = {**os.environ, "SSL_CERT_FILE": str(cert)}
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        secure_base = f"https://127.0.0.1:{secure.server_address[1]}"
        done = fleet(f"{secure_base}/good", env=trusting)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["workers"] == [
            {"url": f"{secure_base}/good/w/ours", "model_id": "ours"}]
        for nodes, said in (([f"{base}/deep"], "not JSON"),
                            ([f"{base}/huge"], "more than 16,777,216 bytes"),
                            # Read at once: their 10 s each run side by side.
                            ([f"{base}/drip", f"{base}/driphead", f"{secure_base}/driphead"],
                             "took more than 10 s")):
            done = fleet(*nodes, env=trusting)
            assert done.returncode == 1, (nodes, done.stderr)
            for node in nodes:
                assert f"{node}: left out of the manifest: " in done.stderr, done.stderr
            assert done.stderr.count(said) == len(nodes), (nodes, done.stderr)
            assert "Traceback" not in done.stderr, done.stderr
            assert "no node answered" in done.stderr
    finally:
        for each in (server, secure):
            each.shutdown()
            each.server_close()


def test_a_node_that_redirects_is_left_out_and_its_key_goes_nowhere_else() -> None:
    """A redirect is not followed: urllib would send the --api-key on to wherever it points,
    and list that server's models as the node's, under the node's URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        done = fleet(f"{base}/redirect", "--api-key", "k-secret")
        assert done.returncode == 1, done.stdout
        assert "redirects (HTTP 302) to '/elsewhere/v1/models'" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and "theirs" not in done.stdout
        assert _Hostile.keys_elsewhere == []
    finally:
        server.shutdown()
        server.server_close()
