"""The first token under concurrency (issue 37): one llama-server child with many slots, reached
directly and through corral (the same child, paths alternating by round), at several numbers of
concurrent streams, with the prompt cache on and off, in one run.

Per setting: TTFT p50/p99 of each path and corral's added p50, tokens/s through corral over
direct, and corral's CPU per relayed chunk (its process's CPU over the events it relayed).
Each request has its own prompt (users do not share one): the prompt cache pins each to a slot.

    python bench/ttft_concurrency.py [--model tiny|smol] [--parallel 128]
                                     [--streams 32,128] [--tokens 32] [--rounds 2]
                                     [--cache on,off] [--workers 0,2]

`--workers 0,2`: corral with `relay_workers` 0, then 2, each a daemon (and child) of its own
(corral's CPU then counts its workers' too).

Targets (issue 37): TTFT p50 through corral <= direct + 5 ms, tokens/s >= 0.97 of direct,
CPU <= 20 us per chunk. On a 2-core VM the client, the child and corral share two cores: the
figures there say more about what corral adds per request than about a GPU box's absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import psutil

from _harness import (
    NGINX_MISSING,
    QUIET,
    REPO,
    Corral,
    Endpoint,
    corral_and_its_child,
    corral_daemon,
    cpu_seconds,
    machine_note,
    nginx_proxy,
    percentile,
    tiny_model,
)

SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_TTFT_MS = 5.0
TARGET_TOKENS = 0.97
TARGET_CPU_US = 20.0
PROMPT = "Tell me a short story about a lighthouse keeper and the sea, please. "


def _server_timing(header: str) -> dict[str, float]:
    """corral's Server-Timing: {"queue": ms, "ttfb": ms, ...}."""
    out = {}
    for part in header.split(","):
        name, _, rest = part.strip().partition(";")
        found = re.search(r"dur=([\d.]+)", rest)
        if found:
            out[name] = float(found.group(1))
    return out


async def _stream(session: aiohttp.ClientSession, to: Endpoint, i: int, tokens: int,
                  timings: list[dict[str, float]] | None = None) -> tuple[float, int]:
    """TTFT ms (first data event) and the data events of one streamed chat; corral's
    Server-Timing appended to `timings`."""
    body = {"model": "tiny", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": f"Request {i}. {PROMPT}"}]}
    started = time.perf_counter()
    first = 0.0
    events = 0
    tail = b""
    async with session.post(to.url + "/v1/chat/completions", json=body,
                            headers=to.headers) as resp:
        assert resp.status == 200, resp.status
        if timings is not None:
            timings.append(_server_timing(resp.headers.get("Server-Timing", "")))
        async for chunk in resp.content.iter_any():
            count = (tail[-5:] + chunk).count(b"data:")
            if count and not events:
                first = (time.perf_counter() - started) * 1000
            events += count
            tail = (tail + chunk)[-64:]  # "[DONE]" may straddle two reads too
    assert tail.endswith(b"data: [DONE]\n\n"), tail[-200:]
    return first, events - 1


async def _batch(session: aiohttp.ClientSession, to: Endpoint, streams: int, tokens: int,
                 start: int, timings: list[dict[str, float]] | None = None,
                 ) -> tuple[list[float], int, float]:
    """`streams` streams at once: their TTFTs, the events relayed, the wall seconds."""
    began = time.perf_counter()
    got = await asyncio.gather(*(_stream(session, to, start + i, tokens, timings)
                                 for i in range(streams)))
    return [t for t, _ in got], sum(n for _, n in got), time.perf_counter() - began


def _corral_pids(corral_pid: int) -> list[int]:
    """The daemon and its relay workers (relay_workers), whose CPU is corral's."""
    workers = [p.pid for p in psutil.Process(corral_pid).children()
               if "corral.proxy.workers.main" in " ".join(p.cmdline())]
    return [corral_pid, *workers]


async def measure(paths: dict[str, Endpoint], corral_pid: int, streams: int, tokens: int,
                  rounds: int) -> dict[str, object]:
    pids = _corral_pids(corral_pid)
    ttft: dict[str, list[float]] = {name: [] for name in paths}
    rates: list[float] = []
    nginx_rates: list[float] = []
    timings: list[dict[str, float]] = []
    cpu = 0.0
    relayed = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for to in paths.values():  # warm both paths (and the child's slots)
            await _batch(session, to, streams, 4, 10_000_000)
        n = 0
        for r in range(rounds):
            names = list(paths)
            order = names[r % len(names):] + names[:r % len(names)]  # each path first in turn
            rate: dict[str, float] = {}
            for name in order:
                before = cpu_seconds(pids)
                t, events, wall = await _batch(session, paths[name], streams, tokens, n,
                                               timings if name == "corral" else None)
                n += streams
                if name == "corral":
                    cpu += cpu_seconds(pids) - before
                    relayed += events
                ttft[name] += t
                rate[name] = events / wall
            rates.append(rate["corral"] / rate["direct"])
            if "nginx" in rate:
                nginx_rates.append(rate["nginx"] / rate["direct"])
    return {"ttft": ttft, "ratio": statistics.median(rates), "ratios": rates,
            "nginx_ratio": statistics.median(nginx_rates) if nginx_rates else None,
            # corral's TTFT split: the wait for a slot, then from the lease to the child's
            # first byte (the prompt cache's pin and the child's prefill).
            "queue": percentile([t.get("queue", 0.0) for t in timings], 50),
            "ttfb": percentile([t.get("ttfb", 0.0) for t in timings], 50),
            "cpu_us": cpu * 1e6 / max(relayed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "smol"), default="tiny")
    parser.add_argument("--fake", action="store_true",
                        help="bench/fast_upstream.py (a token every --pace-us, no prefill) "
                             "instead of llama-server: what corral alone adds to a burst")
    parser.add_argument("--pace-us", type=int, default=0,
                        help="fast_upstream's pace (it sleeps blocking: 0 for bursts)")
    parser.add_argument("--parallel", type=int, default=128, help="the child's slots")
    parser.add_argument("--streams", default="32,128", help="concurrent streams, comma list")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", default="on,off", help="the prompt cache: on, off or both")
    parser.add_argument("--workers", default="0",
                        help="corral's relay_workers, comma list (a daemon for each)")
    args = parser.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    # Each slot holds its prompt (~30 tokens) and its answer.
    ctx = args.parallel * max(256, args.tokens + 128)
    results: list[tuple[str, int, dict[str, object]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp)) if args.model == "tiny" else SMOL
        if not model.is_file():
            sys.exit(f"{model} missing: run `make demo-model`")
        workers_list = [int(w) for w in args.workers.split(",")]
        for cache in args.cache.split(","):
            for workers in workers_list:
                label = cache if len(workers_list) == 1 else f"{cache} w{workers}"
                config: dict[str, object] = {"prompt_cache": {"enabled": cache == "on"},
                                             "defaults": {"max_queue": 4096},
                                             "relay_workers": workers}
                # llama-server's own HTTP threads (parallel + 2 by default): every stream is
                # taken at once, on both paths.
                served = (_fake(args.parallel, args.pace_us, config) if args.fake else
                          corral_and_its_child(model, args.parallel, extra=QUIET, ctx=ctx,
                                               **config))
                with served as (proxied, child), \
                        nginx_proxy(child) as nginx:
                    paths = {"direct": child, "corral": proxied.endpoint}
                    if nginx is not None:
                        paths["nginx"] = nginx.endpoint
                    for streams in counts:
                        got = asyncio.run(measure(paths, proxied.pid, streams, args.tokens,
                                                  args.rounds))
                        results.append((label, streams, got))
                        _print_one(label, streams, got)
    print(f"\nmachine: {machine_note()}")
    upstream = (f"bench/fast_upstream.py, a token every {args.pace_us} µs, parallel "
                f"{args.parallel}" if args.fake else
                f"model {args.model} ({model.name}), one llama-server child with --parallel "
                f"{args.parallel}, ctx {ctx}")
    print(f"{upstream}; {args.tokens} tokens a stream (ignore_eos), every prompt distinct; "
          f"{args.rounds} rounds, paths alternating; corral's relay_workers: {args.workers} "
          f"(w<N> below)")
    print(f"{'cache':8s} {'streams':>7s} {'direct p50':>10s} {'p99':>8s} {'corral p50':>10s} "
          f"{'p99':>8s} {'added p50':>9s} {'tok/s of direct':>15s} {'CPU µs/chunk':>12s}   "
          f"{'nginx added p50':>15s} {'tok/s':>6s}")
    for cache, streams, got in results:
        ttft = got["ttft"]
        assert isinstance(ttft, dict)
        d50, c50 = percentile(ttft["direct"], 50), percentile(ttft["corral"], 50)
        line = (f"{cache:8s} {streams:7d} {d50:10.1f} {percentile(ttft['direct'], 99):8.1f} "
                f"{c50:10.1f} {percentile(ttft['corral'], 99):8.1f} {c50 - d50:+9.1f} "
                f"{got['ratio']:15.3f} {got['cpu_us']:12.1f}")
        if "nginx" in ttft:
            line += (f"   {percentile(ttft['nginx'], 50) - d50:+15.1f} "
                     f"{got['nginx_ratio']:6.3f}")
        print(line)
    if not any("nginx" in got["ttft"] for _, _, got in results):  # type: ignore[operator]
        print(NGINX_MISSING)
    print(f"targets: added TTFT p50 <= +{TARGET_TTFT_MS:g} ms, tokens/s >= {TARGET_TOKENS} of "
          f"direct, CPU <= {TARGET_CPU_US:g} µs a chunk")


@contextlib.contextmanager
def _fake(parallel: int, pace_us: int, config: dict[str, object],
          ) -> Iterator[tuple[Corral, Endpoint]]:
    """corral with bench/fast_upstream.py as its `command` child of `parallel` slots."""
    command = [sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port", "${PORT}",
               "--pace-us", str(pace_us)]
    models = {"tiny": {"backend": "command", "memory_mb": 64, "parallel": parallel, "ttl": 0,
                       "health": "/health", "command": command}}
    with corral_daemon(models, **config) as handle:
        httpx.post(f"{handle.url}/admin/models/tiny/load", timeout=60).raise_for_status()
        desc = httpx.get(f"{handle.url}/admin/models", timeout=10).json()["models"][0]
        yield handle, Endpoint(f"http://127.0.0.1:{desc['port']}", {})


def _print_one(cache: str, streams: int, got: dict[str, object]) -> None:
    ttft = got["ttft"]
    assert isinstance(ttft, dict)
    added = percentile(ttft["corral"], 50) - percentile(ttft["direct"], 50)
    print(f"cache {cache}, {streams} streams: corral's Server-Timing p50: queue "
          f"{got['queue']:.1f} ms, lease to the child's first byte {got['ttfb']:.1f} ms "
          f"(direct TTFT p50 {percentile(ttft['direct'], 50):.1f} ms)")
    print(f"cache {cache}, {streams} streams: TTFT p50 added {added:+.1f} ms, tokens/s of "
          f"direct per round {', '.join(f'{r:.3f}' for r in got['ratios'])}, "  # type: ignore[attr-defined]
          f"CPU {got['cpu_us']:.1f} µs/chunk", flush=True)


if __name__ == "__main__":
    main()
