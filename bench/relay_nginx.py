"""The relay against nginx on a real child (issue 37): wrk with 8 connections sends short chat
requests to one llama-server child (corral's own, defaults on: the prompt cache pins each
request), directly, through nginx (one worker, keep-alive pool) and through corral; paths
alternate by round, each first in turn. Prints req/s and p50/p99 per path, corral's and nginx's
ratio of the other, the added p50, and corral's CPU per request (its process's, over wrk's
requests).

    python bench/relay_nginx.py [--seconds 5] [--rounds 3] [--connections 8] [--tokens 4]
                                [--stream]

Target (issue 37): corral >= 0.90 of nginx's req/s on the 2-core VM. Needs wrk and nginx
(`apt-get install -y wrk nginx`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from _harness import (
    SHARED_CHILD,
    Endpoint,
    corral_and_its_child,
    machine_note,
    nginx_proxy,
    tiny_model,
)

TARGET = 0.90
SCRIPT = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
{headers}
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS[unit]


def run_wrk(wrk: str, to: Endpoint, body: dict[str, object], seconds: float,
            connections: int, folder: Path) -> dict[str, float]:
    """req/s, p50 and p99 ms, requests, non-2xx answers of one wrk run."""
    headers = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in to.headers.items())
    script = folder / "post.lua"
    script.write_text(SCRIPT.format(body=json.dumps(json.dumps(body)), headers=headers))
    out = subprocess.run([wrk, "-t", "1", "-c", str(connections), "-d", f"{seconds:g}s",
                          "--latency", "-s", str(script), to.url + "/v1/chat/completions"],
                         capture_output=True, text=True, check=True).stdout
    got = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
           "p50": _ms(re.search(r"^\s*50%\s+(\S+)", out, re.M).group(1)),  # type: ignore[union-attr]
           "p99": _ms(re.search(r"^\s*99%\s+(\S+)", out, re.M).group(1)),  # type: ignore[union-attr]
           "requests": float(re.search(r"(\d+) requests in", out).group(1))}  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    got["bad"] = float(bad.group(1)) if bad else 0.0
    if errors:
        print(f"  {to.url}: socket errors {errors.group(1)}")
    return got


def _user_kernel(pids: list[int]) -> tuple[float, float]:
    """User and kernel CPU seconds of these processes so far."""
    user = kernel = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        user += times.user
        kernel += times.system
    return user, kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4, help="max_tokens of each answer")
    parser.add_argument("--stream", action="store_true", help="streamed answers")
    parser.add_argument("--prompt-cache", choices=("on", "off"), default="on",
                        help="corral's prompt cache (on: the default, each request pinned)")
    args = parser.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        sys.exit("wrk missing: `apt-get install -y wrk`")
    body = {"model": "tiny", "max_tokens": args.tokens, "temperature": 0,
            "stream": args.stream, "messages": [{"role": "user", "content": "hello"}]}
    runs: dict[str, list[dict[str, float]]] = {}
    # µs of user and of kernel CPU per request, per proxy and round.
    cpu: dict[str, list[tuple[float, float]]] = {"corral": [], "nginx": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = tiny_model(folder)
        config = {"prompt_cache": {"enabled": args.prompt_cache == "on"}}
        with corral_and_its_child(model, args.connections, extra=SHARED_CHILD,
                                  **config) as (proxied, child), \
                nginx_proxy(child) as nginx:
            if nginx is None:
                sys.exit("nginx missing: `apt-get install -y nginx`")
            paths = {"direct": child, "nginx": nginx.endpoint, "corral": proxied.endpoint}
            pids = {"corral": [proxied.pid], "nginx": nginx.pids()}
            for to in paths.values():  # warm
                run_wrk(wrk, to, body, 1, args.connections, folder)
            names = list(paths)
            for r in range(args.rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    before = _user_kernel(pids.get(name, []))
                    got = run_wrk(wrk, paths[name], body, args.seconds, args.connections,
                                  folder)
                    if name in cpu:
                        after = _user_kernel(pids[name])
                        cpu[name].append(tuple(  # type: ignore[arg-type]
                            (b - a) * 1e6 / max(got["requests"], 1)
                            for a, b in zip(before, after, strict=True)))
                    runs.setdefault(name, []).append(got)
                    print(f"round {r} {name:6s} {got['rps']:8.1f} req/s  p50 {got['p50']:.2f} ms"
                          f"  p99 {got['p99']:.2f} ms  non-2xx {got['bad']:.0f}", flush=True)
    print(f"\nmachine: {machine_note()}")
    print(f"wrk -t1 -c{args.connections} -d{args.seconds:g}s, {args.rounds} rounds; one "
          f"llama-server child (tiny model, parallel {args.connections}), "
          f"max_tokens {args.tokens}, {'streamed' if args.stream else 'whole'} answers; "
          f"corral's defaults, prompt cache {args.prompt_cache}")
    med = {name: {k: statistics.median(g[k] for g in got) for k in ("rps", "p50", "p99")}
           for name, got in runs.items()}
    for name, m in med.items():
        print(f"{name:6s} {m['rps']:8.1f} req/s   p50 {m['p50']:6.2f} ms   p99 {m['p99']:6.2f} ms")
    ratios = [c["rps"] / n["rps"] for c, n in zip(runs["corral"], runs["nginx"], strict=True)]
    print(f"corral/nginx req/s per round: {', '.join(f'{x:.3f}' for x in ratios)}  "
          f"(median {statistics.median(ratios):.3f}; target >= {TARGET})")
    print(f"corral p50 over nginx {med['corral']['p50'] - med['nginx']['p50']:+.2f} ms, over "
          f"direct {med['corral']['p50'] - med['direct']['p50']:+.2f} ms; nginx over direct "
          f"{med['nginx']['p50'] - med['direct']['p50']:+.2f} ms")
    for name, spent in cpu.items():
        user = statistics.median(u for u, _ in spent)
        kernel = statistics.median(k for _, k in spent)
        print(f"{name} CPU per request: {user + kernel:.0f} µs ({user:.0f} user, {kernel:.0f} "
              "kernel; median of rounds, 10 ms ticks)")


if __name__ == "__main__":
    main()
