"""The `defaults:` section: every model's settings, unless the model sets its own."""

from __future__ import annotations

from pydantic import BaseModel, Field

from corral.supervisor.config.schema.base import STRICT
from corral.supervisor.config.schema.memory import CacheRamMb, KvCacheConfig
from corral.supervisor.config.schema.overrides import LoadOverridesConfig
from corral.supervisor.config.schema.request import RequestFilters

__all__ = ["Defaults"]


class Defaults(BaseModel):
    model_config = STRICT

    ttl: float = Field(300, ge=0, description="idle seconds before a model is stopped; 0 = never")
    ctx: int = Field(4096, ge=0)
    start_timeout: float = Field(
        120, gt=0, description="seconds a child has to become ready (vllm children: 900 unless "
        "set here or on the model: model load plus graph capture)")
    parallel: int = Field(1, ge=1)
    n_gpu_layers: int = -1
    threads: int | None = Field(
        None, ge=1, description="CPU threads per child; default: cores / policy.max_loaded")
    max_queue: int = Field(64, ge=0, description="requests waiting per model before 429")
    queue_timeout: float = Field(300, gt=0, description="seconds a request waits for a slot")
    stop_grace: float = Field(10, ge=0, description="seconds between SIGTERM and SIGKILL")
    first_byte_timeout: float = Field(
        600, gt=0, description="seconds until the child's first response byte (CPU prefill)")
    idle_timeout: float = Field(120, gt=0, description="longest silence between stream chunks")
    health_interval: float = Field(5, gt=0, description="seconds between /health probes")
    health_timeout: float = Field(3, gt=0, description="timeout of one /health probe")
    health_failures: int = Field(
        3, ge=1, description="consecutive failed probes before the child is killed")
    start_backoff: float = Field(
        1, ge=0, description="back-off after a failed start, doubling per consecutive failure")
    start_backoff_max: float = Field(60, ge=0, description="cap of that back-off")
    kv_cache: KvCacheConfig | None = Field(
        None, description="KV cache mode for every model (default: cache_type_k/v as set)")
    load_overrides: LoadOverridesConfig = Field(
        LoadOverridesConfig(), description="bounds of what an admin load may override for "
        "one start, for every model that sets none of its own")
    request: RequestFilters | None = Field(
        None, description="request filters for every model that sets none of its own")
    loading_progress: bool = Field(
        False, description="a streamed chat request that waits for a cold model gets the load's "
        "progress first, as reasoning_content (what Open WebUI shows as thinking); a request "
        "asks for it itself with the header X-Corral-Progress: 1")
    prompt_cache: bool = Field(
        True, description="llama-server children: save slots at a stop and restore them "
        "(prompt_cache: section); false opts out")
    cache_ram_mb: CacheRamMb = Field(
        "auto", description="llama-server's own prompt cache in RAM (--cache-ram, MiB; 0: "
        "off, -1: no limit), counted in each child's RAM estimate. auto: 1/16 of the RAM "
        "budget, at most 2048; 0 where the model's own RAM estimate plus that passes half the "
        "budget, or when more than one key reaches /v1 (api_keys and admin_api_keys: the "
        "cache is shared by every caller)")
