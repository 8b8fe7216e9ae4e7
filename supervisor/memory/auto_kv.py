"""`kv_cache.mode: auto`'s choice of a ladder step, and the reason the daemon logs for it
(`daemon.kv_cache_chosen`): pure arithmetic over a `MemoryView` and each step's estimate.
policy.BaseStrategy.auto_choice gathers the inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from corral.supervisor.memory.view import Footprint, MemoryView, mib


def choose_step(mem: MemoryView, pool: str | None, labels: Sequence[str],
                needs: Sequence[Footprint], kept: Mapping[str, Footprint]) -> tuple[int, str]:
    """The best step whose estimate (`needs[i]`, per device) fits the pool on every device
    beside what is `kept` loaded there (placement never evicts that; anything else it may
    evict, so making room for it is placement's job); else the best that fits the pool as a
    whole (placement then says what is in the way); else the last step. With the reason."""
    if not needs:
        return -1, "no ladder"  # as before: callers only ask about models with one
    caps = {d: mem.pool_capacity(mem.devices[d], pool) for d in mem.devices}
    level, misses = _first_fit(labels, needs, caps, kept)
    beside = f"beside what is kept loaded ({_named(kept)})" if kept else ""
    if level is not None:
        if not misses:
            return level, f"{labels[level]}, the ladder's top, fits {beside}".rstrip()
        return level, f"{beside}{': ' if kept else ''}{'; '.join(misses)}; {labels[level]} fits"
    whole, whole_misses = _first_fit(labels, needs, caps, {})
    if whole is not None:
        return whole, (f"no step fits {beside}: {'; '.join(misses)}; "
                       f"{labels[whole]} fits the budget as a whole")
    last = len(needs) - 1
    return last, f"no step fits: {'; '.join(whole_misses)}; the last, {labels[last]}"


def _first_fit(labels: Sequence[str], needs: Sequence[Footprint], caps: Mapping[str, int],
               held: Mapping[str, Footprint]) -> tuple[int | None, list[str]]:
    """The first step that fits beside `held`, and what each step before it missed."""
    misses: list[str] = []
    for level, need in enumerate(needs):
        missing = _misfit(need, caps, held)
        if missing is None:
            return level, misses
        misses.append(f"{labels[level]} needs {missing}")
    return None, misses


def _misfit(need: Footprint, caps: Mapping[str, int],
            held: Mapping[str, Footprint]) -> str | None:
    """None when `need` fits beside `held` on every device; else what it needs where."""
    for device, n in need.items():
        if device not in caps:
            continue
        taken = sum(h.get(device, 0) for h in held.values())
        left = max(0, caps[device] - taken)
        if n > left:
            return f"{mib(n)} on {device} where {mib(left)} " + (
                f"of {mib(caps[device])} are left" if taken else "are free")
    return None


def _named(held: Mapping[str, Footprint]) -> str:
    return "; ".join(f"{name}: {', '.join(f'{mib(n)} on {d}' for d, n in f.items() if n)}"
                     for name, f in held.items())
