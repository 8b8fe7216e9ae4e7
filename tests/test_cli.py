"""The client commands (`corral ps | top | load | stop | logs | run`) as a user runs them: real
subprocesses against one real daemon with keys, SmolLM2 where the answer matters."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conftest import Corral, CorralFactory, free_port, llama_server_binary, sse_lines, wait_until

# What the `corral` script runs (pyproject.toml's entry point: corral.supervisor.ctl:main).
CORRAL = [sys.executable, "-m", "corral.supervisor.ctl"]
ADMIN_KEY, USER_KEY = "admin-secret", "user-secret"
MODELS = {"tiny-a", "tiny-b", "tiny-c", "smol", "gated"}
# The demo's request profile (supervisor/demo.py): SmolLM2 answers plainly and briefly.
SMOL_PROFILE = {"defaults": {"temperature": 0, "repeat_penalty": 1.1, "max_tokens": 128},
                "system_prompt": "You are a helpful assistant."}


def config(tiny_models: dict[str, Path], smol: Path, without: str = "") -> dict[str, Any]:
    models: dict[str, Any] = {
        name: {"model": str(tiny_models[name]), "ctx": 2048}
        for name in ("tiny-a", "tiny-b", "tiny-c") if name != without}
    # A child that writes a line, then starts serving only once GATE exists: a test sees what
    # it writes while it is still starting.
    gate = tiny_models["tiny-a"].parent / "GATE"
    models["gated"] = {"backend": "command", "served_name": "gated", "command": [
        "/bin/sh", "-c", f"echo gated: waiting for {gate}; while [ ! -e {gate} ]; do "
        f"sleep 0.05; done; exec {llama_server_binary()} --model {tiny_models['tiny-a']} "
        "--host 127.0.0.1 --port ${PORT} --alias gated --ctx-size 2048 --threads 1"]}
    # A forced stop must be told from a drained one: a drain would wait this long.
    models["smol"] = {"model": str(smol), "ctx": 4096, "request": SMOL_PROFILE}
    return {"defaults": {"ttl": 300, "stop_grace": 5}, "shutdown_grace": 120,
            "api_keys": [USER_KEY], "admin_api_keys": [ADMIN_KEY], "models": models}


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
           smol_model: Path) -> Corral:
    return start_corral_module(config(tiny_models, smol_model), api_key=ADMIN_KEY)


def env(corral: Corral | None, **keys: str) -> dict[str, str]:
    """The environment of a command: the daemon's URL, and only the keys given."""
    out = {k: v for k, v in os.environ.items()
           if k not in ("CORRAL_URL", "CORRAL_API_KEY", "CORRAL_ADMIN_KEY")}
    if corral is not None:
        out["CORRAL_URL"] = corral.url
    return {**out, **keys}


def cli(corral: Corral | None, *args: str, input: str | None = None, admin: bool = True,
        extra_env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    keys = {"CORRAL_ADMIN_KEY": ADMIN_KEY} if admin else {}
    return subprocess.run([*CORRAL, *args],
                          env=env(corral, **keys, **(extra_env or {})), input=input,
                          stdin=None if input is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


class Follower:
    """`corral logs NAME -f` running, its output read line by line as it comes."""

    def __init__(self, corral: Corral, *args: str, keys: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [*CORRAL, "logs", *args, "-f"],
            env=env(corral, **({"CORRAL_ADMIN_KEY": ADMIN_KEY} if keys is None else keys)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                         for s, lines in ((self.proc.stdout, self.out),
                                          (self.proc.stderr, self.err))]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout)
        for thread in self._threads:
            thread.join(5)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()


@pytest.fixture
def follow(corral: Corral) -> Iterator[Any]:
    started: list[Follower] = []

    def start(*args: str) -> Follower:
        started.append(Follower(corral, *args))
        return started[-1]

    yield start
    for follower in started:
        follower.close()


def table(stdout: str) -> dict[str, dict[str, str]]:
    """`corral ps`'s table by model name, cells by header. Headers and cells are split on
    runs of two spaces or more (IN FLIGHT is one header)."""
    lines = stdout.strip().splitlines()
    headers = re.split(r"\s{2,}", lines[0].strip())
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]
    return {row[0]: dict(zip(headers, row, strict=True)) for row in rows}


# -- ps, load, stop ------------------------------------------------------------------------------

def test_load_then_ps_shows_it_ready_with_pid_memory_and_ttl(corral: Corral) -> None:
    loaded = cli(corral, "load", "tiny-a")
    assert loaded.returncode == 0, loaded.stderr
    pid = corral.model("tiny-a")["pid"]
    assert loaded.stdout.startswith(f"tiny-a: ready (pid {pid}, ")

    ps = cli(corral, "ps")
    assert ps.returncode == 0, ps.stderr
    assert ps.stdout.splitlines()[0].split() == [
        "NAME", "STATE", "PID", "MEMORY", "TTL", "IN", "FLIGHT", "QUEUE", "KV"]
    rows = table(ps.stdout)
    assert set(rows) == MODELS
    a = rows["tiny-a"]
    assert (a["STATE"], a["PID"], a["IN FLIGHT"], a["QUEUE"], a["KV"]) == (
        "ready", str(pid), "0/1", "0", "f16/f16")
    assert a["MEMORY"].endswith("MiB") and float(a["MEMORY"].split()[0]) > 0
    assert a["TTL"].startswith("4m")  # ttl 300, a few seconds gone
    assert (rows["tiny-b"]["STATE"], rows["tiny-b"]["PID"], rows["tiny-b"]["TTL"]) == (
        "stopped", "-", "-")


def test_ps_json_shape(corral: Corral) -> None:
    assert cli(corral, "load", "tiny-a").returncode == 0
    ps = cli(corral, "ps", "--json")
    assert ps.returncode == 0, ps.stderr
    doc = json.loads(ps.stdout)
    assert doc["url"] == corral.url and isinstance(doc["time"], float)
    models = {m["name"]: m for m in doc["models"]}
    a = models["tiny-a"]
    assert set(a) == {"name", "state", "pid", "backend", "memory_mib", "memory_total_mib",
                      "ttl", "ttl_left", "pinned", "in_flight", "parallel", "queue",
                      "cache_type_k", "cache_type_v", "last_error"}
    admin = corral.model("tiny-a")
    assert (a["state"], a["pid"], a["backend"], a["ttl"], a["parallel"]) == (
        "ready", admin["pid"], "llama-server", 300, 1)
    assert a["memory_mib"] == admin["memory_mib"] and set(a["memory_mib"]) == {"cpu"}
    assert a["memory_total_mib"] == pytest.approx(sum(a["memory_mib"].values()))
    assert 0 < a["ttl_left"] <= 300
    assert models["tiny-b"]["pid"] is None and models["tiny-b"]["memory_mib"] == {}


def test_top_and_ps_watch_refresh_count_times(corral: Corral) -> None:
    top = cli(corral, "top", "--count", "3", "--interval", "0.05")
    assert top.returncode == 0, top.stderr
    frames = [f for f in top.stdout.split("\n\n") if f.strip()]
    assert len(frames) == 3
    for frame in frames:
        head, *rest = frame.splitlines()
        assert head.startswith(f"corral at {corral.url}  ")
        assert set(table("\n".join(rest))) == MODELS

    watch = cli(corral, "ps", "--watch", "--json", "--count", "2", "--interval", "0.05")
    assert watch.returncode == 0, watch.stderr
    lines = watch.stdout.splitlines()
    assert len(lines) == 2
    assert all({m["name"] for m in json.loads(line)["models"]} == MODELS for line in lines)


def test_stop_unloads_and_the_child_ends(corral: Corral) -> None:
    assert cli(corral, "load", "tiny-c").returncode == 0
    pid = corral.model("tiny-c")["pid"]
    stopped = cli(corral, "stop", "tiny-c")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "tiny-c: stopped\n"
    assert corral.model("tiny-c")["state"] == "stopped"
    assert pid not in corral.child_pids()


def test_stop_force_cuts_off_the_request_in_flight(corral: Corral) -> None:
    """shutdown_grace is 120 s: a drained stop would let the 3,000-token answer finish; a
    forced one ends it at once."""
    got: dict[str, Any] = {"chunks": 0}

    def ask() -> None:
        body = {"model": "smol", "messages": [{"role": "user", "content": "Count to 5000."}],
                "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with corral.http.stream("POST", "/v1/chat/completions", json=body,
                                    timeout=300) as response:
                for line in sse_lines(response):
                    if line.startswith("data: {") and '"content"' in line:
                        got["chunks"] += 1
                    if '"finish_reason":"length"' in line:
                        got["finished"] = True
        except httpx.HTTPError as exc:
            got["error"] = repr(exc)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    wait_until(lambda: corral.model("smol")["in_flight"] == 1 and got["chunks"] > 0,
               timeout=120)
    stopped = cli(corral, "stop", "smol", "--force")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "smol: stopped\n"
    thread.join(60)
    assert not thread.is_alive()
    assert "finished" not in got and got["chunks"] < 3000


# -- logs --------------------------------------------------------------------------------------

def test_logs_prints_the_child_log_tail(corral: Corral) -> None:
    assert cli(corral, "load", "tiny-a").returncode == 0
    logs = cli(corral, "logs", "tiny-a", "-n", "5")
    assert logs.returncode == 0, logs.stderr
    expected = corral.http.get("/admin/models/tiny-a/logs", params={"lines": 5}).json()["lines"]
    assert logs.stdout.splitlines() == expected and len(expected) == 5


def test_logs_follow_asking_for_more_than_the_ring_holds_misses_nothing(
        corral: Corral, follow) -> None:
    assert cli(corral, "load", "tiny-a").returncode == 0

    def ring_full() -> bool:
        corral.chat("tiny-a", max_tokens=1)  # ~10 lines of llama-server's a request
        tail = corral.http.get("/admin/models/tiny-a/logs", params={"lines": 400}).json()
        return len(tail["lines"]) == 400

    wait_until(ring_full, timeout=120)
    for _ in range(5):  # past the ring's 400: its first lines fell off
        corral.chat("tiny-a", max_tokens=1)
    follower = follow("tiny-a", "-n", "1000")
    wait_until(lambda: len(follower.out) >= 400, timeout=30)
    # All it holds, and no word of lines lost: more was asked than kept, nothing came and went.
    assert not any("came and went" in line for line in follower.err), follower.err
    follower.proc.send_signal(signal.SIGINT)
    assert follower.wait() == 130


def test_logs_follow_prints_lines_as_a_new_child_writes_them(corral: Corral, follow) -> None:
    cli(corral, "stop", "tiny-b")
    follower = follow("tiny-b", "-n", "0")
    wait_until(lambda: f"corral: following tiny-b's log at {corral.url} (Ctrl-C ends)"
               in follower.err, timeout=30)
    assert cli(corral, "load", "tiny-b").returncode == 0
    pid = corral.model("tiny-b")["pid"]
    wait_until(lambda: any("listening on" in line for line in follower.out), timeout=30)
    assert f"corral: tiny-b: a new child, pid {pid}" in follower.err
    # Each line as the child wrote it, in order: the log tail ends with what was followed.
    tail = corral.http.get("/admin/models/tiny-b/logs", params={"lines": 400}).json()["lines"]
    assert follower.out == tail[:len(follower.out)]

    follower.proc.send_signal(signal.SIGINT)
    assert follower.wait() == 130


def test_logs_follow_shows_a_starting_childs_lines_before_it_is_ready(
        corral: Corral, follow, tiny_models: dict[str, Path]) -> None:
    gate = tiny_models["tiny-a"].parent / "GATE"
    follower = follow("gated", "-n", "0")
    wait_until(lambda: follower.err, timeout=30)  # the stream is open
    load = subprocess.Popen([*CORRAL, "load", "gated"],
                            env=env(corral, CORRAL_ADMIN_KEY=ADMIN_KEY), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: f"gated: waiting for {gate}" in follower.out, timeout=60)
        assert corral.model("gated")["state"] == "starting"
    finally:
        gate.touch()
        out, err = load.communicate(timeout=120)
    assert load.returncode == 0, err
    assert out.startswith("gated: ready (pid ")


def test_logs_follow_ends_with_the_childs_last_lines_when_corral_stops(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    """A daemon of its own: this one is stopped."""
    own = start_corral({"models": {"tiny-a": {"model": str(tiny_models["tiny-a"]),
                                              "ctx": 2048}}})
    assert cli(own, "load", "tiny-a", admin=False).returncode == 0
    follower = Follower(own, "tiny-a", "-n", "1", keys={})
    try:
        wait_until(lambda: follower.err, timeout=30)  # the stream is open
        own.proc.send_signal(signal.SIGTERM)
        assert follower.wait() == 0
        assert own.proc.wait(60) == 0  # before the factory's own SIGTERM could land on it
    finally:
        follower.close()
    assert follower.err[-1] == "corral: corral is shutting down"
    # It went on until the child had stopped: the child's goodbye is there.
    assert any("cleaning up before exit" in line for line in follower.out), follower.out


def test_log_ring_tells_a_reader_what_came_since_and_what_it_missed() -> None:
    """What `logs -f` reads from: a ring of a child's last lines with a count of all of them."""
    from corral.supervisor.process import LogRing

    ring = LogRing(4)
    for n in range(10):
        ring.append(f"line {n}")
    assert ring.written == 10 and list(ring) == ["line 6", "line 7", "line 8", "line 9"]
    assert ring.since(8) == (["line 8", "line 9"], 0)
    assert ring.since(3) == (["line 6", "line 7", "line 8", "line 9"], 3)  # 3, 4, 5 went
    assert ring.since(10) == ([], 0)


def test_logs_follow_ends_when_the_model_leaves_the_config(corral: Corral, follow,
                                                           tiny_models, smol_model) -> None:
    follower = follow("tiny-c", "-n", "3")
    wait_until(lambda: follower.err, timeout=30)  # the stream is open
    try:
        corral.config_path.write_text(yaml.safe_dump(config(tiny_models, smol_model,
                                                            without="tiny-c")))
        reload = corral.http.post("/admin/reload", timeout=60)
        assert reload.status_code == 200, reload.text
        assert follower.wait() == 0
        assert follower.err[-1] == "corral: tiny-c left the config"
    finally:
        corral.config_path.write_text(yaml.safe_dump(config(tiny_models, smol_model)))
        assert corral.http.post("/admin/reload", timeout=60).status_code == 200


# -- run ---------------------------------------------------------------------------------------

def test_run_streams_one_answer(corral: Corral) -> None:
    run = cli(corral, "run", "smol", "What is the capital of France?", "--verbose")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert run.stderr.startswith("prompt ") and " tokens, answer " in run.stderr


def test_run_chat_from_piped_lines_keeps_the_conversation(corral: Corral) -> None:
    lines = "My name is Zork.\nWhat is my name?\n/bye\nThis line is never asked.\n"
    run = cli(corral, "run", "smol", "--verbose", input=lines)
    assert run.returncode == 0, run.stderr
    stats = [line.split() for line in run.stderr.splitlines() if line.startswith("prompt ")]
    assert len(stats) == 2  # /bye ended it: the third line was not asked
    (prompt1, answer1), (prompt2, _) = [(int(s[1]), int(s[4])) for s in stats]
    # The second turn carried the first question and its answer.
    assert prompt2 >= prompt1 + answer1
    assert len([line for line in run.stdout.splitlines() if line.strip()]) >= 2


def test_run_chat_at_a_terminal(corral: Corral) -> None:
    """On a terminal: a `>>>` prompt per turn, the answers between them, /bye ends it."""
    import pty
    import select

    main_fd, tty_fd = pty.openpty()
    proc = subprocess.Popen([*CORRAL, "run", "smol", "--max-tokens", "8"],
                            env=env(corral, CORRAL_ADMIN_KEY=ADMIN_KEY), stdin=tty_fd,
                            stdout=tty_fd, stderr=subprocess.PIPE, text=False)
    os.close(tty_fd)
    seen = bytearray()

    def prompts() -> int:
        while select.select([main_fd], [], [], 0)[0]:
            try:
                seen.extend(os.read(main_fd, 4096))
            except OSError:  # the other end closed
                break
        return seen.count(b">>> ")

    try:
        wait_until(lambda: prompts() == 1, timeout=60)
        os.write(main_fd, b"Hello!\n")
        wait_until(lambda: prompts() == 2, timeout=120)
        # What a reader sees, less readline's control sequences (bracketed paste, by TERM).
        shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", seen.decode(errors="replace"))
        echo, *answer = shown.split(">>> ")[1].strip("\n").split("\n")
        assert echo == "Hello!"  # the terminal's echo of the typed line
        assert "".join(answer).strip()  # then the answer
        os.write(main_fd, b"/bye\n")
        assert proc.wait(60) == 0
        assert proc.stderr is not None
        assert proc.stderr.read().decode().startswith(
            f"chatting with smol at {corral.url}; /bye or Ctrl-D ends")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main_fd)


def test_run_chat_ends_at_end_of_input(corral: Corral) -> None:
    run = cli(corral, "run", "smol", "--max-tokens", "8", "--verbose", input="Hello!\n")
    assert run.returncode == 0, run.stderr
    assert sum(line.startswith("prompt ") for line in run.stderr.splitlines()) == 1


# -- errors --------------------------------------------------------------------------------------

def test_no_daemon_says_where_it_looked() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    ps = cli(None, "ps", "--url", url)
    assert ps.returncode == 3
    assert f"no corral daemon answers at {url} (--url): connection refused" in ps.stderr
    assert "corral serve" in ps.stderr
    run = cli(None, "run", "smol", "hi", extra_env={"CORRAL_URL": url})
    assert run.returncode == 3 and f"at {url} (CORRAL_URL)" in run.stderr


def test_unknown_model_lists_close_names(corral: Corral) -> None:
    for args in (["load", "tiny-d"], ["stop", "tiny-d"], ["logs", "tiny-d"],
                 ["run", "tiny-d", "hi"]):
        result = cli(corral, *args)
        assert result.returncode == 5, (args, result.stderr)
        assert result.stderr == (f"error: {corral.url} has no model 'tiny-d'; did you mean: "
                                 "tiny-a, tiny-b, tiny-c\n"), args
    far = cli(corral, "load", "llama-70b")
    assert far.returncode == 5
    assert far.stderr.endswith(
        "no model 'llama-70b'; models: gated, smol, tiny-a, tiny-b, tiny-c\n")


def test_missing_or_wrong_keys_say_which_variable(corral: Corral) -> None:
    none = cli(corral, "ps", admin=False)
    assert none.returncode == 4
    assert "wants an admin key" in none.stderr and "set CORRAL_ADMIN_KEY (it is not set)" \
        in none.stderr
    user = cli(corral, "ps", admin=False, extra_env={"CORRAL_API_KEY": USER_KEY})
    assert user.returncode == 4
    assert "refused the key in CORRAL_API_KEY for /admin/models (401)" in user.stderr
    assert "set CORRAL_ADMIN_KEY" in user.stderr
    wrong = cli(corral, "stop", "tiny-a", admin=False, extra_env={"CORRAL_ADMIN_KEY": "nope"})
    assert wrong.returncode == 4 and "refused the key in CORRAL_ADMIN_KEY" in wrong.stderr
    run = cli(corral, "run", "smol", "hi", admin=False)
    assert run.returncode == 4 and "set CORRAL_API_KEY (it is not set)" in run.stderr
    # The user key is enough for /v1.
    asked = cli(corral, "run", "smol", "Say yes.", "--max-tokens", "4", admin=False,
                extra_env={"CORRAL_API_KEY": USER_KEY})
    assert asked.returncode == 0, asked.stderr


def test_usage_errors_and_help(corral: Corral) -> None:
    assert cli(corral, "ps", "--watch", "--interval", "0").returncode == 2
    count = cli(corral, "ps", "--count", "2")
    assert count.returncode == 2 and "add --watch" in count.stderr
    assert cli(corral, "run").returncode == 2  # argparse: NAME is required
    assert cli(corral, "ps", "--url", "ftp://x").returncode == 2
    help_text = cli(corral, "stop", "--help").stdout
    assert "exit codes:" in help_text and "130  interrupted" in help_text
    assert "--force" in help_text


def test_the_commands_are_corrals_beside_serve(corral: Corral) -> None:
    """`corral --help` (the entry point hands it to cli.main) lists them with serve; the full
    parser in corral.supervisor.cli runs them too."""
    listed = cli(corral, "--help")
    assert listed.returncode == 0
    for command in ("serve", "check", "ps", "top", "load", "stop", "logs", "run"):
        assert f"    {command}" in listed.stdout, command
    full = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "ps", "--json"],
                          env=env(corral, CORRAL_ADMIN_KEY=ADMIN_KEY), capture_output=True,
                          text=True, timeout=120)
    assert full.returncode == 0, full.stderr
    assert {m["name"] for m in json.loads(full.stdout)["models"]} == MODELS
