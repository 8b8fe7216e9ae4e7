"""Shared bench plumbing: tiny models, a bare llama-server, a corral daemon, percentiles."""

from __future__ import annotations

import os
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
