"""Latency corral adds in front of a llama-server, measured in one run.

The same tiny model runs twice: once as a bare llama-server, once as corral's child. The same
requests (one generated token, so the server's own work is small and the proxy's share shows)
go to both, interleaved so drift hits both alike. Prints p50/p99 added latency and the req/s
ratio under concurrency.

    python bench/proxy_overhead.py [--requests 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp

from _harness import QUIET, bare_llama_server, corral, percentile, tiny_model

BODY = {"model": "tiny", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}


async def one(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    return (time.perf_counter() - started) * 1000


async def latencies(direct: str, proxied: str, n: int) -> tuple[list[float], list[float]]:
    d, p = [], []
    async with aiohttp.ClientSession() as session:
        for _ in range(50):  # warm both paths: connections, slots, prompt cache
            await one(session, direct)
            await one(session, proxied)
        for _ in range(n):
            d.append(await one(session, direct))
            p.append(await one(session, proxied))
    return d, p


async def throughput(url: str, n: int, concurrency: int) -> float:
    async with aiohttp.ClientSession() as session:
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                await one(session, url)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        parallel = args.concurrency
        with bare_llama_server(model, parallel) as direct, \
                corral({"tiny": {"model": str(model), "ctx": 4096, "parallel": parallel,
                                 "args": QUIET}},
                       defaults={"max_queue": 1024}) as proxied:
            d, p = asyncio.run(latencies(direct, proxied, args.requests))
            rps_direct = asyncio.run(throughput(direct, args.requests, args.concurrency))
            rps_proxied = asyncio.run(throughput(proxied, args.requests, args.concurrency))
    print(f"requests: {args.requests} sequential each way, then {args.requests} at "
          f"concurrency {args.concurrency}; tiny model, 1 token per request")
    print(f"direct   p50 {percentile(d, 50):7.3f} ms   p99 {percentile(d, 99):7.3f} ms")
    print(f"corral   p50 {percentile(p, 50):7.3f} ms   p99 {percentile(p, 99):7.3f} ms")
    print(f"added    p50 {percentile(p, 50) - percentile(d, 50):7.3f} ms   "
          f"p99 {percentile(p, 99) - percentile(d, 99):7.3f} ms")
    print(f"req/s    direct {rps_direct:8.1f}   corral {rps_proxied:8.1f}   "
          f"ratio {rps_proxied / rps_direct:.3f}")


if __name__ == "__main__":
    main()
