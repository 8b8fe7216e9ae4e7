"""16 concurrent streams through corral, beside the same child direct and through nginx, in one
run: output tokens/s, time to first token and inter-token gaps, like `vllm bench serve`
(prompts of ~64 tokens in, 128 out, 16 at a time).

One tiny model, one llama-server child (corral's own, parallel 16); every path sends the same
requests (temperature 0, ignore_eos: each stream is exactly --tokens events) to that child.
Paths alternate by round, in rotating order. Targets (issue 27):

    corral tokens/s / direct tokens/s >= 0.95
    corral TTFT p50 - direct TTFT p50 <= 5 ms

    python bench/concurrent_streams.py [--requests 96] [--concurrency 16] [--tokens 128]
                                       [--rounds 4] [--proxy-core]

--proxy-core: the proxies (corral, nginx) on the last CPU, the client and the child on the
others. On a 2-core box the proxy otherwise takes its CPU from the child and the client, and
even nginx stays under 0.95 of direct; on a GPU box the child computes on the GPU and the relay
has a core to itself. This shows whether the relay keeps up when it has that core.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import httpx

from _harness import (
    NGINX_MISSING,
    Endpoint,
    cpu_seconds,
    machine_note,
    percentile,
    pin_to_cpus,
    spread,
    stream_arrivals,
    three_paths,
    tiny_model,
)

TARGET_TOKENS_RATIO = 0.95
TARGET_TTFT_MS = 5.0
# ~64 tokens of prompt with the tiny model's byte-level vocab would be 64 bytes: words of it.
PROMPT = " ".join(["lorem ipsum dolor sit amet"] * 3)[:64]


async def one(session: aiohttp.ClientSession, to: Endpoint, tokens: int,
              ) -> tuple[float, list[float], int] | None:
    """TTFT ms, inter-event gaps ms, and the content events of one stream; None when it
    failed (nginx answers 502 when llama-server closed the kept-alive connection it picked)."""
    try:
        return await _one(session, to, tokens)
    except (aiohttp.ClientError, AssertionError):
        return None


async def _one(session: aiohttp.ClientSession, to: Endpoint, tokens: int,
               ) -> tuple[float, list[float], int]:
    body = {"model": "tiny", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    _, events = await stream_arrivals(session, to, body)
    return events[0], [b - a for a, b in itertools.pairwise(events)], len(events)


async def batch(session: aiohttp.ClientSession, to: Endpoint, n: int, concurrency: int,
                tokens: int, failed: Counter[str]) -> tuple[float, list[float], list[float]]:
    """Output events/s over the batch, every request's TTFT, every gap."""
    queue = iter(range(n))
    ttft: list[float] = []
    gaps: list[float] = []
    events = 0

    async def worker() -> None:
        nonlocal events
        for _ in queue:
            got = await one(session, to, tokens)
            if got is None:
                failed[to.url] += 1
                continue
            first, between, count = got
            ttft.append(first)
            gaps.extend(between)
            events += count

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return events / (time.perf_counter() - started), ttft, gaps


async def measure(urls: dict[str, Endpoint], pids: dict[str, list[int]], n: int,
                  concurrency: int, tokens: int, rounds: int,
                  ) -> tuple[list[dict[str, float]], dict[str, list[float]],
                             dict[str, list[float]], dict[str, float]]:
    rates: list[dict[str, float]] = []
    ttft: dict[str, list[float]] = {name: [] for name in urls}
    gaps: dict[str, list[float]] = {name: [] for name in urls}
    cpu = {name: 0.0 for name in pids}
    failed: Counter[str] = Counter()
    names = list(urls)
    # A connection per stream: llama-server closes one after each streamed answer while
    # still saying keep-alive, and a pooled one then fails the next request (direct only).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for name in names:  # warm every path
            await batch(session, urls[name], concurrency, concurrency, 8, Counter())
        for r in range(rounds):
            rate: dict[str, float] = {}
            for name in names[r % len(names):] + names[:r % len(names)]:
                before = cpu_seconds(pids.get(name, []))
                rate[name], t, g = await batch(session, urls[name], n, concurrency, tokens,
                                               failed)
                if name in pids:
                    cpu[name] += cpu_seconds(pids[name]) - before
                ttft[name] += t
                gaps[name] += g
            rates.append(rate)
    events = n * tokens * rounds
    for name, to in urls.items():
        print(f"{name}: {failed[to.url]} of {n * rounds} streams failed")
    return rates, ttft, gaps, {k: v * 1e6 / events for k, v in cpu.items()}


def _give_proxies_a_core(urls: dict[str, Endpoint], pids: dict[str, list[int]]) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--proxy-core needs 2 CPUs or more")
    proxy_cpu, rest = {cpus[-1]}, set(cpus[:-1])
    child = httpx.get(urls["corral"].url + "/admin/models", timeout=10).json()["models"][0]
    for pid in [os.getpid(), child["pid"]]:
        pin_to_cpus(pid, rest)
    for proxy_pids in pids.values():
        for pid in proxy_pids:
            pin_to_cpus(pid, proxy_cpu)
    print(f"proxies on CPU {cpus[-1]}, the client and the child (pid {child['pid']}) on CPUs "
          f"{', '.join(map(str, sorted(rest)))}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=96, help="per path and round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--proxy-core", action="store_true",
                        help="the proxies on the last CPU, the client and the child on the rest")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        with three_paths(model, args.concurrency, ctx=4096 * 4,
                         defaults={"max_queue": 1024}) as (urls, pids):
            if args.proxy_core:
                _give_proxies_a_core(urls, pids)
            rates, ttft, gaps, cpu = asyncio.run(
                measure(urls, pids, args.requests, args.concurrency, args.tokens, args.rounds))
            print(f"machine: {machine_note()}")
    print(f"{args.requests} streams per path and round at concurrency {args.concurrency}, "
          f"{args.tokens} tokens each (prompt {len(PROMPT)} bytes), {args.rounds} rounds; "
          f"upstream: llama-server with the tiny test model, parallel {args.concurrency}")
    d_rate = statistics.median(r["direct"] for r in rates)
    d_ttft = percentile(ttft["direct"], 50)
    for name in urls:
        rate = statistics.median(r[name] for r in rates)
        line = (f"{name:7s} tokens/s {rate:8.0f}   TTFT p50 {percentile(ttft[name], 50):7.2f} ms "
                f"p99 {percentile(ttft[name], 99):7.2f}   ITL p50 {percentile(gaps[name], 50):.3f}"
                f" p99 {percentile(gaps[name], 99):.3f} ms")
        if name != "direct":
            added = percentile(ttft[name], 50) - d_ttft
            line += (f"   of direct {rate / d_rate:.3f}  TTFT {added:+.2f} ms   "
                     f"CPU {cpu[name]:.1f} µs/token")
        print(line)
    ratios = [r["corral"] / r["direct"] for r in rates]
    print(f"corral tokens/s of direct per round: {spread(ratios, '{:.3f}')}")
    if "nginx" in urls:
        print(f"nginx  tokens/s of direct per round: "
              f"{spread([r['nginx'] / r['direct'] for r in rates], '{:.3f}')}")
    else:
        print(NGINX_MISSING)
    ratio = statistics.median(ratios)
    added = percentile(ttft["corral"], 50) - d_ttft
    print(f"target tokens/s >= {TARGET_TOKENS_RATIO:.0%} of direct: "
          f"{'met' if ratio >= TARGET_TOKENS_RATIO else 'NOT met'} ({ratio:.3f});  "
          f"target TTFT within +{TARGET_TTFT_MS:g} ms: "
          f"{'met' if added <= TARGET_TTFT_MS else 'NOT met'} ({added:+.2f} ms)")


if __name__ == "__main__":
    main()
