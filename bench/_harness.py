"""Shared bench plumbing: tiny models, a bare llama-server, a corral daemon, nginx, percentiles.

Every bench prints ratios measured in one run (corral beside the bare server, and beside nginx
where that makes sense); absolute numbers on a shared 2-core VM move a lot from run to run.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from corral.supervisor.backends.llama_server import find_executable  # noqa: E402

import tinymodel  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def spread(values: list[float], fmt: str = "{:+.3f}") -> str:
    """'median (min … max over N rounds)': how much a figure moved within this one run."""
    if len(values) < 2:
        return fmt.format(values[0]) if values else "n/a"
    return (f"{fmt.format(statistics.median(values))} "
            f"(rounds {fmt.format(min(values))} … {fmt.format(max(values))})")


def pin_to_cpus(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (sched_setaffinity on a pid moves its main thread only) onto
    `cpus`; threads started later inherit it from the thread that starts them."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


def cpu_seconds(pids: list[int]) -> float:
    """CPU time these processes (all their threads) have run so far, 0 for any that is gone.
    Read from /proc/PID/task/*/schedstat (nanoseconds) where there is one: psutil's
    cpu_times() counts in 10 ms ticks, too coarse for one request."""
    total = 0.0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tasks = []
        if not tasks:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                pass  # a thread that just ended
    return total


def code_note() -> str:
    """Which corral code a run measured: the commit, and whether proxy/ or supervisor/ had
    uncommitted changes (other work in progress shows up in the figures)."""
    import corral.proxy

    where = Path(corral.proxy.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--",
                                "proxy", "supervisor"], capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return f"corral code: {where} (not a git checkout)"
    state = "with uncommitted changes in proxy/ or supervisor/" if dirty.strip() else "clean"
    return f"corral code: {where} at {head}, {state}"


def machine_note() -> str:
    load = os.getloadavg()
    return (f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
            f"(other work on this machine shows up as noise)")


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
    return tinymodel.write_tiny_llama(folder / f"tiny-{seed}.gguf", seed)


RUN_CHAR = "x"
RUN_POWERS = 13  # pieces "x", "xx", "xxxx", ... "x" * 4096


def tiny_model_with_runs(folder: Path, seed: int = 1) -> Path:
    """A tiny model whose vocab also holds "x" * 2**k pieces, so SentencePiece merges a long
    run of x into a few tokens: a 100 KB prompt costs the child ~30 tokens, not 100,000 (a
    byte-level vocab takes ~1.7 s just to tokenize and reject that), and the proxies' share
    of a big body shows."""
    base = tinymodel.vocab

    def vocab() -> tuple[list[str], list[float], list[int]]:
        tokens, scores, types = base()
        for k in range(RUN_POWERS):
            tokens.append(RUN_CHAR * (1 << k))
            scores.append(float(k))  # longer pieces merge first
            types.append(int(tinymodel.TokenType.NORMAL))
        return tokens, scores, types

    with mock.patch.object(tinymodel, "vocab", vocab):
        return tinymodel.write_tiny_llama(folder / f"tiny-runs-{seed}.gguf", seed)


# On a 2-core box llama.cpp's compute threads busy-poll between decodes and starve whatever
# else runs (the client, corral); both sides get the same quieter setting.
QUIET = ["--threads", "1", "--poll", "0"]
# llama-server's HTTP threads stay with an open keep-alive connection until it closes (5 s
# idle). Where two clients hold pools to the one bare child (the bench's direct client and
# nginx's upstream pool), the default parallel + 2 threads run out and new connections wait
# those 5 s. The benches that share a child give every child (corral's too) more threads.
SHARED_CHILD = [*QUIET, "--threads-http", "32"]


def llama_server_argv(model: Path, port: int, parallel: int = 1, ctx: int = 4096,
                      extra: list[str] = QUIET) -> list[str]:
    # The same flags corral's backend passes, so both sides run the same server.
    return [find_executable(None, ("llama-server",)), "--model", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx), "--parallel",
            str(parallel), "--n-gpu-layers", "-1", *extra]


@contextmanager
def bare_llama_server(model: Path, parallel: int = 1, ctx: int = 4096,
                      extra: list[str] = QUIET) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(llama_server_argv(model, port, parallel, ctx, extra),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Endpoint:
    """One way to the model: a base URL and the headers a request along it carries."""

    url: str
    headers: dict[str, str]


@dataclass
class Corral:
    """A running `corral serve`: its URL, its process, and where its files are."""

    url: str
    proc: subprocess.Popen[bytes]
    folder: Path  # config, state dir (children-<port>.json) and corral.log

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, {})

    @property
    def log(self) -> Path:
        return self.folder / "corral.log"


@contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """corral's code at git `ref` (a commit, a branch), extracted where a daemon can run it:
    the folder to put on PYTHONPATH (it holds corral/proxy and corral/supervisor)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "corral"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "proxy", "supervisor"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        yield Path(tmp)


@contextmanager
def corral_daemon(models: dict[str, dict], log_level: str = "warning",
                  stop_timeout: float = 60, code: Path | None = None,
                  **config: object) -> Iterator[Corral]:
    """`code`: a folder from checkout() to run instead of this checkout's corral."""
    env = None
    if code is not None:
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "corral.yaml"
        path.write_text(yaml.safe_dump({"models": models, **config}))
        port = free_port()
        with open(folder / "corral.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "corral.supervisor.cli", "serve", "-c", str(path),
                 "--listen", f"127.0.0.1:{port}", "--state-dir", tmp, "--log-level", log_level,
                 "--log-format", "json"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        handle = Corral(f"http://127.0.0.1:{port}", proc, folder)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{handle.url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = handle.log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"corral did not come up (exit {proc.poll()}):\n{tail}")
                time.sleep(0.05)
            yield handle
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextmanager
def corral(models: dict[str, dict], **config: object) -> Iterator[str]:
    with corral_daemon(models, **config) as handle:
        yield handle.url


def child_headers(pid: int) -> dict[str, str]:
    """What it takes to talk to corral's child directly: corral gives each child a per-start
    API key in its environment (LLAMA_API_KEY) and sends it as a Bearer token; the bench runs
    as the same user, so it reads the key where the child does."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    for entry in env:
        name, _, value = entry.partition(b"=")
        if name == b"LLAMA_API_KEY":
            return {"Authorization": f"Bearer {value.decode()}"}
    return {}


@contextmanager
def corral_and_its_child(model: Path, parallel: int, extra: list[str] = SHARED_CHILD,
                         ctx: int = 4096, code: Path | None = None,
                         **config: object) -> Iterator[tuple[Corral, Endpoint]]:
    """corral serving `model` as "tiny" (loaded, no TTL), and the way to that very child: the
    direct path and nginx talk to the same llama-server process corral relays to, so the
    only difference between the paths is the proxy."""
    models = {"tiny": {"model": str(model), "ctx": ctx, "parallel": parallel, "ttl": 0,
                       "args": extra}}
    with corral_daemon(models, code=code, **config) as handle:
        httpx.post(f"{handle.url}/admin/models/tiny/load", timeout=120).raise_for_status()
        desc = httpx.get(f"{handle.url}/admin/models", timeout=10).json()["models"][0]
        assert desc["state"] == "ready" and desc["port"], desc
        yield handle, Endpoint(f"http://127.0.0.1:{desc['port']}", child_headers(desc["pid"]))


# -- nginx as the reference proxy ---------------------------------------------------------------

NGINX_MISSING = ("nginx: NOT INSTALLED, so there is no reference proxy in this run; "
                 "`apt-get install -y nginx` (make bench does it when it can)")

NGINX_CONF = """
user {user};
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_max_body_size 32m;      # corral's max_body_mb default
    client_body_buffer_size 1m;    # a 100 KB prompt stays in memory, as in corral
    upstream child {{
        server 127.0.0.1:{upstream};
        keepalive 32;
        keepalive_timeout 4s;      # below llama-server's 5 s, so nginx closes idle ones first
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://child;
            proxy_http_version 1.1;        # keep-alive to the upstream pool
            proxy_set_header Connection "";
            proxy_buffering off;           # stream SSE as it comes, like corral
{extra}            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)


@dataclass
class Nginx:
    url: str
    proc: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, {})

    def pids(self) -> list[int]:
        """Master and workers (for CPU accounting)."""
        try:
            master = psutil.Process(self.proc.pid)
            return [master.pid, *(c.pid for c in master.children())]
        except psutil.NoSuchProcess:
            return []


@contextmanager
def nginx_proxy(upstream: Endpoint) -> Iterator[Nginx | None]:
    """nginx (one worker, foreground child, everything in a temp dir) relaying to the same
    upstream with a keep-alive pool, adding the upstream's headers (the child's key) as corral
    does; yields None when nginx is not installed."""
    binary = nginx_binary()
    if binary is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        port_up = upstream.url.rsplit(":", 1)[1]
        extra = "".join(f'            proxy_set_header {k} "{v}";\n'
                        for k, v in upstream.headers.items())
        conf = Path(tmp) / "nginx.conf"
        # Workers run as this same user, so they can use the temp dir (nginx warns and ignores
        # `user` when not root).
        user = pwd.getpwuid(os.getuid()).pw_name
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, upstream=port_up, user=user,
                                          extra=extra))
        proc = subprocess.Popen([binary, "-p", tmp, "-c", str(conf), "-e", f"{tmp}/error.log",
                                 "-g", "daemon off;"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = Path(tmp, "error.log")
                    raise RuntimeError("nginx did not start: " + (
                        log.read_text()[-2000:] if log.exists() else f"exit {proc.returncode}"))
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.02)
            yield Nginx(f"http://127.0.0.1:{port}", proc)
        finally:
            proc.send_signal(signal.SIGQUIT)  # graceful: workers finish, master exits
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def three_paths(model: Path, parallel: int, baseline: str | None = None, **config: object,
                ) -> Iterator[tuple[dict[str, Endpoint], dict[str, list[int]]]]:
    """The ways to one child: direct, through corral and, when installed, through nginx;
    with the pids whose CPU each proxy costs. Prints the code and machine notes.
    `baseline`: a git ref whose corral runs beside this one (its own child of the same model),
    as the path "baseline": an A/B of two builds in one run."""
    def serve(code: Path | None) -> Served:
        return corral_and_its_child(model, parallel, code=code, **config)

    with paths(serve, baseline) as found:
        yield found


# A corral and the child it relays to, once entered.
Served = contextlib.AbstractContextManager[tuple[Corral, Endpoint]]


@contextmanager
def paced_paths(pace_us: int, baseline: str | None = None,
                ) -> Iterator[tuple[dict[str, Endpoint], dict[str, list[int]]]]:
    """three_paths() to bench/fast_upstream.py instead of llama-server: a stream whose events
    come `pace_us` apart, each in its own write (a model's pace without a model's jitter, so
    that every proxy reads each event alone and costs per event compare)."""
    def serve(code: Path | None) -> Served:
        return corral_and_command_child(
            [sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port", "${PORT}",
             "--pace-us", str(pace_us)], code)

    with paths(serve, baseline) as found:
        yield found


@contextmanager
def corral_and_command_child(command: list[str], code: Path | None = None,
                             ) -> Iterator[tuple[Corral, Endpoint]]:
    """corral running `command` as the `command` child "tiny", and the way to it directly."""
    models = {"tiny": {"backend": "command", "memory_mb": 64, "parallel": 1, "ttl": 0,
                       "health": "/health", "command": command}}
    with corral_daemon(models, code=code) as handle:
        httpx.post(f"{handle.url}/admin/models/tiny/load", timeout=60).raise_for_status()
        desc = httpx.get(f"{handle.url}/admin/models", timeout=10).json()["models"][0]
        assert desc["state"] == "ready" and desc["port"], desc
        yield handle, Endpoint(f"http://127.0.0.1:{desc['port']}", {})


@contextmanager
def paths(serve: Callable[[Path | None], Served], baseline: str | None,
          ) -> Iterator[tuple[dict[str, Endpoint], dict[str, list[int]]]]:
    """direct, corral (`serve(None)`), nginx in front of corral's child, and `baseline` (a git
    ref, run by `serve(its code)`, relaying to its own child)."""
    with contextlib.ExitStack() as stack:
        proxied, child = stack.enter_context(serve(None))
        nginx = stack.enter_context(nginx_proxy(child))
        urls = {"direct": child, "corral": proxied.endpoint}
        pids = {"corral": [proxied.pid]}
        if nginx:
            urls["nginx"] = nginx.endpoint
            pids["nginx"] = nginx.pids()
        if baseline is not None:
            code = stack.enter_context(checkout(baseline))
            base, _ = stack.enter_context(serve(code))
            urls["baseline"] = base.endpoint
            pids["baseline"] = [base.pid]
            print(f"baseline: corral at {baseline}, its own child of the same model")
        print(code_note())
        print(f"machine: {machine_note()}")
        yield urls, pids


async def stream_arrivals(session: Any, to: Endpoint, body: dict[str, Any],
                          ) -> tuple[float, list[float]]:
    """One streamed chat: wall ms request → [DONE], and each data event's arrival (ms from
    the start; [DONE] left out). The stream benches' one client loop."""
    arrivals: list[float] = []
    tail = b""
    started = time.perf_counter()
    async with session.post(to.url + "/v1/chat/completions", json=body,
                            headers=to.headers) as resp:
        assert resp.status == 200, resp.status
        async for chunk in resp.content.iter_any():
            now = (time.perf_counter() - started) * 1000
            # An event's "data:" may straddle two reads: count it with the last chunk's tail.
            arrivals.extend([now] * (tail[-5:] + chunk).count(b"data:"))
            tail = chunk
    assert tail.endswith(b"data: [DONE]\n\n"), tail[-200:]
    return (time.perf_counter() - started) * 1000, arrivals[:-1]
