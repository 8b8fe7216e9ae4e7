"""The `groups:` section: models run together on one request (parallel, chain, fan-out,
consensus), and how their answers are compared when they vote."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from corral.supervisor.config.schema.base import STRICT

__all__ = ["CompareConfig", "ExtractConfig", "Fallback", "GroupConfig", "GroupType",
           "QuorumFallback", "Selector", "SimilarConfig"]

GroupType = Literal["parallel", "chain", "fan_out", "consensus"]
Fallback = Literal["strict", "partial", "retry_once", "replace_with"]
Selector = Literal["first_ok", "longest", "shortest", "majority", "judge"]
QuorumFallback = Literal["strict", "partial"]


class ExtractConfig(BaseModel):
    """What of an answer is its vote: exactly one of the four."""

    model_config = STRICT

    regex: str | None = Field(
        None, description="the first group that took part in the first match is the vote, "
        "e.g. '(?i)answer:\\s*(\\w+)'; an answer without a match abstains")
    json_path: str | None = Field(
        None, description="a path into an answer that is JSON, e.g. $.answer or "
        "$.items[0].name (set the group's response_format so members answer JSON)")
    last_line: bool = Field(False, description="the answer's last non-empty line is the vote")
    first_sentence: bool = Field(
        False, description="the answer's first sentence is the vote (up to the first . ! or ? "
        "followed by a space, or the end of its first non-empty line)")


class SimilarConfig(BaseModel):
    model_config = STRICT

    model: str = Field(description="a model of the config with `embeddings: true`")
    threshold: float = Field(
        0.9, gt=0, le=1, description="cosine similarity at which two answers count as one "
        "vote (average linkage between clusters)")
    # Sentence embeddings barely see a number or a yes/no ("15 + 5 = 6" sits at 0.96 cosine
    # from "= 7"): these keep such answers apart whatever the threshold.
    distinct_numbers: bool = Field(
        True, description="answers whose last numbers differ are never one vote (\"7 + 5 is "
        "12\" and \"12\" agree, \"= 12\" and \"= 13\" do not); an answer without a number "
        "may join any")
    distinct_yes_no: bool = Field(
        True, description="an answer whose first bare yes or no (opening it, or ending a "
        "clause: \"The answer is yes.\") is yes and one whose is no are never one vote")


class CompareConfig(BaseModel):
    """How answers are compared for a vote. With both, the extracted votes are embedded."""

    model_config = STRICT

    extract: ExtractConfig | None = None
    similar: SimilarConfig | None = None


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
    compare: Literal["exact"] | CompareConfig = Field(
        "exact", description="how answers are compared for a vote (fan_out with selector "
        "majority, parallel and consensus): exact (normalized text), or {extract: ...} "
        "and/or {similar: ...}")
    quorum: int | None = Field(
        None, ge=1, description="parallel, consensus, fan_out majority: at least this many "
        "members must agree (as `compare` sees it), else quorum_fallback applies")
    quorum_fallback: QuorumFallback | None = Field(
        None, description="no quorum: strict fails the request (502 no_quorum), partial "
        "answers the best vote with complete: false (default: strict when fallback is "
        "strict, else partial)")
    response_format: dict[str, Any] | None = Field(
        None, description="sent to every member when the request sets none, e.g. "
        "{type: json_object} for a json_path vote")
