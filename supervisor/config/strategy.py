"""The `policy:` section checked and resolved to data: which strategy, with what settings. No
plugin is imported here: the daemon builds the strategy (supervisor/runtime.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from corral.supervisor.config.issues import ConfigIssue, Loc, dotted
from corral.supervisor.config.loaded import PluginChoice
from corral.supervisor.config.schema import Config
from corral.supervisor.config.secrets import SecretOptions
from corral.supervisor.config.specs import GroupSpec, ModelSpec

__all__ = ["BUILTIN_STRATEGIES", "resolve_strategy"]

# The strategies corral ships (supervisor/policy.py); anything else is a plugin.
BUILTIN_STRATEGIES = frozenset({"generic", "pinned-group", "multi-group", "fixed-appliance"})


def resolve_strategy(config: Config, base_dir: Path, models: dict[str, ModelSpec],
                      aliases: dict[str, str], groups: dict[str, GroupSpec],
                      issues: list[ConfigIssue], line: Callable[[Loc], int | None],
                      filename: str) -> PluginChoice | None:
    """Check the settings each built-in strategy reads; the strategy to build, as data."""
    policy = config.policy
    name = policy.strategy
    before = len(issues)  # the list holds other sections' issues too

    def problem(loc: Loc, message: str) -> None:
        issues.append(ConfigIssue(filename, line(loc), dotted(loc), message))

    # Which policy keys each built-in reads; a key set for another strategy is a mistake.
    reads = {"pinned-group": "groups", "multi-group": "shares", "fixed-appliance": "models"}
    for strategy, key in reads.items():
        if getattr(policy, key) and name != strategy:
            problem(("policy", key), f"policy.{key} applies to strategy {strategy} "
                                     f"(strategy is {name})")
    if policy.options and name in BUILTIN_STRATEGIES:
        problem(("policy", "options"), "policy.options is read by plugin strategies only")
    for i, group in enumerate(policy.groups):
        if group not in groups:
            problem(("policy", "groups", i), f"unknown group {group!r}; groups: "
                                             f"{', '.join(sorted(groups)) or 'none'}")
    fixed: list[str] = []
    for i, model in enumerate(policy.models):
        found = model if model in models else aliases.get(model)
        if found is None:
            problem(("policy", "models", i), f"unknown model {model!r}; models: "
                                             f"{', '.join(sorted(models)) or 'none'}")
        else:
            fixed.append(found)
    if name == "pinned-group" and not policy.groups:
        problem(("policy", "groups"), "strategy pinned-group needs the groups to keep loaded")
    owner: dict[str, str] = {}
    for group, share in policy.shares.items():
        loc: Loc = ("policy", "shares", group)
        if group not in groups:
            problem(loc, f"unknown group {group!r}; groups: {', '.join(sorted(groups)) or 'none'}")
            continue
        if share < 1:
            problem(loc, "a share holds at least 1 model")
        for member in groups[group].models:
            if member in owner:
                problem(loc, f"{member!r} is in the shares of both {owner[member]!r} and "
                             f"{group!r}; a model belongs to one share")
            owner.setdefault(member, group)
    if name == "multi-group":
        if not policy.shares:
            problem(("policy", "shares"), "strategy multi-group needs shares (group: slots)")
        elif sum(policy.shares.values()) > policy.max_loaded:
            problem(("policy", "shares"), f"the shares add up to {sum(policy.shares.values())} "
                                          f"but max_loaded is {policy.max_loaded}")
    if len(issues) > before:
        return None
    options = policy.options if name not in BUILTIN_STRATEGIES else SecretOptions({
        "groups": list(policy.groups), "shares": dict(policy.shares), "models": fixed})
    return PluginChoice(name, options, base_dir, ("policy", "strategy"))
