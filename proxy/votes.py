"""Votes over a group's answers: what each answer says (its text normalized, or what a regex,
a JSON path or its last line extracts), which answers agree (the same vote, or embeddings
within a cosine threshold), and who wins. Pure: the caller gets the embeddings.

A tally is what the group reports under `vote` and what its metrics count."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from corral.supervisor.config import jsonpath
from corral.supervisor.config.specs import VoteSpec

__all__ = ["Ballot", "Bloc", "Stance", "Tally", "ballots", "cluster", "extract",
           "first_sentence", "normalized", "stance", "tally_by_value", "tally_similar"]


def normalized(text: str) -> str:
    """Exact comparison forgives case, runs of spaces and a trailing period."""
    return re.sub(r"\s+", " ", text.strip().lower()).rstrip(".!")


# What a report shows of one vote. Under `exact` (or `similar` on whole answers) a vote is the
# whole answer, and the report names it per member, per bloc and as the winner: a member's
# answer as long as its max_tokens allowed would come back three times over.
SHOWN_CHARS = 200


def shown(vote: str | None) -> str | None:
    return vote if vote is None or len(vote) <= SHOWN_CHARS else vote[:SHOWN_CHARS] + "…"


def extract(rule: VoteSpec, text: str) -> str | None:
    """What `text` votes for under `rule`, normalized; None: it casts no vote."""
    value: str | None
    if rule.extract == "regex":
        assert rule.regex is not None
        match = re.search(rule.regex, text)
        # The first group that took part in the match: alternatives can each have their own
        # (`(\w+) is the capital|capital is (\w+)`).
        value = next((g for g in match.groups() if g is not None), None) if match else None
    elif rule.extract == "json":
        picked = jsonpath.pick(text, rule.json_path)
        # A number or an object votes as its compact JSON: 4 and 4.0 stay apart, as they
        # would in the answer's text.
        value = None if picked is None else picked if isinstance(picked, str) \
            else json.dumps(picked, sort_keys=True, separators=(",", ":"))
    elif rule.extract == "last_line":
        lines = [line for line in text.splitlines() if line.strip()]
        value = lines[-1] if lines else None
    elif rule.extract == "first_sentence":
        value = first_sentence(text)
    else:
        value = text
    if value is None:
        return None
    value = normalized(value)
    return value or None


# A list marker or emphasis that opens a line ("1. ", "- ", "**") is no sentence of its own.
_LEAD = re.compile(r"^\s*(?:(?:[-*+\u2022]|\d+[.)])\s+)?[*_#>\s]*")
# A sentence ends at . ! ? (or a run of them, closing marks after) followed by a space:
# "3.5" and "e.g.," go on.
_END = re.compile(r"[.!?\u2026]++[*_\"')\]\u201d]*+(?=\s|$)")
_SENTENCE_MAX = 2000


def first_sentence(text: str) -> str | None:
    """The first sentence of the first non-empty line. A model that answers and then goes on
    ("Paris. It is also known for...") says its answer there; what follows is what makes two
    rambling answers with one answer look different to an embeddings model."""
    line = next((line for line in text.splitlines() if line.strip()), None)
    if line is None:
        return None
    # A sentence worth a vote is short; the bound keeps the search linear in what a member
    # (steered by a client's prompt) can write: a long run of dots is quadratic for _END.
    line = _LEAD.sub("", line[:_SENTENCE_MAX])
    end = _END.search(line)
    return (line[:end.start()] if end else line).strip().rstrip("*_").strip() or None


@dataclass(frozen=True)
class Ballot:
    index: int  # the member's place in the group
    model: str
    vote: str | None  # what is counted; None abstains (nothing extracted)


def ballots(rule: VoteSpec, answers: Sequence[tuple[int, str, str]]) -> list[Ballot]:
    """(index, model, answer text) of the answers that came → their ballots."""
    return [Ballot(i, model, extract(rule, text)) for i, model, text in answers]


@dataclass
class Bloc:
    """Answers that agree: their vote (for a cluster, its centre member's) and members."""

    vote: str
    members: list[int]  # member indices, in the group's order
    centre: int  # the member that speaks for the bloc
    cohesion: float = 1.0  # similar: mean cosine of its members to its centre

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"vote": shown(self.vote), "members": self.members,
                               "count": len(self.members)}
        if self.cohesion != 1.0:
            out["cohesion"] = round(self.cohesion, 4)
        return out


@dataclass
class Tally:
    compare: str
    ballots: list[Ballot]
    blocs: list[Bloc]  # biggest first, the winner first of all
    quorum: int | None = None
    tie: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def winner(self) -> Bloc | None:
        return self.blocs[0] if self.blocs else None

    @property
    def agree(self) -> int:
        return len(self.blocs[0].members) if self.blocs else 0

    @property
    def voters(self) -> int:
        """Answers that came, abstentions included: a share is of the answers given."""
        return len(self.ballots)

    @property
    def share(self) -> float:
        return self.agree / self.voters if self.voters else 0.0

    @property
    def quorum_met(self) -> bool:
        return self.quorum is None or self.agree >= self.quorum

    @property
    def agreement(self) -> str:
        """majority: more than half the answers agree; plurality: fewer, but more than agree
        on any other answer; no_majority: no bloc is bigger than every other (a tie, or no
        two answers agree); none: no answer cast a vote."""
        if not self.blocs:
            return "none"
        if 2 * self.agree > self.voters:
            return "majority"
        if len(self.blocs) > 1 and len(self.blocs[1].members) == self.agree:
            return "no_majority"
        return "plurality"

    @property
    def tied(self) -> list[Bloc]:
        """The blocs as big as the winner's (the winner's alone when it has no rival)."""
        return [b for b in self.blocs if len(b.members) == self.agree]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "compare": self.compare,
            "votes": [{"index": b.index, "model": b.model, "vote": shown(b.vote),
                       "bloc": self._bloc_of(b.index)} for b in self.ballots],
            "blocs": [bloc.as_dict() for bloc in self.blocs],
            "winner": shown(self.winner.vote) if self.winner else None,
            "agree": self.agree, "of": self.voters, "share": round(self.share, 4),
            "agreement": self.agreement, "tie": self.tie}
        if self.quorum is not None:
            out["quorum"] = self.quorum
            out["quorum_met"] = self.quorum_met
        if self.notes:
            out["notes"] = self.notes
        return out

    def _bloc_of(self, index: int) -> int | None:
        return next((n for n, bloc in enumerate(self.blocs) if index in bloc.members), None)

    def summary(self) -> str:
        """One line for a selection's reason or an error, opening with the agreement word."""
        how = f"({self.compare})"
        if not self.blocs:
            return f"none: no answer cast a vote {how}"
        agreement = self.agreement
        if agreement == "majority":
            return f"majority: {self.agree} of {self.voters} answers agree {how}"
        if agreement == "plurality":
            return (f"plurality: {self.agree} of {self.voters} answers agree, more than any "
                    f"other answer but not a majority {how}")
        if self.agree == 1:
            return f"no_majority: no two of {self.voters} answers agree {how}"
        return (f"no_majority: {len(self.tied)} blocs of {self.agree} of {self.voters} "
                f"answers tie {how}")


def _ranked(blocs: list[Bloc], tie_rule: str) -> tuple[list[Bloc], dict[str, Any] | None]:
    """Biggest bloc first; between blocs of one size `tie_rule` decides, then the group's
    order (the bloc whose first member comes first)."""
    if tie_rule == "tightest cluster":
        blocs.sort(key=lambda b: (-len(b.members), -round(b.cohesion, 6), b.members[0]))
    else:
        blocs.sort(key=lambda b: (-len(b.members), b.members[0]))
    tied = [b for b in blocs if len(b.members) == len(blocs[0].members)] if blocs else []
    if len(tied) < 2:
        return blocs, None
    broken_by = tie_rule
    if tie_rule == "tightest cluster" and round(tied[0].cohesion, 6) == round(tied[1].cohesion,
                                                                              6):
        broken_by = "first in order"
    return blocs, {"between": [shown(b.vote) for b in tied], "size": len(tied[0].members),
                   "broken_by": broken_by, "winner": shown(blocs[0].vote)}


def tally_by_value(compare: str, cast: list[Ballot], quorum: int | None = None) -> Tally:
    """Answers agree when their votes are equal (exact text or extracted values)."""
    blocs: dict[str, Bloc] = {}
    for b in cast:
        if b.vote is None:
            continue
        bloc = blocs.setdefault(b.vote, Bloc(b.vote, [], b.index))
        bloc.members.append(b.index)
    ranked, tie = _ranked(list(blocs.values()), "first in order")
    return Tally(compare, cast, ranked, quorum, tie)


def _unit(vector: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def _cos(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


# A number as written: a sign not glued to a word ("9-3" is 9 and 3), thousands separators,
# decimals ("3.5"; the period that ends "is 12." is no decimal point).
_NUMBER = re.compile(r"(?<![\w.])[-\u2212]?\d+(?:,\d{3})*(?:\.\d+)?|\d+(?:\.\d+)?")
# A bare yes or no: one the answer opens with (after quotes, emphasis, a list marker), or one
# that ends a clause ("The answer is yes.", "I'd say no,"). A "no" before a word is mostly a
# determiner ("there is no reason") and says nothing.
_POLARITY = re.compile(r"^\W*(yes|no)\b|\b(yes|no)(?=[*_\"'\u201d)\]]*(?:[.!?,;:]|\s*$))",
                       re.IGNORECASE)


@dataclass(frozen=True)
class Stance:
    """What sentence embeddings cannot tell apart and a vote must: the number an answer ends
    on and its first bare yes or no. None: it states none."""

    number: Decimal | None = None
    polarity: str | None = None

    def contradicts(self, other: Stance) -> bool:
        return any(a is not None and b is not None and a != b
                   for a, b in ((self.number, other.number), (self.polarity, other.polarity)))


def stance(text: str, numbers: bool = True, yes_no: bool = True) -> Stance:
    """The answer's last number (so "7 + 5 is 12" and "12" state one number: the operands
    a model restates come before its result) and its first bare yes or no."""
    number = None
    if numbers and (found := _NUMBER.findall(text)):
        # 12, 12.0 and 12.00 are one value; 1,000 and 1000 too.
        number = Decimal(found[-1].replace(",", "").replace("\u2212", "-")).normalize()
    polarity = None
    if yes_no and (m := _POLARITY.search(text)):
        polarity = (m.group(1) or m.group(2)).lower()
    return Stance(number, polarity)


def cluster(vectors: Sequence[Sequence[float]], threshold: float,
            stances: Sequence[Stance] | None = None) -> list[list[int]]:
    """Average-linkage clustering: the two clusters whose members are most alike on average
    merge while that average is at least `threshold`. Unlike chaining pairs (single linkage),
    a bloc cannot grow from one answer to a different one through a run of near neighbours;
    unlike a first-come leader, the result does not depend on the members' order.
    With `stances`, two clusters never merge while any member of one contradicts any member
    of the other (a cannot-link constraint): an answer without a number may join "12" or
    "13", not both."""
    units = [_unit(v) for v in vectors]
    sims = [[_cos(a, b) for b in units] for a in units]
    apart = [[stances is not None and stances[i].contradicts(stances[j])
              for j in range(len(units))] for i in range(len(units))]
    clusters = [[i] for i in range(len(units))]
    while len(clusters) > 1:
        best, pair = -2.0, (0, 0)
        for x in range(len(clusters)):
            for y in range(x + 1, len(clusters)):
                if any(apart[i][j] for i in clusters[x] for j in clusters[y]):
                    continue
                mean = sum(sims[i][j] for i in clusters[x] for j in clusters[y]) / (
                    len(clusters[x]) * len(clusters[y]))
                if mean > best:
                    best, pair = mean, (x, y)
        if best < threshold:
            break
        x, y = pair
        clusters[x] = sorted(clusters[x] + clusters[y])
        del clusters[y]
    return clusters


def tally_similar(compare: str, cast: list[Ballot], vectors: Sequence[Sequence[float]],
                  threshold: float, quorum: int | None = None,
                  stances: Sequence[Stance] | None = None) -> Tally:
    """Answers agree when their embeddings cluster together (`vectors`, and `stances` that
    keep contradicting answers apart: one per ballot that has a vote, in order). A bloc
    speaks through the member closest to its centre."""
    voting = [b for b in cast if b.vote is not None]
    assert len(voting) == len(vectors), (len(voting), len(vectors))
    assert stances is None or len(stances) == len(voting), (len(stances), len(voting))
    units = [_unit(v) for v in vectors]
    blocs = []
    for members in cluster(units, threshold, stances):
        centre = [sum(units[i][d] for i in members) / len(members)
                  for d in range(len(units[0]))]
        closeness = [_cos(units[i], _unit(centre)) for i in members]
        speaker = members[max(range(len(members)), key=lambda k: (closeness[k], -k))]
        vote = voting[speaker].vote
        assert vote is not None
        blocs.append(Bloc(vote, [voting[i].index for i in members], voting[speaker].index,
                          sum(closeness) / len(closeness)))
    ranked, tie = _ranked(blocs, "tightest cluster")
    return Tally(compare, cast, ranked, quorum, tie)
