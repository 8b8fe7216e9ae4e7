"""Cold start through corral vs a bare server start, measured in one run (issue 37's target:
corral ready ≤ bare ready + 50 ms).

llama-server, each round (the order of the paths turns every round):
- bare: spawn llama-server, poll /health 1 ms apart (over a bare socket: cheap) until 200
  (ready), then one streamed token (first token);
- corral load: `POST /admin/models/m/load` answered (ready: corral health-gated its child),
  then one streamed token (first token);
- corral on demand: one streamed request with the model stopped (corral spawns, gates and
  relays): request → first token;
- with `--baseline REF`: corral at git REF beside this one (its load and on-demand figures),
  so a change to corral is measured before and after in the same run.
Between rounds each corral model is unloaded.

`--vllm`: the same for vLLM's CPU build (build/vllm-venv, `make vllm`) on a tiny random Llama
checkpoint: bare ready is /health 200 and /v1/models naming the model; after one uncounted
start (disk and compile caches). A vLLM start takes over a minute on 2 cores: few rounds.

    python bench/cold_start.py [--rounds 7] [--model PATH] [--baseline REF]
    python bench/cold_start.py --vllm [--vllm-rounds 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from _harness import (
    QUIET,
    checkout,
    code_note,
    corral_daemon,
    free_port,
    llama_server_argv,
    machine_note,
    tiny_model,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tinyhf import write_tiny_hf_llama  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("CORRAL_VLLM_PYTHON", ROOT / "build/vllm-venv/bin/python"))
VLLM_COMMAND = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
TARGET_MS = 50.0
Times = dict[str, list[float]]  # figure name → ms per round


def first_token(client: httpx.Client, url: str, headers: dict[str, str] | None = None) -> None:
    body = {"model": "m", "max_tokens": 1, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    with client.stream("POST", url + "/v1/chat/completions", json=body,
                       headers=headers or {}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return


def ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


@contextlib.contextmanager
def spawned(argv: list[str], env: dict[str, str] | None = None) -> Iterator[float]:
    """A bare server process: yields the perf_counter moment it was spawned; killed after."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    try:
        yield started
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def poll_until(check: Callable[[], bool], timeout: float) -> None:
    """As tight a poll as a client can do: 1 ms apart."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {timeout:g}s")
        time.sleep(0.001)


def healthy(port: int, headers: dict[str, str] | None = None) -> bool:
    """GET /health answered 200, over a bare socket: a 1 ms poll through an HTTP client
    costs most of a core, which on 2 cores slows the very start it times."""
    request = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + "\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request.encode())
            return sock.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def lists(client: httpx.Client, url: str, headers: dict[str, str], name: str) -> bool:
    try:
        listed = client.get(url + "/v1/models", headers=headers).json()
    except (httpx.TransportError, ValueError):
        return False
    return any(m.get("id") == name for m in listed.get("data", []))


def bare_llama(client: httpx.Client, model: Path, times: Times) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with spawned(llama_server_argv(model, port)) as started:
        poll_until(lambda: healthy(port), 120)
        times["bare ready"].append(ms_since(started))
        first_token(client, url)
        times["bare first token"].append(ms_since(started))


def corral_load(client: httpx.Client, url: str, name: str, times: Times,
                timeout: float = 120) -> None:
    """Load → ready, then a first token, then unloaded again."""
    started = time.perf_counter()
    resp = client.post(url + "/admin/models/m/load", timeout=timeout)
    assert resp.status_code == 200, resp.text
    times[f"{name} load ready"].append(ms_since(started))
    first_token(client, url)
    times[f"{name} load first token"].append(ms_since(started))
    unload(client, url)


def corral_on_demand(client: httpx.Client, url: str, name: str, times: Times) -> None:
    started = time.perf_counter()
    first_token(client, url)
    times[f"{name} on demand first token"].append(ms_since(started))
    unload(client, url)


def unload(client: httpx.Client, url: str) -> None:
    client.post(url + "/admin/models/m/unload", params={"force": "true"}).raise_for_status()


def llama_rounds(args: argparse.Namespace, model: Path) -> Times:
    times: Times = collections.defaultdict(list)
    models = {"m": {"model": str(model), "ctx": 4096, "args": QUIET, "ttl": 0}}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=120))
        # At debug level each child line is in the log: the bench reads when the child said
        # it was ready, and when corral knew (phases()).
        handles = {"corral": stack.enter_context(corral_daemon(models, log_level="debug"))}
        if args.baseline:
            code = stack.enter_context(checkout(args.baseline))
            handles["baseline"] = stack.enter_context(
                corral_daemon(models, log_level="debug", code=code))
        daemons = {name: handle.url for name, handle in handles.items()}
        for url in daemons.values():  # warm each daemon's own code paths once
            first_token(client, url)
            unload(client, url)
        skip = {name: len(phases(handle.log)["spawn → ready"]) for name, handle in handles.items()}
        steps: list[Callable[[], None]] = [lambda: bare_llama(client, model, times)]
        for name, url in daemons.items():
            steps.append(lambda n=name, u=url: corral_load(client, u, n, times))  # type: ignore[misc]
            steps.append(lambda n=name, u=url: corral_on_demand(client, u, n, times))  # type: ignore[misc]
        for round_no in range(args.rounds):
            shift = round_no % len(steps)  # each path goes first in turn
            for step in steps[shift:] + steps[:shift]:
                step()
        for name, handle in handles.items():
            for phase, values in phases(handle.log).items():
                times[f"{name} {phase}"] = values[skip[name]:]
    return times


def phases(log: Path, ready_line: str = "model loaded") -> Times:
    """Each start in a daemon's log, in its phases (ms): the model `starting` → its child
    spawned, spawned → `ready`, and the child's own `ready_line` (llama-server's "model
    loaded") → `ready`: how late corral knew, on corral's clock alone."""
    out: Times = collections.defaultdict(list)
    starting = spawned = said = None
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            at = datetime.datetime.fromisoformat(record["timestamp"]).timestamp() * 1000
        except (ValueError, KeyError, TypeError):
            continue
        event = record.get("event")
        if event == "instance.state" and record.get("new") == "starting":
            starting, spawned, said = at, None, None
        elif event == "child.spawned":
            spawned = at
        elif event == "child.output" and ready_line in str(record.get("line")):
            said = at
        elif event == "instance.state" and record.get("new") == "ready" and spawned:
            out["starting → spawned"].append(spawned - (starting or spawned))
            out["spawn → ready"].append(at - spawned)
            if said is not None:
                out["ready line → ready"].append(at - said)
    return out


def bare_vllm(client: httpx.Client, checkpoint: Path, times: Times | None) -> None:
    port, key = free_port(), secrets.token_urlsafe(16)
    env = {**os.environ, "VLLM_API_KEY": key, "VLLM_CPU_KVCACHE_SPACE": "1"}
    headers = {"Authorization": f"Bearer {key}"}
    url = f"http://127.0.0.1:{port}"
    argv = [*VLLM_COMMAND, "--model", str(checkpoint), "--served-model-name", "m", "--host",
            "127.0.0.1", "--port", str(port), "--max-num-seqs", "2", "--max-model-len", "512"]
    with spawned(argv, env) as started:
        poll_until(lambda: healthy(port, headers) and lists(client, url, headers, "m"), 600)
        ready = ms_since(started)
        first_token(client, url, headers)
        if times is not None:
            times["bare ready"].append(ready)
            times["bare first token"].append(ms_since(started))


def vllm_rounds(args: argparse.Namespace, folder: Path) -> Times:
    checkpoint = write_tiny_hf_llama(folder / "tiny-hf")
    times: Times = collections.defaultdict(list)
    # The bare server's KV space, so both allocate the same (corral's own default is sized
    # from the checkpoint, smaller, and starts faster).
    models = {"m": {"backend": "vllm", "model": str(checkpoint), "command": VLLM_COMMAND,
                    "ctx": 512, "parallel": 2, "ttl": 0,
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}
    with corral_daemon(models, stop_timeout=90, log_level="debug") as daemon, \
            httpx.Client(timeout=600) as client:
        # Not counted: the first vLLM start reads its packages from disk and compiles its
        # model graphs into ~/.cache/vllm; later starts reuse both.
        bare_vllm(client, checkpoint, None)
        for round_no in range(args.vllm_rounds):
            steps = [lambda: bare_vllm(client, checkpoint, times),
                     lambda: corral_load(client, daemon.url, "corral", times, timeout=600)]
            for step in steps if round_no % 2 == 0 else steps[::-1]:
                step()
        for phase, values in phases(daemon.log, "Application startup complete").items():
            times[f"corral {phase}"] = values
    return times


def report(title: str, times: Times, rounds: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"\n{title}: medians of {rounds} rounds (ms; rounds min … max)")
    for key, values in times.items():
        if values:
            print(f"  {key:32s} {med[key]:8.1f}   ({min(values):.1f} … {max(values):.1f})")
    for name in ("corral", "baseline"):
        if f"{name} load ready" not in med:
            continue
        late = med[f"{name} load ready"] - med["bare ready"]
        verdict = "met" if late <= TARGET_MS else "MISSED"
        print(f"  {name}: ready {late:+.1f} ms vs bare ready "
              f"(target ≤ +{TARGET_MS:.0f} ms: {verdict})")
        first = med[f"{name} load first token"] - med["bare first token"]
        line = f"  {name}: first token {first:+.1f} ms vs bare after a load"
        if f"{name} on demand first token" in med:
            demand = med[f"{name} on demand first token"] - med["bare first token"]
            line += f", {demand:+.1f} ms on demand"
        print(line)
        per_round = [c - b for c, b in zip(times[f"{name} load ready"], times["bare ready"],
                                           strict=True)]
        print(f"  {name}: ready − bare ready, each round: "
              + " ".join(f"{d:+.0f}" for d in per_round))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", type=Path, help="GGUF to use (default: a tiny test model)")
    parser.add_argument("--baseline", help="git ref of a corral to measure beside this one")
    parser.add_argument("--vllm", action="store_true",
                        help="vLLM's CPU build instead (build/vllm-venv, `make vllm`)")
    parser.add_argument("--vllm-rounds", type=int, default=1)
    args = parser.parse_args()
    print(code_note())
    if args.baseline:
        print(f"baseline: corral at {args.baseline}, its own daemon, same config")
    with tempfile.TemporaryDirectory() as tmp:
        if args.vllm:
            if not VLLM_PYTHON.is_file():
                sys.exit(f"{VLLM_PYTHON} missing: run `make vllm`")
            times = vllm_rounds(args, Path(tmp))
            print(f"machine: {machine_note()}")
            report("vLLM (CPU build, tiny random Llama)", times, args.vllm_rounds)
            return
        model = args.model.resolve() if args.model else tiny_model(Path(tmp))
        times = llama_rounds(args, model)
        print(f"machine: {machine_note()}")
        report(f"llama-server, {model.name}", times, args.rounds)


if __name__ == "__main__":
    main()
