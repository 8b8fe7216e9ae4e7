"""llama-server (llama.cpp) adapter: binary discovery and argv."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
from collections.abc import Mapping, Sequence

from corral.supervisor.backends.binaries import INSTALL_HINT, find_executable
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory import cache_ram
from corral.supervisor.memory.estimate import Estimate, estimate, model_facts

__all__ = ["INSTALL_HINT", "LlamaServer", "find_executable"]

# Values per block of ggml's quantized types (f16, bf16, f32: 1).
_BLOCK = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "iq4_nl": 32,
          "turbo2": 32, "turbo3": 32, "turbo4": 32}

class LlamaServer:
    kind = "llama-server"
    spawns = True
    # 200 once the model is loaded; 503 {"error": "Loading model"} before that.
    health_path = "/health"
    lists_models = False
    binds_itself = True
    # server.cpp sets its ready flag, then logs "model loaded" (then "listening on ...", and
    # older builds "all slots are idle" once the loop runs). "loading model" comes first and
    # matches neither.
    ready_lines: tuple[str, ...] | None = ("model loaded", "listening on", "all slots are idle")

    def argv(self, spec: ModelSpec, port: int) -> list[str]:
        binary = find_executable(spec.binary, ("llama-server",))
        argv = [
            binary,
            "--model", str(spec.model_path),
            "--host", "127.0.0.1",
            # Always explicit: the binary's default port is about to change upstream.
            "--port", str(port),
            "--alias", spec.name,
            "--ctx-size", str(spec.ctx),
            "--parallel", str(spec.parallel),
            "--n-gpu-layers", str(spec.n_gpu_layers),
        ]
        if not {"-t", "--threads"} & set(spec.args):
            argv += ["--threads", str(spec.threads)]
        if spec.cache_type_k:
            argv += ["--cache-type-k", spec.cache_type_k]
        if spec.cache_type_v:
            argv += ["--cache-type-v", spec.cache_type_v]
        if spec.mmproj:
            argv += ["--mmproj", str(spec.mmproj)]
        if spec.embeddings:
            argv += ["--embeddings"]
        if cache_ram.own_mib(spec.args, spec.env) is None:
            # Never the binary's default (8192 MiB, grown unseen): the value placement counted.
            # Still auto here is a start no tracker resolved: off rather than uncounted.
            argv += ["--cache-ram", str(spec.cache_ram_mb or 0)]
        if spec.slot_save_path is not None:  # the prompt cache: /slots save and restore
            argv += ["--slot-save-path", str(spec.slot_save_path)]
        if spec.rpc_servers:  # deployed over RPC workers: layers per worker, in their order
            argv += ["--rpc", ",".join(spec.rpc_servers),
                     "--tensor-split", ",".join(str(n) for n in spec.tensor_split)]
        elif len(spec.gpu_split) > 1 and not {"-ts", "--tensor-split"} & set(spec.args):
            # Placed on several GPUs: each one's share of the layers, in the order
            # CUDA_VISIBLE_DEVICES lists them (the estimate split them the same way).
            argv += ["--tensor-split", ",".join(str(n) for n in spec.gpu_split)]
        argv += spec.args
        # An admin load's draft settings: after args, so they win over the config's.
        for value, new, old in ((spec.draft_max, "--spec-draft-n-max", "--draft-max"),
                                (spec.draft_min, "--spec-draft-n-min", "--draft-min")):
            if value is not None:
                argv += [new if _speaks(binary, new) else old, str(value)]
        return argv

    def auth_env(self, api_key: str) -> dict[str, str]:
        # The environment, not argv: any local user can read a process's argv (ps), only
        # its owner can read its environment.
        return {"LLAMA_API_KEY": api_key}

    def env(self, spec: ModelSpec) -> dict[str, str]:
        return dict(spec.env)

    def lost_port_race(self, log_tail: list[str]) -> bool:
        return any("couldn't bind HTTP server socket" in line for line in log_tail)

    def estimate(self, spec: ModelSpec, kv: tuple[str | None, str | None],
                 gpus: Sequence[str]) -> Estimate:
        """What the child takes per device, its RAM prompt cache at its limit included (the
        user's own --cache-ram, else the spec's; still auto: not counted, the tracker
        resolves auto before it asks)."""
        facts = model_facts(spec.model_path)
        if spec.rpc_workers:
            # The layers and their KV live on the RPC workers (the split planner checks they
            # fit there); the head keeps its compute buffers and itself on this machine.
            whole = estimate(facts, ctx=spec.ctx, parallel=spec.parallel, n_gpu_layers=0,
                             cache_type_k=kv[0], cache_type_v=kv[1], gpus=())
            # The head copies its slots' states (fetched from the workers) into its own RAM.
            head = dataclasses.replace(whole, devices={"cpu": whole.compute + whole.overhead},
                                       weights=0, kv=0)
            return head.with_cache_ram(self._cache_ram_bytes(spec, whole.kv))
        found = estimate(facts, ctx=spec.ctx, parallel=spec.parallel,
                         n_gpu_layers=spec.n_gpu_layers, cache_type_k=kv[0],
                         cache_type_v=kv[1], gpus=gpus,
                         split=spec.gpu_split if len(spec.gpu_split) == len(gpus) else ())
        # Wherever the KV lives, a cached state is a copy in host memory.
        return found.with_cache_ram(self._cache_ram_bytes(spec, found.kv))

    @staticmethod
    def _cache_ram_bytes(spec: ModelSpec, kv_bytes: int) -> int:
        mib = cache_ram.own_mib(spec.args, spec.env)
        if mib is None:
            mib = spec.cache_ram_mb or 0
        return cache_ram.counted_bytes(mib, kv_bytes)

    def usable_kv_steps(self, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
        """A quantized type stores blocks of 32 values, and llama.cpp refuses it when the
        head size is not a multiple of that."""
        facts = model_facts(spec.model_path)
        return tuple(step for step in spec.kv_ladder
                     if facts.head_dim_k % _BLOCK.get(step[0], 1) == 0
                     and facts.head_dim_v % _BLOCK.get(step[1], 1) == 0)

    def tune(self, spec: ModelSpec, need: Mapping[str, int],
             gpu_totals: Mapping[str, int]) -> ModelSpec:
        return spec  # llama-server takes what its layers need, no share to set


def _speaks(binary: str, flag: str) -> bool:
    """Whether `binary`'s --help lists `flag` (llama.cpp renamed --draft-max to
    --spec-draft-n-max, and the old name now refuses to start)."""
    st = os.stat(binary)
    text = _help(os.path.realpath(binary), st.st_mtime_ns, st.st_size)
    return flag in text.replace(",", " ").split()


@functools.lru_cache(maxsize=16)
def _help(binary: str, mtime_ns: int, size: int) -> str:
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout + done.stderr
