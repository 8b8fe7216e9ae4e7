"""Cold start through corral vs a bare llama-server start, measured in one run.

Bare: spawn llama-server, poll /health every 2 ms, then ask for one streamed token.
corral: the model is stopped; one streamed request arrives; corral spawns, health-gates and
relays. Both times run to the first token of the same request. Prints each, the difference
and the ratio; repeated, with the model unloaded between rounds.

    python bench/cold_start.py [--rounds 5] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from _harness import (
    QUIET,
    code_note,
    corral,
    free_port,
    llama_server_argv,
    machine_note,
    tiny_model,
)

BODY = {"model": "m", "max_tokens": 1, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}


def first_token(client: httpx.Client, url: str) -> None:
    with client.stream("POST", url + "/v1/chat/completions", json=BODY) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return


def bare(client: httpx.Client, model: Path) -> tuple[float, float]:
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(llama_server_argv(model, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:  # as tight a health poll as a client can do: 1 ms apart, one client
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.001)
        healthy = time.perf_counter() - started
        first_token(client, f"http://127.0.0.1:{port}")
        return healthy * 1000, (time.perf_counter() - started) * 1000
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def through_corral(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    first_token(client, url)
    elapsed = (time.perf_counter() - started) * 1000
    client.post(url + "/admin/models/m/unload", params={"force": "true"})
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path, help="GGUF to use (default: a tiny test model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp))
        healthy, bare_first, via = [], [], []
        with corral({"m": {"model": str(model), "ctx": 4096, "args": QUIET}}) as url, \
                httpx.Client(timeout=120) as client:
            first_token(client, url)  # warm corral's own code paths once, then unload
            client.post(url + "/admin/models/m/unload", params={"force": "true"})
            for _ in range(args.rounds):
                h, f = bare(client, model)
                healthy.append(h)
                bare_first.append(f)
                via.append(through_corral(client, url))
    print(code_note())
    print(f"machine: {machine_note()}")
    med = statistics.median
    print(f"model: {model.name}, {args.rounds} rounds, medians")
    print(f"bare llama-server  start→healthy {med(healthy):8.1f} ms   "
          f"start→first token {med(bare_first):8.1f} ms")
    print(f"through corral     request→first token {med(via):8.1f} ms")
    print(f"corral - bare      {med(via) - med(bare_first):+8.1f} ms   "
          f"ratio {med(via) / med(bare_first):.3f}")


if __name__ == "__main__":
    main()
