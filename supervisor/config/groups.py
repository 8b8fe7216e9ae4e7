"""The `groups:` section checked and resolved: members, judges, synthesizers and fallbacks by
their canonical model names."""

from __future__ import annotations

from collections.abc import Callable

from corral.supervisor.config.issues import ConfigIssue, Loc, dotted
from corral.supervisor.config.schema import Config
from corral.supervisor.config.specs import GroupSpec, ModelSpec
from corral.supervisor.templates import template_problem

__all__ = ["resolve_groups"]


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
