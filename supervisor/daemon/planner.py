"""The planner: the snapshot a strategy decides over (pure data), asking the strategy, and
acting on a start it allows (KV types, GPUs, the backend's last word)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog

from corral.supervisor import policy
from corral.supervisor.backends import BACKENDS
from corral.supervisor.config import ModelSpec
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.instance import LOADED_STATES, Instance, State
from corral.supervisor.memory.devices import CUDA_VISIBLE, visible_devices_of
from corral.supervisor.memory.placement import GpuChoice
from corral.supervisor.memory.tracker import MemoryTracker
from corral.supervisor.memory.view import Footprint
from corral.supervisor.model.overrides import Overrides

log = structlog.get_logger("corral.daemon")


class Planner:
    def __init__(self, herd: Herd, memory: MemoryTracker,
                 http: Callable[[], aiohttp.ClientSession]):
        self._herd = herd
        self._memory = memory
        self.http = http  # the daemon's session, for a start's probes
        self._strategy_failures: dict[str, str] = {}  # decision → last error (logged once)

    def snapshot(self, now: float | None = None) -> policy.Snapshot:
        now = time.monotonic() if now is None else now
        views = tuple(self.view(i) for rs in self._herd.models.values() for i in rs.members) \
            + tuple(policy.ModelView(
                # Left the config, still draining: it holds its room until it is gone.
                name=f"{i.name} (removed)", loaded=i.state in LOADED_STATES, stoppable=False,
                last_used=i.last_used, ttl=0, footprint=self.footprint(i),
                model=i.model if i.model in self._herd.loaded.models else "",
            ) for i in self._herd.retired) + tuple(dataclasses.replace(
                # A new child starting beside the old one (blue/green): its own settings.
                # An extra child, not a restart: new-load limits apply to it.
                self.view(rs.incoming), name=f"{rs.name} (new)", stoppable=False, ttl=0,
                kv_changing=False,
            ) for rs in self._herd.models.values() if rs.incoming is not None)
        snap = self._herd.loaded.snapshot(views, now)
        return dataclasses.replace(snap, memory=self._memory.view(self._herd.live(), now),
                                   estimate=self.estimate, estimate_on=self.estimate_on)

    def view(self, i: Instance) -> policy.ModelView:
        spec = self.settings_of(i)
        rs = self._herd.models.get(i.model)
        # KV types an admin load set are that start's: no ladder step replaces them.
        ladder = tuple(policy.KvCache(k, v) for k, v in self._memory.ladder(spec)) \
            if spec.kv_ladder and not Overrides(spec.overrides).fixes_kv else ()
        level = rs.kv_level if rs is not None else 0
        # A remote holds no memory and no room here: never counted against max_loaded, never
        # evicted (its state is its own business: door.py starts it without asking the policy).
        loaded = i.state in LOADED_STATES and i.backend.spawns
        footprint = self.footprint(i)
        primary = rs.primary if rs is not None else None
        restarting = rs is not None and rs.restarting
        for_kv = rs is not None and rs.stepping_kv
        if not loaded and for_kv and i is primary:
            # Stopped to restart at another KV step: its room is kept for that start, or a
            # waiting cold start would take it and the restart would fail.
            loaded = True
            footprint = self.estimate(i.name, ladder[min(level, len(ladder) - 1)]
                                       if ladder else None)
        return policy.ModelView(
            name=i.name,
            loaded=loaded,
            stoppable=i.state is State.READY and not i.busy and i.backend.spawns,
            last_used=i.last_used,
            ttl=spec.ttl,
            size_bytes=i.size_bytes,
            cache_type_k=spec.cache_type_k,
            cache_type_v=spec.cache_type_v,
            in_flight=i.in_flight,
            queued=i.queued,
            model=i.model,
            ready=i.state is State.READY,
            footprint=footprint,
            kv_ladder=ladder,
            kv_level=level,
            kv_auto=spec.kv_mode == "auto",
            kv_adaptive=spec.kv_adaptive,
            kv_hold=spec.kv_hold,
            kv_changing=for_kv or restarting or (rs is not None and rs.incoming is not None),
            **_gpu_request(spec),
        )


    def placed(self, spec: ModelSpec, choice: GpuChoice | None,
                env: bool = False) -> ModelSpec:
        """`spec` on the GPUs of `choice`; with `env`, for the start: the child is confined
        to them (CUDA_VISIBLE_DEVICES in NVML's PCI bus order, or the reader's variable),
        unless the model's env already names its GPUs."""
        if choice is None:
            return spec
        placed = dataclasses.replace(spec, placed_gpus=choice.gpus, gpu_split=choice.split)
        if not env or any(v in spec.env for v in _VISIBLE_VARS):
            return placed
        var = visible_devices_of(self._herd.runtime.gpu_reader)
        extra = {var: ",".join(str(i) for i in choice.indices)}
        if var == CUDA_VISIBLE and "CUDA_DEVICE_ORDER" not in spec.env:
            extra["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return dataclasses.replace(placed, env={**spec.env, **extra})

    def settings_of(self, inst: Instance) -> ModelSpec:
        """The config's spec with the admin load overrides of the child that runs, or of the
        start the model's load under way would make: what placement must count."""
        if inst.state in LOADED_STATES:
            return Overrides(inst.started_with.overrides).apply(inst.spec)
        rs = self._herd.models.get(inst.model)
        return rs.for_start(inst.spec) if rs is not None and rs.holds(inst) else inst.spec

    def footprint(self, inst: Instance) -> Footprint:
        return self._memory.footprint(inst) if inst.state in LOADED_STATES else {}

    def estimate(self, name: str, kv: policy.KvCache | None) -> Footprint:
        """The snapshot's estimate: what `name` (a model, a replica, "<m> (new)") takes when
        started with `kv` (None: its configured types)."""
        inst = self.instance_of(name)
        if inst is None:
            return {}
        spec = self.settings_of(inst)
        if inst.state in LOADED_STATES and inst.started_with.placed_gpus is not None:
            # Where it runs (a KV step's saving is counted there).
            spec = dataclasses.replace(spec, placed_gpus=inst.started_with.placed_gpus,
                                       gpu_split=inst.started_with.gpu_split)
        return self._memory.need(spec, (kv.type_k or spec.cache_type_k,
                                       kv.type_v or spec.cache_type_v) if kv else
                                (spec.cache_type_k, spec.cache_type_v))

    def estimate_on(self, name: str, kv: policy.KvCache | None,
                     choice: GpuChoice) -> Footprint:
        """The snapshot's estimate of `name` started with `kv` on the GPUs of `choice`."""
        inst = self.instance_of(name)
        if inst is None:
            return {}
        spec = self.placed(self.settings_of(inst), choice)
        return self._memory.need(spec, (kv.type_k or spec.cache_type_k,
                                       kv.type_v or spec.cache_type_v) if kv else
                                (spec.cache_type_k, spec.cache_type_v))

    def instance_of(self, name: str) -> Instance | None:
        """The instance behind a view's name (a model, a replica, "<m> (new)")."""
        base = name.removesuffix(" (new)")
        if base != name:
            rs = self._herd.models.get(base)
            return rs.incoming if rs is not None else None
        return self._herd.loaded_member(base)

    def begin_start(self, inst: Instance, snap: policy.Snapshot, view_name: str,
                     reason: str = "demand") -> None:
        """Start `inst` with the KV types the strategy picks for it, on the GPUs it picks;
        it counts at its estimate until measured."""
        kv = self.decide("kv_cache", None, snap, view_name)
        self._log_auto_kv(inst, snap, view_name, kv)
        strategy: Any = self._herd.runtime.strategy
        chooser = strategy if callable(getattr(strategy, "gpus_for", None)) else policy.Generic()
        try:
            choice: GpuChoice | None = chooser.gpus_for(snap, view_name, kv)
        except Exception:  # a plugin's bad answer: the child starts unplaced, as before
            log.exception("daemon.gpu_choice_failed", model=inst.name)
            choice = None

        rs = self._herd.models.get(inst.model)
        overrides = rs.start_overrides() if rs is not None and rs.holds(inst) else Overrides()

        def tune(spec: ModelSpec) -> ModelSpec:
            return self.tune(self.placed(overrides.apply(spec), choice, env=True))

        inst.begin_start(self.http(), self._herd.on_spawn,
                         (kv.type_k, kv.type_v) if kv else None, tune=tune, reason=reason)
        if choice is not None:
            log.info("daemon.gpus_chosen", model=inst.name, gpus=list(choice.indices),
                     split=list(choice.split) or None)
        self._memory.started(inst)

    def _log_auto_kv(self, inst: Instance, snap: policy.Snapshot, view_name: str,
                     kv: policy.KvCache | None) -> None:
        """Why `kv_cache.mode: auto` starts `inst` at `kv` (a step below the top is a
        surprise worth explaining: what did not fit, beside what)."""
        view = snap.view(view_name)
        explain = getattr(self._herd.runtime.strategy, "auto_choice", None)
        if kv is None or view is None or not view.kv_auto or explain is None:
            return
        try:
            level, reason = explain(snap, view)
        except Exception:  # a plugin's own auto_choice: the start goes on unexplained
            log.exception("daemon.strategy_failed", decision="auto_choice")
            return
        step = view.kv_ladder.index(kv) if kv in view.kv_ladder else None
        if step is not None and step != level:
            reason += f"; adaptive KV holds it at step {step}"
        log.info("daemon.kv_cache_chosen", model=inst.name, kv=f"{kv.type_k}/{kv.type_v}",
                 step=step, reason=reason)

    def tune(self, spec: ModelSpec) -> ModelSpec:
        """The backend's last word on a start's settings, from what it needs per device
        (a vLLM child's share of the GPU). An auto `cache_ram_mb` becomes the number
        placement counted, for the argv."""
        try:
            spec = self._memory.with_cache_ram(spec, (spec.cache_type_k, spec.cache_type_v))
            need = self._memory.need(spec, (spec.cache_type_k, spec.cache_type_v))
            return BACKENDS[spec.backend].tune(spec, need, self._memory.gpu_totals())
        except Exception:  # odd figures are no reason to refuse a start: as configured
            log.exception("daemon.tune_failed", model=spec.name)
            return spec

    def decide(self, decision: str, fallback: Any, *args: Any) -> Any:
        """Ask the strategy. A plugin that raises must not take requests down with it: the
        error is logged (once per kind of failure) and `fallback` stands in."""
        try:
            answer = getattr(self._herd.runtime.strategy, decision)(*args)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if self._strategy_failures.get(decision) != message:
                self._strategy_failures[decision] = message
                log.exception("daemon.strategy_failed", decision=decision,
                              strategy=self._herd.loaded.config.policy.strategy)
            return fallback
        self._strategy_failures.pop(decision, None)
        return answer


# What a child's runtime reads to choose its GPUs (NVIDIA's, AMD's HIP and ROCr).
_VISIBLE_VARS = (CUDA_VISIBLE, "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _gpu_request(spec: ModelSpec) -> dict[str, Any]:
    """The view's `gpus` and `gpu_count`: a pin, a vLLM model's parallel size, or the GPUs
    the model's own env names (CUDA_VISIBLE_DEVICES=1,2: it runs on exactly those, and is
    counted there; a value that is not indices, say GPU UUIDs, leaves it unplaced)."""
    if spec.backend == "remote" or spec.rpc_workers:
        return {"gpu_count": -1}  # nothing here, or its layers on RPC workers
    own = next((spec.env[v] for v in _VISIBLE_VARS if v in spec.env), None)
    if own is not None:
        parts = [p.strip() for p in own.split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            return {"gpu_count": -1}
        return {"gpus": tuple(f"gpu{p}" for p in parts), "gpu_count": len(parts)}
    count = spec.tensor_parallel_size * spec.pipeline_parallel_size \
        if spec.backend == "vllm" else 0
    return {"gpus": tuple(f"gpu{i}" for i in spec.gpus), "gpu_count": count}
