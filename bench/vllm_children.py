"""vLLM children through corral vs a bare vLLM, measured in one run (vLLM's CPU build from
build/vllm-venv, `make vllm`; a tiny random Llama checkpoint from tests/tinyhf.py).

- cold start, after one uncounted start that warms the disk and compile caches: a bare
  `python -m vllm.entrypoints.openai.api_server` polled until /v1/models lists the model, then
  one streamed token; vs one streamed request to corral with the model stopped (corral spawns,
  waits for /health and /v1/models, relays). Ratio and difference.
- warm requests: one-token chats straight to corral's vLLM child and through corral,
  interleaved; added p50/p90.
- memory: corral's estimate from config.json and the safetensors headers against the child's
  measured RAM (its three processes).

    python bench/vllm_children.py [--rounds 2] [--requests 30]
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _harness import code_note, corral_daemon, free_port, machine_note, percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tinyhf import write_tiny_hf_llama  # noqa: E402

PYTHON = Path(os.environ.get("CORRAL_VLLM_PYTHON", ROOT / "build/vllm-venv/bin/python"))
COMMAND = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
BODY = {"model": "v", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def first_token(client: httpx.Client, url: str, headers: dict[str, str]) -> None:
    with client.stream("POST", url + "/v1/chat/completions", headers=headers,
                       json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return


def bare(client: httpx.Client, checkpoint: Path) -> float:
    port, key = free_port(), secrets.token_urlsafe(16)
    env = {**os.environ, "VLLM_API_KEY": key, "VLLM_CPU_KVCACHE_SPACE": "1"}
    headers = {"Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*COMMAND, "--model", str(checkpoint), "--served-model-name", "v", "--host",
         "127.0.0.1", "--port", str(port), "--max-num-seqs", "2", "--max-model-len", "512"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None, "vLLM exited during start"
            try:
                listed = client.get(url + "/v1/models", headers=headers).json()
                if any(m.get("id") == "v" for m in listed.get("data", [])):
                    break
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.05)
        first_token(client, url, headers)
        return time.perf_counter() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def child_headers(pid: int) -> dict[str, str]:
    """corral's per-start key for its child, read where the child reads it (same user)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = entry.partition(b"=")
        if name == b"VLLM_API_KEY":
            return {"Authorization": f"Bearer {value.decode()}"}
    return {}


def timed(client: httpx.Client, url: str, headers: dict[str, str]) -> float:
    started = time.perf_counter()
    resp = client.post(url + "/v1/chat/completions", headers=headers, json=BODY)
    assert resp.status_code == 200, resp.text
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2, help="cold starts of each kind")
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    if not PYTHON.is_file():
        sys.exit(f"{PYTHON} missing: run `make vllm`")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_tiny_hf_llama(Path(tmp) / "tiny-hf")
        models = {"v": {"backend": "vllm", "model": str(checkpoint), "command": COMMAND,
                        "ctx": 512, "parallel": 2}}
        bare_s, corral_s, direct_ms, via_ms = [], [], [], []
        memory: dict[str, object] = {}
        with corral_daemon(models, stop_timeout=90) as daemon, \
                httpx.Client(timeout=600) as client:
            # Not counted: the first vLLM start on a machine reads its packages from disk and
            # compiles its model graphs into ~/.cache/vllm; later starts reuse both.
            bare(client, checkpoint)
            for round_no in range(args.rounds):
                # Alternate which goes first: back-to-back vLLM starts on 2 cores differ by
                # several seconds from order alone.
                if round_no % 2 == 0:
                    bare_s.append(bare(client, checkpoint))
                if corral_s:
                    client.post(daemon.url + "/admin/models/v/unload")
                started = time.perf_counter()
                first_token(client, daemon.url, {})
                corral_s.append(time.perf_counter() - started)
                if round_no % 2 == 1:
                    client.post(daemon.url + "/admin/models/v/unload")  # one vLLM at a time
                    bare_s.append(bare(client, checkpoint))
                    first_token(client, daemon.url, {})  # loaded again for what follows
            state = {m["name"]: m for m in client.get(daemon.url + "/admin/models").json()
                     ["models"]}["v"]
            child = f"http://127.0.0.1:{state['port']}"
            headers = child_headers(state["pid"])
            for _ in range(args.requests):
                direct_ms.append(timed(client, child, headers))
                via_ms.append(timed(client, daemon.url, {}))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not memory.get("measured_mib"):
                memory = {m["name"]: m for m in client.get(daemon.url + "/admin/memory")
                          .json()["models"]}["v"]
                time.sleep(0.5)
    print(code_note())
    print(f"machine: {machine_note()}")
    med = statistics.median
    print(f"cold start to first token, {args.rounds} round(s), medians:")
    print(f"  bare vLLM        {med(bare_s):7.1f} s")
    print(f"  through corral   {med(corral_s):7.1f} s   "
          f"corral - bare {med(corral_s) - med(bare_s):+.1f} s   "
          f"ratio {med(corral_s) / med(bare_s):.3f}")
    print(f"warm one-token chats, {args.requests} each, interleaved:")
    print(f"  direct p50 {med(direct_ms):7.1f} ms  p90 {percentile(direct_ms, 90):7.1f} ms")
    print(f"  corral p50 {med(via_ms):7.1f} ms  p90 {percentile(via_ms, 90):7.1f} ms   "
          f"added p50 {med(via_ms) - med(direct_ms):+.2f} ms   "
          f"ratio {med(via_ms) / med(direct_ms):.3f}")
    estimate = memory.get("estimate_mib", {}).get("cpu")  # type: ignore[union-attr]
    measured = (memory.get("measured_mib") or {}).get("cpu")  # type: ignore[union-attr]
    if estimate and measured:
        print(f"memory: estimate {estimate:.0f} MiB, measured {measured:.0f} MiB "
              f"({(estimate - measured) / measured * 100:+.1f} %)")
    else:
        print(f"memory: not measured within 30 s ({memory})")


if __name__ == "__main__":
    main()
