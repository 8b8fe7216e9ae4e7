"""The prompt cache: a llama-server child's slots saved to disk (`/slots/N?action=save`) once
it is idle and when it stops, and restored into an empty slot (`action=restore`) when a
request continues one of those conversations, so the next turn after a swap, an eviction
or a corral restart does not prefill the whole conversation again.

`PromptCache` (one per daemon) holds the store (store.py) and what makes a KV cache
compatible (`setup`, taken at each child's spawn: identity.py); each running child gets a
`Slots` (slots.py), which pins requests to slots (choice.py) and restores them, and a `Saver`
(saver.py), which saves them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from corral.supervisor.config.schema import PromptCacheConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.events import EventBus
from corral.supervisor.inventory import shards
from corral.supervisor.prompt_cache.identity import Setup, file_id, key_parts
from corral.supervisor.prompt_cache.namespace import Namespaces
from corral.supervisor.prompt_cache.salt import PrefixSalts
from corral.supervisor.prompt_cache.store import Entry, Store

if TYPE_CHECKING:
    import aiohttp

    from corral.supervisor.prompt_cache.slots import Slots

__all__ = ["PromptCache", "Setup", "Store"]

log = structlog.get_logger("corral.prompt_cache")


class PromptCache:
    def __init__(self, folder: Path, settings: Callable[[], PromptCacheConfig],
                 events: EventBus):
        self.settings = settings  # read at each use: a reload may change them
        self.events = events
        self.store = Store(folder, lambda: int(self.settings().max_mb * (1 << 20)),
                           self._dropped)
        self.namespaces = Namespaces(folder)  # whose each save is (namespace.py)
        # Each caller's own prefix cache in a vLLM child (salt.py).
        self.salts = PrefixSalts(self.namespaces)
        self._builds: dict[tuple[str, int, int], str] = {}

    def _dropped(self, entry: Entry, reason: str) -> None:
        self.events.publish("prompt_cache_dropped", model=entry.model, file=entry.file,
                            bytes=entry.bytes, reason=reason)

    async def build(self, binary: str) -> str:
        """The binary's identity: `--version` (its build number and commit) with its path, size
        and mtime (a local build says "build 0, commit unknown"). Read once per file."""
        st = os.stat(binary)
        known = (binary, st.st_size, st.st_mtime_ns)
        if known not in self._builds:
            proc = await asyncio.create_subprocess_exec(
                binary, "--version", stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
            try:
                async with asyncio.timeout(10):
                    out, _ = await proc.communicate()
            except BaseException:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                raise
            version = next((line for line in out.decode(errors="replace").splitlines()
                            if line.startswith("version")), "")
            self._builds[known] = f"{version}|{binary}|{st.st_size}|{st.st_mtime_ns}"
        return self._builds[known]

    async def setup(self, spec: ModelSpec, binary: str) -> Setup:
        """What a saved KV cache is only valid for, taken at the child's spawn (identity.py):
        each file it maps (the model, all its parts if split, the mmproj: path, device,
        inode, size, mtime and a hash of the GGUF header and tensor index), the context per
        slot, the cache types, the user's extra flags (flash attention, rope, ... change the
        layout), given as `args` or as llama-server's LLAMA_ARG_* variables in `env`, the RPC
        workers and the llama-server build. Any difference: never
        restored. Raises OSError."""
        # Every part of a split model (llama-server maps them all), the projector, then the
        # adapters its args name: a LoRA or a control vector changes the KV as weights do.
        paths = [*shards(Path(spec.model_path)), *([spec.mmproj] if spec.mmproj else []),
                 *_adapters(spec.args)]
        # At once, on the start's path: the binary's --version (40 ms here, a process) beside
        # the headers' hashes (threads); the first error stops the rest and is raised.
        try:
            async with asyncio.TaskGroup() as group:
                build = group.create_task(self.build(binary))
                ids = [group.create_task(file_id(path)) for path in paths]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        files = tuple(task.result() for task in ids)
        parts = {"files": [key_parts(f) for f in files],
                 "ctx_per_slot": spec.ctx // max(spec.parallel, 1),
                 "cache_type_k": spec.cache_type_k, "cache_type_v": spec.cache_type_v,
                 "args": list(spec.args), "rpc": list(spec.rpc_servers),
                 "build": build.result()}
        env = _kv_env(spec.env)
        if env:  # absent when none: the keys of setups without any stay as they were
            parts["env"] = env
        key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
        return Setup(key, files)

    def slots(self, *, model: str, instance: str, spec: ModelSpec, setup: Setup,
              base_url: str, headers: dict[str, str], session: aiohttp.ClientSession,
              busy: Callable[[], bool] = lambda: False,
              live: Callable[[], ModelSpec] | None = None) -> Slots:
        """`setup`: the child's, from its spawn (`setup()`); `busy`: whether the child has a
        request in flight (no idle save then); `live`: the model's spec now (a reload's
        queue_timeout applies at once; `spec` is the one the child started with)."""
        from corral.supervisor.prompt_cache.slots import Slots

        return Slots(self, model=model, instance=instance, spec=spec, setup=setup,
                     base_url=base_url, headers=headers, session=session, busy=busy,
                     live=live)

    def status(self) -> dict[str, object]:
        settings = self.settings()
        return {"enabled": settings.enabled, "min_tokens": settings.min_tokens,
                "idle_save_after": settings.idle_save_after, **self.store.status()}


def _kv_env(env: Mapping[str, str]) -> list[list[str]]:
    """The model's `env` entries that llama-server reads as flags (LLAMA_ARG_ROPE_FREQ_BASE is
    --rope-freq-base, LLAMA_ARG_CACHE_TYPE_K where corral passes no --cache-type-k, ...):
    part of the key as `args` are, or a child started with another RoPE base would restore
    KV rotated under the old one. Never a secret's value (a key, a token: no flag of the KV)."""
    return sorted([name, value] for name, value in env.items()
                  if name.startswith("LLAMA_ARG_")
                  and not any(word in name for word in ("KEY", "TOKEN")))


# llama-server's flags that name adapter files (comma-separated; the scaled ones FNAME:SCALE),
# and whether their items carry a scale.
_ADAPTER_FLAGS = {"--lora": False, "--lora-scaled": True, "--control-vector": False,
                  "--control-vector-scaled": True}


def _adapters(args: Sequence[str]) -> list[Path]:
    """The LoRA adapters and control vectors `args` name. Their paths alone are in the key
    with the args; a file replaced under the same name (a retrained adapter) is another
    file, as the model's is."""
    found = []
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag not in _ADAPTER_FLAGS:
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        for item in value.split(","):
            name = item.rpartition(":")[0] if _ADAPTER_FLAGS[flag] and ":" in item else item
            if name:
                found.append(Path(name))
    return found
