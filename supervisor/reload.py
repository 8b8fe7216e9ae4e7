"""Reload as a pure diff: the config running now and the one just read → what to do to each
model. The daemon applies the plan (supervisor/daemon.py, `_apply_plan`) through the instance
state machine; nothing here touches a process, a clock or a file.

Per model:
- keep:    nothing changed; its child stays (same pid, streams untouched).
- update:  only settings the child was not started with changed (ttl, queue limits, timeouts,
           health knobs, aliases, ...): the running Instance takes the new spec in place.
- replace: something the child was started with changed (its argv or environment): in-flight
           requests finish, then the child restarts with the new settings.
- remove:  gone from the config: drains and stops; new requests get 404.
- add:     new in the config.
Config outside the models (policy, groups, api keys, ...) applies live; `listen`,
`max_body_mb` and `state_dir` are read once at startup, and the plan says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from corral.supervisor.config import MASK, Config, ConfigIssue, LoadedConfig, ModelSpec

# ModelSpec fields the child was not started with: they apply to a running model at once.
# Every other field (model_path, ctx, parallel, threads, n_gpu_layers, cache types, args, env,
# binary, backend, embeddings, mmproj, and whatever a future field is) changes the child's argv
# or environment, so a change restarts it: a new field is safe until it is listed here.
LIVE_FIELDS = frozenset({
    "aliases", "ttl", "start_timeout", "max_queue", "queue_timeout", "stop_grace",
    "first_byte_timeout", "idle_timeout", "health_interval", "health_timeout",
    "health_failures", "start_backoff", "start_backoff_max",
    "replicas_min", "replicas_max", "scale_after",  # the daemon adds or retires children
    "kv_adaptive", "kv_hold",  # read by the sampler, not the child
    "loading_progress", "request", "capabilities", "paths",  # read by the proxy
    "override_bounds",  # read by the next admin load
})

# Read once, when `corral serve` starts (the listening socket, aiohttp's body limit, the pid
# file's folder): a change is reported, and applies at the next start of corral.
RESTART_KEYS = ("listen", "max_body_mb", "relay_workers", "state_dir")
# Top-level keys reported model by model instead.
_PER_MODEL_KEYS = ("models", "defaults", "models_dir", "binary", "include")


@dataclass(frozen=True)
class ModelChange:
    name: str
    spec: ModelSpec  # the new one
    fields: tuple[str, ...]  # what changed, in ModelSpec field order


@dataclass(frozen=True)
class Plan:
    keep: tuple[str, ...] = ()
    update: tuple[ModelChange, ...] = ()
    replace: tuple[ModelChange, ...] = ()
    remove: tuple[str, ...] = ()
    add: tuple[ModelChange, ...] = ()
    settings: tuple[str, ...] = ()  # top-level keys that changed and apply live
    needs_restart: tuple[str, ...] = ()  # top-level keys that changed and wait for a restart
    pinned: tuple[str, ...] = ()  # models now kept loaded (pinned groups, the strategy)
    unpinned: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.update or self.replace or self.remove or self.add or self.settings
                    or self.needs_restart or self.pinned or self.unpinned)

    def summary(self) -> dict[str, Any]:
        """What changed, for the log and /admin: names and setting names, never values."""
        return {
            "added": [c.name for c in self.add],
            "removed": list(self.remove),
            "restarted": {c.name: list(c.fields) for c in self.replace},
            "updated": {c.name: list(c.fields) for c in self.update},
            "unchanged": len(self.keep),
            "settings": list(self.settings),
            "pinned": list(self.pinned),
            "unpinned": list(self.unpinned),
            "needs_restart": list(self.needs_restart),
        }


def diff(old: LoadedConfig, new: LoadedConfig,
         kept: tuple[frozenset[str], frozenset[str]] | None = None) -> Plan:
    """What changed from `old` to `new`. `kept`: what the strategy keeps loaded under each (the
    daemon's runtime decides it); without it, the members of pinned groups."""
    keep: list[str] = []
    update: list[ModelChange] = []
    replace: list[ModelChange] = []
    for name, spec in new.models.items():
        before = old.models.get(name)
        if before is None:
            continue
        changed = changed_fields(before, spec)
        if not changed:
            keep.append(name)
            continue
        child = [f for f in changed if f not in LIVE_FIELDS]
        if child == ["threads"] and _threads_not_in_argv(old, before) \
                and _threads_not_in_argv(new, spec):
            child = []
        change = ModelChange(name, spec, changed)
        (replace if child else update).append(change)
    was_pinned, now_pinned = (set(kept[0]), set(kept[1])) if kept else \
        (set(old.pinned), set(new.pinned))
    return Plan(
        keep=tuple(keep),
        update=tuple(update),
        replace=tuple(replace),
        remove=tuple(name for name in old.models if name not in new.models),
        add=tuple(ModelChange(name, spec, ()) for name, spec in new.models.items()
                  if name not in old.models),
        settings=tuple(k for k in _changed_keys(old.config, new.config)
                       if k not in RESTART_KEYS and k not in _PER_MODEL_KEYS),
        needs_restart=tuple(k for k in _changed_keys(old.config, new.config)
                            if k in RESTART_KEYS),
        pinned=tuple(sorted(now_pinned - was_pinned)),
        unpinned=tuple(sorted((was_pinned - now_pinned) & set(new.models))),
    )


def changed_fields(old: ModelSpec, new: ModelSpec) -> tuple[str, ...]:
    return tuple(f.name for f in fields(ModelSpec)
                 if getattr(old, f.name) != getattr(new, f.name))


def _threads_not_in_argv(loaded: LoadedConfig, spec: ModelSpec) -> bool:
    """A change of `threads` alone leaves the child alone when the value was never chosen:
    the automatic one (cores / policy.max_loaded) moves with max_loaded, and a policy change
    must not restart every model; it applies at each model's next start. Likewise when args
    carry their own --threads, which wins over the setting."""
    if {"-t", "--threads"} & set(spec.args):
        return True
    configured = loaded.config.models.get(spec.name)
    return (configured is None or configured.threads is None) \
        and loaded.config.defaults.threads is None


def _changed_keys(old: Config, new: Config) -> list[str]:
    return [key for key in Config.model_fields if getattr(old, key) != getattr(new, key)]


# -- what /admin/config shows -----------------------------------------------------------------

REDACTED = MASK  # what every secret shows as


def config_view(loaded: LoadedConfig) -> dict[str, Any]:
    """The active config as JSON: where it came from, its hash, and the config itself. Its
    secrets (API keys, tokens, models' `env:` values, plugins' options) are typed as such in the
    schema, so the JSON dump shows each as `**********`: nothing here picks them out by name."""
    return {
        "source": str(loaded.source) if loaded.source else None,
        "files": [str(p) for p in loaded.files],
        "hash": f"sha256:{loaded.digest}" if loaded.digest else None,
        "models": sorted(loaded.models),
        "config": loaded.config.model_dump(mode="json"),
    }


@dataclass(frozen=True)
class ReloadAttempt:
    """One reload: when, why, and what came of it."""

    at: float  # wall clock
    trigger: str  # file | sighup | admin
    ok: bool
    duration_ms: float
    issues: tuple[ConfigIssue, ...] = ()
    changes: dict[str, Any] | None = None  # Plan.summary() of what was applied
    files: tuple[Path, ...] = ()  # read (or tried) by this attempt
    digest: str = ""  # of the config applied

    @classmethod
    def applied(cls, trigger: str, started: float, plan: Plan,
                loaded: LoadedConfig) -> ReloadAttempt:
        return cls(time.time(), trigger, True, _ms_since(started), (), plan.summary(),
                   loaded.files, loaded.digest)

    @classmethod
    def failed(cls, trigger: str, started: float, issues: list[ConfigIssue],
               files: tuple[Path, ...]) -> ReloadAttempt:
        return cls(time.time(), trigger, False, _ms_since(started), tuple(issues), None, files)

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "trigger": self.trigger,
            "ok": self.ok,
            "duration_ms": self.duration_ms,
            "issues": [{"file": i.file, "line": i.line, "key": i.key, "message": i.message,
                        "text": str(i)} for i in self.issues],
            "changes": self.changes,
            "hash": f"sha256:{self.digest}" if self.digest else None,
        }


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 2)
