"""Zero lost requests: 1,000 concurrent streaming chats to one tiny model, five rounds in a row.

corral serves one tiny model with `parallel: 4` and a `max_queue` that holds every request, so
none should be refused, and none may be lost. Each round sends N streaming chat requests at
once (max_tokens 16–32, ignore_eos), reads every stream to its end, and sorts the outcomes:

    ok        200 and the stream ends with `data: [DONE]` and carries no error event
    refused   an explicit 429 or 503 with a Retry-After header (the client was told to retry)
    lost      anything else: 502 or another status, 429/503 without Retry-After, a connection
              error, a stream without [DONE] or with an error event
    hung      no complete answer within --hang-after seconds of being sent

Between rounds the run pauses --pause seconds (default 6): llama-server closes keep-alive
connections idle for 5 s, so the next round starts on a pool of connections the child has
already closed (and the child also closes each one after 100 requests).

Target: lost = 0 and hung = 0 in every round. Exits 1 on any lost or hung request with
--check (make bench runs it without, to print the figures and carry on).

    python bench/load_streams.py [--requests 1000] [--rounds 5] [--parallel 4] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from _harness import QUIET, code_note, corral_daemon, machine_note, tiny_model


async def one(session: aiohttp.ClientSession, url: str, tokens: int) -> str:
    """One streamed chat; returns its outcome: 'ok', 'refused', or 'lost: <why>'."""
    body = {"model": "tiny", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"count to {tokens}"}]}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                if resp.status in (429, 503) and resp.headers.get("Retry-After"):
                    return "refused"
                try:
                    code = json.loads(text)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = text[:60]
                extra = " without Retry-After" if resp.status in (429, 503) else ""
                return f"lost: HTTP {resp.status}{extra} ({code})"
            data = await resp.read()
    except (aiohttp.ClientError, OSError) as exc:
        return f"lost: {type(exc).__name__}"
    if b'"error"' in data:
        return "lost: error event in the stream"
    if not data.rstrip().endswith(b"data: [DONE]"):
        return "lost: stream without [DONE]"
    return "ok"


async def run_round(url: str, n: int, hang_after: float,
                    rng: random.Random) -> tuple[Counter[str], float]:
    # One connection per request (limit=0): 1,000 clients at once, as a load balancer in
    # front would send them.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def bounded(tokens: int) -> str:
            try:
                return await asyncio.wait_for(one(session, url, tokens), hang_after)
            except TimeoutError:
                return "hung"

        started = time.perf_counter()
        outcomes = await asyncio.gather(*(bounded(rng.randint(16, 32)) for _ in range(n)))
        return Counter(outcomes), time.perf_counter() - started


def corral_failures(lines: list[str]) -> Counter[str]:
    """Why corral answered 502: its proxy.upstream_failed log events, by message."""
    reasons: Counter[str] = Counter()
    for line in lines:
        if "upstream_failed" not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        reasons[str(event.get("error", event.get("event")))[:110]] += 1
    return reasons


def summary(c: Counter[str]) -> tuple[int, int, int, int]:
    lost = sum(v for k, v in c.items() if k.startswith("lost"))
    return c["ok"], c["refused"], lost, c["hung"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000, help="concurrent, per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--pause", type=float, default=6.0,
                        help="seconds between rounds (> llama-server's 5 s keep-alive)")
    parser.add_argument("--hang-after", type=float, default=300.0)
    parser.add_argument("--check", action="store_true", help="exit 1 on any lost/hung request")
    args = parser.parse_args()
    # The client needs a socket per request; corral inherits this limit (which is what a
    # systemd unit with LimitNOFILE would give it).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * args.requests + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    rng = random.Random(1)
    totals: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        models = {"tiny": {"model": str(model), "ctx": 512 * args.parallel,
                           "parallel": args.parallel, "ttl": 0, "args": QUIET}}
        with corral_daemon(models, defaults={"max_queue": 2 * args.requests,
                                             "queue_timeout": args.hang_after}) as proxied:
            print(code_note())
            print(f"machine: {machine_note()}; open files limit {want}")
            print(f"{args.requests} concurrent streaming chats per round (max_tokens 16-32), "
                  f"parallel {args.parallel}, max_queue {2 * args.requests}, "
                  f"{args.pause:g} s pause between rounds, hung = no answer in "
                  f"{args.hang_after:g} s")
            log_seen = 0
            for r in range(1, args.rounds + 1):
                if r > 1:
                    time.sleep(args.pause)
                outcomes, wall = asyncio.run(run_round(proxied.url, args.requests,
                                                       args.hang_after, rng))
                totals += outcomes
                ok, refused, lost, hung = summary(outcomes)
                log = proxied.log.read_text(errors="replace").splitlines()
                reasons = corral_failures(log[log_seen:])
                log_seen = len(log)
                print(f"round {r}: ok {ok:4d}   refused (429/503 + Retry-After) {refused:4d}   "
                      f"lost {lost:4d}   hung {hung:4d}   {wall:6.1f} s")
                for kind, count in sorted(outcomes.items()):
                    if kind.startswith("lost"):
                        print(f"         {count:4d} × {kind}")
                for reason, count in reasons.most_common(3):
                    print(f"         corral's log: {count:4d} × {reason}")
            print(f"machine: {machine_note()}")
    ok, refused, lost, hung = summary(totals)
    total = sum(totals.values())
    print(f"all rounds: ok {ok}/{total}, refused {refused}, lost {lost} "
          f"({100 * lost / total:.2f} %), hung {hung}")
    met = lost == 0 and hung == 0
    print(f"target 0 lost and 0 hung: {'met' if met else 'NOT met'}")
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
