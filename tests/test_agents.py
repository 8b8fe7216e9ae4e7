"""Real coding agents pointed at corral, as their users run them: Codex CLI (`codex exec`, a
provider whose base URL is corral's, `wire_api = "responses"`) and Claude Code (`claude -p`,
`ANTHROPIC_BASE_URL` = corral) each complete one non-interactive turn against a model and
against an exposed group, with corral's API key and no network but corral.

`make agents` installs both from npm at pinned versions into build/agents (`make test` does).
The demo model need not write good code: what is checked is the protocol. The agent exits 0
with the model's text as its answer, and corral's request log holds what it sent (the path,
status 200, both token counts); the usage the agent reports is the one corral relayed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, Corral, wait_until

AGENTS = REPO / "build" / "agents" / "node_modules" / ".bin"
KEY = "agent-key"
# A turn is a second or two on 2 cores (the prompts below are small); a cold start of the
# members comes on top.
TURN_TIMEOUT = 180
PROMPT = "Say hello in one short sentence."
# Nothing but corral: every other address goes to a proxy nobody listens on, so a turn that
# needed anything else (a login, a model catalogue, telemetry) fails here.
OFFLINE = {name: "http://127.0.0.1:9" for name in
           ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")}
OFFLINE.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")

# Codex CLI's own prompt is ~17 KB of instructions, a skills list and the sandbox's rules
# (4,560 prompt tokens: 30 s of prefill for SmolLM2 on 2 cores); these keys leave the
# instructions file, the user's turn and the tool definitions.
CODEX_CONFIG = """\
model_provider = "corral"
model_instructions_file = "{instructions}"
model_context_window = 4096
include_permissions_instructions = false
include_environment_context = false
web_search = "disabled"
check_for_update_on_startup = false

[model_providers.corral]
name = "corral"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "CORRAL_API_KEY"

[agents]
enabled = false

[skills]
include_instructions = false

[analytics]
enabled = false

[feedback]
enabled = false
"""
INSTRUCTIONS = "You are a coding assistant. Answer briefly.\n"
# A model, then an exposed group of each kind that answers with one text.
MODELS = ["smol", "pair", "relay", "council"]


def agent(name: str) -> Path:
    path = AGENTS / name
    assert path.is_file(), f"{path} missing: run `make agents` (make test does it)"
    return path


@pytest.fixture(scope="module")
def corral(start_corral_module: Any, smol_model: Path) -> Corral:
    # Greedy, and a server-side cap on what one answer may run to: a looping 135M model
    # stops there instead of filling the context.
    smol = {"model": str(smol_model), "ctx": 4096, "args": ["--temp", "0", "-n", "256"]}
    config = {
        "api_keys": [KEY],
        "defaults": {"ttl": 600, "stop_grace": 5},
        "models": {"smol": smol, "smol-b": dict(smol)},
        "groups": {
            # Both answer at once; the longer answer is the group's.
            "pair": {"type": "fan_out", "models": ["smol", "smol-b"], "selector": "longest",
                     "expose_as_model": True},
            # The second rewrites the first's answer.
            "relay": {"type": "chain", "models": ["smol", "smol-b"], "expose_as_model": True},
            # Both answer; smol writes the agent's answer from theirs.
            "council": {"type": "consensus", "models": ["smol", "smol-b"],
                        "synthesizer": "smol", "expose_as_model": True},
        },
    }
    return start_corral_module(config, api_key=KEY)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty home for the agent: no login, no settings but the test's."""
    folder = tmp_path / "home"
    folder.mkdir()
    return folder


def requests_since(corral: Corral, since: float) -> list[dict[str, Any]]:
    log = corral.http.get("/admin/requests", params={"limit": 200}).json()["requests"]
    return [r for r in log if r["time"] >= since]


def counted(entries: list[dict[str, Any]], endpoint: str, model: str) -> list[dict[str, Any]]:
    """The request log's entries of `model` on `endpoint`, each checked: 200 and both token
    counts."""
    mine = [r for r in entries if r["endpoint"] == endpoint and r["model"] == model]
    assert mine, f"no {endpoint} request of {model} in corral's log: {entries}"
    for r in mine:
        assert r["status"] == 200, entries
        assert r["tokens_in"] and r["tokens_out"], f"tokens not counted: {r}"
    return mine


def run_agent(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env={**os.environ, **OFFLINE, **env},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=TURN_TIMEOUT)
    assert done.returncode == 0, (
        f"{argv[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


# -- Codex CLI ----------------------------------------------------------------------------------

def codex(corral: Corral, model: str, home: Path) -> list[dict[str, Any]]:
    """One `codex exec` turn on `model`; its JSONL events."""
    codex_home = home / ".codex"
    codex_home.mkdir()
    instructions = codex_home / "instructions.md"
    instructions.write_text(INSTRUCTIONS)
    (codex_home / "config.toml").write_text(
        CODEX_CONFIG.format(url=corral.url, instructions=instructions))
    done = run_agent(
        [str(agent("codex")), "exec", "--json", "--strict-config", "--skip-git-repo-check",
         "--sandbox", "read-only", "--ephemeral", "-m", model, PROMPT],
        {"HOME": str(home), "CODEX_HOME": str(codex_home), "CORRAL_API_KEY": KEY}, home)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def codex_usage(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The turn's usage, from `codex exec --json`'s events, once they show a completed turn
    whose last message (the model's text) is not empty."""
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, (
        events)
    messages = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages and messages[-1].strip(), events
    usage: dict[str, Any] = next(e["usage"] for e in events if e.get("type") == "turn.completed")
    return usage


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_codex_exec_completes_a_turn(corral: Corral, home: Path, model: str) -> None:
    since = time.time()
    usage = codex_usage(codex(corral, model, home))
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0, usage
    entries = counted(requests_since(corral, since), "/v1/responses", model)
    # One request a turn (plus one per tool call the model makes, none expected here).
    assert sum(r["tokens_in"] for r in entries) >= usage["input_tokens"], (entries, usage)


# -- Claude Code --------------------------------------------------------------------------------

def claude(corral: Corral, model: str, home: Path, tools: str = "",
           key_variable: str = "ANTHROPIC_AUTH_TOKEN") -> dict[str, Any]:
    """One `claude -p` turn on `model` with its built-in `tools` (none by default) and
    corral's key in `key_variable`; its JSON result."""
    env = {
        "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        # Claude Code appends /v1/messages. ANTHROPIC_AUTH_TOKEN goes as `Authorization:
        # Bearer`, ANTHROPIC_API_KEY as `x-api-key`.
        "ANTHROPIC_BASE_URL": corral.url, key_variable: KEY,
        # Every model it might ask for is corral's: the main one and the small, fast one.
        "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "200",
    }
    done = run_agent(
        [str(agent("claude")), "-p", PROMPT, "--bare", "--model", model, "--tools", tools,
         "--system-prompt", INSTRUCTIONS.strip(), "--output-format", "json",
         "--no-session-persistence"], env, home)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def claude_turn_checked(corral: Corral, model: str, home: Path, tools: str = "",
                        key_variable: str = "ANTHROPIC_AUTH_TOKEN") -> None:
    since = time.time()
    result = claude(corral, model, home, tools, key_variable)
    assert result["type"] == "result" and result["subtype"] == "success", result
    assert result["is_error"] is False and result["stop_reason"] == "end_turn", result
    assert isinstance(result["result"], str) and result["result"].strip(), result
    entries = counted(requests_since(corral, since), "/v1/messages", model)
    usage = result["usage"]
    prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert prompt > 0 and usage["output_tokens"] > 0, usage
    assert sum(r["tokens_in"] for r in entries) >= prompt, (entries, usage)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_claude_print_completes_a_turn(corral: Corral, home: Path, model: str) -> None:
    claude_turn_checked(corral, model, home)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["smol", "pair"])
def test_claude_print_with_its_tools(corral: Corral, home: Path, model: str) -> None:
    """Claude Code's own tools go in Anthropic's shape (`name`, `description`,
    `input_schema`, no `type`: a custom tool's `type` is optional there), which corral must
    not refuse as a malformed OpenAI tool. Whether the model calls one is its business."""
    claude_turn_checked(corral, model, home, tools="Read,Grep")


@pytest.mark.timeout(300)
def test_claude_print_with_an_anthropic_api_key(corral: Corral, home: Path) -> None:
    """ANTHROPIC_API_KEY, the variable most Claude Code users set, goes as `x-api-key`."""
    claude_turn_checked(corral, "smol", home, key_variable="ANTHROPIC_API_KEY")


# -- what the agents do at the end of a stream ------------------------------------------------

def read_until_last_event(corral: Corral, path: str, body: dict[str, Any], last: bytes) -> None:
    """A streamed request on a raw connection, closed as soon as the whole `last` event is
    in, as an SSE client that has what it waited for does."""
    raw = json.dumps(body).encode()
    port = int(corral.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
                     f"\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}"
                     "\r\n\r\n".encode() + raw)
        got = b""
        while (at := got.find(last)) < 0 or b"\n\n" not in got[at:]:
            chunk = conn.recv(65536)
            assert chunk, f"the stream ended before {last!r}: {got[-500:]!r}"
            got += chunk


@pytest.mark.timeout(300)
def test_hanging_up_on_the_last_event_is_no_499(corral: Corral) -> None:
    """Codex CLI closes the connection once `response.completed` is in, which may be before
    corral has read the end of the child's stream: the client got the whole answer, and the
    request log must say 200 (it said 499, `client closed request`, for about one in five;
    chat's `[DONE]` and Messages' `message_stop` hit it more rarely)."""
    since = time.time()
    body = {"model": "smol", "stream": True, "input": "hi", "max_output_tokens": 3}
    for _ in range(40):
        read_until_last_event(corral, "/v1/responses", body, b"event: response.completed")

    def all_in() -> list[dict[str, Any]]:
        # The last one is accounted for once its handler has ended, after the hang-up.
        mine = [r for r in requests_since(corral, since) if r["endpoint"] == "/v1/responses"]
        return mine if len(mine) == 40 else []

    entries = wait_until(all_in)
    assert [r["status"] for r in entries] == [200] * 40, entries
