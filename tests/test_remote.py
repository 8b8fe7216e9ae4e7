"""`backend: remote`, for real: a llama-server the test starts with `--api-key` is the remote
endpoint. Streamed and whole answers through corral under the model's corral name, the key
never shown, a clean 5xx fast while the remote is down and answers once it is back, and a
council of a native, a command and a remote member. Plus `corral check` on the two backends'
keys and the ${PORT} macro surviving ${VAR} expansion."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from conftest import Corral, CorralFactory, free_port, llama_server_binary, wait_until

KEY = "remote-secret-6f1e9a"
HI = [{"role": "user", "content": "hi"}]


class RemoteServer:
    """A llama-server on a fixed port, started and killed by the test (the 'remote')."""

    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.port = model, log, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [llama_server_binary(), "--model", str(self.model), "--host", "127.0.0.1",
                 "--port", str(self.port), "--api-key", KEY, "--alias", "far-served",
                 "--ctx-size", "2048", "--threads", "1"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/health",
                                 timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=120, interval=0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def remote(tiny_models: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    server = RemoteServer(tiny_models["tiny-b"],
                          tmp_path_factory.mktemp("remote") / "llama-server.log")
    server.start()
    yield server
    server.kill()


def remote_config(remote: RemoteServer, tiny_models: dict[str, Path]) -> dict[str, Any]:
    return {
        "defaults": {"ttl": 600, "stop_grace": 5},
        "models": {
            "tiny-a": {"model": str(tiny_models["tiny-a"]), "ctx": 2048},
            "near-cmd": {"backend": "command", "memory_mb": 100,
                         "command": [llama_server_binary(), "--model",
                                     str(tiny_models["tiny-c"]), "--host", "127.0.0.1",
                                     "--port", "${PORT}", "--ctx-size", "2048",
                                     "--threads", "1"]},
            "far": {"backend": "remote", "url": f"http://127.0.0.1:{remote.port}/v1",
                    "api_key": KEY, "served_name": "far-served", "parallel": 2},
            "far-wrong-key": {"backend": "remote", "url": f"http://127.0.0.1:{remote.port}",
                              "api_key": "not-the-key"},
        },
        "groups": {"council": {"models": ["tiny-a", "near-cmd", "far"], "type": "parallel",
                               "fallback": "partial", "required_responses": 2,
                               "expose_as_model": True}},
    }


@pytest.fixture(scope="module")
def served(start_corral_module: CorralFactory, remote: RemoteServer,
           tiny_models: dict[str, Path]) -> Corral:
    return start_corral_module(remote_config(remote, tiny_models))


def test_whole_and_streamed_answers_come_back_under_corrals_name(served: Corral) -> None:
    client = served.client(timeout=60)
    reply = client.chat.completions.create(model="far", messages=HI, max_tokens=3)
    assert reply.model == "far", reply  # the remote said far-served
    assert reply.choices[0].message.content is not None
    chunks = list(client.chat.completions.create(model="far", messages=HI, max_tokens=3,
                                                 stream=True))
    assert chunks and {c.model for c in chunks} == {"far"}, chunks
    listed = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
    assert listed["far"]["backend"] == "remote" and listed["far"]["state"] == "ready"
    assert listed["far"]["answering"] is True
    state = served.model("far")
    assert state["pid"] is None and state["port"] is None
    # No process, no memory: nothing counted for it.
    by = {m["name"]: m for m in served.http.get("/admin/memory").json()["models"]}
    assert not (by.get("far") or {}).get("estimate_mib"), by.get("far")


def test_a_remote_that_refuses_the_key_is_a_502_not_the_clients_401(served: Corral) -> None:
    answer = served.chat("far-wrong-key", max_tokens=1)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "upstream_auth", answer.json()


def test_the_key_never_shows(served: Corral) -> None:
    assert served.chat("far", max_tokens=1).status_code == 200
    config = served.http.get("/admin/config").text
    assert "api_key" in config and KEY not in config
    assert KEY not in served.http.get("/admin/models").text
    assert KEY not in served.log_path.read_text(errors="replace")


@pytest.mark.expect_log("proxy.upstream_failed", "proxy.request_failed")
def test_a_down_remote_is_a_clean_5xx_fast_and_serves_again_once_back(
        served: Corral, remote: RemoteServer) -> None:
    assert served.chat("far", max_tokens=1).status_code == 200
    remote.kill()
    began = time.monotonic()
    answer = served.chat("far", max_tokens=1, timeout=30)
    assert time.monotonic() - began < 15
    assert answer.status_code in (502, 503, 504), answer.text
    assert answer.json()["error"]["message"], answer.json()
    listed = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
    assert listed["far"]["answering"] is False
    with pytest.raises(openai.APIStatusError) as failed:
        served.client(timeout=30).chat.completions.create(
            model="far", messages=HI, max_tokens=1)
    assert failed.value.status_code in (502, 503, 504)
    # A group's fallback takes the down remote as a failed member: the others answer.
    council = council_answer(served)
    assert {m["model"]: m["status"] for m in council["responses"]} == {
        "tiny-a": "ok", "near-cmd": "ok", "far": "error"}, council
    assert council["complete"], council
    remote.start()
    assert served.chat("far", max_tokens=1).status_code == 200
    listed = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
    assert listed["far"]["answering"] is True


def council_answer(served: Corral) -> dict[str, Any]:
    answer = served.http.post("/v1/chat/completions", json={
        "model": "council", "messages": HI, "max_tokens": 2}, timeout=120)
    assert answer.status_code == 200, answer.text
    group: dict[str, Any] = answer.json()["corral_group"]
    return group


def test_a_council_of_native_command_and_remote_members_answers_3_of_3(
        served: Corral) -> None:
    members = council_answer(served)["responses"]
    answered = {m["model"] for m in members if m["status"] == "ok"}
    assert answered == {"tiny-a", "near-cmd", "far"}, members


def check(config: dict[str, Any], folder: Path,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = folder / "check.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check", str(path)],
                          capture_output=True, text=True, timeout=120, check=False, env=env)


def test_check_validates_command_and_remote_models(tmp_path: Path) -> None:
    good = {"models": {
        "cmd": {"backend": "command", "command": ["server", "--port", "${PORT}"]},
        "far": {"backend": "remote", "url": "https://api.example.com/v1", "api_key": "k"}}}
    # ${PORT} is corral's: an environment variable of that name does not replace it.
    assert check(good, tmp_path, env={**os.environ, "PORT": "1234"}).returncode == 0
    bad = {"models": {
        "cmd": {"backend": "command", "command": ["server", "--port", "8080"], "ctx": 4},
        "far": {"backend": "remote", "url": "ftp://example.com", "binary": "x"},
        "nourl": {"backend": "remote"},
        "native": {"model": "x.gguf", "url": "http://example.com"}}}
    result = check(bad, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "${PORT} is missing from command" in out, out
    assert "ctx is not a setting of backend: command" in out, out
    assert "url must be http(s)" in out, out
    assert "binary is not a setting of backend: remote" in out, out
    assert "a remote model needs `url`" in out, out
    assert "url is a command/remote setting" in out, out
    refused = check({"models": {"far": {"backend": "remote",
                                        "url": "https://user:s3cret@gateway.example/v1"}}},
                    tmp_path)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "url carries credentials" in said and "api_key" in said
    assert "s3cret" not in said, said


def test_served_name_is_renamed_in_events_split_across_chunks() -> None:
    """The relay's chunks cut events anywhere: an event split mid-name is renamed whole, and
    every other byte passes as it came."""
    from corral.proxy.rename import StreamRenamer, rename_answer, rename_request

    stream = (b'data: {"id":"x","model":"far-served","choices":[]}\n\n'
              b'data: {"id":"y","model":"far-served",'
              b'"choices":[{"delta":{"content":"far-served"}}]}\n\n'
              b": keep-alive\n\ndata: [DONE]\n\n")
    for cut in range(1, len(stream)):
        renamer = StreamRenamer("far-served", "far")
        out = renamer.feed(stream[:cut]) + renamer.feed(stream[cut:]) + renamer.flush()
        assert out.count(b'"model":"far"') == 2 and b'"content":"far-served"' in out, out
        assert out.endswith(b": keep-alive\n\ndata: [DONE]\n\n")
    assert rename_answer(b'{"model": "far-served", "x": 1}', "far-served", "far") == \
        b'{"model":"far","x":1}'
    assert rename_answer(b'{"model":"other"}', "far-served", "far") == b'{"model":"other"}'
    assert rename_request(b'{"model":"far","messages":[]}', "far-served") == \
        b'{"model":"far-served","messages":[]}'


def test_the_renamer_holds_back_no_more_than_a_line_limit() -> None:
    """A server that never ends its line cannot grow corral's buffer without bound: past the
    limit, what is held goes out as it came."""
    from corral.proxy import rename, sse

    renamer = rename.StreamRenamer("served", "ours")
    held = renamer.feed(b'data: {"model": "served", "x": "')
    assert held == b""
    out = renamer.feed(b"y" * (sse.LINE_LIMIT + 1))
    assert out.startswith(b'data: {"model": "served"') and len(out) > sse.LINE_LIMIT
    assert renamer.feed(b'\ndata: {"model":"served"}\n') == b'\ndata: {"model":"ours"}\n'
