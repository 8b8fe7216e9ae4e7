"""A model split over two local rpc-servers: through corral vs the same processes started by
hand, measured in one run (SmolLM2-135M from ./models, 30 layers, split 15/15).

- cold start to first token: bare = start two rpc-servers, wait until they accept, start the
  head with --rpc/--tensor-split, poll /health, one streamed token; corral = one streamed
  request with the model stopped (corral starts the workers, plans the split, starts the head).
- decode: 128-token completions (ignore_eos), tokens/s straight to the head and through corral.

    python bench/rpc_split.py [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from corral.supervisor.backends.binaries import find_executable
from corral.supervisor.rpc.workers import rpc_server_binary

from _harness import QUIET, code_note, corral, free_port, machine_note

ROOT = Path(__file__).resolve().parent.parent
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
HI = [{"role": "user", "content": "What is the capital of France?"}]


def first_token(client: httpx.Client, url: str) -> None:
    body = {"model": "big", "messages": HI, "max_tokens": 1, "stream": True}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return


def tokens_per_second(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    resp = client.post(url + "/v1/chat/completions", json={
        "model": "big", "messages": HI, "max_tokens": 128, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["completion_tokens"] / (time.perf_counter() - started)


def accepting(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def bare(client: httpx.Client, model: Path, decode_rounds: int) -> tuple[float, list[float]]:
    rpc = rpc_server_binary(None)
    started = time.perf_counter()
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([rpc, "-H", "127.0.0.1", "-p", str(p), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for p in ports]
    try:
        while not all(accepting(p) for p in ports):
            time.sleep(0.002)
        port = free_port()
        procs.append(subprocess.Popen(
            [find_executable(None, ("llama-server",)), "--model", str(model), "--host",
             "127.0.0.1", "--port", str(port), "--ctx-size", "2048", "--parallel", "1",
             "--n-gpu-layers", "-1", *QUIET, "--rpc",
             ",".join(f"127.0.0.1:{p}" for p in ports), "--tensor-split", "15,15"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if client.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.002)
        first_token(client, url)
        cold = time.perf_counter() - started
        return cold, [tokens_per_second(client, url) for _ in range(decode_rounds)]
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, default=SMOL)
    args = parser.parse_args()
    models = {"big": {"model": str(args.model), "ctx": 2048, "args": QUIET,
                      "rpc": {"workers": ["local", "local"]}}}
    bare_cold, via_cold, bare_tps, via_tps = [], [], [], []
    with corral(models) as url, httpx.Client(timeout=300) as client:
        first_token(client, url)  # warm corral's own code paths once, then unload
        client.post(url + "/admin/models/big/unload", params={"force": "true"})
        for _ in range(args.rounds):
            cold, tps = bare(client, args.model, 3)
            bare_cold.append(cold)
            bare_tps += tps
            started = time.perf_counter()
            first_token(client, url)
            via_cold.append(time.perf_counter() - started)
            via_tps += [tokens_per_second(client, url) for _ in range(3)]
            split = [w["layers"] for w in httpx.get(url + "/admin/models").json()["models"][0]
                     ["rpc"]["deployed"]]
            client.post(url + "/admin/models/big/unload", params={"force": "true"})
    med = statistics.median
    print(code_note())
    print(f"machine: {machine_note()}")
    print(f"model: {args.model.name}, two local rpc-servers, corral's split {split}, "
          f"{args.rounds} rounds, medians")
    print(f"cold start to first token  bare {med(bare_cold) * 1000:8.1f} ms   "
          f"corral {med(via_cold) * 1000:8.1f} ms   ratio {med(via_cold) / med(bare_cold):.3f}")
    print(f"decode tokens/s            bare {med(bare_tps):8.1f}      corral {med(via_tps):8.1f}"
          f"      ratio {med(via_tps) / med(bare_tps):.3f}")


if __name__ == "__main__":
    main()
