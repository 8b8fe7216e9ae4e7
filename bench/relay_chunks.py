"""What corral costs per relayed chunk of a long stream, measured in one run.

One tiny model, one llama-server child (corral's own). The same streamed request (1,000
generated tokens: max_tokens + ignore_eos, temperature 0, so every run is the same stream) goes
straight to that child, through corral, and through nginx (proxy_buffering off) when installed,
in rotating order, for several rounds. Per path: request → [DONE] wall time, the SSE events
received, the inter-event gaps the client sees (p50/p99/max), and the proxy's own CPU time.

    cost per chunk = (corral's wall time - direct's wall time) / events      target <= 0.2 ms

The stream is paced by the child's generation (~0.5 ms a token here), so a proxy's per-chunk
work mostly overlaps with it; what shows in wall time is what it delays. CPU ms per chunk is
the proxy's own work, whether it delays the stream or not (on 2 cores it is taken from the
child and the client).

    python bench/relay_chunks.py [--tokens 1000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
from pathlib import Path

import aiohttp

from _harness import (
    NGINX_MISSING,
    Endpoint,
    cpu_seconds,
    machine_note,
    paced_paths,
    percentile,
    spread,
    stream_arrivals,
    three_paths,
    tiny_model,
)

TARGET_MS_PER_CHUNK = 0.2
TARGET_CPU_US_PER_CHUNK = 20  # issue 27: corral's own CPU per relayed SSE chunk


async def stream(session: aiohttp.ClientSession, to: Endpoint,
                 tokens: int) -> tuple[float, list[float]]:
    """Wall ms request → [DONE], and each data event's arrival time (ms from the start)."""
    body = {"model": "tiny", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    return await stream_arrivals(session, to, body)


def read_calls(pids: list[int]) -> int:
    """read() system calls these processes made so far (/proc/PID/io syscr; needs the right
    to read it: the same user or root). uvloop reads sockets with read(): one per arrival."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("syscr:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return total


def gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals)]


async def measure(urls: dict[str, Endpoint], pids: dict[str, list[int]], tokens: int,
                  rounds: int) -> tuple[list[dict[str, float]], dict[str, list[float]],
                                        dict[str, int], dict[str, float]]:
    walls: list[dict[str, float]] = []
    all_gaps: dict[str, list[float]] = {name: [] for name in urls}
    events: dict[str, int] = {}
    cpu = {name: 0.0 for name in pids}
    per_event: dict[str, list[float]] = {name: [] for name in pids}  # µs, per round
    per_read: dict[str, list[float]] = {name: [] for name in pids}  # read calls per event
    per_call: dict[str, list[float]] = {name: [] for name in pids}  # µs per read call
    names = list(urls)
    async with aiohttp.ClientSession() as session:
        for name in names:  # warm-up: connections, the child's prompt cache
            await stream(session, urls[name], 50)
        for r in range(rounds):
            wall: dict[str, float] = {}
            for name in names[r % len(names):] + names[:r % len(names)]:
                before = cpu_seconds(pids.get(name, []))
                reads = read_calls(pids.get(name, []))
                wall[name], arrivals = await stream(session, urls[name], tokens)
                if name in pids:
                    spent = cpu_seconds(pids[name]) - before
                    cpu[name] += spent
                    per_event[name].append(spent * 1e6 / len(arrivals))
                    reads = read_calls(pids[name]) - reads
                    per_read[name].append(reads / len(arrivals))
                    if reads:
                        per_call[name].append(spent * 1e6 / reads)
                all_gaps[name] += gaps(arrivals)
                events[name] = len(arrivals)
            walls.append(wall)
    for name, values in per_event.items():
        print(f"CPU per event, {name}: {spread(values, '{:.1f}')} µs; read() calls per event "
              f"{spread(per_read[name], '{:.2f}')} (events that come together cost one read: "
              f"fewer reads, less CPU per event; nginx's recv() is not counted)")
        if per_call[name]:
            print(f"    CPU per read() call, {name}: {spread(per_call[name], '{:.1f}')} µs")
    return walls, all_gaps, events, {n: t * 1000 / rounds for n, t in cpu.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--baseline", metavar="REF",
                        help="also relay through corral at this git ref (A/B in one run)")
    parser.add_argument("--paced", type=int, metavar="US",
                        help="stream from bench/fast_upstream.py, an event every US µs, "
                             "instead of llama-server (whose events often come together)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.paced:
            opened = paced_paths(args.paced, baseline=args.baseline)
        else:
            opened = three_paths(tiny_model(Path(tmp)), 1, baseline=args.baseline)
        with opened as (urls, pids):
            walls, all_gaps, events, cpu = asyncio.run(
                measure(urls, pids, args.tokens, args.rounds))
            print(f"machine: {machine_note()}")

    n = events["direct"]
    kind = (f"bench/fast_upstream.py, an event every {args.paced} µs" if args.paced else
            "llama-server; byte tokens that end mid-UTF-8 are sent together")
    print(f"one stream of {args.tokens} tokens = {n} SSE events ({kind}), {args.rounds} rounds "
          f"per path, rotating order")
    for name in urls:
        w = [r[name] for r in walls]
        g = all_gaps[name]
        line = (f"{name:7s} wall {statistics.median(w):7.1f} ms   gap p50 {percentile(g, 50):.3f} "
                f"p90 {percentile(g, 90):.3f} p99 {percentile(g, 99):.3f} max {max(g):.2f} ms")
        if name in cpu:
            line += f"   CPU {cpu[name] * 1000 / events[name]:.1f} µs/event"
        print(line)
    print(f"per-chunk cost = (proxy wall - direct wall) / {n} events, per round; "
          f"the spread is this run's noise:")
    per_chunk: dict[str, list[float]] = {}
    for name in urls:
        if name != "direct":
            per_chunk[name] = [(r[name] - r["direct"]) / n for r in walls]
            added_gap = [percentile(all_gaps[name], q) - percentile(all_gaps["direct"], q)
                         for q in (50, 99)]
            print(f"  {name:7s} {spread(per_chunk[name], '{:+.4f}')} ms/chunk;  added gap "
                  f"p50 {added_gap[0]:+.3f} ms  p99 {added_gap[1]:+.3f} ms")
    if "nginx" not in urls:
        print(NGINX_MISSING)
    cost = statistics.median(per_chunk["corral"])
    print(f"target corral <= {TARGET_MS_PER_CHUNK} ms per chunk: "
          f"{'met' if cost <= TARGET_MS_PER_CHUNK else 'NOT met'} ({cost:+.4f} ms)")
    cpu_us = cpu["corral"] * 1000 / events["corral"]
    beside = "".join(f", {name} {cpu[name] * 1000 / events[name]:.1f} µs"
                     for name in ("nginx", "baseline") if name in cpu)
    print(f"target corral CPU <= {TARGET_CPU_US_PER_CHUNK} µs per chunk: "
          f"{'met' if cpu_us <= TARGET_CPU_US_PER_CHUNK else 'NOT met'} ({cpu_us:.1f} µs"
          f"{beside})")


if __name__ == "__main__":
    main()
