"""The `policy:` section checked and resolved: the strategy, with the keys each built-in one
reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from corral.supervisor.config.issues import ConfigIssue, Loc, dotted
from corral.supervisor.config.schema import Config
from corral.supervisor.config.specs import GroupSpec, ModelSpec
from corral.supervisor.policy import BUILTIN, Strategy, StrategyError, load_strategy

__all__ = ["resolve_strategy"]


def resolve_strategy(config: Config, base_dir: Path, models: dict[str, ModelSpec],
                      aliases: dict[str, str], groups: dict[str, GroupSpec],
                      issues: list[ConfigIssue], line: Callable[[Loc], int | None],
                      filename: str) -> Strategy | None:
    """Build `policy.strategy`, checking the settings each built-in strategy reads."""
    policy = config.policy
    name = policy.strategy

    def problem(loc: Loc, message: str) -> None:
        issues.append(ConfigIssue(filename, line(loc), dotted(loc), message))

    # Which policy keys each built-in reads; a key set for another strategy is a mistake.
    reads = {"pinned-group": "groups", "multi-group": "shares", "fixed-appliance": "models"}
    for strategy, key in reads.items():
        if getattr(policy, key) and name != strategy:
            problem(("policy", key), f"policy.{key} applies to strategy {strategy} "
                                     f"(strategy is {name})")
    if policy.options and name in BUILTIN:
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
    if issues:
        return None
    options = policy.options.get_secret_value() if name not in BUILTIN else {
        "groups": list(policy.groups), "shares": dict(policy.shares),
        "models": fixed}
    try:
        return load_strategy(name, options, base_dir)
    except StrategyError as exc:
        problem(("policy", "strategy"), str(exc))
        return None
