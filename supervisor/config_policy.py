"""Checks and resolution of the policy and groups sections: strategies with the keys each one
reads, and groups with their members, judges and fallbacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from corral.supervisor.config_schema import Config
from corral.supervisor.config_specs import GroupSpec, ModelSpec
from corral.supervisor.config_yaml import ConfigIssue, Loc, dotted
from corral.supervisor.policy import BUILTIN, Strategy, StrategyError, load_strategy
from corral.supervisor.templates import template_problem

__all__ = ["resolve_groups", "resolve_strategy"]


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
    options = policy.options if name not in BUILTIN else {
        "groups": list(policy.groups), "shares": dict(policy.shares),
        "models": fixed}
    try:
        return load_strategy(name, options, base_dir)
    except StrategyError as exc:
        problem(("policy", "strategy"), str(exc))
        return None


def resolve_groups(config: Config, models: dict[str, ModelSpec], aliases: dict[str, str],
                    issues: list[ConfigIssue], line: Callable[[Loc], int | None],
                    filename: str) -> dict[str, GroupSpec]:
    def problem(loc: Loc, message: str) -> None:
        issues.append(ConfigIssue(filename, line(loc), dotted(loc), message))

    def canonical(name: str, loc: Loc) -> str | None:
        found = name if name in models else aliases.get(name)
        if found is None:
            problem(loc, f"unknown model {name!r}; models: {', '.join(sorted(models)) or 'none'}")
        return found

    groups: dict[str, GroupSpec] = {}
    pinned: set[str] = set()
    for name, g in config.groups.items():
        at: Loc = ("groups", name)
        if name in models or name in aliases:
            problem(at, f"group name {name!r} is already a model name or alias")
        members: list[str] = []
        for i, member in enumerate(g.models):
            found = canonical(member, (*at, "models", i))
            if found is None:
                continue
            if found in members:
                problem((*at, "models", i), f"{member!r} is listed twice")
            members.append(found)
        judge = canonical(g.judge, (*at, "judge")) if g.judge else None
        synthesizer = canonical(g.synthesizer, (*at, "synthesizer")) if g.synthesizer else None
        if g.type == "fan_out" and g.selector == "judge" and not g.judge:
            problem((*at, "judge"), "selector 'judge' needs a judge model")
        if g.type == "consensus" and not g.synthesizer:
            problem((*at, "synthesizer"), "a consensus group needs a synthesizer model")
        replace: dict[str, str] = {}
        for member, backup in g.replace_with.items():
            loc = (*at, "replace_with", member)
            original = canonical(member, loc)
            substitute = canonical(backup, loc)
            if original and original not in members:
                problem(loc, f"{member!r} is not a member of the group")
            elif original and substitute:
                replace[original] = substitute
        if g.fallback == "replace_with" and not g.replace_with:
            problem((*at, "replace_with"), "fallback 'replace_with' needs a replace_with map")
        # fan_out wants one good answer to choose from; the others want every member.
        required = g.required_responses or (1 if g.type == "fan_out" else len(g.models))
        if required > len(g.models):
            problem((*at, "required_responses"),
                    f"{required} exceeds the group's {len(g.models)} members")
        if g.template is not None and g.type != "chain":
            problem((*at, "template"), "template applies to chain groups only")
        template_issue = template_problem(g.template) if g.template is not None else None
        if template_issue:
            problem((*at, "template"), template_issue)
        if g.pinned:
            pinned.update(members)
        groups[name] = GroupSpec(
            name=name, type=g.type, models=tuple(members), required_responses=required,
            member_timeout=g.member_timeout, fallback=g.fallback, replace_with=replace,
            pinned=g.pinned, selector=g.selector, judge=judge, synthesizer=synthesizer,
            template=g.template, expose_as_model=g.expose_as_model)
    if len(pinned) > config.policy.max_loaded:
        problem(("policy", "max_loaded"),
                f"pinned groups keep {len(pinned)} models loaded ({', '.join(sorted(pinned))}) "
                f"but max_loaded is {config.policy.max_loaded}")
    return groups
