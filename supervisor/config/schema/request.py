"""The `request:` section: what corral does to a request's body before the model sees it.
The demo profile (supervisor/demo.py) uses it without the whole schema."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator

from corral.supervisor.config.schema.base import STRICT


class RequestFilters(BaseModel):
    """What corral does to a request's body before the model sees it."""

    model_config = STRICT

    defaults: dict[str, Any] = Field(
        {}, description="body fields used when the request does not set them, e.g. "
        "{temperature: 0.2, max_tokens: 256}")
    set: dict[str, Any] = Field(
        {}, description="body fields always set, overriding the client's, e.g. {top_k: 40}")
    strip: list[str] = Field(
        [], description="body fields removed before relaying, e.g. [logit_bias]")
    system_prompt: str | None = Field(
        None, description="chat requests without a system (or developer) message get this one "
        "first")

    @field_validator("set", "defaults")
    @classmethod
    def _not_routing(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "model" in value:
            raise ValueError("'model' is corral's to route by: it cannot be set here")
        return value

    @field_validator("strip")
    @classmethod
    def _keeps_model(cls, value: list[str]) -> list[str]:
        if "model" in value or "messages" in value:
            raise ValueError("'model' and 'messages' cannot be stripped")
        return value
