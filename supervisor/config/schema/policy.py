"""The `policy:` section: which strategy decides what stays loaded, and the settings it reads."""

from __future__ import annotations

from pydantic import BaseModel, Field

from corral.supervisor.config.schema.base import STRICT
from corral.supervisor.config.secrets import SecretOptions

__all__ = ["PolicyConfig"]


class PolicyConfig(BaseModel):
    model_config = STRICT

    strategy: str = Field(
        "generic", description="generic | pinned-group | multi-group | fixed-appliance | "
        "plugin:package.module:Class | plugin:file.py:Class | an entry point in the group "
        "corral.strategies")
    max_loaded: int = Field(4, ge=1, description="children loaded at once, at most")
    evict_timeout: float = Field(
        30, gt=0, description="seconds a cold start waits for a busy model to drain before 503"
    )
    groups: list[str] = Field(
        [], description="pinned-group: the groups kept loaded; other models load on demand")
    shares: dict[str, int] = Field(
        {}, description="multi-group: group -> load slots its members use, and no other model")
    models: list[str] = Field(
        [], description="fixed-appliance: the fixed set loaded at boot (default: every model)")
    options: SecretOptions = Field(
        SecretOptions(), description="settings passed to a plugin strategy (secret: shown as "
        "**********)")
