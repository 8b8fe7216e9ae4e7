"""The `groups:` section: models run together on one request (parallel, chain, fan-out,
consensus)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from corral.supervisor.config.schema.base import STRICT

__all__ = ["Fallback", "GroupConfig", "GroupType", "Selector"]

GroupType = Literal["parallel", "chain", "fan_out", "consensus"]
Fallback = Literal["strict", "partial", "retry_once", "replace_with"]
Selector = Literal["first_ok", "longest", "shortest", "majority", "judge"]


class GroupConfig(BaseModel):
    model_config = STRICT

    models: list[str] = Field(min_length=1)
    type: GroupType = "parallel"
    required_responses: int | None = Field(
        None, ge=1, description="ok answers that make the result complete; default: all")
    member_timeout: float = Field(60, gt=0)
    fallback: Fallback = "strict"
    replace_with: dict[str, str] = {}
    pinned: bool = False
    selector: Selector = "first_ok"
    judge: str | None = None
    synthesizer: str | None = None
    template: str | None = None
    expose_as_model: bool = False
