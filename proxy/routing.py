"""Model name / alias / exposed group → what answers the request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corral.proxy.errors import UnknownGroup
from corral.supervisor.config import GroupSpec
from corral.supervisor.errors import UnknownModel
from corral.supervisor.json_bytes import compact
from corral.supervisor.port import Supervisor


@dataclass(frozen=True)
class ModelTarget:
    name: str  # canonical model name


@dataclass(frozen=True)
class GroupTarget:
    group: GroupSpec


def upstream_body(raw: bytes, body: dict[str, Any], canonical: str,
                  changed: bool = False) -> bytes:
    """The body to send the child: the client's bytes untouched, unless filters `changed` the
    body or the client named the model by an alias, which becomes the model's name (servers
    like vLLM only know that)."""
    if body.get("model") == canonical and not changed:
        return raw
    return compact({**body, "model": canonical})


def exposed_groups(daemon: Supervisor) -> dict[str, GroupSpec]:
    return {n: g for n, g in daemon.loaded.groups.items() if g.expose_as_model}


def resolve(daemon: Supervisor, name: str) -> ModelTarget | GroupTarget:
    canonical = daemon.resolve(name)
    if canonical is not None:
        return ModelTarget(canonical)
    group = exposed_groups(daemon).get(name)
    if group is not None:
        return GroupTarget(group)
    raise UnknownModel(name, sorted([*daemon.model_names(), *exposed_groups(daemon)]))


def group_by_name(daemon: Supervisor, name: str, *, admin: bool) -> GroupSpec:
    """A group named in a /v1/batch or /v1/chain body. Groups exposed as models are anyone's
    (like the models themselves); the others are the operator's: without an admin key they
    do not exist, exactly as they do not exist in /v1/models or as a chat `model`."""
    runnable = {n: g for n, g in daemon.loaded.groups.items() if admin or g.expose_as_model}
    group = runnable.get(name)
    if group is None:
        hint = "" if admin else " (groups not exposed as models need an admin key)"
        raise UnknownGroup(name, sorted(runnable), hint)
    return group
