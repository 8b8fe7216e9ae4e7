"""What llama-server's RAM prompt cache (`--cache-ram`) does to a child's memory, measured.

Three llama-server children of the same model run side by side: llama-server's default
(no flag: 8192 MiB), a small limit (`--cap`, below what the prompts fill) and `0` (off).
Each gets the same run of distinct prompts (one at a time, interleaved across the children
prompt by prompt, so the machine's load falls on all three alike); after each answer the
bench reads each child's RSS. It prints the RSS each child gained over the cache-off one, and
that gain against the limit corral counts in its estimate (the `cache_ram` term), and the
limit corral's auto gives this model on this machine.

    python bench/cache_ram.py [--model PATH] [--prompts 8] [--tokens 600] [--cap 32]
                              [--ctx 4096]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from corral.supervisor.memory import cache_ram
from corral.supervisor.memory.estimate import MiB, estimate, model_facts

from _harness import REPO, code_note, free_port, llama_server_argv, machine_note, wait_healthy

SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ("river", "stone", "lantern", "meadow", "copper", "violin", "harbor", "pepper",
         "glacier", "orchard", "velvet", "thunder", "cobalt", "saddle", "marble", "falcon",
         "ember", "willow", "canyon", "lattice", "quartz", "tundra", "mirror", "saffron",
         "beacon", "timber", "garnet", "plume", "drift")


def prompt(i: int, words: int) -> str:
    """A prompt that shares no prefix with another index's (its own opening and words)."""
    rng = random.Random(i)
    return f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def start(model: Path, ctx: int, flag: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = llama_server_argv(model, port, 1, ctx, ["--threads", "2", *flag])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SMOL)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=600, help="words per prompt (about "
                        "as many tokens)")
    parser.add_argument("--cap", type=int, default=32, help="the small limit, MiB")
    parser.add_argument("--ctx", type=int, default=4096)
    args = parser.parse_args()
    # A SIGTERM (timeout, Ctrl-C's cousin) ends through the `finally` below: the children run
    # in sessions of their own and would outlive the bench.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    facts = model_facts(args.model)
    bare = estimate(facts, ctx=args.ctx, parallel=1, n_gpu_layers=-1, cache_type_k=None,
                    cache_type_v=None)
    budget = psutil.virtual_memory().total - 512 * MiB  # memory.reserve_mb's default
    auto = cache_ram.auto_mib(budget, bare.devices["cpu"], bare.kv)
    capped = f"cap ({args.cap})"
    children = {"default (8192)": [], capped: ["--cache-ram", str(args.cap)],
                "off (0)": ["--cache-ram", "0"]}
    counted = {"default (8192)": 8192, capped: args.cap, "off (0)": 0}
    print(f"{args.model.name}, ctx {args.ctx}, {args.prompts} prompts of ~{args.tokens} "
          f"tokens; KV {bare.kv / MiB:.0f} MiB; corral's auto here: --cache-ram {auto}; "
          f"{machine_note()}; {code_note()}")
    running: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    rss: dict[str, list[int]] = {name: [] for name in children}
    try:
        for name, flag in children.items():
            running[name] = start(args.model, args.ctx, flag)  # before the wait: cleaned up
        for _, url in running.values():
            wait_healthy(url + "/health", timeout=120, interval=0.05)
        with httpx.Client(timeout=600) as http:
            for i in range(args.prompts):
                for name, (proc, url) in running.items():
                    body = {"prompt": prompt(i, args.tokens), "max_tokens": 1,
                            "temperature": 0}
                    http.post(url + "/v1/completions", json=body).raise_for_status()
                    rss[name].append(psutil.Process(proc.pid).memory_info().rss)
                print(f"  prompt {i + 1}: " + ", ".join(
                    f"{n} {rss[n][-1] / MiB:.0f} MiB" for n in children), flush=True)
    finally:
        for proc, _ in running.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    off = rss["off (0)"][-1]
    print("\nRSS after the last prompt, and what the cache added over the cache-off child "
          "(same prompts, same model):")
    print(f"{'child':<16}{'RSS MiB':>9}{'added MiB':>11}{'counted MiB':>13}  within")
    for name in children:
        added = (rss[name][-1] - off) / MiB
        limit = counted[name]
        print(f"{name:<16}{rss[name][-1] / MiB:>9.0f}{added:>11.0f}{limit:>13}  "
              f"{'yes' if added <= limit * 1.05 + 8 else 'NO'}")
    default, small = rss["default (8192)"][-1] - off, rss[capped][-1] - off
    if small > MiB:  # a ratio of page-sized noise says nothing
        print(f"\nthe default's cache took {default / small:.1f}x the {args.cap} MiB cap's "
              f"({default / MiB:.0f} vs {small / MiB:.0f} MiB)")


if __name__ == "__main__":
    main()
