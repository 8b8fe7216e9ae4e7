"""Two corral nodes (127.0.0.5 and .6, stub command children of tests/scripted_member.py)
behind smg 1.13.0, for what the load report and the manifest decide at the router: a model
starting on one node draws the next request there rather than starting on the other, and an
alias is a name the router serves (docs/fleet.md). tests/test_fleet.py has the full setup."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_fleet import Router, start_router

from conftest import Corral, CorralFactory, terminate, wait_until

STUB = Path(__file__).parent / "scripted_member.py"


def member(node: str, name: str, folder: Path, gate: Path | None = None) -> dict[str, Any]:
    """A stub; with `gate`, its start waits until that file exists (a model loading for as
    long as the test wants)."""
    argv = [sys.executable, "-S", str(STUB), "--reply", f"{node}:{name}",
            "--record", str(folder / f"{node}-{name}.jsonl")]
    if gate is None:
        return {"backend": "command", "health": "/health",
                "command": [*argv, "--port", "${PORT}"]}
    script = f'while [ ! -e "{gate}" ]; do sleep 0.05; done; exec "$@" --port "$0"'
    return {"backend": "command", "health": "/health", "start_timeout": 120,
            "command": ["sh", "-c", script, "${PORT}", *argv]}


@dataclass
class Pair:
    a: Corral
    b: Corral
    folder: Path
    gate: Path
    router: Router


@pytest.fixture(scope="module")
def pair(start_corral_module: CorralFactory,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp("fleet-router")
    gate = folder / "go"
    base = {"defaults": {"ttl": 300, "stop_grace": 5}}
    a = start_corral_module({**base, "node_name": "na", "models": {
        "slow": member("na", "slow", folder, gate),
        "alpha": {**member("na", "alpha", folder), "aliases": ["al"]}}}, host="127.0.0.5")
    b = start_corral_module({**base, "node_name": "nb", "models": {
        "slow": member("nb", "slow", folder, gate)}}, host="127.0.0.6")
    done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "fleet", "manifest",
                           a.url, b.url, "--out", str(folder / "workers.json")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    router = start_router(folder)
    try:
        wait_until(lambda: {"alpha", "slow"} <= router.ids(), timeout=30)
        yield Pair(a, b, folder, gate, router)
    except BaseException:
        print(router.tail())
        raise
    finally:
        gate.touch()
        router.http.close()
        terminate(router.proc, 30)


def test_an_alias_is_a_name_the_router_serves(pair: Pair) -> None:
    workers = json.loads((pair.folder / "workers.json").read_text())["workers"]
    assert {"url": f"{pair.a.url}/w/al", "model_id": "al"} in workers
    assert pair.router.ids() == {"alpha", "al", "slow"}
    answer = pair.router.chat("al")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-corral-node"] == "na"
    assert answer.json()["choices"][0]["message"]["content"] == "na:alpha"
    recorded = (pair.folder / "na-alpha.jsonl").read_text().splitlines()
    assert json.loads(recorded[-1])["body"]["model"] == "alpha"  # the child knows its name


def test_a_model_starting_on_one_node_draws_the_next_request_there(pair: Pair) -> None:
    """Both nodes serve `slow`, stopped. The first request starts it on one node; while it
    loads, the next request must queue there, not start a second copy on the other node."""
    nodes = {"na": pair.a, "nb": pair.b}
    answers: list[httpx.Response] = []

    def ask() -> None:
        answers.append(pair.router.chat("slow"))

    def queued(node: Corral) -> int:
        return int(node.http.get("/w/slow/v1/loads").json()["corral"]["queued"])

    def seen_by_router(url: str) -> int:
        """The waiting requests smg's last load poll of this worker found."""
        loads = pair.router.http.get("/get_loads").json()["loads"]
        return sum(rank["num_waiting_reqs"] for rank in loads
                   if rank.get("worker") == f"{url}/w/slow")

    first = threading.Thread(target=ask)
    first.start()
    wait_until(lambda: queued(pair.a) + queued(pair.b) == 1)
    loading = "na" if queued(pair.a) else "nb"
    other = "nb" if loading == "na" else "na"
    assert nodes[loading].models()["slow"]["state"] == "starting"
    wait_until(lambda: seen_by_router(nodes[loading].url) == 1)

    second = threading.Thread(target=ask)
    second.start()
    wait_until(lambda: queued(pair.a) + queued(pair.b) == 2)
    try:
        assert queued(nodes[loading]) == 2
        assert nodes[other].models()["slow"]["state"] == "stopped"
    finally:
        pair.gate.touch()
        first.join(60)
        second.join(60)
    assert [a.status_code for a in answers] == [200, 200]
    assert {a.headers["x-corral-node"] for a in answers} == {loading}
