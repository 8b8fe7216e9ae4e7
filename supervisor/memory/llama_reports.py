"""What llama.cpp itself reports a model uses: the buffer lines of llama-server's load log,
and llama-fit-params' per-device figures (the estimate's own arithmetic is in estimate.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from corral.supervisor.memory.estimate import (
    GPU_OVERHEAD,
    Estimate,
    EstimateError,
    MiB,
    _cpu_overhead,
    _Tally,
    model_facts,
)

_GPU_BACKENDS = r"CUDA|ROCm|HIP|Vulkan|MTL|Metal|SYCL|CANN|MUSA|OpenCL|WebGPU"


def device_name(ggml_name: str) -> str:
    """corral's device name for a ggml buffer type or device name: CPU, CPU_Mapped,
    CPU_REPACK, CUDA_Host, Host → "cpu"; CUDA0 → "gpu0", ROCm1 → "gpu1", Vulkan0,
    Metal, MTL0 → "gpu0" (CUDA_Split, the row-split buffer, counts as gpu0); anything else
    (RPC servers) keeps its own name, lowercased."""
    if ggml_name.startswith("CPU") or ggml_name == "Host" or ggml_name.endswith("_Host"):
        return "cpu"
    m = re.fullmatch(rf"(?:{_GPU_BACKENDS})(\d*)(?:_\w+)?", ggml_name)
    if m:
        return f"gpu{int(m.group(1) or 0)}"
    return ggml_name.lower()


_BUFFER_LINE = re.compile(
    r"\s(\S+)\s+(model |KV |RS |compute |output |)buffer size\s*=\s*([\d.]+)\s*MiB")
_BUFFER_KIND = {"model": "model", "": "model", "KV": "kv", "RS": "kv", "compute": "compute",
                "output": "output"}


def parse_load_log(lines: Iterable[str]) -> dict[str, dict[str, int]]:
    """Buffers a llama-server child allocated, from its startup log (needs `-lv 4`):
    device → {"model", "kv", "compute", "output"} bytes. Lines look like
    `load_tensors:   CPU_Mapped model buffer size =    92.10 MiB`,
    `llama_kv_cache:        CPU KV buffer size =    90.00 MiB`,
    `llama_context:        CPU  output buffer size =     0.19 MiB`,
    `sched_reserve:        CPU compute buffer size =    18.64 MiB` (a timestamp and level
    before them; older builds say `CPU buffer size` for the model). Several buffers of one
    device add up (CPU_Mapped + CPU_REPACK, both caches of a sliding-window model). At `-v`
    the --fit dry run logs a block of zero-size buffers first: a model line after a
    context's lines starts a new load, and the last load wins."""
    out: dict[str, dict[str, int]] = {}
    context_seen = False
    for line in lines:
        m = _BUFFER_LINE.search(line)
        if not m:
            continue
        kind = _BUFFER_KIND[m.group(2).strip()]
        if kind == "model" and context_seen:
            out, context_seen = {}, False
        context_seen = context_seen or kind != "model"
        device = out.setdefault(device_name(m.group(1)),
                                {"model": 0, "kv": 0, "compute": 0, "output": 0})
        device[kind] += round(float(m.group(3)) * MiB)
    return out


def fit_params_binary(llama_server: str) -> str | None:
    """llama-fit-params next to the given llama-server (a path, or a name on PATH)."""
    found = Path(shutil.which(llama_server) or llama_server)
    # beside the path as given, else beside the file a symlink points to
    for folder in dict.fromkeys((found.parent, found.resolve().parent)):
        candidate = folder / "llama-fit-params"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


_FIT_LINE = re.compile(r"(\S+) (\d+) (\d+) (\d+)\s*")


async def fit_params(binary: str, model_path: Path, *, ctx: int, parallel: int,
                     n_gpu_layers: int, cache_type_k: str | None, cache_type_v: str | None,
                     timeout: float = 30.0) -> Estimate | None:
    """llama.cpp's own dry run: `llama-fit-params --fit-print on` loads the metadata, builds
    the context without allocating and prints `<device> <model> <context> <compute>` in MiB
    (floored) per GPU, then `Host …` (common_fit_print in common/fit.cpp). Took 0.13–0.32 s on
    SmolLM2-135M and 0.03 s on the 2-layer test model here (2 cores, CPU build).

    Weights and KV match what llama-server then logs to the MiB. Compute is high for
    llama-server: the dry run reserves logits for a whole ubatch (n_vocab × 512 × 4 B) where
    the server reserves one row per slot — SmolLM2 at -c 4096: 106 MiB vs 18.64 logged.
    The figures get the same per-process overhead as `estimate`. None when the binary is
    missing, fails, prints nothing usable or runs past `timeout` (then it is killed, as on
    cancellation); nothing is logged: the caller falls back to `estimate`."""
    argv = [binary, "--fit-print", "on", "-m", str(model_path), "-c", str(ctx),
            "-np", str(parallel), "-ngl", str(n_gpu_layers)]
    if cache_type_k:
        argv += ["-ctk", cache_type_k]
    if cache_type_v:
        argv += ["-ctv", cache_type_v]
    stdout = await _run(argv, timeout)
    if stdout is None:
        return None
    rows = [m.groups() for line in stdout.splitlines() if (m := _FIT_LINE.fullmatch(line))]
    if not rows or rows[-1][0] != "Host":
        return None
    return _fit_estimate(rows, model_path)


async def _run(argv: list[str], timeout: float) -> str | None:
    """stdout of a successful run, else None. GGML_NO_BACKTRACE: on abort ggml would attach
    gdb to print a backtrace (to stdout, and ~0.6 s)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    except OSError:
        return None
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        await _kill(proc)
        return None
    except asyncio.CancelledError:
        await _kill(proc)
        raise
    return stdout.decode(errors="replace") if proc.returncode == 0 else None


async def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()


def _fit_estimate(rows: list[tuple[str, ...]], model_path: Path) -> Estimate:
    try:
        n_vocab = model_facts(model_path).n_vocab
    except EstimateError:
        n_vocab = 0
    tally = _Tally({}, {})
    for name, model, context, compute in rows:
        dev = device_name(name)
        tally.add(dev, "weights", int(model) * MiB)
        tally.add(dev, "kv", int(context) * MiB)
        tally.add(dev, "compute", int(compute) * MiB)
        tally.add(dev, "overhead", _cpu_overhead(n_vocab) if dev == "cpu" else GPU_OVERHEAD)
    return tally.result("llama-fit-params")
