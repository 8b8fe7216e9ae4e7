"""`load_overrides:` (on a model, or in `defaults:`): the bounds within which an operator's
`POST /admin/models/<m>/load` may set a start's context, KV cache types, slots and draft
settings (supervisor/model/overrides.py checks a load's values against them)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from corral.supervisor.backends.binaries import STANDARD_KV_TYPES, TURBO_KV_TYPES
from corral.supervisor.config.schema.base import STRICT

__all__ = ["LoadOverridesConfig"]


class LoadOverridesConfig(BaseModel):
    model_config = STRICT

    enabled: bool = Field(
        True, description="false: an admin load of this model takes no overrides (400)")
    max_ctx: int | None = Field(
        None, ge=1, description="the largest `ctx` a load may ask (default: the model's "
        "trained context from its GGUF file, or its configured ctx when larger)")
    cache_types: list[str] | None = Field(
        None, min_length=1, description="the KV cache types `cache_type_k`/`cache_type_v` "
        "may name (default: every type llama.cpp knows)")
    max_parallel: int = Field(16, ge=1, description="the most slots (`parallel`) a load may ask")
    max_draft: int = Field(
        16, ge=1, description="the largest `draft_max` (tokens drafted per step) a load may ask")

    @field_validator("cache_types")
    @classmethod
    def _known(cls, value: list[str] | None) -> list[str] | None:
        unknown = [t for t in value or () if t not in (*STANDARD_KV_TYPES, *TURBO_KV_TYPES)]
        if unknown:
            raise ValueError(f"unknown cache type {unknown[0]!r}; llama.cpp knows "
                             f"{', '.join(STANDARD_KV_TYPES)} (and "
                             f"{', '.join(TURBO_KV_TYPES)} with a TurboQuant build)")
        return value
