"""Latency corral adds in front of a llama-server, measured in one run, beside nginx as a
reference reverse proxy when nginx is installed.

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

from _harness import QUIET, bare_llama_server, corral, nginx_proxy, percentile, tiny_model

BODY = {"model": "tiny", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}


async def one(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    return (time.perf_counter() - started) * 1000


async def latencies(urls: dict[str, str], n: int) -> dict[str, list[float]]:
    """Interleaved: each round asks every path once, so drift hits all alike."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession() as session:
        for _ in range(50):  # warm every path: connections, slots, prompt cache
            for url in urls.values():
                await one(session, url)
        for _ in range(n):
            for name, url in urls.items():
                out[name].append(await one(session, url))
    return out


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
        with bare_llama_server(model, parallel) as direct, nginx_proxy(direct) as nginx, \
                corral({"tiny": {"model": str(model), "ctx": 4096, "parallel": parallel,
                                 "args": QUIET}},
                       defaults={"max_queue": 1024}) as proxied:
            urls = {"direct": direct, "corral": proxied}
            if nginx:
                urls["nginx"] = nginx
            lat = asyncio.run(latencies(urls, args.requests))
            rps = {name: asyncio.run(throughput(url, args.requests, args.concurrency))
                   for name, url in urls.items()}
    print(f"requests: {args.requests} sequential per path (interleaved), then {args.requests} "
          f"at concurrency {args.concurrency}; tiny model, 1 token per request")
    d = lat["direct"]
    for name, values in lat.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        added = "" if name == "direct" else (
            f"   added p50 {p50 - percentile(d, 50):+7.3f} ms"
            f"  p99 {p99 - percentile(d, 99):+7.3f} ms"
            f"   req/s ratio {rps[name] / rps['direct']:.3f}")
        print(f"{name:7s} p50 {p50:7.3f} ms   p99 {p99:7.3f} ms   {rps[name]:7.1f} req/s{added}")
    if "nginx" not in lat:
        print("nginx    not installed: `apt-get install nginx` adds it as a reference proxy")


if __name__ == "__main__":
    main()
