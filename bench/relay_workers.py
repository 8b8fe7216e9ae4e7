"""Relay workers (`relay_workers`): where a request's CPU goes with and without them, in one run.

Two corral daemons side by side, each with its own bench/fast_upstream.py child (a `command`
model, 64 slots, answers at memory speed): one serves alone (`relay_workers: 0`), the other
through N workers. Rounds alternate between them; each round sends small chat requests at a
fixed concurrency over kept-alive connections. Per daemon it prints requests/s, and the CPU per
request of the daemon process and of its workers (from /proc): the daemon's share is what one
core does for every request of a burst (its serial part), the rest spreads over the workers.

    python bench/relay_workers.py [--workers 2] [--requests 3000] [--concurrency 16]
                                  [--rounds 3] [--log-level info]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import aiohttp
import httpx
import psutil

from _harness import REPO, Corral, corral_daemon, cpu_seconds, machine_note


@contextmanager
def _daemon(workers: int, log_level: str) -> Iterator[Corral]:
    command = [sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port", "${PORT}",
               "--pace-us", "0"]
    models = {"tiny": {"backend": "command", "memory_mb": 64, "parallel": 64, "ttl": 0,
                       "health": "/health", "command": command}}
    with corral_daemon(models, log_level=log_level, prompt_cache={"enabled": False},
                       relay_workers=workers) as handle:
        httpx.post(f"{handle.url}/admin/models/tiny/load", timeout=60).raise_for_status()
        yield handle


def _workers_of(daemon: Corral) -> list[int]:
    return [p.pid for p in psutil.Process(daemon.pid).children()
            if "corral.proxy.workers.main" in " ".join(p.cmdline())]


async def _load(url: str, requests: int, concurrency: int) -> float:
    """`requests` small chats, `concurrency` at a time: the seconds they took."""
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with gate, session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, resp.status
                await resp.read()

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3000, help="per daemon and round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log-level", default="info", help="corral's (info: its default)")
    args = parser.parse_args()
    counts = {"alone": 0, f"{args.workers} workers": args.workers}
    stats: dict[str, dict[str, list[float]]] = {
        name: {"rate": [], "daemon": [], "workers": []} for name in counts}
    with ExitStack() as stack:
        daemons = {name: stack.enter_context(_daemon(n, args.log_level))
                   for name, n in counts.items()}
        for daemon in daemons.values():  # warm: connections, the child, the code paths
            asyncio.run(_load(daemon.url, 500, args.concurrency))
        for r in range(args.rounds):
            names = list(daemons)
            for name in names[r % 2:] + names[:r % 2]:  # each first in turn
                daemon = daemons[name]
                workers = _workers_of(daemon)
                before = cpu_seconds([daemon.pid]), cpu_seconds(workers)
                wall = asyncio.run(_load(daemon.url, args.requests, args.concurrency))
                after = cpu_seconds([daemon.pid]), cpu_seconds(workers)
                stats[name]["rate"].append(args.requests / wall)
                stats[name]["daemon"].append((after[0] - before[0]) * 1e6 / args.requests)
                stats[name]["workers"].append((after[1] - before[1]) * 1e6 / args.requests)
    print(f"machine: {machine_note()}")
    print(f"bench/fast_upstream.py (a command child, 64 slots, memory speed); "
          f"{args.requests} small chats a round at concurrency {args.concurrency}, "
          f"{args.rounds} rounds, daemons alternating; corral's log level {args.log_level}")
    print(f"{'':12s} {'req/s':>8s} {'daemon µs/req':>14s} {'workers µs/req':>15s} "
          f"{'all µs/req':>11s}")
    for name, got in stats.items():
        daemon_us = statistics.median(got["daemon"])
        workers_us = statistics.median(got["workers"])
        print(f"{name:12s} {statistics.median(got['rate']):8.0f} {daemon_us:14.0f} "
              f"{workers_us:15.0f} {daemon_us + workers_us:11.0f}")
    alone, spread = (statistics.median(stats[n]["daemon"]) for n in stats)
    print(f"the daemon's share per request (its serial part): {spread / alone:.2f} of the "
          f"daemon alone's; a burst of 128 waits ~{128 * spread / 1000:.1f} ms for it, "
          f"against ~{128 * alone / 1000:.1f} ms alone (on this machine's cores)")


if __name__ == "__main__":
    main()
