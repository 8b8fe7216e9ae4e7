"""Admin load overrides: the settings an operator may give one start of a model
(`POST /admin/models/<m>/load {"ctx": 8192, ...}`), checked against the bounds its config sets
(`load_overrides:`) before anything starts, and applied to the spec that start runs with. A
later start without them runs the config again."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from corral.supervisor.backends.binaries import (
    STANDARD_KV_TYPES,
    TURBO_KV_TYPES,
    BinaryNotFound,
    find_executable,
    kv_type_problem,
)
from corral.supervisor.backends.llama_server import LlamaServer
from corral.supervisor.config import ModelSpec
from corral.supervisor.errors import BadOverride, SettingsDiffer
from corral.supervisor.memory.estimate import EstimateError, model_facts

__all__ = ["FIELDS", "BadOverride", "Overrides", "SettingsDiffer", "check_overrides"]

# What a load may set, in the config's own names, per backend that reads them.
FIELDS = ("ctx", "cache_type_k", "cache_type_v", "parallel", "draft_max", "draft_min")
_BY_BACKEND = {"llama-server": FIELDS, "vllm": ("ctx", "parallel")}
# llama-server args that give a model something to draft with: only then do draft settings
# mean anything (llama.cpp's old and new spellings).
_DRAFT_FLAGS = {"--model-draft", "-md", "--spec-draft-model", "--hf-repo-draft", "-hfd",
                "-hfrd", "--spec-draft-hf", "--spec-type"}


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The checked overrides of one load, in FIELDS order."""

    values: tuple[tuple[str, int | str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.values)

    def apply(self, spec: ModelSpec) -> ModelSpec:
        """`spec` as the start runs it. A KV type asked for one half only leaves the other as
        the config sets it."""
        if not self.values:
            return spec
        values: dict[str, Any] = dict(self.values)
        return dataclasses.replace(spec, **values, overrides=self.values)

    @property
    def fixes_kv(self) -> bool:
        return any(f in ("cache_type_k", "cache_type_v") for f, _ in self.values)

    def as_dict(self) -> dict[str, int | str]:
        return dict(self.values)


def running_differs(asked: ModelSpec, running: ModelSpec) -> list[str]:
    """The overridable settings in which the child that runs differs from what a load asks."""
    return [f for f in FIELDS if getattr(asked, f) != getattr(running, f)]


def check_overrides(spec: ModelSpec, given: Mapping[str, Any]) -> Overrides:
    """`given` checked against `spec`'s bounds; BadOverride names the first field that is not
    allowed. Reads the model's GGUF header (cached) and asks its binary for its KV types: call
    it off the event loop."""
    if not given:
        return Overrides()
    allowed = _BY_BACKEND.get(spec.backend, ())
    bounds = spec.override_bounds
    for name in given:
        if name not in FIELDS:
            raise BadOverride(f"unknown field {name!r}: a load takes {', '.join(FIELDS)} and "
                              f"restart", name)
        if name not in allowed:
            raise BadOverride(f"{spec.name} is a {spec.backend} model: a load of it takes "
                              f"{', '.join(allowed) or 'no overrides'}", name)
        if not bounds.enabled:
            raise BadOverride(f"{spec.name}'s config takes no load overrides "
                              f"(load_overrides.enabled: false)", name)
    values: dict[str, int | str] = {}
    for name in ("ctx", "parallel", "draft_max", "draft_min"):
        if name in given:
            values[name] = _integer(given[name], name, *_range(spec, name, given))
    for name in ("cache_type_k", "cache_type_v"):
        if name in given:
            values[name] = _kv_type(spec, given[name], name)
    kv = (str(values.get("cache_type_k", spec.cache_type_k) or "f16"),
          str(values.get("cache_type_v", spec.cache_type_v) or "f16"))
    if any(f in values for f in ("cache_type_k", "cache_type_v")) and not _runs_kv(spec, kv):
        param = "cache_type_k" if "cache_type_k" in values else "cache_type_v"
        raise BadOverride(f"{spec.name} cannot run a {kv[0]}/{kv[1]} KV cache: a quantized "
                          f"type stores blocks of 32 values, and its heads are not a "
                          f"multiple of that", param)
    if ("draft_max" in values or "draft_min" in values) \
            and not _DRAFT_FLAGS & {a.split("=", 1)[0] for a in spec.args}:
        param = "draft_max" if "draft_max" in values else "draft_min"
        raise BadOverride(f"{spec.name} has no draft model configured (args: --model-draft "
                          f"FILE): draft settings would do nothing", param)
    return Overrides(tuple((f, values[f]) for f in FIELDS if f in values))


def _range(spec: ModelSpec, name: str, given: Mapping[str, Any]) -> tuple[int, int, str]:
    """(lowest, highest, where the highest comes from) for an integer field."""
    bounds = spec.override_bounds
    if name == "ctx":
        if bounds.max_ctx is not None:
            return 1, bounds.max_ctx, "load_overrides.max_ctx"
        return 1, max(_trained_ctx(spec), spec.ctx), "the model's trained context"
    if name == "parallel":
        return 1, bounds.max_parallel, "load_overrides.max_parallel"
    if name == "draft_max":
        return 1, bounds.max_draft, "load_overrides.max_draft"
    top = given.get("draft_max")
    if isinstance(top, int) and not isinstance(top, bool) and 1 <= top <= bounds.max_draft:
        return 0, top, "draft_max"
    return 0, bounds.max_draft, "load_overrides.max_draft"


def _runs_kv(spec: ModelSpec, kv: tuple[str, str]) -> bool:
    try:
        return bool(LlamaServer().usable_kv_steps(dataclasses.replace(spec, kv_ladder=(kv,))))
    except EstimateError:  # a file we cannot read: llama-server says so at the start
        return True


def _trained_ctx(spec: ModelSpec) -> int:
    if spec.backend != "llama-server":
        return spec.ctx
    try:
        return model_facts(spec.model_path).n_ctx_train
    except EstimateError:
        return spec.ctx


def _integer(value: Any, name: str, low: int, high: int, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadOverride(f"{name!r} must be an integer", name)
    if not low <= value <= high:
        raise BadOverride(f"{name} {value} is out of bounds: {low} to {high} ({source})", name)
    return value


def _kv_type(spec: ModelSpec, value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise BadOverride(f"{name!r} must be a string (f16, q8_0, q4_0, ...)", name)
    allowed = spec.override_bounds.cache_types or [*STANDARD_KV_TYPES, *TURBO_KV_TYPES]
    if value not in allowed:
        raise BadOverride(f"{name} {value[:40]!r} is not allowed: {', '.join(allowed)} "
                          f"(load_overrides.cache_types)", name)
    try:
        binary: str | None = find_executable(spec.binary, ("llama-server",))
    except BinaryNotFound:  # none to ask: the start says so; the standard types apply
        binary = None
    problem = kv_type_problem(value, binary)
    if problem is not None:
        raise BadOverride(f"{name}: {problem}", name)
    return value
