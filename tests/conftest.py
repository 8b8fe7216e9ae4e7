"""Real corral daemons over real llama-server children on tiny GGUF models."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from tinymodel import write_tiny_llama

REPO = Path(__file__).resolve().parent.parent
SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether a new server could listen there (TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny-a, tiny-b, tiny-c differ; tiny-a2 has tiny-a's weights (answers like it)."""
    folder = tmp_path_factory.mktemp("models")
    seeds = {"tiny-a": 1, "tiny-b": 2, "tiny-c": 3, "tiny-a2": 1}
    return {name: write_tiny_llama(folder / f"{name}.gguf", seed) for name, seed in seeds.items()}


@pytest.fixture(scope="session")
def smol_model() -> Path:
    assert SMOL.is_file(), f"{SMOL} missing: run `make demo-model` (make test does it)"
    return SMOL


@dataclass
class Corral:
    """A running `corral serve` process and clients for it."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    config_path: Path
    api_key: str = "unused"
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=60,
                                 headers={"Authorization": f"Bearer {self.api_key}"})

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0,
                             **kwargs)

    def models(self) -> dict[str, dict[str, Any]]:
        data = self.http.get("/admin/models").json()["models"]
        return {m["name"]: m for m in data}

    def model(self, name: str) -> dict[str, Any]:
        return self.models()[name]

    def chat(self, model: str, content: str = "hi", **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        return self.http.post("/v1/chat/completions", json=body)

    def log_events(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                out.append(record)
        return out

    def child_pids(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def tiny_config(tiny_models: dict[str, Path], names: list[str] | None = None,
                **overrides: Any) -> dict[str, Any]:
    models = {name: {"model": str(tiny_models[name]), "ctx": 8192}
              for name in (names or ["tiny-a"])}
    config: dict[str, Any] = {"defaults": {"ttl": 300, "stop_grace": 5}, "models": models}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


@pytest.fixture
def start_corral(tmp_path: Path) -> Iterator[Any]:
    started: list[Corral] = []

    def start(config: dict[str, Any], api_key: str = "unused", wait: bool = True) -> Corral:
        n = len(started)
        config_path = tmp_path / f"corral-{n}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        log_path = tmp_path / f"corral-{n}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "corral.supervisor.cli", "serve", "-c", str(config_path),
                 "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"),
                 "--log-format", "json", "--log-level", "debug"],
                stdout=subprocess.DEVNULL, stderr=log_file, cwd=tmp_path)
        corral = Corral(proc, f"http://127.0.0.1:{port}", log_path, config_path, api_key)
        started.append(corral)
        if wait:
            def healthy() -> bool:
                assert proc.poll() is None, f"corral exited:\n{log_path.read_text()}"
                try:
                    return httpx.get(corral.url + "/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False
            wait_until(healthy, timeout=15)
        return corral

    yield start

    for corral in started:
        children = corral.child_pids()
        if corral.proc.poll() is None:
            corral.proc.send_signal(signal.SIGTERM)
            try:
                corral.proc.wait(30)
            except subprocess.TimeoutExpired:
                corral.proc.kill()
                corral.proc.wait()
        corral.http.close()
        # Nothing survives the daemon: every child it had must be gone.
        leftovers = [p for p in children if psutil.pid_exists(p)
                     and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"children outlived corral: {leftovers}"
