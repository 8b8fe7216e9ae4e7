"""A fleet: three corral nodes (127.0.0.2, .3, .4) behind smg 1.13.0, the model router, which
finds them in the discovery file `corral fleet manifest --watch` writes (docs/fleet.md).
Stub models are command children of tests/scripted_member.py, which records what reaches it;
the demo model on one node is the real check. The nodes, the router and the manifest are
shared by the module; the tests run in file order (the last ones kill a node)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Corral, CorralFactory, free_port, sse_lines, terminate, wait_until

STUB = Path(__file__).parent / "scripted_member.py"
SMG = Path(sys.executable).with_name("smg")

# phi cannot start on n3 (its command exits at once): the failure is the point.
pytestmark = pytest.mark.expect_log(allow=[r'"model": "phi"', r"phi exited with code 3"])


def stub(node: str, name: str, folder: Path) -> dict[str, Any]:
    return {"backend": "command", "health": "/health",
            "command": [sys.executable, "-S", str(STUB), "--port", "${PORT}",
                        "--reply", f"{node}:{name}",
                        "--record", str(folder / f"{node}-{name}.jsonl"),
                        "--chunks", "4", "--gap", "0.4"]}


def received(folder: Path, node: str, name: str) -> list[dict[str, Any]]:
    path = folder / f"{node}-{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@dataclass
class Router:
    """smg, a child of the test: its URL, its log (shown when a test fails) and its manifest."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    manifest: Path
    http: httpx.Client

    def ids(self) -> set[str]:
        response = self.http.get("/v1/models")
        if response.status_code != 200:
            return set()
        return {m["id"] for m in response.json()["data"]}

    def chat(self, model: str, **extra: Any) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], **extra})

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@dataclass
class Fleet:
    n2: Corral
    n3: Corral
    n4: Corral
    folder: Path
    router: Router
    watcher: subprocess.Popen[bytes] | None = None

    def watch(self, *nodes: Corral) -> None:
        """(Re)start `corral fleet manifest --watch` over `nodes`; the router keeps running."""
        self.stop_watching()
        with (self.folder / "manifest.log").open("ab") as log:
            self.watcher = subprocess.Popen(
                [sys.executable, "-m", "corral.supervisor.cli", "fleet", "manifest",
                 *(n.url for n in nodes), "--out", str(self.router.manifest), "--watch",
                 "--interval", "0.3"], stderr=log)

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.send_signal(signal.SIGTERM)
            assert self.watcher.wait(30) == 0
            self.watcher = None


def start_router(folder: Path) -> Router:
    port = free_port()
    manifest = folder / "workers.json"
    log = folder / "smg.log"
    argv = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--policy", "least_load",
            "--discovery-provider", "file", "--discovery-file", str(manifest),
            "--discovery-check-interval-secs", "1", "--load-monitor-interval", "1",
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
            # smg keeps its port 180 s after SIGTERM by default
            "--shutdown-grace-period-secs", "1", "--log-level", "info"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "NO_COLOR": "1"})
    router = Router(proc, f"http://127.0.0.1:{port}", log, manifest,
                    httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60))

    def up() -> bool:
        assert proc.poll() is None, f"smg exited:\n{router.tail()}"
        try:
            return router.http.get("/liveness", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(up, timeout=30)
    return router


@pytest.fixture(scope="module")
def fleet(start_corral_module: CorralFactory, tmp_path_factory: pytest.TempPathFactory,
          smol_model: Path) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("fleet")
    base = {"defaults": {"ttl": 300, "stop_grace": 5}}
    broken = {"backend": "command", "command": [sys.executable, "-c", "raise SystemExit(3)",
                                                "${PORT}"]}
    n2 = start_corral_module({**base, "node_name": "n2", "models": {
        "alpha": stub("n2", "alpha", folder), "gamma": stub("n2", "gamma", folder),
        "phi": stub("n2", "phi", folder),
        "smol": {"model": str(smol_model), "ctx": 2048}}}, host="127.0.0.2")
    n3 = start_corral_module({**base, "node_name": "n3", "models": {
        "beta": stub("n3", "beta", folder), "gamma": stub("n3", "gamma", folder),
        "phi": broken}}, host="127.0.0.3")
    n4 = start_corral_module({**base, "node_name": "n4", "models": {
        "delta": stub("n4", "delta", folder)}}, host="127.0.0.4")
    router = start_router(folder)
    result = Fleet(n2, n3, n4, folder, router)
    result.watch(n2, n3)
    try:
        wait_until(lambda: router.ids() == {"alpha", "beta", "gamma", "phi", "smol"},
                   timeout=30)
        yield result
    except BaseException:
        print(router.tail())
        raise
    finally:
        result.stop_watching()
        router.http.close()
        terminate(router.proc, 30)


@pytest.fixture
def router(fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[Router]:
    """The router; its log's tail and the manifest printed under a test that failed."""
    failed = request.session.testsfailed
    yield fleet.router
    if request.session.testsfailed > failed:
        print(f"--- smg log (tail) ---\n{fleet.router.tail()}")
        if fleet.router.manifest.exists():
            print(f"--- {fleet.router.manifest} ---\n{fleet.router.manifest.read_text()}")


def node_of(response: httpx.Response) -> str | None:
    return response.headers.get("x-corral-node")


def test_the_router_lists_the_union_and_sends_each_model_where_it_is_served(
        fleet: Fleet, router: Router) -> None:
    assert router.ids() == {"alpha", "beta", "gamma", "phi", "smol"}
    for model, node in [("alpha", "n2"), ("beta", "n3"), ("alpha", "n2"), ("beta", "n3")]:
        response = router.chat(model)
        assert response.status_code == 200, response.text
        assert node_of(response) == node
        assert response.json()["choices"][0]["message"]["content"] == f"{node}:{model}"


def test_an_unknown_model_is_model_not_found(router: Router) -> None:
    response = router.chat("nobody-serves-this")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_llama_cpp_fields_reach_the_child_unchanged(fleet: Fleet, router: Router) -> None:
    fields = {"cache_prompt": True, "repeat_penalty": 1.3, "grammar": 'root ::= "yes" | "no"',
              "temperature": 0.25}
    response = router.chat("beta", **fields)
    assert response.status_code == 200, response.text
    body = received(fleet.folder, "n3", "beta")[-1]["body"]
    assert {k: body.get(k) for k in fields} == fields


def test_sse_chunk_gaps_survive_the_router(router: Router) -> None:
    arrivals: list[float] = []
    with router.http.stream("POST", "/v1/chat/completions", json={
            "model": "alpha", "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as response:
        assert response.status_code == 200
        assert node_of(response) == "n2"
        for line in sse_lines(response):
            if line.startswith("data:") and "n2:alpha" in line:
                arrivals.append(time.monotonic())
    # The stub spaces its 4 content chunks 0.4 s apart: a buffering hop would bunch them
    # (gaps near 0). Bounds with room for a busy 2-core box's scheduling jitter: no two
    # chunks together, and the 1.2 s the stub spent between first and last still there.
    assert len(arrivals) == 4
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) > 0.1 and arrivals[-1] - arrivals[0] > 0.9, gaps


def test_the_demo_model_answers_through_the_router(router: Router) -> None:
    # At llama-server's own sampling SmolLM2 may end at any token: ignore_eos, and the
    # node's own count of the whole answer; its wording (spaces, say) is the model's.
    response = router.chat("smol", max_tokens=8, ignore_eos=True)
    assert response.status_code == 200, response.text
    assert node_of(response) == "n2"
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == 8, answer
    assert answer["choices"][0]["message"]["content"], answer


def test_a_model_warm_on_one_node_goes_only_there(fleet: Fleet, router: Router) -> None:
    # gamma is served by n2 and n3; n3 has it loaded. The mount's cold-start penalty in
    # /v1/loads makes least_load prefer n3; n2 never starts it.
    loaded = fleet.n3.http.post("/admin/models/gamma/load", timeout=60)
    assert loaded.status_code == 200, loaded.text
    wait_until(lambda: fleet.n3.model("gamma")["state"] == "ready")
    wait_until(lambda: loads_seen(router, fleet.n3, "gamma"), timeout=15)
    for _ in range(6):
        response = router.chat("gamma")
        assert response.status_code == 200, response.text
        assert node_of(response) == "n3"
    assert fleet.n2.spawned("gamma") == []
    assert received(fleet.folder, "n2", "gamma") == []


def loads_seen(router: Router, node: Corral, model: str) -> bool:
    """Whether smg's load monitor has polled what the node's mount reports now (the model
    warm): the `engine_load` GET /workers shows for the worker matches the mount's own
    /v1/loads, field by field. (GET /get_loads asks the workers afresh, which says nothing
    of what the policy has seen.)"""
    worker = f"{node.url}/w/{model}"
    now = httpx.get(f"{worker}/v1/loads").json()["loads"]
    for entry in router.http.get("/workers").json()["workers"]:
        if entry["url"] == worker:
            seen = (entry.get("engine_load") or {}).get("loads") or []
            return len(seen) == len(now) and all(
                all(polled.get(k) == v for k, v in mine.items())
                for polled, mine in zip(seen, now, strict=True))
    return False


def test_a_failed_model_leaves_rotation_on_its_node(fleet: Fleet, router: Router) -> None:
    # phi cannot start on n3: once failed there, its mount's health is 503 and smg routes
    # every phi request to n2.
    fleet.n3.http.post("/admin/models/phi/load", timeout=60)
    wait_until(lambda: fleet.n3.model("phi")["state"] == "failed", timeout=30)
    assert httpx.get(f"{fleet.n3.url}/w/phi/health").status_code == 503
    wait_until(lambda: not worker_healthy(router, f"{fleet.n3.url}/w/phi"), timeout=15)
    for _ in range(4):
        response = router.chat("phi")
        assert response.status_code == 200, response.text
        assert node_of(response) == "n2"


def worker_healthy(router: Router, url: str) -> bool:
    workers = router.http.get("/workers").json()
    items = workers.get("workers", workers) if isinstance(workers, dict) else workers
    for worker in items:
        if worker.get("url") == url:
            return bool(worker.get("is_healthy", worker.get("healthy")))
    return False


def test_a_node_added_to_the_manifest_serves_without_restarting_the_router(
        fleet: Fleet, router: Router) -> None:
    pid = router.proc.pid
    fleet.watch(fleet.n2, fleet.n3, fleet.n4)
    wait_until(lambda: "delta" in router.ids(), timeout=30)
    response = router.chat("delta")
    assert response.status_code == 200, response.text
    assert node_of(response) == "n4"
    assert router.proc.pid == pid and router.proc.poll() is None


def test_a_killed_node_fails_over_with_no_client_error(fleet: Fleet, router: Router) -> None:
    # gamma is warm on n3 (above): kill n3 outright; every gamma request still answers, now
    # from n2, before and after the router and the manifest have noticed.
    fleet.n3.expect(exit_code=-9)
    fleet.n3.proc.send_signal(signal.SIGKILL)
    fleet.n3.proc.wait(10)
    for _ in range(6):
        response = router.chat("gamma")
        assert response.status_code == 200, response.text
        assert node_of(response) == "n2"
