"""Shared bench plumbing: tiny models, a bare llama-server, a corral daemon, percentiles."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from corral.supervisor.backends.llama_server import find_executable  # noqa: E402

from tinymodel import write_tiny_llama  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def wait_healthy(url: str, timeout: float = 30, interval: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{url} not healthy in {timeout}s")


def tiny_model(folder: Path, seed: int = 1) -> Path:
    return write_tiny_llama(folder / f"tiny-{seed}.gguf", seed)


# On a 2-core box llama.cpp's compute threads busy-poll between decodes and starve whatever
# else runs (the client, corral); both sides get the same quieter setting.
QUIET = ["--threads", "1", "--poll", "0"]


def llama_server_argv(model: Path, port: int, parallel: int = 1) -> list[str]:
    # The same flags corral's backend passes, so both sides run the same server.
    return [find_executable(None, ("llama-server",)), "--model", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--ctx-size", "4096", "--parallel", str(parallel),
            "--n-gpu-layers", "-1", *QUIET]


@contextmanager
def bare_llama_server(model: Path, parallel: int = 1) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(llama_server_argv(model, port, parallel), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def corral(models: dict[str, dict], **config: object) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corral.yaml"
        path.write_text(yaml.safe_dump({"models": models, **config}))
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "corral.supervisor.cli", "serve", "-c", str(path),
             "--listen", f"127.0.0.1:{port}", "--state-dir", tmp, "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", interval=0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


NGINX_CONF = """
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    upstream child {{ server 127.0.0.1:{upstream}; keepalive 32; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://child;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;   # stream SSE as it comes, like corral
        }}
    }}
}}
"""


@contextmanager
def nginx_proxy(upstream_url: str) -> Iterator[str | None]:
    """nginx relaying to the same upstream, as a reference proxy; None when not installed."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                       else None)
    if binary is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        upstream = upstream_url.rsplit(":", 1)[1]
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, upstream=upstream))
        proc = subprocess.Popen([binary, "-c", str(conf), "-p", tmp],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.02)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)
