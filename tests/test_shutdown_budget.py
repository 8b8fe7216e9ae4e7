"""corral's shutdown within its budget (`shutdown_timeout`, below systemd's TimeoutStopSec),
saves first; and requests llama-server places itself (no id_slot: /v1/messages, embeddings)
never saved under another conversation's tokens.

Real daemons: a llama-server child (SmolLM2) with a conversation to save, a command child
that never answers and ignores SIGTERM. The budget's arithmetic, the unit file and the slot
bookkeeping without a child at the end."""

from __future__ import annotations

import configparser
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_prompt_cache import _chat, _files, _next_turn

from corral.supervisor.config.schema import Config, PromptCacheConfig
from corral.supervisor.daemon.shutdown import EXIT_S, TASKS_S, ShutdownBudget
from corral.supervisor.process import KILL_WAIT_S
from corral.supervisor.prompt_cache.choice import CHAT, Choice, Record

from conftest import REPO, Corral, free_port, gone, port_is_free, wait_until

# A server that is healthy, takes every POST and never answers it, and ignores SIGTERM.
_HANG = """
import signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(3600)
    def log_message(self, *args):
        pass
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""

# What the hung request does to the log when the shutdown cuts it off.
_CUT_OFF = ("proxy.upstream_failed", "proxy.request_failed", "proxy.stream_broken")


def _index(corral: Corral) -> list[dict[str, Any]]:
    folder = corral.log_path.parent / "state" / "prompt-cache"
    return list(json.loads((folder / "index.json").read_text())["entries"])


@pytest.fixture
def hung_upstream(tmp_path: Path) -> Iterator[str]:
    """A remote endpoint (not corral's child) that never answers: corral's stop of it ends
    nothing, so its request is still open when the children are gone."""
    script = tmp_path / "upstream.py"
    script.write_text(_HANG)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port)])
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                   if not port_is_free(port) else False, timeout=15)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.kill()  # it ignores SIGTERM
        proc.wait()


@pytest.mark.expect_log(*_CUT_OFF)
def test_sigterm_ends_within_the_budget_with_the_saves_made_and_no_child_left(
        start_corral, smol_model, tmp_path: Path, hung_upstream: str) -> None:
    hang = tmp_path / "hang.py"
    hang.write_text(_HANG)
    budget = 20
    config = {
        # The drain alone would take 30 s and the hung child's stop_grace 8 more: the budget
        # cuts the drain short so that the saves and the SIGKILL still fit.
        "shutdown_grace": 30, "shutdown_timeout": budget,
        "defaults": {"ttl": 300, "stop_grace": 5},
        "prompt_cache": {"min_tokens": 64, "idle_save_after": 0, "save_timeout": 3},
        "models": {
            "smol": {"model": str(smol_model), "ctx": 2048, "threads": 1},
            "hang": {"backend": "command", "command": [sys.executable, str(hang), "${PORT}"],
                     "memory_mb": 50, "stop_grace": 8},
            "far": {"backend": "remote", "url": hung_upstream},
        },
    }
    corral = start_corral(config)
    # Short (a busy 2-core box prefills ~25 tokens a second), yet worth a file.
    facts = " ".join(f"Fact {i}: the orchard's row {i} is kept by its clerk." for i in range(12))
    _chat(corral, "smol", [{"role": "system", "content": f"You answer questions. {facts}"},
                           {"role": "user", "content": "Tell me one thing."}])
    assert not _files(corral)  # saved at the stop only (idle_save_after: 0)
    outcome: dict[str, Any] = {}

    def hung(model: str) -> None:
        try:
            outcome[model] = corral.chat(model, timeout=120)
        except httpx.HTTPError as exc:
            outcome[model] = exc

    askers = [threading.Thread(target=hung, args=(name,), daemon=True)
              for name in ("hang", "far")]
    for asker in askers:
        asker.start()
    wait_until(lambda: corral.model("hang")["in_flight"] == 1
               and corral.model("far")["in_flight"] == 1, timeout=30)
    pids = corral.spawned_pids()
    assert len(pids) == 2

    began = time.monotonic()
    corral.proc.send_signal(signal.SIGTERM)
    code = corral.proc.wait(budget + 30)
    took = time.monotonic() - began
    assert code == 0
    assert took <= budget, f"corral took {took:.1f}s to exit, over its {budget}s budget"

    # The plan it logged: the drain cut to what the stops leave of the budget.
    (plan,) = corral.log_events("daemon.shutdown_budget")
    kill_by = budget - KILL_WAIT_S - EXIT_S
    assert plan["drain"] <= kill_by - TASKS_S - 8 + 0.5, plan
    assert corral.log_events("daemon.drain_expired")
    # The conversation was saved at the stop and is in the index, before its child went.
    (saved,) = corral.log_events("prompt_cache.saved")
    assert saved["when"] == "stop" and saved["tokens"] > 100
    (stopping,) = [e for e in corral.log_events("child.stopping") if e["model"] == "smol"]
    assert saved["timestamp"] <= stopping["timestamp"]  # saved before its SIGTERM
    (entry,) = _index(corral)
    assert entry["file"] == saved["file"] and entry["model"] == "smol"
    # The child that ignored SIGTERM got SIGKILL within the budget; no child is left.
    assert corral.log_events("child.kill")
    assert all(gone(pid) for pid in pids)
    for asker in askers:
        asker.join(30)
        assert not asker.is_alive()


# -- unpinned requests on a multi-slot child ------------------------------------------------------


def _messages(corral: Corral, topic: str) -> None:
    """An Anthropic Messages request: llama-server ignores id_slot on it and picks the slot
    itself. Long enough that a slot holding it would be worth a file."""
    text = f"Write about {topic}. " + " ".join(f"Note {i} on {topic}." for i in range(25))
    resp = corral.http.post("/v1/messages", json={
        "model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
    assert resp.status_code == 200, resp.text


def _talk(topic: str) -> list[dict[str, str]]:
    """A conversation worth a file (min_tokens 64), short enough for a busy 2-core box."""
    facts = " ".join(f"Fact {i}: the {topic}'s ledger {i} is kept by its clerk."
                     for i in range(15))
    return [{"role": "system", "content": f"You answer questions about {topic}. {facts}"},
            {"role": "user", "content": f"Tell me one thing about {topic}."}]


def _unload(corral: Corral) -> None:
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)


def _stop_saves(corral: Corral) -> list[dict[str, Any]]:
    return [e for e in corral.log_events("prompt_cache.saved") if e["when"] == "stop"]


def _reused(answer: dict[str, Any], headers: httpx.Headers) -> int:
    """Restored, the child took (nearly) all of it from its cache; the tokens restored."""
    timing = headers.get("Server-Timing", "")
    assert 'desc="restored ' in timing, (answer["timings"], timing)
    restored = int(timing.split('desc="restored ')[1].split()[0])
    assert answer["timings"]["cache_n"] >= restored - 1, (answer["timings"], restored)
    return restored


def test_unpinned_requests_never_save_over_a_conversation(start_corral, smol_model) -> None:
    corral = start_corral({
        "defaults": {"ttl": 300, "stop_grace": 5},
        "prompt_cache": {"min_tokens": 64, "idle_save_after": 0},
        "models": {"smol": {"model": str(smol_model), "ctx": 4096, "parallel": 2,
                            "threads": 1}}})
    messages = _talk("the mill")
    first, _ = _chat(corral, "smol", messages)
    _unload(corral)
    (genuine,) = _files(corral)  # the conversation's first turn, saved at the stop

    # Its second turn is restored into a slot; then requests llama-server places itself.
    messages = _next_turn(messages, first, "And the mill's clerk?")
    second, headers = _chat(corral, "smol", messages)
    _reused(second, headers)
    _messages(corral, "the harbour")
    _messages(corral, "the lighthouse")
    _unload(corral)
    # The slot corral had for the second turn may hold a Messages request now: not saved
    # under the turn's tokens, and the first turn's genuine file is not superseded.
    assert len(_stop_saves(corral)) == 1
    assert [f["file"] for f in _files(corral)] == [genuine["file"]]

    # That file still restores, and the child reuses it.
    messages = _next_turn(messages, second, "And the mill's bridge?")
    third, headers = _chat(corral, "smol", messages)
    assert _reused(third, headers) == genuine["prompt_tokens"]

    # A Messages request, then the conversation pinned again: its slot is sure again (the
    # turn restored into it first, as into an empty one), and its stop saves it.
    _messages(corral, "the quarry")
    messages = _next_turn(messages, third, "And the mill's well?")
    fourth, headers = _chat(corral, "smol", messages)
    _reused(fourth, headers)
    _unload(corral)
    saves = _stop_saves(corral)
    assert len(saves) == 2 and saves[-1]["tokens"] > genuine["prompt_tokens"]
    (latest,) = _files(corral)  # the longer save of the same conversation replaced the first
    assert latest["file"] == saves[-1]["file"]

    # What it saved is this conversation's KV: the next turn reuses all of it.
    messages = _next_turn(messages, fourth, "And the mill's road?")
    fifth, headers = _chat(corral, "smol", messages)
    assert _reused(fifth, headers) == latest["prompt_tokens"]


# -- without a child ------------------------------------------------------------------------------


def test_the_default_budget_fits_the_unit_and_leaves_the_saves_their_time() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(REPO / "systemd" / "corral.service")
    stop_timeout = float(unit["Service"]["TimeoutStopSec"])
    config = Config()
    # The interpreter's start of exit and systemd's own bookkeeping: a margin above it.
    assert config.shutdown_timeout + 5 <= stop_timeout
    cache = PromptCacheConfig()
    budget = ShutdownBudget(config.shutdown_timeout, began=0.0)
    stops = config.defaults.stop_grace + cache.save_timeout
    drain_until = budget.drain_until(config.shutdown_grace, stops)
    # A llama-server child at the defaults: its save and stop_grace whole, a drain left.
    assert drain_until >= 15
    assert drain_until + TASKS_S + stops + KILL_WAIT_S + EXIT_S <= config.shutdown_timeout
    # Nothing to save, nothing slow to stop: the whole shutdown_grace.
    assert budget.drain_until(config.shutdown_grace, 0) == config.shutdown_grace


def _record(text: str) -> Record:
    return Record(CHAT, {"messages": [{"role": "user", "content": text}]})


def test_a_request_without_a_slot_makes_the_idle_slots_unsure_until_pinned_again() -> None:
    choice = Choice(3)
    choice.take(0, _record("x"))
    choice.release(0)
    choice.take(1, _record("y"))  # leased: its answer may be generated, still relayed
    choice.doubt()
    # Slot 0 may hold the unpinned request; slot 2 is empty (nothing to lose); slot 1 is
    # leased, but idle in the child once its answer is generated: it may hold it too.
    assert choice.unsure == {0, 1}
    choice.release(1)
    choice.doubt()  # the unpinned request's end
    assert choice.unsure == {0, 1}
    choice.take(0, _record("x2"))
    assert choice.unsure == {1}
    choice.forget(0)
    choice.release(0)
    choice.forget(1)
    assert choice.unsure == set()
