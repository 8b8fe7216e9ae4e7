"""The `groups:` section checked and resolved: members, judges, synthesizers and fallbacks by
their canonical model names."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from corral.supervisor.config import jsonpath
from corral.supervisor.config.issues import ConfigIssue, Loc, dotted
from corral.supervisor.config.names import name_problem
from corral.supervisor.config.schema import Config, GroupConfig
from corral.supervisor.config.specs import GroupSpec, ModelSpec, VoteSpec
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
        bad = name_problem(name)
        if bad is not None:
            problem(at, bad)
        elif name in models or name in aliases:
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
        vote = _vote(g, at, problem, canonical, models)
        if g.pinned:
            pinned.update(members)
        groups[name] = GroupSpec(
            name=name, type=g.type, models=tuple(members), required_responses=required,
            member_timeout=g.member_timeout, fallback=g.fallback, replace_with=replace,
            pinned=g.pinned, selector=g.selector, judge=judge, synthesizer=synthesizer,
            template=g.template, expose_as_model=g.expose_as_model, vote=vote,
            response_format=g.response_format)
    if len(pinned) > config.policy.max_loaded:
        problem(("policy", "max_loaded"),
                f"pinned groups keep {len(pinned)} models loaded ({', '.join(sorted(pinned))}) "
                f"but max_loaded is {config.policy.max_loaded}")
    return groups


def _vote(g: GroupConfig, at: Loc, problem: Callable[[Loc, str], None],
          canonical: Callable[[str, Loc], str | None],
          models: dict[str, ModelSpec]) -> VoteSpec | None:
    """The group's vote, checked: a regex that compiles and has a group, a JSON path that
    parses, an embeddings model that exists and serves embeddings, a quorum it can reach."""
    compare = g.compare if g.compare != "exact" else None
    votes = g.type in ("parallel", "consensus") or (g.type == "fan_out"
                                                    and g.selector == "majority")
    if (compare is not None or g.quorum is not None) and not votes:
        key = "quorum" if compare is None else "compare"
        problem((*at, key), f"{key} applies to parallel and consensus groups and to fan_out "
                "with selector majority")
        return None
    if g.quorum is not None and g.quorum > len(g.models):
        problem((*at, "quorum"), f"quorum {g.quorum} exceeds the group's {len(g.models)} "
                "members")
    if g.quorum_fallback is not None and g.quorum is None:
        problem((*at, "quorum_fallback"), "quorum_fallback needs a quorum")
    spec = VoteSpec(quorum=g.quorum, on_no_quorum=g.quorum_fallback or (
        "strict" if g.fallback == "strict" else "partial"))
    if compare is None:
        return spec if g.quorum is not None or g.type == "fan_out" else None
    if compare.extract is not None:
        e = compare.extract
        where: Loc = (*at, "compare", "extract")
        chosen = [k for k, v in (("regex", e.regex), ("json_path", e.json_path),
                                 ("last_line", e.last_line),
                                 ("first_sentence", e.first_sentence)) if v]
        if len(chosen) != 1:
            problem(where, "give exactly one of regex, json_path, last_line, first_sentence"
                    + (f" (got {', '.join(chosen)})" if chosen else ""))
        elif e.regex is not None:
            try:
                groups = re.compile(e.regex).groups
            except re.error as exc:
                problem((*where, "regex"), f"regex does not compile: {exc}")
            else:
                if groups < 1:
                    problem((*where, "regex"), "the regex needs a group: its first group is "
                            "the vote, e.g. 'answer:\\s*(\\w+)'")
            spec = dataclasses.replace(spec, extract="regex", regex=e.regex)
        elif e.json_path is not None:
            try:
                path = jsonpath.parse(e.json_path)
            except ValueError as exc:
                problem((*where, "json_path"), str(exc))
                path = ()
            spec = dataclasses.replace(spec, extract="json", json_path=path)
        elif e.last_line:
            spec = dataclasses.replace(spec, extract="last_line")
        else:
            spec = dataclasses.replace(spec, extract="first_sentence")
    if compare.similar is not None:
        where = (*at, "compare", "similar", "model")
        embedder = canonical(compare.similar.model, where)
        if embedder is not None and "embeddings" not in models[embedder].capabilities:
            problem(where, f"{embedder!r} does not serve embeddings: set `embeddings: true` "
                    "on it (llama-server: with args [--pooling, mean])")
        spec = dataclasses.replace(spec, similar_model=embedder,
                                   threshold=compare.similar.threshold,
                                   distinct_numbers=compare.similar.distinct_numbers,
                                   distinct_yes_no=compare.similar.distinct_yes_no)
    return spec
