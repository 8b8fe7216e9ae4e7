"""Model groups: one prompt over several local models — parallel, chain, fan-out, consensus —
with per-member timeouts and fallbacks, selectors, and a judge or synthesizer model.

Every member call goes through the same door as a single-model request: `daemon.acquire()`.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import structlog

from corral.proxy import capabilities, filters, group_images, votes
from corral.proxy.child_http import ChildPool
from corral.proxy.errors import ApiError, UpstreamFailed
from corral.proxy.families import translate
from corral.proxy.forward import post_json
from corral.proxy.group_outcome import GroupFailed as GroupFailed
from corral.proxy.group_outcome import GroupOutcome as GroupOutcome
from corral.proxy.group_outcome import MemberResult as MemberResult
from corral.proxy.group_outcome import Selection as Selection
from corral.proxy.upstream import leased
from corral.supervisor.config import GroupSpec
from corral.supervisor.config.specs import VoteSpec
from corral.supervisor.errors import SupervisorError
from corral.supervisor.port import Reservation, Supervisor
from corral.supervisor.templates import render_template

log = structlog.get_logger("corral.groups")

CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
# About 512 tokens of English: what a small sentence-embedding model reads of one answer.
EMBED_CHARS = 2000
# Request fields that steer the group itself; everything else goes to every member as is.
GROUP_FIELDS = frozenset({"group", "models", "template", "stream", "stream_options", "model"})


def member_body(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k not in GROUP_FIELDS}


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """The last user message's text (its text parts; its pictures are not text)."""
    return group_images.user_turn(messages)[0]


def with_user_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The conversation with its last user message replaced (or appended) by `text`."""
    out = list(messages)
    for i in range(len(out) - 1, -1, -1):
        if out[i].get("role") == "user":
            out[i] = {**out[i], "content": text}
            return out
    return [*out, {"role": "user", "content": text}]


class GroupRunner:
    def __init__(self, daemon: Supervisor, pool: ChildPool):
        self.daemon = daemon
        self.pool = pool  # the relay's own client to children: the same rules for members

    def answer_limit(self) -> int:
        """The bytes a member's whole answer may have (max_answer_mb, live)."""
        return int(self.daemon.loaded.config.max_answer_mb * 1024 * 1024)

    # -- one member ----------------------------------------------------------------------------

    def body_for(self, model: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        """What `model` gets: the group's body under the model's own request filters."""
        spec = self.daemon.status(model).spec if self.daemon.resolve(model) else None
        filtered = filters.apply({**body, "model": model}, spec.request if spec else None)
        return {**filtered, "stream": stream}

    def api_of(self, model: str) -> str:
        """The family `model` is asked in (`api:` on command and remote models): chat unless
        it speaks only Responses or only Messages."""
        return self.daemon.status(model).spec.api if self.daemon.resolve(model) else "chat"

    async def call(self, model: str, body: dict[str, Any], timeout: float, *,
                   ignore_backoff: bool = False) -> MemberResult:
        """One attempt: acquire, ask, release. A timeout cancels the upstream request too.
        A member that speaks another family is asked in it, and answers back as chat."""
        started = time.monotonic()

        def result(status: str, **kw: Any) -> MemberResult:
            now = time.monotonic()
            return MemberResult(model, status, latency_ms=(now - started) * 1000,
                                finished_at=now, **kw)

        api = self.api_of(model)
        try:
            async with asyncio.timeout(timeout), leased(
                    self.daemon, model, self.daemon.acquire(model, ignore_backoff=True)
                    if ignore_backoff else None) as lease:
                data = await post_json(
                    self.pool, translate.PATHS[api],
                    translate.member_request(api, self.body_for(model, body, stream=False)),
                    model, lease, limit=self.answer_limit())
        except TimeoutError:
            return result("timeout", error=f"no answer within {timeout:g}s (cancelled)")
        except (SupervisorError, UpstreamFailed) as exc:
            return result("error", error=str(exc))
        try:
            answer = translate.member_answer(api, data)
        except (KeyError, IndexError, TypeError, AttributeError):
            return result("error", error=f"{model} answered without a message: {str(data)[:200]}")
        return result("ok", content=answer.text, usage=answer.usage,
                      tool_calls=answer.tool_calls or None, finish=answer.finish,
                      stop_sequence=answer.stop_sequence)

    async def member(self, group: GroupSpec, model: str, body: dict[str, Any],
                     held: Reservation | None = None) -> MemberResult:
        """One member under the group's fallback rule, told how many pictures it was sent."""
        pictures = group_images.count(body.get("messages") or [])
        if pictures and not self.sees(model):
            return await self._blind(group, model, body, pictures, held)
        first = await self.call(model, body, group.member_timeout)
        if first.ok:
            return self._shown(first, pictures)
        if group.fallback == "retry_once":
            log.info("group.member_retry", group=group.name, model=model, error=first.error)
            # A failed start put the model under its start back-off, which would refuse this
            # very retry at once, untried: the group's own second attempt may start it.
            second = await self.call(model, body, group.member_timeout, ignore_backoff=True)
            if second.ok:
                return self._shown(replace(second, status="retried",
                                           error=f"first attempt failed: {first.error}"),
                                   pictures)
            return replace(second, error=f"failed twice: {first.error}; then: {second.error}")
        backup = group.replace_with.get(model)
        if group.fallback == "replace_with" and backup:
            log.info("group.member_replaced", group=group.name, model=model, backup=backup,
                     error=first.error)
            if held is not None and model in held.names:
                # The failed member gives its place to the backup: held, it would keep the
                # backup from starting when the group's members fill max_loaded.
                held.swap(model, backup)
            stand_in = await self.call(backup, body, group.member_timeout)
            if stand_in.ok:
                return self._shown(replace(stand_in, status="replaced", replaced=model,
                                           error=f"{model} failed: {first.error}"), pictures)
            return replace(first, error=f"{first.error}; backup {backup}: {stand_in.error}")
        return self._shown(first, pictures)

    # -- pictures ------------------------------------------------------------------------------

    def sees(self, model: str) -> bool:
        """Whether `model` takes image parts (what a single request to it is checked for)."""
        return self.daemon.resolve(model) is None \
            or "vision" in self.daemon.spec(model).capabilities

    def cannot_see(self, model: str) -> str:
        spec = self.daemon.spec(model)
        return f"{spec.name!r} cannot see images ({capabilities.vision_hint(spec)})"

    @staticmethod
    def _shown(result: MemberResult, pictures: int) -> MemberResult:
        return replace(result, images=pictures) if pictures else result

    async def _blind(self, group: GroupSpec, model: str, body: dict[str, Any], pictures: int,
                     held: Reservation | None) -> MemberResult:
        """A member that cannot see, sent a request with pictures: its backup when the group
        has one that sees, else left out (strict groups refuse such a request up front)."""
        why = f"{self.cannot_see(model)}; the request has {pictures} image(s)"
        backup = group.replace_with.get(model) if group.fallback == "replace_with" else None
        if backup and self.sees(backup):
            log.info("group.member_replaced", group=group.name, model=model, backup=backup,
                     error=why)
            if held is not None and model in held.names:
                held.swap(model, backup)
            stand_in = await self.call(backup, body, group.member_timeout)
            if stand_in.ok:
                return replace(stand_in, status="replaced", replaced=model, images=pictures,
                               error=f"{model} skipped: {why}")
            return replace(stand_in, error=f"{model} skipped: {why}; backup {backup}: "
                                           f"{stand_in.error}")
        log.info("group.member_skipped", group=group.name, model=model, error=why)
        return MemberResult(model, "skipped", error=f"skipped: {why}", images=0)

    def refuse_blind(self, group: GroupSpec, body: dict[str, Any]) -> None:
        """A strict group never answers without a member it has: a request with pictures
        that one of them cannot see is a 400, as it is for that model alone, before anything
        starts. A chain's step after one that sees works on its text, and needs no eyes."""
        messages = body.get("messages") or []
        if group.fallback != "strict" or not group_images.count(messages):
            return
        if group.type == "chain":
            blind = list(itertools.takewhile(lambda m: not self.sees(m), group.models))
        else:
            blind = [m for m in group.models if not self.sees(m)]
        if blind:
            raise ApiError(400, f"group {group.name!r} cannot answer a request with images: "
                                + "; ".join(self.cannot_see(m) for m in blind),
                           "vision_unsupported", param="messages")

    # -- whole groups --------------------------------------------------------------------------

    async def run(self, group: GroupSpec, request: dict[str, Any],
                  final_step: Callable[[GroupOutcome], Awaitable[None]] | None = None,
                  ) -> GroupOutcome:
        """Run `group` on an OpenAI-style request. `final_step`, when given, replaces the
        synthesizer call of a consensus group (a streaming caller relays it itself)."""
        # Members that run together must fit together, and are held so one's cold start
        # cannot evict another. A chain's steps run one at a time: no such constraint.
        together = () if group.type == "chain" else group.models
        body = member_body(request)
        self.refuse_blind(group, body)
        self.daemon.check_capacity(together, f"group {group.name!r}")
        if group.response_format is not None and "response_format" not in body:
            body["response_format"] = group.response_format
        started = time.monotonic()
        outcome: GroupOutcome | None = None
        try:
            with self.daemon.reserve(together) as held:
                if group.type == "chain":
                    responses = await self._chain(group, body, request.get("template"))
                elif group.type == "fan_out" and group.selector == "first_ok":
                    responses = await self._first_ok(group, body, held)
                else:
                    responses = await self._concurrent(group, body, held)
            outcome = GroupOutcome(group, responses, (time.monotonic() - started) * 1000)
            self._enforce_fallback(outcome)
            outcome.tally = await self._vote(group, outcome)
            self._enforce_quorum(outcome)
            await self._conclude(group, body, outcome, final_step)
        except GroupFailed as exc:
            # A synthesizer that failed after the members answered fails the run as much as
            # members that did not: the event and the metric count it.
            exc.outcome.wall_ms = (time.monotonic() - started) * 1000
            self._publish(exc.outcome, "failed")
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            # The client hung up (or was cut off while the answer went out), or corral is
            # shutting down: the run ends here, and is counted as such (corral_requests_total
            # counts its 499), with what its members had done by then.
            if outcome is None:
                outcome = GroupOutcome(group, [MemberResult(m, "cancelled", error="the run was "
                                                            "cancelled") for m in group.models],
                                       0.0)
            outcome.wall_ms = (time.monotonic() - started) * 1000
            self._publish(outcome, "cancelled")
            raise
        outcome.wall_ms = (time.monotonic() - started) * 1000
        log.info("group.done", group=group.name, type=group.type, ok=outcome.ok_count,
                 members=len(responses), wall_ms=round(outcome.wall_ms, 1))
        self._publish(outcome, outcome.result)  # the word the answer's `complete` says
        return outcome

    async def _conclude(self, group: GroupSpec, body: dict[str, Any], outcome: GroupOutcome,
                        final_step: Callable[[GroupOutcome], Awaitable[None]] | None) -> None:
        """The group's one answer from its members': selected, synthesized or the last step's."""
        if group.type == "fan_out":
            outcome.selected = await self._select(group, body, outcome)
        elif group.type == "consensus":
            if final_step is not None:
                await final_step(outcome)
            else:
                await self.synthesize(group, body, outcome)
        elif group.type == "chain":
            done = [r for r in outcome.responses if r.ok]
            outcome.final = done[-1].content if done else None

    def _publish(self, outcome: GroupOutcome, result: str) -> None:
        group = outcome.group
        tally = outcome.tally
        vote = None if tally is None else {
            "compare": tally.compare, "agree": tally.agree, "of": tally.voters,
            "agreement": tally.agreement,
            "quorum_met": None if tally.quorum is None else tally.quorum_met}
        self.daemon.events.publish(
            "group", group=group.name, type=group.type, result=result,
            wall_ms=round(outcome.wall_ms, 1), vote=vote,
            members=[{"model": r.model, "status": r.status, "latency_ms": round(r.latency_ms, 1),
                      **({"error": r.error[:300]} if r.error else {})}
                     for r in outcome.responses])

    async def _concurrent(self, group: GroupSpec, body: dict[str, Any],
                          held: Reservation) -> list[MemberResult]:
        # Members run at once: the group takes as long as its slowest member, not the sum.
        tasks = [asyncio.create_task(self.member(group, m, body, held)) for m in group.models]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one raised, or our caller is gone: none outlives the run and its hold
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _first_ok(self, group: GroupSpec, body: dict[str, Any],
                        held: Reservation) -> list[MemberResult]:
        """Until required_responses members answered, or all are done: whether the group
        succeeds is decided by that count, never by which member failed first."""
        need = group.required_responses
        tasks = [asyncio.create_task(self.member(group, m, body, held)) for m in group.models]
        pending = set(tasks)
        answered = 0
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                answered += sum(t.result().ok for t in done)
                if answered >= need:
                    break
        finally:  # enough good answers are in, or our caller is gone: stop the rest
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        why = f"{need} member{'s' if need != 1 else ''} had answered"
        return [MemberResult(model, "cancelled", error=f"not needed: {why}")
                if task.cancelled() else task.result()
                for task, model in zip(tasks, group.models, strict=True)]

    async def _chain(self, group: GroupSpec, body: dict[str, Any],
                     template: str | None) -> list[MemberResult]:
        messages = list(body.get("messages") or [])
        original, pictures = group_images.user_turn(messages)
        shown = group_images.count(messages) > 0
        shape = template or group.template or "{previous}"
        steps: list[MemberResult] = []
        previous: str | None = None
        seen = False  # a step that sees has answered: the text after it stands for the picture
        for model in group.models:
            # Not str.format: client text must not reach format specs or attributes.
            text = original if previous is None else render_template(
                shape, previous=previous, input=original)
            # The template shapes the text part; the user's pictures go beside it, to each
            # step that sees. A step that cannot see works on the text once one that sees
            # answered; before that, it is refused or left out like any member (member()).
            text_only = shown and seen and not self.sees(model)
            step_messages = group_images.with_user_turn(
                group_images.without_images(messages) if text_only else messages,
                text, [] if text_only else pictures)
            step = await self.member(group, model, {**body, "messages": step_messages})
            if shown and step.images is None:
                step = replace(step, images=group_images.count(step_messages))
            steps.append(replace(step, input=text))
            if step.failed:
                break  # a chain cannot go on without its previous step's output
            if step.ok:
                previous = step.content or ""
                seen = seen or (shown and self.sees(step.model))
        return steps

    def _enforce_fallback(self, outcome: GroupOutcome) -> None:
        """Nothing answered fails any group. Under strict, fewer ok answers than
        required_responses fail it (a chain cut short has fewer); at least that many succeed,
        the failures reported beside them. Other fallbacks answer what came, complete: false
        when it is too little."""
        group = outcome.group
        failed = [r for r in outcome.responses if r.failed]
        short = outcome.ok_count < group.required_responses
        if outcome.ok_count == 0 or (group.fallback == "strict" and short):
            detail = "; ".join(f"{r.model}: {r.error}" for r in failed) or "no member answered"
            raise GroupFailed(
                f"group {group.name!r} failed ({group.fallback}): {outcome.ok_count} of "
                f"{len(group.models)} members answered, {group.required_responses} required: "
                f"{detail}", outcome)

    # -- selectors -----------------------------------------------------------------------------

    async def _select(self, group: GroupSpec, body: dict[str, Any],
                      outcome: GroupOutcome) -> Selection:
        ok = [(i, r) for i, r in enumerate(outcome.responses) if r.ok]
        selector = group.selector
        if selector == "judge" and group.judge:
            picked = await self._judge(group, body, outcome, ok)
            if picked is not None:
                return picked
            selector = "first_ok"
        if selector == "longest":
            i, r = max(ok, key=lambda p: len(p[1].content or ""))
            return Selection(i, r.model, f"longest answer ({len(r.content or '')} chars)")
        if selector == "shortest":
            i, r = min(ok, key=lambda p: len(p[1].content or ""))
            return Selection(i, r.model, f"shortest answer ({len(r.content or '')} chars)")
        if selector == "majority" and outcome.tally is not None:
            tally = outcome.tally  # its summary names the agreement: majority or less
            if tally.winner is None:  # nothing extracted from any answer: the first stands
                i, r = ok[0]
                return Selection(i, r.model, f"{tally.summary()}; first in order")
            i = tally.winner.centre
            tie = f"; tie broken by {tally.tie['broken_by']}" if tally.tie else ""
            return Selection(i, outcome.responses[i].model, f"{tally.summary()}{tie}")
        i, r = min(ok, key=lambda p: p[1].finished_at)
        return Selection(i, r.model, "first answer to arrive")

    async def _judge(self, group: GroupSpec, body: dict[str, Any], outcome: GroupOutcome,
                     ok: list[tuple[int, MemberResult]]) -> Selection | None:
        assert group.judge
        question = last_user_text(body.get("messages") or [])
        listing = "\n\n".join(f"[{n}] {r.content}" for n, (_, r) in enumerate(ok, 1))
        prompt = (f"Question:\n{question}\n\nCandidate answers:\n\n{listing}\n\n"
                  f"Which answer is best? Reply with its number only (1-{len(ok)}).")
        judge_body = {
            "messages": [{"role": "system", "content": "You compare answers and pick the best."},
                         {"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 4,
            # llama-server's GBNF grammar: the judge can only answer a valid number.
            "grammar": "root ::= " + " | ".join(f'"{n}"' for n in range(1, len(ok) + 1)),
        }
        verdict = await self.call(group.judge, judge_body, group.member_timeout)
        if verdict.usage:
            outcome.extra_usage.append(verdict.usage)
        match = re.search(r"\d+", verdict.content or "") if verdict.ok else None
        if match and 1 <= int(match.group()) <= len(ok):
            i, r = ok[int(match.group()) - 1]
            return Selection(i, r.model, f"judge {group.judge} picked answer {match.group()}")
        log.warning("group.judge_unusable", group=group.name, judge=group.judge,
                    answer=verdict.content, error=verdict.error)
        return None

    # -- consensus -----------------------------------------------------------------------------

    def synthesis_body(self, group: GroupSpec, body: dict[str, Any],
                       outcome: GroupOutcome) -> dict[str, Any]:
        messages = list(body.get("messages") or [])
        question = last_user_text(messages)
        numbered = [(n, i) for n, i in enumerate(
            (i for i, r in enumerate(outcome.responses) if r.ok), 1)]
        answers = "\n\n".join(f"[Answer {n}] {outcome.responses[i].content}"
                              for n, i in numbered)
        agreed = agreement_note(outcome.tally, dict((i, n) for n, i in numbered))
        prompt = (f"{question}\n\nSeveral assistants answered this independently:\n\n"
                  f"{answers}\n\n{agreed}Using what they agree on, write the single best "
                  "answer.")
        # The answers are text: the synthesizer reads them, not the pictures.
        return {**body, "messages": group_images.without_images(
            with_user_text(messages, prompt))}

    async def synthesize(self, group: GroupSpec, body: dict[str, Any],
                         outcome: GroupOutcome) -> MemberResult:
        """The synthesizer's whole answer, as the group's final one (its usage counted)."""
        assert group.synthesizer
        result = await self.call(group.synthesizer, self.synthesis_body(group, body, outcome),
                                 group.member_timeout)
        if result.usage:
            outcome.extra_usage.append(result.usage)
        if not result.ok:
            raise GroupFailed(f"group {group.name!r}: synthesizer {group.synthesizer} failed: "
                              f"{result.error}", outcome)
        outcome.final = result.content or ""
        return result

    # -- votes ---------------------------------------------------------------------------------

    async def _vote(self, group: GroupSpec, outcome: GroupOutcome) -> votes.Tally | None:
        rule = group.vote
        if rule is None:
            if not (group.type == "fan_out" and group.selector == "majority"):
                return None
            rule = VoteSpec()  # a group built by hand (an ad-hoc one): exact text
        cast = votes.ballots(rule, [(i, r.model, r.content or "")
                                    for i, r in enumerate(outcome.responses) if r.ok])
        if rule.similar_model is None:
            return votes.tally_by_value(rule.compare, cast, rule.quorum)
        # The answers themselves, as written, unless a value was extracted from them.
        texts = [b.vote if rule.extract else (outcome.responses[b.index].content or "")
                 for b in cast if b.vote is not None]
        # The embedder sees each answer's opening only: a sentence-embedding model's context
        # is short (all-MiniLM's: 512 tokens), and one long answer past it would fail the
        # whole vote. The stances below read the whole text.
        vectors = await self.embed(outcome, rule.similar_model,
                                   [t[:EMBED_CHARS] for t in texts]) if texts else []
        stances = [votes.stance(t, rule.distinct_numbers, rule.distinct_yes_no) for t in texts]
        return votes.tally_similar(rule.compare, cast, vectors, rule.threshold, rule.quorum,
                                   stances)

    async def embed(self, outcome: GroupOutcome, model: str,
                    texts: list[str]) -> list[list[float]]:
        """One embedding per text from a model of the herd, leased like any request."""
        group = outcome.group
        try:
            async with asyncio.timeout(group.member_timeout), \
                    leased(self.daemon, model) as lease:
                data = await post_json(self.pool, EMBEDDINGS_PATH,
                                       {"model": model, "input": texts}, model, lease,
                                       limit=self.answer_limit())
            rows = sorted(data["data"], key=lambda row: row["index"])
            vectors = [[float(x) for x in row["embedding"]] for row in rows]
        except TimeoutError as exc:
            raise GroupFailed(f"group {group.name!r}: embeddings model {model} gave no answer "
                              f"within {group.member_timeout:g}s", outcome,
                              "vote_failed") from exc
        except (SupervisorError, UpstreamFailed, KeyError, TypeError, ValueError) as exc:
            raise GroupFailed(f"group {group.name!r}: embeddings model {model} failed: "
                              f"{exc}", outcome, "vote_failed") from exc
        if len(vectors) != len(texts) or any(not v for v in vectors) \
                or len({len(v) for v in vectors}) > 1:
            raise GroupFailed(f"group {group.name!r}: embeddings model {model} answered "
                              f"{len(vectors)} vectors for {len(texts)} answers",
                              outcome, "vote_failed")
        return vectors

    def _enforce_quorum(self, outcome: GroupOutcome) -> None:
        tally, rule = outcome.tally, outcome.group.vote
        if tally is None or rule is None or tally.quorum_met or rule.on_no_quorum != "strict":
            return
        raise GroupFailed(f"group {outcome.group.name!r}: no quorum: {tally.agree} of "
                          f"{tally.voters} answers agree ({tally.compare}), quorum is "
                          f"{tally.quorum}", outcome, "no_quorum")


def agreement_note(tally: votes.Tally | None, number: dict[int, int]) -> str:
    """For a synthesizer: which of the numbered answers agreed (`number`: member index →
    the answer's number in the prompt), and whether that is a majority."""
    if tally is None or tally.winner is None:
        return ""
    how = f"compared by {tally.compare}"

    def listed(bloc: votes.Bloc) -> str:
        return ", ".join(str(number[i]) for i in bloc.members)

    if tally.agreement == "no_majority":
        if tally.agree == 1:
            return f"No two of the {tally.voters} answers agree ({how}).\n\n"
        first, *rest = tally.tied
        return (f"No answer has a majority: answers {listed(first)} agree, "
                + ", ".join(f"and so do answers {listed(b)}" for b in rest) + f" ({how}).\n\n")
    winner = tally.winner
    line = (f"Answers {listed(winner)} agree ({len(winner.members)} of {tally.voters}, "
            f"{how}: {votes.shown(winner.vote)!r})")
    if tally.agreement == "plurality":
        line += ", more than any other answer but not a majority"
    others = [str(number[b.index]) for b in tally.ballots if b.index not in winner.members]
    if others:
        line += f"; answers {', '.join(others)} differ"
    return line + ".\n\n"
