"""The memory section checked against the groups: every budget names a group, and no model
sits in two budgets, and the budgets fit under budget_mb."""

from __future__ import annotations

from collections.abc import Callable

from corral.supervisor.config.issues import ConfigIssue, Loc, dotted
from corral.supervisor.config.schema import Config
from corral.supervisor.config.specs import GroupSpec

__all__ = ["check_budgets"]


def check_budgets(config: Config, groups: dict[str, GroupSpec], issues: list[ConfigIssue],
                  line: Callable[[Loc], int | None], filename: str) -> None:
    memory = config.memory

    def problem(loc: Loc, message: str) -> None:
        issues.append(ConfigIssue(filename, line(loc), dotted(loc), message))

    owner: dict[str, str] = {}
    for group in memory.budgets:
        loc: Loc = ("memory", "budgets", group)
        if group not in groups:
            problem(loc, f"unknown group {group!r}; groups: {', '.join(sorted(groups)) or 'none'}")
            continue
        for member in groups[group].models:
            if member in owner:
                problem(loc, f"{member!r} is in the budgets of both {owner[member]!r} and "
                             f"{group!r}; a model lives in one budget")
            owner.setdefault(member, group)
    total = sum(memory.budgets.values())
    if memory.budget_mb is not None and total > memory.budget_mb:
        problem(("memory", "budgets"), f"the group budgets add up to {total:g} MiB but "
                                       f"budget_mb is {memory.budget_mb:g}")
