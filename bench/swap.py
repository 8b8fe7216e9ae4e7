"""Swapping two models on one corral (`max_loaded: 1`): each switch timed as the client sees it
and as corral reports it, with the prompt cache on and off, in one run.

The protocol of vLLM's sleep-mode post ("Zero-Reload Model Switching with vLLM Sleep Mode",
blog.vllm.ai, 2025-10-26): models A and B alternate, each prompt a different question
(so no cache answers it), A B A B A B: one cold start, then --switches switches. Each switch:
  stop    the other model's stop, from corral's `stop` event to its `state` → stopped (a
          prompt-cache save runs inside it)
  start   this model's `state` starting → ready
  first   request → first content token, as the client reads it
  total   request → [DONE]
Then a shared-prefix conversation (about --tokens tokens) on A: a turn on A, a turn on B (the
swap that has A's conversation to save), then A's next turn (after the swap: the cache restores
it; without the cache it is the same turn cold, the whole prefill again), one more turn on A
with nothing swapped (the floor), and at once a turn on B (a swap with no idle time before it:
the stop has A's newest turns to save, or a save under way to wait for). Between the other
turns the client waits --think seconds, as a user reading the answer does (corral's idle saves,
`prompt_cache.idle_save_after`, 2 s by default, happen there).

Both daemons (prompt cache on, off) run at once in each round, each with its own children,
and take turns step by step (the order flipped every step), so that the machine's other work
falls on both alike; one child computes at a time. Both use the same model files. Printed:
per phase the medians, and the ratios
  swap (cache on) / swap (cache off)     target <= 1.1 (issue 37)
  next turn after a swap / the same turn cold      target <= 0.20 on CPU
Both models are SmolLM2 (A on the demo model's file, B on a copy of it) so the prefill is a
real model's. Event times are corral's (`/admin/events`, wall clock), the request times the
client's, on the same machine.

    python bench/swap.py [--switches 5] [--tokens 2000] [--rounds 2] [--think 3]
                         [--answer-tokens 32] [--model PATH] [--threads N] [--code GIT-REF]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from _harness import REPO, checkout, code_note, corral_daemon, machine_note

SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_SWAP = 1.1
TARGET_NEXT_TURN = 0.20
QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "What is two plus two?", "Which planet is closest to the sun?",
             "What do bees make?", "How many days are in a week?", "What colour is the sky?",
             "Name a large ocean.", "What is frozen water called?", "Who wrote Hamlet?",
             "What gas do plants take in?", "How many legs does a spider have?"]
_PLACES = ["river", "orchard", "mill", "bridge", "well", "road", "school", "market", "forge",
           "chapel", "harbour", "quarry"]
# SmolLM2 spends about 21.5 tokens on one of the sentences below (numbers go digit by digit).
_TOKENS_PER_SENTENCE = 21.5


class Events:
    """corral's `/admin/events`, read in a thread for the daemon's whole life: every event,
    with corral's own wall-clock `time`."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._seen: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(10, read=None)) as client, \
                    client.stream("GET", self._url + "/admin/events?since=0") as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        event = json.loads(line[5:])
                        with self._lock:
                            self._seen.append(event)
        except httpx.HTTPError:
            pass  # the daemon went away: the bench is over with it

    def between(self, began: float, ended: float) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self._seen if began <= e["time"] <= ended]

    def wait(self, until: Callable[[list[dict[str, Any]]], bool], timeout: float) -> bool:
        """Until `until(all events so far)` holds; the reader lags a request's end by a few
        milliseconds, so a switch's last event may come after the client saw [DONE]."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if until(list(self._seen)):
                    return True
            time.sleep(0.01)
        return False


@dataclass
class Turn:
    """One request as the client saw it, with what corral reported while it ran."""

    model: str
    first: float  # s, request → first content token
    total: float  # s, request → [DONE]
    prefilled: int  # the child's own timings.prompt_n: tokens it computed, not reused
    text: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def _time(self, kind: str, model: str, **match: str) -> float | None:
        for e in self.events:
            if e["kind"] == kind and e.get("model") == model and all(
                    e.get(k) == v for k, v in match.items()):
                return float(e["time"])
        return None

    def stop(self, other: str) -> float | None:
        """s the other model's stop took (its `stop` event to its state → stopped)."""
        began, ended = self._time("stop", other), self._time("state", other, new="stopped")
        return None if began is None or ended is None else ended - began

    def start(self) -> float | None:
        """s this model's start took (state → starting to state → ready)."""
        began = self._time("state", self.model, new="starting")
        ended = self._time("state", self.model, new="ready")
        return None if began is None or ended is None else ended - began

    def saved(self, other: str) -> tuple[float, int]:
        """s and bytes of the other model's prompt-cache saves during this request: what its
        stop wrote on this request's critical path."""
        found = [e for e in self.events
                 if e["kind"] == "prompt_cache_saved" and e.get("model") == other]
        return sum(e["seconds"] for e in found), sum(e["bytes"] for e in found)

    def restored(self) -> int:
        return sum(e["tokens"] for e in self.events
                   if e["kind"] == "prompt_cache_restored" and e.get("model") == self.model)


def conversation(tokens: int) -> list[dict[str, str]]:
    sentences = [f"Note {i}: the {_PLACES[i % len(_PLACES)]} of the valley was last repaired in "
                 f"year {1700 + i * 3}." for i in range(int(tokens / _TOKENS_PER_SENTENCE))]
    return [{"role": "system", "content": "You answer questions about the valley's records. "
             + " ".join(sentences)},
            {"role": "user", "content": "Which note mentions the forge first?"}]


def ask(client: httpx.Client, events: Events, model: str, messages: list[dict[str, str]],
        answer_tokens: int) -> Turn:
    body = {"model": model, "messages": messages, "max_tokens": answer_tokens,
            "temperature": 0, "stream": True}
    began, clock = time.time(), time.perf_counter()
    first: float | None = None
    prefilled, text = -1, []
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter() - clock
                    text.append(piece)
            if isinstance(chunk.get("timings"), dict):
                prefilled = int(chunk["timings"].get("prompt_n", -1))
    total = time.perf_counter() - clock
    ended = time.time()
    turn = Turn(model, first if first is not None else total, total, prefilled, "".join(text))
    # A switch's events are all in once this model is ready; the reader may lag a little.
    # (A turn with no switch waits out the half second: outside the timed part.)
    events.wait(lambda seen: any(
        e["time"] >= began and e["kind"] == "state" and e.get("model") == model
        and e.get("new") == "ready" for e in seen), timeout=0.5)
    turn.events = events.between(began, max(ended, time.time()))
    return turn


@dataclass
class Daemon:
    """One corral (cache on or off) run through both phases: what the report needs."""

    switches: list[Turn]
    first: Turn  # the conversation's first turn on A (a swap back to A, whole prefill)
    swap: Turn  # the turn on B that evicts A holding the conversation
    after: Turn  # A's next turn, after that swap
    warm: Turn  # the turn after that, nothing swapped
    rush: Turn  # a turn on B right after `warm`, with no time for an idle save


THINK = "think"  # what a protocol step yields when a user would read before the next one


def protocol(client: httpx.Client, events: Events, args: argparse.Namespace,
             out: list[Daemon]) -> Iterator[str | None]:
    """One daemon's requests, step by step: it yields after each step (THINK where a user
    would read the answer first), so that the two daemons' steps interleave."""
    questions = iter(QUESTIONS * 4)
    names = ["A", "B"]
    switches = []
    for i in range(args.switches + 1):  # the first request is a cold start, not a switch
        q = [{"role": "user", "content": next(questions)}]
        turn = ask(client, events, names[i % 2], q, args.answer_tokens)
        if i:
            switches.append(turn)
        yield None
    messages = conversation(args.tokens)
    first = ask(client, events, "A", messages, args.answer_tokens)
    yield THINK  # a user reading the answer: the child idles
    swap = ask(client, events, "B", [{"role": "user", "content": next(questions)}],
               args.answer_tokens)
    yield THINK
    messages = [*messages, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "And the mill?"}]
    after = ask(client, events, "A", messages, args.answer_tokens)
    yield THINK
    messages = [*messages, {"role": "assistant", "content": after.text},
                {"role": "user", "content": "And the well?"}]
    warm = ask(client, events, "A", messages, args.answer_tokens)
    # No think time: the stop has A's last two turns to save, or a save under way to await.
    rush = ask(client, events, "B", [{"role": "user", "content": next(questions)}],
               args.answer_tokens)
    out.append(Daemon(switches, first, swap, after, warm, rush))


def run(a: Path, b: Path, args: argparse.Namespace, folder: Path, code: Path | None,
        first: bool) -> dict[bool, Daemon]:
    """Two daemons at once, the prompt cache on in one and off in the other, each with its
    own child: every step of the protocol runs on one, then on the other (order flipped each
    step, `first` goes first at the first), so the machine's other work hits both alike. Only
    one child computes at a time; the other daemon's child sits idle."""
    ctx = 2 * args.tokens + 1024
    models: dict[str, dict[str, Any]] = {"A": {"model": str(a), "ctx": ctx},
                                         "B": {"model": str(b), "ctx": ctx}}
    if args.threads:
        for model in models.values():
            model["threads"] = args.threads
    got: dict[bool, list[Daemon]] = {False: [], True: []}
    with contextlib.ExitStack() as stack:
        steps = {}
        for cache in (False, True):
            config: dict[str, Any] = {
                "policy": {"max_loaded": 1},
                "prompt_cache": {"enabled": cache, "dir": str(folder / f"cache-{cache}")}}
            daemon = stack.enter_context(corral_daemon(models, code=code, **config))
            client = stack.enter_context(httpx.Client(base_url=daemon.url, timeout=600))
            steps[cache] = protocol(client, Events(daemon.url), args, got[cache])
        order = [first, not first]
        while True:
            said = [next(steps[cache], "done") for cache in order]
            if "done" in said:
                break
            if THINK in said:
                time.sleep(args.think)
            order.reverse()
    return {cache: done[0] for cache, done in got.items()}


@contextmanager
def two_files(model: Path) -> Iterator[tuple[Path, Path]]:
    """A on `model`, B on a copy of it: two model files, so nothing is shared but the bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / f"B-{model.name}"
        shutil.copyfile(model, copy)
        yield model, copy


def _rev(ref: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref],
                          capture_output=True, text=True, check=True).stdout.strip()


def med(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else float("nan")


def report(got: dict[bool, list[Daemon]], args: argparse.Namespace) -> None:
    def switch_row(pick: Callable[[Turn], float | None]) -> list[float]:
        return [med([pick(t) for d in got[cache] for t in d.switches]) for cache in (False, True)]

    def other(t: Turn) -> str:
        return "B" if t.model == "A" else "A"

    print(f"\n{args.switches} switches A↔B per daemon (short questions, {args.answer_tokens}-token "
          f"answers), median over {args.rounds} round(s), seconds:")
    print(f"{'':28}{'cache off':>11}{'cache on':>11}{'on/off':>8}")
    rows = {
        "stop (the other model)": switch_row(lambda t: t.stop(other(t))),
        "start (to ready)": switch_row(lambda t: t.start()),
        "first token": switch_row(lambda t: t.first),
        "total (request → [DONE])": switch_row(lambda t: t.total),
    }
    for name, (off, on) in rows.items():
        print(f"{name:28}{off:11.3f}{on:11.3f}{on / off:8.2f}")

    def phase(pick: Callable[[Daemon], float | None]) -> tuple[float, float]:
        return med([pick(d) for d in got[False]]), med([pick(d) for d in got[True]])

    tokens = med([d.first.prefilled for d in got[False]])
    print(f"\nShared-prefix conversation on A ({tokens:.0f} tokens), think {args.think:g} s "
          f"between turns, median seconds (tokens the child prefilled):")
    print(f"{'':34}{'cache off':>18}{'cache on':>18}{'on/off':>8}")
    for name, which in (("first turn on A (swap + prefill)", "first"),
                        ("turn on B after think (swap)", "swap"),
                        ("A's next turn after the swap", "after"),
                        ("A's turn after that (no swap)", "warm"),
                        ("turn on B at once (no think)", "rush")):
        turns = {cache: [getattr(d, which) for d in got[cache]] for cache in (False, True)}
        off, on = (med([t.total for t in turns[cache]]) for cache in (False, True))
        n_off, n_on = (med([t.prefilled for t in turns[cache]]) for cache in (False, True))
        print(f"{name:34}{off:9.2f} s ({n_off:5.0f}){on:9.2f} s ({n_on:5.0f}){on / off:8.2f}")
    for name, which in (("after think", "swap"), ("at once", "rush")):
        saved = [getattr(d, which).saved("A") for d in got[True]]
        stop_off, stop_on = (med([getattr(d, which).stop("A") for d in got[cache]])
                             for cache in (False, True))
        print(f"swap to B {name}: A's stop took {stop_off:.3f} s (cache off), {stop_on:.3f} s "
              f"(cache on), of which saves {med([s for s, _ in saved]):.3f} s, "
              f"{med([b for _, b in saved]) / (1 << 20):.1f} MiB")
    print(f"tokens restored into A's next turn (cache on): "
          f"{phase(lambda d: d.after.restored())[1]:.0f}")

    swap_plain = rows["total (request → [DONE])"]
    swap_conv = phase(lambda d: d.swap.total)
    swap_rush = phase(lambda d: d.rush.total)
    after = phase(lambda d: d.after.total)
    per_round = [on.after.total / off.after.total
                 for on, off in zip(got[True], got[False], strict=True)]
    print("\nratios (one run):")
    _target(f"swap, cache on / off ({args.switches} switches, short prompts)",
            swap_plain[1] / swap_plain[0], TARGET_SWAP)
    _target("swap after think, A holding the chat, on / off", swap_conv[1] / swap_conv[0],
            TARGET_SWAP)
    _target("swap right after A's turn (no think), cache on / off",
            swap_rush[1] / swap_rush[0], TARGET_SWAP)
    # What the cache itself adds to a swap, from corral's own clock: the extra time the other
    # model's stop took (its saves, or the wait for one under way), over the cache-off swap.
    # On a loaded machine the wall-clock ratios above move with other work; this one does not.
    for name, which in (("after think", "swap"), ("at once", "rush")):
        stop_off, stop_on = (med([getattr(d, which).stop("A") for d in got[cache]])
                             for cache in (False, True))
        total_off = med([getattr(d, which).total for d in got[False]])
        _target(f"swap {name}, events: (off + stop added) / off",
                1 + (stop_on - stop_off) / total_off, TARGET_SWAP)
    _target("A's next turn after the swap / the same turn cold", after[1] / after[0],
            TARGET_NEXT_TURN, f" (rounds: {', '.join(f'{r:.2f}' for r in per_round)})")


def _target(name: str, ratio: float, target: float, extra: str = "") -> None:
    verdict = "met" if ratio <= target else "NOT met"
    print(f"  {name:52} {ratio:5.2f}  target <= {target:g}: {verdict}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--switches", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2000,
                        help="the shared-prefix conversation's length (SmolLM2 tokens)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--think", type=float, default=3.0,
                        help="seconds between the conversation's turns (a user reading)")
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, default=SMOL)
    parser.add_argument("--threads", type=int, default=None,
                        help="each child's CPU threads (default: corral's, the cores with "
                             "max_loaded 1)")
    parser.add_argument("--code", metavar="REF",
                        help="run corral as it is at this git ref (a commit, a branch) instead "
                             "of this checkout: a before/after of a change, one run each")
    args = parser.parse_args()
    print(code_note() if args.code is None else
          f"corral code: git {args.code} ({_rev(args.code)}), proxy/ and supervisor/ as committed")
    print(f"machine: {machine_note()}")
    got: dict[bool, list[Daemon]] = {False: [], True: []}
    began = time.monotonic()
    with two_files(args.model) as (a, b), tempfile.TemporaryDirectory() as tmp, \
            contextlib.ExitStack() as stack:
        code = None if args.code is None else stack.enter_context(checkout(args.code))
        for r in range(args.rounds):
            folder = Path(tmp) / f"round-{r}"
            for cache, done in run(a, b, args, folder, code, first=r % 2 == 1).items():
                got[cache].append(done)
    print(f"machine after the run: {machine_note()}; {time.monotonic() - began:.0f} s in all")
    report(got, args)


if __name__ == "__main__":
    main()
