"""Reload latency: from writing the config file to the new config being live, for a 100-model
config with one change (target < 100 ms).

Each round changes one model's ttl and saves the file the way editors do (a new file renamed
over the old one); the clock stops at the first GET /admin/config (polled every 2 ms) that shows
the change. Also printed: when the daemon had applied it, from its own timestamp (free of the
polling), and how long the reload itself took (read + validate + diff + apply). Part of the
latency is by design: the watcher waits for STEP_MS without writes before it reloads, so that a
burst of writes is one reload.

    python bench/reload_latency.py [--rounds 20] [--models 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from corral.supervisor.config.watch import STEP_MS

from _harness import code_note, corral_daemon, machine_note, percentile, tiny_model


def models_config(model: Path, count: int, changed_ttl: float) -> dict[str, Any]:
    models = {f"m-{i:03d}": {"model": str(model), "ctx": 2048 + 16 * i, "ttl": 300 + i,
                             "aliases": [f"alias-{i:03d}"], "args": ["--flash-attn", "auto"]}
              for i in range(count)}
    models["m-042"]["ttl"] = changed_ttl
    return models


def save(path: Path, config: dict[str, Any]) -> float:
    """Write as an editor does; the wall time just before the rename makes it visible."""
    tmp = path.with_name(path.name + ".swp")
    tmp.write_text(yaml.safe_dump(config))
    written = time.time()
    os.replace(tmp, path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", type=int, default=100)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        extra: dict[str, Any] = {"policy": {"max_loaded": 2}}
        with corral_daemon(models_config(model, args.models, 1000), **extra) as handle, \
                httpx.Client(base_url=handle.url, timeout=10) as client:
            path = handle.folder / "corral.yaml"
            seen, applied, reload_ms = [], [], []
            for i in range(args.rounds):
                ttl = 1001 + i
                config = {"models": models_config(model, args.models, ttl), **extra}
                written = save(path, config)
                while True:
                    status = client.get("/admin/config").json()
                    if status["active"]["config"]["models"]["m-042"]["ttl"] == ttl:
                        seen.append((time.time() - written) * 1000)
                        break
                    if time.time() - written > 10:
                        raise SystemExit(f"round {i}: the change was not live within 10 s: "
                                         f"{status['last_reload']}")
                    time.sleep(0.002)
                last = status["last_reload"]
                assert last["ok"] and last["changes"]["updated"] == {"m-042": ["ttl"]}, last
                applied.append((last["at"] - written) * 1000)
                reload_ms.append(last["duration_ms"])
                time.sleep(0.3)  # rounds apart: each write its own burst

    print(f"reload latency, {args.models}-model config, one ttl change, {args.rounds} rounds")
    print(f"  {machine_note()}")
    print(f"  {code_note()}")
    for label, values in (("write → live in GET /admin/config", seen),
                          ("write → applied (daemon's timestamp)", applied),
                          ("  of which the reload (read, validate, diff, apply)", reload_ms)):
        print(f"  {label}: median {statistics.median(values):.1f} ms, "
              f"p90 {percentile(values, 90):.1f} ms, max {max(values):.1f} ms")
    print(f"  the watcher's quiet window (debounce): {STEP_MS} ms of the above")
    median = statistics.median(seen)
    print(f"  target < 100 ms (median write → live): {'met' if median < 100 else 'not met'}")


if __name__ == "__main__":
    main()
