"""A 3-member parallel group vs its slowest member alone, measured in one run.

Three tiny models, all loaded first. Each round asks each member alone (in turn), then the
group once with the same request. Prints the group's wall time over the slowest member's solo
time (the target is ≤ 1.05 plus a few ms), and corral's own orchestration cost: the group's
wall time minus its slowest member's time inside the group.

On a machine with fewer cores than members, members also compete for CPU while running
together, which the first ratio includes and the orchestration figure does not.

    python bench/group_parallel.py [--rounds 10] [--tokens 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from _harness import code_note, corral, machine_note, tiny_model

MEMBERS = ["m1", "m2", "m3"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": args.tokens,
            "ignore_eos": True, "temperature": 0}
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: {"model": str(tiny_model(Path(tmp), seed)), "ctx": 2048}
                  for seed, name in enumerate(MEMBERS, 1)}
        groups = {"trio": {"models": MEMBERS, "type": "parallel"}}
        with corral(models, groups=groups) as url, httpx.Client(base_url=url,
                                                                 timeout=120) as client:
            for name in MEMBERS:
                client.post(f"/admin/models/{name}/load")
            ratios, overheads, walls, slowest = [], [], [], []
            for _ in range(args.rounds + 1):  # the first round warms everything up
                solo = []
                for name in MEMBERS:
                    started = time.perf_counter()
                    reply = client.post("/v1/chat/completions", json={**body, "model": name})
                    assert reply.status_code == 200, reply.text
                    solo.append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                result = client.post("/v1/batch/execute", json={**body, "group": "trio"}).json()
                wall = (time.perf_counter() - started) * 1000
                assert result["complete"], result
                inside = max(m["latency_ms"] for m in result["responses"])
                ratios.append(wall / max(solo))
                overheads.append(result["wall_ms"] - inside)
                walls.append(wall)
                slowest.append(max(solo))
    print(code_note())
    print(f"machine: {machine_note()}")
    med = statistics.median
    print(f"3 tiny members, {args.tokens} tokens each, {args.rounds} rounds, medians, "
          f"{os.cpu_count()} cores")
    print(f"slowest member alone {med(slowest[1:]):8.1f} ms   group wall {med(walls[1:]):8.1f} ms")
    print(f"group / slowest alone  ratio {med(ratios[1:]):.3f}")
    print(f"orchestration (group wall - slowest member inside it) {med(overheads[1:]):.2f} ms")


if __name__ == "__main__":
    main()
