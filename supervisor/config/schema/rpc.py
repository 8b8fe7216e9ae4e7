"""The config of models split over several hosts with llama.cpp's RPC backend: a model's `rpc`
section, the head's `peers`, and the `worker` section of a corral that lends its devices."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from corral.supervisor.config.schema.base import STRICT, HeaderKey

__all__ = ["PeerConfig", "RpcConfig", "WorkerConfig"]


class RpcConfig(BaseModel):
    model_config = STRICT

    workers: list[str] = Field(
        min_length=1, description="where the model's layers go: `local` (an rpc-server child on "
        "this machine; on a GPU box the n-th local worker gets the n-th GPU) or a peer's name")
    split: Literal["auto"] | list[float] = Field(
        "auto", description="auto: layers in proportion to each worker's measured free memory, "
        "none past what fits; or one weight per worker")
    threads: int = Field(1, ge=1, description="CPU threads of each local rpc-server")

    @field_validator("split")
    @classmethod
    def _positive(cls, value: str | list[float]) -> str | list[float]:
        if isinstance(value, list) and (not value or any(w < 0 for w in value)
                                        or not any(w > 0 for w in value)):
            raise ValueError("split weights are >= 0, and one is > 0")
        return value


class PeerConfig(BaseModel):
    model_config = STRICT

    url: str = Field(description="the peer corral's address, e.g. http://10.0.0.2:8080")
    token: HeaderKey = Field(description="its worker.token (sent as a Bearer key)")


class WorkerConfig(BaseModel):
    model_config = STRICT

    enabled: bool = Field(
        False, description="serve as a worker: no models of its own; peers ask it to run "
        "rpc-servers (also `corral serve --worker`)")
    token: HeaderKey | None = Field(
        None, description="the key peers must send (Bearer); required")
    bind: str = Field(
        "127.0.0.1", description="the address its rpc-servers listen on; rpc-server has no "
        "authentication, so anything but loopback is logged as a warning")
    lease: float = Field(
        30, gt=0, description="seconds an rpc-server lives without word from the head that "
        "asked for it (a head that died leaves nothing running here)")
    max_loans: int = Field(
        8, ge=1, description="rpc-servers lent at once, to all heads together; one more is "
        "refused with 429 until a loan ends")
