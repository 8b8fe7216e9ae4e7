"""What a group run says happened: each member's result, the selection, and whether the
run is complete. One place decides `complete`, so the answer's `corral_group`, the `group`
event and the metrics label can never disagree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from corral.proxy import votes
from corral.supervisor.config import GroupSpec

# A member that gave an answer: itself, on its second try, or through its backup.
OK_STATUSES = frozenset({"ok", "retried", "replaced"})
# Not answered, and no failure of the member's: the run ended before it was needed
# (first_ok's losers), or it was left out because it cannot take the request (no vision).
NOT_FAILED = frozenset({"cancelled", "skipped"})


@dataclass
class MemberResult:
    model: str
    status: str  # ok | error | timeout | retried | replaced | cancelled | skipped
    content: str | None = None
    latency_ms: float = 0.0
    usage: dict[str, Any] | None = None
    error: str | None = None
    replaced: str | None = None  # for status "replaced": the member this answer stands in for
    input: str | None = None  # chain steps: the user message's text this step was given
    images: int | None = None  # image parts this member was sent (None: the request had none)
    # What else the answer said, for a group answering as this member: its tool calls (chat
    # shape) and why it ended (stop | length | tool_calls), with the stop string it ended on
    # where the member said which.
    tool_calls: list[dict[str, Any]] | None = None
    finish: str | None = None
    stop_sequence: str | None = None
    finished_at: float = field(default=0.0, repr=False)

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    @property
    def failed(self) -> bool:
        return not self.ok and self.status not in NOT_FAILED

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "status": self.status, "content": self.content,
            "latency_ms": round(self.latency_ms, 1), "usage": self.usage, "error": self.error}
        if self.replaced:
            out["replaced"] = self.replaced
        if self.input is not None:
            out["input"] = self.input
        if self.images is not None:
            out["images"] = self.images
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


@dataclass
class Selection:
    index: int
    model: str
    reason: str


@dataclass
class GroupOutcome:
    group: GroupSpec
    responses: list[MemberResult]
    wall_ms: float
    selected: Selection | None = None
    final: str | None = None
    extra_usage: list[dict[str, Any]] = field(default_factory=list)  # judge / synthesizer
    tally: votes.Tally | None = None  # how the answers voted, for groups that vote

    @property
    def ok_count(self) -> int:
        return sum(r.ok for r in self.responses)

    @property
    def complete(self) -> bool:
        """Enough members answered (required_responses) and, with a quorum, enough agreed.
        A member cancelled because the others already answered is no shortfall."""
        quorum = self.tally is None or self.tally.quorum_met
        return quorum and self.ok_count >= self.group.required_responses

    @property
    def result(self) -> str:
        """The `group` event's and corral_group_requests_total's word for an answered run:
        ok when complete, partial when not (a run that failed never gets here)."""
        return "ok" if self.complete else "partial"

    def answer(self) -> str:
        """The one text a chat completion for this group returns."""
        if self.final is not None:
            return self.final
        if self.selected is not None:
            return self.responses[self.selected.index].content or ""
        return "\n\n".join(
            f"### {r.model}\n{r.content if r.ok else f'(no answer: {r.error})'}"
            for r in self.responses)

    def usage(self) -> dict[str, int]:
        total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for usage in [r.usage for r in self.responses] + self.extra_usage:
            for key in total:
                total[key] += int((usage or {}).get(key) or 0)
        return total

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.group.name, "type": self.group.type, "complete": self.complete,
            "required_responses": self.group.required_responses,
            "wall_ms": round(self.wall_ms, 1),
            "responses": [r.as_dict() for r in self.responses],
            "usage": self.usage()}
        if self.tally is not None:
            out["vote"] = self.tally.as_dict()
        if self.selected is not None:
            out["selected"] = {"index": self.selected.index, "model": self.selected.model,
                               "reason": self.selected.reason}
        if self.final is not None or self.group.type in ("fan_out", "consensus", "chain"):
            out["final"] = self.answer()
        if self.group.type == "consensus" and self.final is not None:
            out["synthesis"] = {
                "model": self.group.synthesizer,
                "reason": f"{self.group.synthesizer} wrote the final answer from the "
                          f"{self.ok_count} member answers"}
        return out


class GroupFailed(Exception):
    """Fewer members answered than the group requires (strict: required_responses;
    otherwise: none at all), or not enough agreed (a strict quorum) → 502 with `code`."""

    def __init__(self, message: str, outcome: GroupOutcome, code: str = "group_failed"):
        self.outcome = outcome
        self.code = code
        super().__init__(message)


__all__ = ["NOT_FAILED", "OK_STATUSES", "GroupFailed", "GroupOutcome", "MemberResult",
           "Selection"]
