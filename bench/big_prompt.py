"""What a 100 KB request body costs corral (read, JSON parse, relay), measured in one run.

The same non-streamed request (one generated token) goes straight to corral's child, through
corral, and through nginx when installed, interleaved request by request, with three bodies:

- a 100 KB prompt. The tiny model's vocab merges runs of "x" into a few tokens (see
  tiny_model_with_runs), so the prompt is ~50 tokens, prompt-cached, but the child still
  tokenizes 100 K characters (~45 ms here: this path is end to end, and noisy);
- the same 100 KB carried in a field the child parses but ignores ("metadata"): the proxies
  do exactly the same work as for the prompt (corral reads and parses the whole body either
  way) and the child's share is ~1 ms, so the body's cost to the proxy shows clearly;
- a small prompt, for the per-request baseline.

Prints each path's p50, the added ms over direct (with the per-round spread), the proxies'
CPU ms per request, and what the 100 KB adds over the small body.

    python bench/big_prompt.py [--requests 300] [--prompt-requests 60] [--rounds 3] [--kb 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from _harness import (
    NGINX_MISSING,
    RUN_CHAR,
    Endpoint,
    cpu_seconds,
    machine_note,
    percentile,
    spread,
    three_paths,
    tiny_model_with_runs,
)


def prompt(size: int) -> str:
    block = RUN_CHAR * 4096 + "\n"  # "\n" is escaped in JSON, as a real prompt's newlines are
    return (block * (size // len(block) + 1))[:size]


def body(content: str, ignored: str | None = None) -> bytes:
    payload: dict[str, object] = {"model": "tiny", "max_tokens": 1, "temperature": 0,
                                  "messages": [{"role": "user", "content": content}]}
    if ignored is not None:
        payload["metadata"] = {"note": ignored}
    return json.dumps(payload).encode()


async def one(session: aiohttp.ClientSession, to: Endpoint, data: bytes) -> float:
    started = time.perf_counter()
    async with session.post(to.url + "/v1/chat/completions", data=data,
                            headers={"Content-Type": "application/json", **to.headers}) as resp:
        payload = await resp.read()
        assert resp.status == 200, (resp.status, payload[:300])
    return (time.perf_counter() - started) * 1000


async def measure(urls: dict[str, Endpoint], pids: dict[str, list[int]],
                  bodies: dict[str, tuple[bytes, int]], rounds: int,
                  ) -> tuple[dict[str, list[dict[str, list[float]]]], dict[str, dict[str, float]]]:
    """{body kind: [per round {path: latencies}]}, {body kind: {proxy: CPU ms per request}}.
    `bodies` maps a kind to (body, requests per path per round)."""
    out: dict[str, list[dict[str, list[float]]]] = {kind: [] for kind in bodies}
    cpu = {kind: dict.fromkeys(pids, 0.0) for kind in bodies}
    async with aiohttp.ClientSession() as session:
        for data, _ in bodies.values():  # warm-up: connections, the child's prompt cache
            for _ in range(5):
                for url in urls.values():
                    await one(session, url, data)
        for _ in range(rounds):
            for kind, (data, n) in bodies.items():
                lat: dict[str, list[float]] = {name: [] for name in urls}
                for _ in range(n):
                    for name, url in urls.items():
                        before = cpu_seconds(pids.get(name, []))
                        lat[name].append(await one(session, url, data))
                        if name in pids:
                            cpu[kind][name] += cpu_seconds(pids[name]) - before
                out[kind].append(lat)
    return out, {kind: {p: t * 1000 / (bodies[kind][1] * rounds) for p, t in c.items()}
                 for kind, c in cpu.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300,
                        help="per path, for the small and the ignored-field bodies, in all")
    parser.add_argument("--prompt-requests", type=int, default=60,
                        help="per path, for the 100 KB prompt (the child takes ~45 ms each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kb", type=int, default=100)
    args = parser.parse_args()
    size = args.kb * 1024
    per_round = max(1, args.requests // args.rounds)
    bodies = {
        f"{args.kb} KB prompt": (body(prompt(size)), max(1, args.prompt_requests // args.rounds)),
        f"{args.kb} KB ignored field": (body("hi", ignored=prompt(size)), per_round),
        "small": (body("hi"), per_round),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_with_runs(Path(tmp))
        with three_paths(model, 1) as (urls, pids):
            lat, cpu = asyncio.run(measure(urls, pids, bodies, args.rounds))
            print(f"machine: {machine_note()}")

    print(f"{args.rounds} rounds, paths interleaved request by request; one generated token")

    def added(kind: str, name: str) -> list[float]:
        return [percentile(r[name], 50) - percentile(r["direct"], 50) for r in lat[kind]]

    def p50(kind: str, name: str) -> float:
        return percentile([v for r in lat[kind] for v in r[name]], 50)

    for kind, (data, n) in bodies.items():
        print(f"{kind} ({len(data):,} bytes, {n * args.rounds} requests per path):")
        for name in urls:
            line = f"  {name:7s} p50 {p50(kind, name):7.3f} ms"
            if name != "direct":
                line += (f"   added p50 {p50(kind, name) - p50(kind, 'direct'):+.3f} ms, "
                         f"per round {spread(added(kind, name))}   "
                         f"CPU {cpu[kind][name]:.3f} ms/request")
            print(line)
    print("what the 100 KB adds over the small body (added p50 difference per round; CPU):")
    for kind in list(bodies)[:2]:
        for name in urls:
            if name != "direct":
                extra = [b - s for b, s in zip(added(kind, name), added("small", name),
                                               strict=True)]
                print(f"  {kind:22s} {name:7s} {spread(extra)} ms   "
                      f"CPU {cpu[kind][name] - cpu['small'][name]:+.3f} ms")
    if "nginx" not in urls:
        print(NGINX_MISSING)


if __name__ == "__main__":
    main()
