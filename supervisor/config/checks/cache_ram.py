"""`corral check`'s warning about llama-server's RAM prompt caches: the limits the config sets
(`cache_ram_mb`, or a model's own `--cache-ram` in args) of the models that may be loaded
together add up to more than the RAM budget. A warning, not an error: each cache fills only
with use, and placement counts it (it evicts, or refuses with a 503), but such a config
starts fewer models at once than its `max_loaded` says."""

from __future__ import annotations

import psutil

from corral.supervisor.config.issues import ConfigIssue
from corral.supervisor.config.loaded import LoadedConfig
from corral.supervisor.memory import cache_ram

__all__ = ["cache_ram_warnings"]

MIB = 1024 * 1024


def cache_ram_warnings(loaded: LoadedConfig) -> list[ConfigIssue]:
    """The caches set of the models that may be loaded together past the RAM budget (at the
    biggest cache's key), and a cache set on a child that several user keys share."""
    return _over_budget(loaded) + _shared_by_keys(loaded)


def _shared_by_keys(loaded: LoadedConfig) -> list[ConfigIssue]:
    """Auto is 0 with several callers (Config.several_callers); a number set there gives
    that isolation up."""
    if not loaded.config.several_callers():
        return []
    out = []
    for name, spec in loaded.models.items():
        own = cache_ram.own_mib(spec.args, spec.env)
        mib = spec.cache_ram_mb if own is None else own
        if spec.backend == "llama-server" and mib:
            key = ("models", name, "args") if own is not None else \
                ("models", name, "cache_ram_mb")
            out.append(loaded.issue(key, (
                f"{name}'s RAM prompt cache (--cache-ram {mib}) is shared by every caller, "
                f"and api_keys lists {len(loaded.config.api_keys)} keys: one key's cached "
                f"prefix speeds up another's guess (auto is 0 with several keys)")))
    return out


def _over_budget(loaded: LoadedConfig) -> list[ConfigIssue]:
    """Auto caches are left out: each is at most 1/16 of the budget. The budget is
    `memory.budget_mb`, else this machine's RAM less `memory.reserve_mb` (the message says
    which)."""
    config = loaded.config
    sizes: dict[str, int] = {}
    for name, spec in loaded.models.items():
        if spec.backend != "llama-server":
            continue
        mib = cache_ram.own_mib(spec.args, spec.env)
        mib = spec.cache_ram_mb if mib is None else mib
        if mib is not None and mib > 0:  # -1 (no limit) is sized by the child's KV: unknown here
            sizes[name] = mib
    together = sorted(sizes, key=lambda n: -sizes[n])[:config.policy.max_loaded]
    total = sum(sizes[n] for n in together)
    memory = config.memory
    if memory.budget_mb is not None:
        budget, what = memory.budget_mb, "memory.budget_mb"
    else:
        budget = psutil.virtual_memory().total / MIB - memory.reserve_mb
        what = "this machine's RAM less memory.reserve_mb"
    if not together or total <= budget:
        return []
    biggest = together[0]
    own = cache_ram.own_mib(loaded.models[biggest].args, loaded.models[biggest].env) is not None
    key = ("models", biggest, "args") if own else ("models", biggest, "cache_ram_mb")
    listed = ", ".join(f"{n} {sizes[n]}" for n in together)
    return [loaded.issue(key, (
        f"the RAM prompt caches (--cache-ram) of the {len(together)} models that may be "
        f"loaded together add up to {total} MiB ({listed}), more than the RAM budget "
        f"({budget:.0f} MiB: {what}); placement counts them, so fewer models load at once "
        f"(a smaller cache_ram_mb, or auto, keeps them under it)"))]
