"""The read model: what the proxy and the admin API may read of the herd, as values."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

from corral.supervisor.config import GroupSpec, LoadedConfig, ModelSpec
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.errors import NotServed
from corral.supervisor.instance import LOADED_STATES, Instance, State
from corral.supervisor.instance.view import describe as describe_instance
from corral.supervisor.instance.view import rpc_state
from corral.supervisor.inventory import cached_facts, read_facts
from corral.supervisor.memory import cache_ram
from corral.supervisor.memory.estimate import model_facts
from corral.supervisor.memory.gguf_info import describe_gguf
from corral.supervisor.memory.tracker import MemoryTracker, mib_map
from corral.supervisor.memory.view import MIB
from corral.supervisor.model import Model
from corral.supervisor.port import ModelStatus, RequestsNow
from corral.supervisor.rpc.plan import layer_need


class ReadModel:
    def __init__(self, herd: Herd, planner: Planner, memory: MemoryTracker):
        self._herd = herd
        self._planner = planner
        self._memory = memory


    def model_names(self) -> list[str]:
        return list(self._herd.models)

    def groups(self) -> Mapping[str, GroupSpec]:
        return self._herd.loaded.groups

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [self._admin_view(m, r, now) for m in self._herd.models.values()
                for r in m.members]

    def requests_now(self, names: Iterable[str]) -> RequestsNow:
        """The requests in flight and queued and the slots over every instance of these
        models (canonical names; unknown ones count nothing): what a router polls for each
        model, so it reads three counters an instance instead of describe()'s whole view of
        every instance."""
        running = queued = slots = 0
        for name in set(names):
            model = self._herd.models.get(name)
            for inst in model.members if model is not None else ():
                running += inst.in_flight
                queued += inst.queued
                slots += inst.spec.parallel
        return RequestsNow(running, queued, slots)

    def describe_one(self, name: str) -> dict[str, Any]:
        """The admin view of one model's instance named like it (an alias resolves)."""
        model = self._herd.model(name)
        return self._admin_view(model, model.primary, time.monotonic())

    def _admin_view(self, model: Model, inst: Instance, now: float) -> dict[str, Any]:
        # What its child holds per device (measured, the estimate until measured): the memory
        # tracker's, which the instance does not know.
        return {**describe_instance(inst, now), **model.describe(),
                "memory_mib": mib_map(self._planner.footprint(inst)),
                **self._estimate(inst), **_settings(inst)}

    def _estimate(self, inst: Instance) -> dict[str, Any]:
        """The running child's estimate per device and by part (`cache_ram`: llama-server's
        RAM prompt cache at its limit), and that limit in MiB; None while none runs."""
        running = inst.state in LOADED_STATES
        described = self._memory.describe(inst) if running else {}
        spec = inst.started_with if running else inst.spec
        own = cache_ram.own_mib(spec.args, spec.env) if spec.backend == "llama-server" \
            else None
        return {"estimate_mib": described.get("estimate_mib"),
                "estimate_breakdown_mib": described.get("estimate_breakdown_mib"),
                "cache_ram_mb": own if own is not None else spec.cache_ram_mb}

    def child_logs(self, key: str, lines: int) -> dict[str, Any]:
        """The last `lines` lines a model's child (or one replica's, "<model>#<n>") wrote."""
        inst = self._herd.member(key)
        return {"model": inst.name, "pid": inst.pid,
                "lines": inst.process.tail(lines) if inst.process else []}

    def follow_logs(self, key: str, lines: int,
                    idle: float) -> AsyncGenerator[dict[str, Any], None]:
        """What a model's child (or one replica's) writes, as it writes it: its last `lines`
        lines first, then batches of new ones; after a restart, the new child's lines from its
        first. `skipped`: lines that came and went off the ring before they could be read. A batch
        without lines after `idle` quiet seconds (the reader's keep-alive). The last item says why
        it ends (`end`): corral shuts down, or the model left the config. An unknown name raises
        UnknownModel here, before the first batch."""
        return self._follow(self._herd.member(key), lines, idle)

    async def _follow(self, inst: Instance, lines: int,
                      idle: float) -> AsyncGenerator[dict[str, Any], None]:
        loop = asyncio.get_running_loop()
        process = inst.process
        # No further back than the ring holds: asking for more than it keeps is no line missed.
        cursor = process.logs.written - min(lines, len(process.logs)) if process is not None else 0
        last_sent: float | None = None
        while True:
            # A reload may have replaced it (a new spec: its successor is followed) or removed it.
            current = self._herd.loaded_member(inst.name)
            if current is None:
                yield {"model": inst.name, "end": f"{inst.name} left the config"}
                return
            inst = current
            if inst.process is not process:  # a new child: every line of it
                process, cursor = inst.process, 0
            batch, skipped = process.logs.since(cursor) if process is not None else ([], 0)
            if process is not None:
                cursor = process.logs.written
            now = loop.time()
            if batch or skipped or last_sent is None or now - last_sent >= idle:
                last_sent = now
                yield {"model": inst.name, "pid": inst.pid, "lines": batch, "skipped": skipped}
                continue
            if self._herd.closing and inst.state in (State.STOPPED, State.FAILED):
                # Once its child is gone: its last lines (the drain, the exit) were worth reading.
                yield {"model": inst.name, "end": "corral is shutting down"}
                return
            # Until a line comes, anything changes in the herd (a new child, a reload, the
            # shutdown), or the keep-alive is due.
            waits = [asyncio.ensure_future(self._herd.changed.wait(None))]
            if process is not None:
                waits.append(asyncio.ensure_future(process.logs.wait(None)))
            try:
                await asyncio.wait(waits, timeout=idle - (now - last_sent),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()

    def status(self, name: str) -> ModelStatus:
        """One model (a canonical name, an alias) over its replicas. Raises UnknownModel."""
        rs = self._herd.model(name)
        health = rs.primary.health
        answering = None if rs.primary.backend.spawns or health.last_probe is None \
            else health.failures == 0
        return ModelStatus(rs.name, rs.spec, rs.instance_state(), rs.primary.since, answering)

    def spec(self, name: str) -> ModelSpec:
        """A model's config (a canonical name, an alias), without the status around it: the
        relay reads it on every request. Raises UnknownModel."""
        return self._herd.model(name).spec

    def statuses(self) -> list[ModelStatus]:
        return [self.status(name) for name in self._herd.models]

    def ready_now(self, name: str) -> bool:
        """Whether a request for `name` would find a ready child (of any replica) now."""
        rs = self._herd.models.get(name)
        return rs is not None and any(r.state is State.READY for r in rs.members)

    def inventory(self, name: str) -> dict[str, Any] | None:
        """What a model's GGUF file is, for /v1/models (supervisor/inventory.py): its
        architecture, parameters, quantization, native context_length, size_bytes (all
        shards) and whether it has a projector. From memory only; None while the file has
        not been read yet (just after a start or reload), when it cannot be read, and for a
        model that is not a GGUF file."""
        rs = self._herd.models.get(name)
        if rs is None or rs.spec.backend != "llama-server":
            return None
        facts = cached_facts(rs.spec.model_path)
        return None if facts is None else {**facts, "mmproj": rs.spec.mmproj is not None}

    async def gguf_info(self, name: str) -> dict[str, Any]:
        """The model file's metadata and tensors (the gguf package's reader, in a thread), the
        bytes per layer, and for a model split over RPC workers the split it runs with."""
        inst = self._herd.instance(name)
        if inst.spec.backend != "llama-server":
            raise NotServed(f"{name} is a {inst.spec.backend} model, not a GGUF file")
        try:
            info = await asyncio.to_thread(describe_gguf, inst.spec.model_path)
        except (OSError, ValueError) as exc:
            raise NotServed(f"{name}: cannot read {inst.spec.model_path}: {exc}") from exc
        spec = inst.started_with
        info["model"] = inst.name
        try:
            facts = await asyncio.to_thread(model_facts, spec.model_path)
            info["layer_need_mib"] = round(layer_need(
                facts, spec.ctx, spec.parallel, spec.cache_type_k, spec.cache_type_v) / MIB, 3)
        except Exception:  # a file llama.cpp reads but our arithmetic does not: say nothing
            info["layer_need_mib"] = None
        info["rpc"] = rpc_state(inst)
        return info

    async def read_inventory(self, loaded: LoadedConfig) -> None:
        """Read the headers of models not read yet (or changed on disk), one at a time in a
        thread: what inventory() answers from."""
        for spec in list(loaded.models.values()):
            if spec.backend == "llama-server":
                await asyncio.to_thread(read_facts, spec.model_path)

    async def prefetch_facts(self, loaded: LoadedConfig) -> None:
        """Read every model file's GGUF header once, in a thread, so the first decision about
        a model does not (the header parse is fast, loading gguf/numpy is not)."""
        for spec in list(loaded.models.values()):
            await asyncio.to_thread(self._memory.warm, spec)


def _settings(inst: Instance) -> dict[str, Any]:
    """The settings an admin load may override, as its child runs them (the config's while
    none runs), and the overrides in force (None: none, or not running)."""
    running = inst.state in LOADED_STATES
    spec = inst.started_with if running else inst.spec
    return {"ctx": spec.ctx, "parallel": spec.parallel,
            "draft_max": spec.draft_max, "draft_min": spec.draft_min,
            "overrides": dict(spec.overrides) if running and spec.overrides else None}
