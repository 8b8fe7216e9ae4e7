"""The `memory:` section, and the KV cache modes a model (or `defaults:`) sets: schema and the
checks within each."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from corral.supervisor.config.schema.base import STRICT
from corral.supervisor.config.secrets import SecretOptions

__all__ = ["CacheRamMb", "KvCacheConfig", "MemoryConfig", "ladder_step"]

# llama-server's --cache-ram in MiB (-1: no limit, 0: off), or "auto" (memory/cache_ram.py).
CacheRamMb = Annotated[int, Field(ge=-1)] | Literal["auto"]


class MemoryConfig(BaseModel):
    model_config = STRICT

    reserve_mb: float = Field(
        512, ge=0, description="per device (each GPU, and RAM): never handed out to children")
    budget_mb: float | None = Field(
        None, gt=0, description="per device: the most corral's children may take in all "
        "(default: the device, less the reserve and what other processes use)")
    low_watermark: float = Field(
        85, gt=0, le=100, description="% of a device used: idle models are evicted in the "
        "background, then adaptive KV caches step down")
    critical_watermark: float = Field(
        95, gt=0, le=100, description="% of a device used: new loads are refused and idle "
        "models evicted at once")
    budgets: dict[str, float] = Field(
        {}, description="group -> MiB per device that only the group's members use, and "
        "nobody else takes (isolation)")
    interval: float = Field(
        2.0, ge=0.1, description="seconds between memory samples (devices and children)")
    gpu_reader: str = Field(
        "auto", description="auto (NVIDIA's NVML where it finds GPUs, else AMD's amdsmi) | "
        "nvml | amdsmi | none | plugin:package.module:Class | plugin:file.py:Class "
        "(another vendor's GPUs; tests inject numbers this way)")
    gpu_placement: Literal["best-fit", "most-free"] = Field(
        "best-fit", description="which GPU a model that fits one goes to: best-fit (the one "
        "it leaves least free: big holes stay for big models) or most-free")
    gpu_reader_options: SecretOptions = Field(
        SecretOptions(), description="passed to a plugin reader (secret: shown as **********)")

    @model_validator(mode="after")
    def _ordered(self) -> MemoryConfig:
        if self.critical_watermark < self.low_watermark:
            raise ValueError(f"critical_watermark ({self.critical_watermark:g}) is below "
                             f"low_watermark ({self.low_watermark:g})")
        return self

    @field_validator("budgets")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [g for g, mb in value.items() if mb <= 0]
        if bad:
            raise ValueError(f"a budget is more than 0 MiB ({', '.join(bad)})")
        return value


def ladder_step(step: str) -> tuple[str, str]:
    """A ladder step: `q8_0` (K and V), or `q8_0/q4_0` (K/V, asymmetric)."""
    k, sep, v = step.partition("/")
    return (k.strip(), v.strip() if sep else k.strip())


class KvCacheConfig(BaseModel):
    model_config = STRICT

    mode: Literal["fixed", "auto"] = Field(
        "fixed", description="fixed: cache_type_k/v as set; auto: the best step of the "
        "ladder whose estimate fits the model's memory budget")
    ladder: list[str] = Field(
        ["f16", "q8_0", "q4_0"], min_length=1, description="KV cache types, best first; a "
        "step is one type for K and V (q8_0) or K/V (q8_0/q4_0)")
    adaptive: bool = Field(
        False, description="under memory pressure step down the ladder (the child restarts; "
        "requests queue, none fail) and back up after `hold` seconds without pressure")
    hold: float = Field(
        60, ge=0, description="seconds without memory pressure before stepping back up")

    @field_validator("ladder")
    @classmethod
    def _steps(cls, ladder: list[str]) -> list[str]:
        for step in ladder:
            k, v = ladder_step(step)
            if not k or not v or "/" in v:
                raise ValueError(f"ladder step {step!r}: expected TYPE or TYPE_K/TYPE_V")
        steps = [ladder_step(step) for step in ladder]
        if len(set(steps)) != len(steps):  # q8_0 and q8_0/q8_0 are the same step
            raise ValueError("a ladder step is listed twice")
        return ladder
