"""The next turn of a long conversation after its model was evicted, and after a corral
restart, with the prompt cache and without it, measured in one run.

One model (SmolLM2, the demo model) holds a conversation of about --tokens tokens; another
model evicts it (policy.max_loaded: 1). Timed, each to the whole answer (16 tokens):
  cold     the conversation's first request, the model not loaded (load + whole prefill)
  evicted  its next turn after the other model evicted it
  warm     the turn after that, the model still loaded (llama-server's own cache)
  restart  its next turn after corral was stopped and started again
Each phase runs with prompt_cache.enabled true and false, interleaved over --rounds rounds; the
medians and their ratios to cold are printed, and the warm turn with the cache beside the warm
turn without it. The tokens the child prefilled (its own timings.prompt_n) are the figure the
machine's other work cannot move.

    python bench/prompt_cache.py [--tokens 4000] [--rounds 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from _harness import REPO, code_note, corral_daemon, machine_note, tiny_model

SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
_PLACES = ["river", "orchard", "mill", "bridge", "well", "road", "school", "market", "forge",
           "chapel", "harbour", "quarry"]


def conversation(tokens: int) -> list[dict[str, str]]:
    # About 24 tokens a sentence (SmolLM2 tokenizes numbers digit by digit).
    sentences = [f"Note {i}: the {_PLACES[i % len(_PLACES)]} of the valley was last repaired in "
                 f"year {1700 + i * 3}." for i in range(tokens // 24)]
    return [{"role": "system", "content": "You answer questions about the valley's records. "
             + " ".join(sentences)},
            {"role": "user", "content": "Which note mentions the forge first?"}]


def turn(client: httpx.Client, messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    began = time.perf_counter()
    resp = client.post("/v1/chat/completions", json={
        "model": "smol", "messages": messages, "max_tokens": 16, "temperature": 0})
    seconds = time.perf_counter() - began
    assert resp.status_code == 200, resp.text
    return seconds, resp.json()


def next_messages(messages: list[dict[str, str]], answer: dict[str, Any],
                  question: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": question}]


def run(enabled: bool, smol: Path, other: Path, tokens: int, cache_dir: Path,
        ) -> dict[str, tuple[float, int]]:
    models = {"smol": {"model": str(smol), "ctx": 2 * tokens + 1024},
              "other": {"model": str(other), "ctx": 512}}
    config: dict[str, Any] = {"policy": {"max_loaded": 1},
                              "prompt_cache": {"enabled": enabled, "dir": str(cache_dir)}}
    out: dict[str, tuple[float, int]] = {}
    messages = conversation(tokens)
    with corral_daemon(models, **config) as daemon, \
            httpx.Client(base_url=daemon.url, timeout=600) as client:
        seconds, answer = turn(client, messages)
        out["cold"] = (seconds, answer["timings"]["prompt_n"])
        client.post("/v1/completions", json={"model": "other", "prompt": "hi",
                                              "max_tokens": 1}).raise_for_status()
        messages = next_messages(messages, answer, "And the mill?")
        seconds, answer = turn(client, messages)
        out["evicted"] = (seconds, answer["timings"]["prompt_n"])
        warm = []
        for question in ("And the well?", "And the road?", "And the school?"):
            messages = next_messages(messages, answer, question)
            seconds, answer = turn(client, messages)
            warm.append((seconds, answer["timings"]["prompt_n"]))
        out["warm"] = min(warm)  # the machine's other work adds, never subtracts
    # The daemon stopped (SIGTERM): its shutdown saved the slot; a new one starts cold.
    with corral_daemon(models, **config) as daemon, \
            httpx.Client(base_url=daemon.url, timeout=600) as client:
        messages = next_messages(messages, answer, "And the chapel?")
        seconds, answer = turn(client, messages)
        out["restart"] = (seconds, answer["timings"]["prompt_n"])
        if enabled:
            status = client.get("/admin/prompt-cache").json()
            out["files"] = (status["bytes"] / (1 << 20), status["files"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--model", type=Path, default=SMOL)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(code_note())
    print(machine_note())
    rounds: dict[bool, list[dict[str, tuple[float, int]]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        other = tiny_model(Path(tmp))
        for r in range(args.rounds):  # off and on interleaved: the machine's load hits both
            for enabled in (False, True):
                cache_dir = Path(tmp) / f"cache-{enabled}-{r}"
                rounds[enabled].append(run(enabled, args.model, other, args.tokens, cache_dir))
    results = {enabled: {phase: (statistics.median(x[phase][0] for x in got),
                                 int(statistics.median(x[phase][1] for x in got)))
                         for phase in got[0]} for enabled, got in rounds.items()}
    print(f"\nA {args.tokens}-token conversation on {args.model.name}, 16-token answers, "
          f"median of {args.rounds} round(s): seconds to the whole answer (tokens the child "
          f"prefilled), ratio to cold:")
    print(f"{'':10}{'cache off':>24}{'cache on':>24}")
    for phase in ("cold", "evicted", "warm", "restart"):
        cells = []
        for enabled in (False, True):
            seconds, prefilled = results[enabled][phase]
            ratio = seconds / results[enabled]["cold"][0]
            cells.append(f"{seconds:6.2f} s ({prefilled:5d}) {ratio:4.2f}")
        print(f"{phase:10}{cells[0]:>24}{cells[1]:>24}")
    on, off = results[True], results[False]
    print(f"\nnext turn after an eviction: {on['evicted'][0] / on['cold'][0]:.2f} of cold with "
          f"the cache, {off['evicted'][0] / off['cold'][0]:.2f} without")
    print(f"next turn after a restart:   {on['restart'][0] / on['cold'][0]:.2f} of cold with "
          f"the cache, {off['restart'][0] / off['cold'][0]:.2f} without")
    print(f"warm turn (best of 3), cache on / off: {on['warm'][0] / off['warm'][0]:.2f}")
    mib, files = on["files"]
    print(f"on disk after a round: {files} file(s), {mib:.0f} MiB")


if __name__ == "__main__":
    main()
