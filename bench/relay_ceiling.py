"""The ceiling of corral's one process: how many stream chunks and small requests a second it
relays when the upstream is not the limit, and what happens past that.

The upstream is bench/fast_upstream.py (aiohttp, answers at memory speed), run by corral as a
`command` child (parallel 64). For each load, the same requests go straight to the child and
through corral, alternating, for --seconds each:

- streams: C concurrent streams of --tokens events each, read as they come;
- small: C concurrent one-shot chats (a small JSON answer each).

Per load it prints chunks/s (or req/s) through corral and direct, corral's CPU use (1.00 = one
core busy all the time), corral's CPU per chunk (or request), and the requests that did not
come back 200 (a lost request would show here: an exception or a wrong status). Past
`parallel`, requests wait in corral's queue (max_queue is raised so that none is refused):
the added latency is the back-pressure, and none may be lost. A slow reader is also run: one
stream whose client reads nothing for a while; corral's memory must not grow with what the
child produced (the relay stops reading the child while the client is behind).

On a 2-core machine the client, the upstream and corral share the cores: the ceiling of one
core is extrapolated as throughput / corral's CPU use, and said so.

    python bench/relay_ceiling.py [--seconds 5] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import httpx
import psutil

from _harness import Endpoint, code_note, corral_daemon, cpu_seconds, machine_note, percentile

HERE = Path(__file__).resolve().parent
PARALLEL = 64


async def run_load(to: Endpoint, seconds: float, concurrency: int, stream: bool,
                   tokens: int) -> tuple[int, int, Counter[str], list[float]]:
    """(requests done, chunks received, failures by kind, latencies ms) over `seconds`."""
    body = {"model": "fast", "max_tokens": tokens if stream else 8, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}
    done = chunks = 0
    failed: Counter[str] = Counter()
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal done, chunks
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    async with session.post(to.url + "/v1/chat/completions", json=body,
                                            headers=to.headers) as resp:
                        if stream:
                            tail = b""
                            async for data in resp.content.iter_any():
                                chunks += (tail[-6:] + data).count(b"data: ")
                                tail = data
                            ok = tail.endswith(b"data: [DONE]\n\n")
                        else:
                            ok = b'"usage"' in await resp.read()
                    if resp.status != 200 or not ok:
                        failed[f"HTTP {resp.status}" + ("" if ok else " (cut short)")] += 1
                except (TimeoutError, aiohttp.ClientError) as exc:
                    failed[type(exc).__name__] += 1
                done += 1
                latencies.append((time.perf_counter() - started) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, chunks, failed, latencies


async def slow_reader(to: Endpoint, pid: int, tokens: int, pause: float) -> tuple[float, bool]:
    """One stream whose client reads its head, then nothing for `pause` s: corral's RSS growth
    over that pause (MiB), and whether the whole stream still arrives afterwards."""
    body = {"model": "fast", "max_tokens": tokens, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    proc = psutil.Process(pid)
    before = proc.memory_info().rss
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=2**16) as session, \
            session.post(to.url + "/v1/chat/completions", json=body) as resp:
        await asyncio.sleep(pause)
        grown = (proc.memory_info().rss - before) / 2**20
        tail = b""
        async for data in resp.content.iter_any():
            tail = (tail + data)[-64:]
    return grown, tail.endswith(b"data: [DONE]\n\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--streams", default="16,64,256", help="concurrencies, streams")
    parser.add_argument("--small", default="8,64,256", help="concurrencies, small requests")
    args = parser.parse_args()
    models = {"fast": {"backend": "command", "memory_mb": 64, "parallel": PARALLEL, "ttl": 0,
                       "max_queue": 100000, "health": "/health",
                       "command": [sys.executable, str(HERE / "fast_upstream.py"), "--port",
                                   "${PORT}"]}}
    print(code_note())
    with corral_daemon(models) as proxied:
        httpx.post(f"{proxied.url}/admin/models/fast/load", timeout=60).raise_for_status()
        desc = httpx.get(f"{proxied.url}/admin/models", timeout=10).json()["models"][0]
        paths = {"direct": Endpoint(f"http://127.0.0.1:{desc['port']}", {}),
                 "corral": proxied.endpoint}
        print(f"machine: {machine_note()}")
        print(f"upstream: bench/fast_upstream.py as corral's command child (parallel "
              f"{PARALLEL}); {args.seconds:g} s per load and path, direct and corral "
              f"alternating; streams of {args.tokens} events")
        loads = [("streams", int(c), True) for c in args.streams.split(",")] + \
                [("small", int(c), False) for c in args.small.split(",")]
        lost = 0
        for kind, concurrency, stream in loads:
            results = {}
            for name in (("direct", "corral") if concurrency % 2 else ("corral", "direct")):
                asyncio.run(run_load(paths[name], 0.5, concurrency, stream, args.tokens))
                cpu0, t0 = cpu_seconds([proxied.pid]), time.perf_counter()
                done, chunks, failed, lat = asyncio.run(
                    run_load(paths[name], args.seconds, concurrency, stream, args.tokens))
                wall = time.perf_counter() - t0
                results[name] = (done, chunks, failed, lat, wall, cpu_seconds([proxied.pid]) - cpu0)
            d_done, d_chunks, _, d_lat, d_wall, _ = results["direct"]
            done, chunks, failed, lat, wall, cpu = results["corral"]
            lost += sum(failed.values())
            use = cpu / wall
            if stream:
                rate, d_rate, unit = chunks / wall, d_chunks / d_wall, "chunks/s"
                per = cpu * 1e6 / max(chunks, 1)
            else:
                rate, d_rate, unit = done / wall, d_done / d_wall, "req/s"
                per = cpu * 1e6 / max(done, 1)
            print(f"{kind:7s} c{concurrency:<4d} corral {rate:9.0f} {unit} (direct {d_rate:9.0f}, "
                  f"ratio {rate / d_rate:.2f})   corral CPU use {use:.2f} core, "
                  f"{per:6.1f} µs per {'chunk' if stream else 'request'} -> one core: "
                  f"{1e6 / per:9.0f} {unit}   latency p50 {percentile(lat, 50):.1f} ms "
                  f"(direct {percentile(d_lat, 50):.1f}) p99 {percentile(lat, 99):.1f} ms   "
                  f"not 200: {dict(failed) or 0} of {done}")
        grown, whole = asyncio.run(slow_reader(paths["corral"], proxied.pid, 200_000, 3.0))
        print(f"slow reader: a {200_000}-event stream (~{200_000 * 190 / 2**20:.0f} MiB) read "
              f"after a 3 s pause: corral's RSS grew {grown:.1f} MiB over the pause; "
              f"{'arrived whole' if whole else 'CUT SHORT'}")
        print(f"lost or failed requests in all loads: {lost}")
        return 0 if lost == 0 and whole else 1


if __name__ == "__main__":
    sys.exit(main())
