"""Latency and throughput corral adds in front of a llama-server, beside nginx as the reference
reverse proxy, all measured in one run.

One tiny model, one llama-server child (corral's own). The same requests (one generated
token, so the server's own work is small and the proxies' share shows) go straight to that
child, through nginx (one worker, keep-alive upstream pool, HTTP/1.1, proxy_buffering off) to
that same child, and through corral. The run is split into
rounds; each round measures every path sequentially (interleaved request by request, so drift
hits all alike) and then at concurrency 8 (paths in rotating order). Prints p50/p99 added
latency, req/s at concurrency 1 and 8, the per-round spread, and the two targets:

    corral's added p50 - nginx's added p50 <= 0.3 ms
    corral req/s / nginx req/s at concurrency 8 >= 0.90
    corral's CPU per request at concurrency 8 <= 0.35 ms

    python bench/proxy_overhead.py [--requests 2000] [--concurrency 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from _harness import (
    NGINX_MISSING,
    Endpoint,
    cpu_seconds,
    machine_note,
    percentile,
    spread,
    three_paths,
    tiny_model,
)

BODY = {"model": "tiny", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}
TARGET_ADDED_P50_MS = 0.3
TARGET_RPS_RATIO = 0.90
TARGET_CPU_MS = 0.35  # issue 27: corral's CPU per relayed request at concurrency 8


async def one(session: aiohttp.ClientSession, to: Endpoint) -> float:
    started = time.perf_counter()
    async with session.post(to.url + "/v1/chat/completions", json=BODY,
                            headers=to.headers) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    return (time.perf_counter() - started) * 1000


async def sequential(session: aiohttp.ClientSession, urls: dict[str, Endpoint],
                     n: int) -> dict[str, list[float]]:
    """Interleaved: every path once per step, so drift hits all alike."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    for _ in range(n):
        for name, url in urls.items():
            out[name].append(await one(session, url))
    return out


async def throughput(session: aiohttp.ClientSession, url: Endpoint, n: int,
                     concurrency: int) -> float:
    queue = iter(range(n))

    async def worker() -> None:
        for _ in queue:
            await one(session, url)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - started)


async def measure(urls: dict[str, Endpoint], pids: dict[str, list[int]], per_round: int,
                  rounds: int,
                  concurrency: int) -> tuple[list[dict[str, list[float]]],
                                             list[dict[str, float]], dict[str, float]]:
    """Per-round latencies and req/s, and each proxy's CPU ms per request under load."""
    lat_rounds: list[dict[str, list[float]]] = []
    rps_rounds: list[dict[str, float]] = []
    cpu = {name: 0.0 for name in pids}
    names = list(urls)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await sequential(session, urls, 50)  # warm every path: connections, slots, cache
        for name in names:
            await throughput(session, urls[name], 4 * concurrency, concurrency)
        for r in range(rounds):
            lat_rounds.append(await sequential(session, urls, per_round))
            order = names[r % len(names):] + names[:r % len(names)]
            rps: dict[str, float] = {}
            for name in order:
                before = cpu_seconds(pids.get(name, []))
                rps[name] = await throughput(session, urls[name], per_round, concurrency)
                if name in pids:
                    cpu[name] += cpu_seconds(pids[name]) - before
            rps_rounds.append(rps)
    return lat_rounds, rps_rounds, {n: t * 1000 / (per_round * rounds) for n, t in cpu.items()}


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000, help="per path, all rounds")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", metavar="REF",
                        help="a git ref whose corral runs beside this one, as path 'baseline'")
    args = parser.parse_args()
    per_round = max(1, args.requests // args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        with three_paths(model, args.concurrency, args.baseline,
                         defaults={"max_queue": 1024}) as (urls, pids):
            lat_rounds, rps_rounds, cpu = asyncio.run(
                measure(urls, pids, per_round, args.rounds, args.concurrency))
            print(f"machine: {machine_note()}")

    c = args.concurrency
    print(f"{per_round * args.rounds} requests per path sequentially (interleaved) and as many "
          f"at concurrency {c}, in {args.rounds} rounds; tiny model, 1 token per request; "
          f"paths: {', '.join(urls)}")
    lat = {name: [v for r in lat_rounds for v in r[name]] for name in urls}
    # req/s at concurrency 1 = requests / time spent on that path in the sequential phase
    rps1 = [{name: len(r[name]) / (sum(r[name]) / 1000) for name in urls} for r in lat_rounds]
    d50, d99 = percentile(lat["direct"], 50), percentile(lat["direct"], 99)
    for name in urls:
        p50, p99 = percentile(lat[name], 50), percentile(lat[name], 99)
        r1 = statistics.median(r[name] for r in rps1)
        r8 = statistics.median(r[name] for r in rps_rounds)
        line = (f"{name:8s} p50 {p50:7.3f} ms  p99 {p99:7.3f} ms   req/s c1 {r1:6.1f}  "
                f"c{c} {r8:6.1f}")
        if name != "direct":
            line += (f"   added p50 {p50 - d50:+.3f} ms  p99 {p99 - d99:+.3f} ms   "
                     f"of direct: c1 {r1 / statistics.median(r['direct'] for r in rps1):.3f}  "
                     f"c{c} {r8 / statistics.median(r['direct'] for r in rps_rounds):.3f}   "
                     f"CPU {cpu[name]:.3f} ms/request")
        print(line)

    def added(name: str) -> list[float]:
        return [percentile(r[name], 50) - percentile(r["direct"], 50) for r in lat_rounds]

    print("per-round spread (median, min … max), the noise of this run:")
    for name in urls:
        if name != "direct":
            print(f"  {name:7s} added p50 {spread(added(name))} ms;  req/s c{c} of direct "
                  f"{spread([r[name] / r['direct'] for r in rps_rounds], '{:.3f}')}")
    if "nginx" not in urls:
        print(NGINX_MISSING)
        print("targets: not judged (they are relative to nginx)")
        return
    gap = [a - b for a, b in zip(added("corral"), added("nginx"), strict=True)]
    ratio1 = [r["corral"] / r["nginx"] for r in rps1]
    ratio8 = [r["corral"] / r["nginx"] for r in rps_rounds]
    pooled_gap = (percentile(lat["corral"], 50) - percentile(lat["nginx"], 50))
    print(f"corral vs nginx: added p50 difference {pooled_gap:+.3f} ms "
          f"(per round {spread(gap)});  req/s ratio c1 {spread(ratio1, '{:.3f}')}, "
          f"c{c} {spread(ratio8, '{:.3f}')}")
    print(f"target added p50 within {TARGET_ADDED_P50_MS} ms of nginx: "
          f"{verdict(pooled_gap <= TARGET_ADDED_P50_MS)};  "
          f"target c{c} req/s >= {TARGET_RPS_RATIO:.0%} of nginx: "
          f"{verdict(statistics.median(ratio8) >= TARGET_RPS_RATIO)};  "
          f"target CPU <= {TARGET_CPU_MS} ms/request at c{c}: "
          f"{verdict(cpu['corral'] <= TARGET_CPU_MS)} ({cpu['corral']:.3f} ms, nginx "
          f"{cpu['nginx']:.3f} ms, ratio {cpu['corral'] / cpu['nginx']:.1f}x)")


if __name__ == "__main__":
    main()
