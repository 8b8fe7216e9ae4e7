"""Every secret set to a marker, a daemon taken through its life (answers that succeed and
fail, a remote that quotes its key back whole, in a stream it already began and to a group's
synthesizer, a reload refused over a bad file that holds a key, a child killed, SIGTERM), then
everything corral wrote or serves grepped for the markers: its log, its state dir (and the
modes of its files), the admin views, /metrics, error bodies, every process's command line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fake_upstream import exchanges
from raw_server import RawServer

from corral.proxy.redact import StreamRedactor, without_secrets
from corral.supervisor.config import ConfigError, parse_config

from conftest import Corral, CorralFactory, llama_server_binary, tiny_config, wait_until

REMOTE_KEY = "sk-remote-MARKER-5e1f0a9c77"
USER_KEY = "sk-user-MARKER-0b3d9e2a41"
ADMIN_KEY = "sk-admin-MARKER-c8a2f61d03"
HF_TOKEN = "hf_MARKER_7d0c2b5e19aa"
ENV_KEY = "sk-env-MARKER-93ab41c7e2"  # reaches the config only through ${CORRAL_TEST_KEY}
MARKERS = (REMOTE_KEY, USER_KEY, ADMIN_KEY, HF_TOKEN, ENV_KEY)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _answer(status: str, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw


class Remote(RawServer):
    """Answers by the `model` asked of it; `echo` models quote the key they were sent."""

    def serve(self, conn: socket.socket) -> None:
        for _method, _path, headers, raw in exchanges(conn):
            body = json.loads(raw or b"{}")
            key = headers.get("authorization", "").rpartition(" ")[2]
            model, stream = body.get("model"), body.get("stream")
            if model in ("echo", "echo-200"):  # some send their errors with a 200
                conn.sendall(_answer("200 OK" if model == "echo-200" else "401 Unauthorized",
                                     {"error": {"message": f"Incorrect API key provided: {key}",
                                                "type": "invalid_request_error"}}))
            elif stream:
                self._stream(conn, model, key)
            else:
                conn.sendall(_answer("200 OK", {
                    "id": "r", "object": "chat.completion", "model": model, "choices": [{
                        "index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "ok"}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                              "total_tokens": 2}}))

    @staticmethod
    def _stream(conn: socket.socket, model: str, key: str) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        first = {"object": "chat.completion.chunk", "model": model,
                 "choices": [{"index": 0, "delta": {"content": "o"}}]}
        conn.sendall(_chunk(f"data: {json.dumps(first)}\n\n".encode()))
        if model == "echo-stream":
            # The provider's error event, the key cut in two by the network: a stream the
            # remote already began (200) cannot be a whole error answer.
            event = json.dumps({"error": {"message": f"key {key} was revoked",
                                          "type": "invalid_request_error"}})
            raw = f"data: {event}\n\n".encode()
            cut = raw.index(key.encode()) + len(key) // 2
            for part in (raw[:cut], raw[cut:]):
                conn.sendall(_chunk(part))
                time.sleep(0.05)
        conn.sendall(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    server = Remote()
    yield server
    server.close()


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, remote: Remote,
           tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Corral:
    base = f"http://127.0.0.1:{remote.port}"
    remotes = {name: {"backend": "remote", "url": base, "api_key": REMOTE_KEY,
                      "served_name": name} for name in ("echo", "echo-200", "echo-stream",
                                                        "fine")}
    remotes["from-env"] = {"backend": "remote", "url": base, "api_key": "${CORRAL_TEST_KEY}",
                           "served_name": "echo"}
    config = tiny_config(tiny_models, api_keys=[USER_KEY], admin_api_keys=[ADMIN_KEY])
    config["models"].update(remotes)
    # A command child told to require the key corral sends it, which it finds in its
    # environment: a shell puts it where llama-server reads one, and no argv shows it.
    config["models"]["guarded"] = {"backend": "command", "command": [
        "/bin/sh", "-c", 'LLAMA_API_KEY="$CORRAL_CHILD_API_KEY" exec '
        f'{llama_server_binary()} --model {tiny_models["tiny-a"]} --port ${{PORT}} '
        "--ctx-size 512"]}
    config["groups"] = {"council": {"type": "consensus", "models": ["fine"],
                                    "synthesizer": "echo", "expose_as_model": True}}
    path = tmp_path_factory.mktemp("markers") / "corral.yaml"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o644)  # the umask's usual mode: every local user may read the keys in it
    corral = start_corral_module.serve(path, api_key=ADMIN_KEY, env={
        "HF_TOKEN": HF_TOKEN, "CORRAL_TEST_KEY": ENV_KEY})
    corral.expect("proxy.request_failed", "proxy.upstream_failed", "proxy.stream_broken",
                  "daemon.reload_failed", "proxy.group_failed", "instance.crashed",
                  "instance.exited", "child.exited")
    return corral


def _in_clear(text: str) -> list[str]:
    return [marker for marker in MARKERS if marker in text]


def test_a_stream_the_remote_began_never_carries_its_key(corral: Corral) -> None:
    with corral.http.stream("POST", "/v1/chat/completions", json={
            "model": "echo-stream", "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as answer:
        text = answer.read().decode()
    assert answer.status_code == 200, text
    assert "[redacted]" in text and "was revoked" in text, text
    assert _in_clear(text) == [], text
    # A healthy stream through the same relay comes through whole.
    with corral.http.stream("POST", "/v1/chat/completions", json={
            "model": "fine", "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as answer:
        text = answer.read().decode()
    assert '"content":"o"' in text.replace(' ', '') and text.rstrip().endswith("[DONE]"), text


def test_a_synthesizer_that_quotes_its_key_never_shows_it(corral: Corral) -> None:
    for stream in (True, False):
        answer = corral.http.post("/v1/chat/completions", json={
            "model": "council", "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]})
        assert "Incorrect API key provided" in answer.text, answer.text
        assert _in_clear(answer.text) == [], answer.text


def test_a_key_from_the_environment_quoted_back_never_shows(corral: Corral) -> None:
    answer = corral.chat("from-env")
    assert answer.status_code == 502, answer.text
    assert "[redacted]" in answer.text and _in_clear(answer.text) == [], answer.text


def test_an_error_a_remote_sends_with_a_200_never_carries_its_key(corral: Corral) -> None:
    answer = corral.chat("echo-200")
    assert "[redacted]" in answer.text and _in_clear(answer.text) == [], answer.text


def test_the_redactor_finds_a_key_cut_anywhere() -> None:
    key = b"sk-0123456789abcdef"
    stream = b"data: one\n\ndata: " + key + b" and " + key + b"\n\ndata: s\n\n"
    for size in range(1, len(stream) + 1):
        redactor = StreamRedactor([key])
        out = b"".join(redactor.feed(stream[i:i + size]) for i in range(0, len(stream), size))
        out += redactor.flush()
        assert out == stream.replace(key, b"[redacted]"), size
    # A key as a JSON string quotes it, `/` escaped as PHP's encoder writes it.
    headers = {"Authorization": "Bearer abc/def+ghi"}
    quoted = b'{"error": {"message": "key abc\\/def+ghi refused"}}'
    assert without_secrets(quoted, headers) == b'{"error": {"message": "key [redacted] refused"}}'
    # A chunk that ends like the key begins is held back only that far, and let go whole.
    redactor = StreamRedactor([key])
    assert redactor.feed(b"data: sk-01") == b"data: "
    assert redactor.feed(b"x\n\n") == b"sk-01x\n\n"


def test_a_token_flag_in_args_is_refused_without_quoting_it(tmp_path: Path) -> None:
    for args in (["--hf-token", HF_TOKEN], [f"--hf-token={HF_TOKEN}"], ["-hft", HF_TOKEN]):
        text = yaml.safe_dump({"models": {"m": {"model": "m.gguf", "args": args}}})
        with pytest.raises(ConfigError) as caught:
            parse_config(text, tmp_path / "corral.yaml")
        assert [i.key for i in caught.value.issues] == ["models.m.args"], caught.value
        assert "HF_TOKEN" in str(caught.value) and "ps" in str(caught.value)
        assert _in_clear(str(caught.value)) == [] and _in_clear(str(caught.value.__cause__)) == []


def test_a_config_others_can_read_with_a_secret_in_it_is_named(tmp_path: Path) -> None:
    def check(text: str, mode: int) -> str:
        path = tmp_path / "corral.yaml"
        path.write_text(text)
        path.chmod(mode)
        done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check",
                               "--no-files", str(path)], capture_output=True, text=True,
                              env={**os.environ, "CORRAL_TEST_KEY": ENV_KEY}, timeout=60)
        assert done.returncode == 0, done.stderr
        assert _in_clear(done.stdout + done.stderr) == [], done.stderr
        return done.stderr

    inline = yaml.safe_dump({"api_keys": [USER_KEY], "models": {}})
    assert "(mode 0644): every local user can read" in check(inline, 0o644)
    assert check(inline, 0o640) == ""  # root:corral 0640: the service's group only
    assert check("api_keys: ['${CORRAL_TEST_KEY}']\nmodels: {}\n", 0o644) == ""
    # A shipped example's placeholder behind a variable (presets/distributed-rpc.yaml's
    # `${PEER_TOKEN:-change-me}`): the file asks for the variable, nothing was pasted in.
    assert check("api_keys: ['${CORRAL_UNSET_KEY:-change-me-please}']\nmodels: {}\n",
                 0o644) == ""


def test_a_watching_manifest_given_its_key_in_argv_says_where_it_belongs() -> None:
    def manifest(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "fleet",
                               "manifest", "http://127.0.0.2:1", "--watch", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr  # no --out: refused before any poll
        return done.stderr

    assert "--api-key shows in `ps`" in manifest("--api-key", USER_KEY)
    assert "CORRAL_API_KEY instead" in manifest("--api-key", USER_KEY)
    assert "`ps`" not in manifest()


def test_the_unit_sets_no_secret_where_systemctl_show_prints_it() -> None:
    unit = (Path(__file__).resolve().parent.parent / "systemd" / "corral.service").read_text()
    lines = [line.strip() for line in unit.splitlines() if not line.lstrip().startswith("#")]
    assert [line for line in lines if line.startswith("Environment=")] == []
    assert not any(word in line for line in lines for word in ("KEY", "TOKEN", "SECRET"))


def _events(corral: Corral) -> str:
    """The event feed's history (it then stays open: read until it goes quiet)."""
    got = b""
    with contextlib.suppress(httpx.ReadTimeout), corral.http.stream(
            "GET", "/admin/events?last=500", timeout=httpx.Timeout(10, read=5)) as feed:
        for data in feed.iter_bytes():
            got += data
    assert b"event: " in got, got
    return got.decode()


def test_a_command_child_gets_its_key_in_its_environment_only(corral: Corral) -> None:
    assert corral.chat("guarded").status_code == 200  # corral's key is the one it requires
    port = corral.model("guarded")["port"]
    # Not another local user: the port alone is no way in.
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=30)
    assert direct.status_code == 401, direct.text
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert _child_key(corral, "guarded", "CORRAL_CHILD_API_KEY") not in ps.stdout


def _child_key(corral: Corral, model: str = "tiny-a", name: str = "LLAMA_API_KEY") -> str:
    pid = corral.model(model)["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in environ
             if e.startswith(name.encode() + b"=")]
    assert found, "the child got no key of its own"
    return found[0]


@pytest.mark.expect_log("daemon.reload_failed")
def test_nothing_corral_wrote_or_serves_holds_a_secret(corral: Corral) -> None:
    assert corral.chat("tiny-a").status_code == 200
    child_key = _child_key(corral)
    markers = (*MARKERS, child_key)
    # A command line is every local user's to read (ps): no key travels in one.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert [m for m in markers if m in ps.stdout] == []
    assert corral.chat("echo").status_code == 502
    # A reload refused over a file whose broken line holds a key.
    good = corral.config_path.read_text()
    corral.config_path.write_text(good + f"\napi_keys: [{USER_KEY}\n")
    refused = corral.http.post("/admin/reload")
    assert refused.status_code >= 400, refused.text
    corral.config_path.write_text(good)
    # The child dies; corral notices.
    pid = corral.model("tiny-a")["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: corral.model("tiny-a")["state"] != "ready", timeout=30)
    served = [corral.http.get(path).text for path in (
        "/admin/config", "/admin/models", "/admin/requests?limit=500", "/metrics", "/health",
        "/v1/models", "/admin/models/tiny-a/logs", "/admin/models/echo/logs")]
    served += [_events(corral), refused.text]
    served.append(httpx.get(corral.url + "/admin/config",
                            headers={"Authorization": "Bearer sk-wrong-key-0000"}).text)
    for text in served:
        assert [m for m in markers if m in text] == [], text
    state = corral.log_path.parent / "state"
    for file in (p for p in state.rglob("*") if p.is_file()):
        assert stat.S_IMODE(file.stat().st_mode) & 0o077 == 0, file
        assert [m for m in markers if m.encode() in file.read_bytes()] == [], file
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    corral.proc.send_signal(signal.SIGTERM)
    corral.proc.wait(60)
    log = corral.log_path.read_text()
    assert [m for m in markers if m in log] == []
    assert [e["file"] for e in corral.log_events("config.secrets_readable")] == [
        str(corral.config_path)]
