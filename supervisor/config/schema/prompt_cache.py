"""The `prompt_cache:` section: llama-server children's slots saved to disk when they stop and
restored when a conversation comes back (supervisor/prompt_cache/)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from corral.supervisor.config.schema.base import STRICT

__all__ = ["PromptCacheConfig"]


class PromptCacheConfig(BaseModel):
    model_config = STRICT

    enabled: bool = Field(
        True, description="save each llama-server slot's KV cache when its child stops, "
        "restore it when the conversation continues; a model opts out with "
        "prompt_cache: false")
    dir: str | None = Field(
        None, description="where the files go (default: prompt-cache/ under state_dir)")
    max_mb: float = Field(
        4096, ge=0, description="disk budget; the least recently used files go first")
    min_tokens: int = Field(
        256, ge=1, description="a slot holding fewer prompt tokens is not saved (its prefill "
        "is cheaper than a file)")
    save_timeout: float = Field(
        10, gt=0, description="seconds a stop may spend saving its slots; past that it stops "
        "without the rest")
    restore_timeout: float = Field(
        5, gt=0, description="seconds a request may wait for its restore; past that it "
        "goes on without it")
    idle_save_after: float | None = Field(
        2.0, ge=0, allow_inf_nan=False, description="seconds a child must have had no "
        "request before the slots its last turns changed are saved, so its stop (an "
        "eviction, a swap) has nothing left to write; 0 or null: saved only when it stops")
