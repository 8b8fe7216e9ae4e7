"""HTTP for groups: /v1/batch/execute, /v1/chain/execute, and exposed groups answering as
models on /v1/chat/completions, /v1/responses and /v1/messages (whole, or streamed in the
client's family)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import structlog
from aiohttp import web

from corral.proxy import client_io, sse
from corral.proxy.accounting import RECORD
from corral.proxy.child_http import ChildHttpError, ChildResponse
from corral.proxy.client_io import ClientWriter
from corral.proxy.errors import (
    ApiError,
    UpstreamFailed,
    UpstreamRejected,
    error_response,
    http_error,
    without_secrets,
)
from corral.proxy.families import translate
from corral.proxy.families.streams import FamilyWriter, writer_for
from corral.proxy.families.translate import Answer
from corral.proxy.forward import open_child
from corral.proxy.groups import (
    CHAT_PATH,
    GroupFailed,
    GroupOutcome,
    GroupRunner,
)
from corral.proxy.routing import group_by_name
from corral.proxy.timing import RequestRecord
from corral.proxy.upstream import leased
from corral.proxy.validate import bad, check_fields, check_messages
from corral.supervisor.config import GroupSpec
from corral.supervisor.errors import ShuttingDown, SupervisorError
from corral.supervisor.port import Lease, Supervisor
from corral.supervisor.templates import template_problem

log = structlog.get_logger("corral.proxy")

# An ad-hoc chain runs its models one after another: a request naming hundreds of them would
# hold a connection (and the models) for as long as it liked.
MAX_CHAIN_MODELS = 16


def check_group_request(body: dict[str, Any]) -> None:
    """What every group request must get right before any member starts. The template too:
    /v1/batch/execute runs chain groups as well, with the request's template."""
    check_messages(body, required=True)
    check_fields(body)
    check_template(body)


def check_template(body: dict[str, Any]) -> None:
    """A request's chain template is checked before any model starts, not mid-chain."""
    template = body.get("template")
    if template is not None and not isinstance(template, str):
        raise ApiError(400, "'template' must be a string using {previous} and {input}",
                       "invalid_template", param="template")
    problem = template_problem(template) if template else None
    if problem:
        raise ApiError(400, f"bad template: {problem}", "invalid_template", param="template")


def failed_response(exc: GroupFailed, daemon: Supervisor) -> web.Response:
    details = {"group": exc.outcome.as_dict()}
    log.warning("proxy.group_failed", group=exc.outcome.group.name, error=str(exc),
                closing=daemon.closing)
    if daemon.closing:  # the members were stopped by the shutdown, not broken
        return http_error(ShuttingDown("corral is shutting down"), extra=details)
    return error_response(502, str(exc), kind="server_error", code=exc.code, extra=details)


async def _whole(request: web.Request, response: web.Response,
                 group: GroupSpec) -> web.StreamResponse:
    """A group's whole answer (every member's answer in it: megabytes with logprobs), written
    under the client's deadline: aiohttp would wait on a client that stopped reading for as
    long as it stays connected, holding the answer and the handler."""
    return await client_io.send(request, response, group.name)


def _group_name(body: dict[str, Any]) -> str:
    name = body.get("group")
    if not isinstance(name, str) or not name:
        raise bad("'group' must be the name of a configured group", "group", "missing_group")
    return name


async def batch_execute(request: web.Request, runner: GroupRunner, body: dict[str, Any], *,
                        admin: bool) -> web.StreamResponse:
    group = group_by_name(runner.daemon, _group_name(body), admin=admin)
    check_group_request(body)
    request[RECORD].model = group.name
    try:
        outcome = await runner.run(group, body)
    except GroupFailed as exc:
        _count(request[RECORD], exc.outcome)
        return await _whole(request, failed_response(exc, runner.daemon), group)
    _count(request[RECORD], outcome)
    return await _whole(request, web.json_response(outcome.as_dict()), group)


def _count(record: RequestRecord, outcome: GroupOutcome) -> None:
    """A group's request is accounted under the group's name, with what its members spent
    (/v1/batch and /v1/chain as a group asked as a model)."""
    usage = outcome.usage()
    record.prompt_tokens = usage["prompt_tokens"]
    record.completion_tokens = usage["completion_tokens"]


async def chain_execute(request: web.Request, runner: GroupRunner, body: dict[str, Any], *,
                        admin: bool) -> web.StreamResponse:
    check_group_request(body)
    if "group" in body:
        group = group_by_name(runner.daemon, _group_name(body), admin=admin)
        if group.type != "chain":
            group = _as_chain(group)
    else:
        group = _ad_hoc_chain(runner.daemon, body.get("models"))
    request[RECORD].model = group.name
    try:
        outcome = await runner.run(group, body)
    except GroupFailed as exc:
        _count(request[RECORD], exc.outcome)
        return await _whole(request, failed_response(exc, runner.daemon), group)
    _count(request[RECORD], outcome)
    result = outcome.as_dict()
    result["steps"] = result.pop("responses")
    return await _whole(request, web.json_response(result), group)


def _as_chain(group: GroupSpec) -> GroupSpec:
    return replace(group, type="chain", required_responses=len(group.models))


def _ad_hoc_chain(daemon: Supervisor, models: object) -> GroupSpec:
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        raise bad("give 'group' or 'models' (a list of model names)", "models", "missing_models")
    if len(models) > MAX_CHAIN_MODELS:
        raise bad(f"'models' names {len(models)} steps; a chain has at most {MAX_CHAIN_MODELS}",
                  "models", "too_many_models")
    canonical = []
    for name in models:
        canonical.append(daemon.status(name).name)  # UnknownModel → 404
    return GroupSpec(
        name="+".join(canonical), type="chain", models=tuple(canonical),
        required_responses=len(canonical),
        member_timeout=daemon.loaded.config.defaults.queue_timeout,
        fallback="strict", replace_with={}, pinned=False, selector="first_ok", judge=None,
        synthesizer=None, template=None, expose_as_model=False)


# -- a group answering as a model: chat completions, Responses, Messages -------------------

# The paths an exposed group answers as a model, and the family each speaks.
GROUP_FAMILIES = {"/v1/chat/completions": "chat", "/v1/responses": "responses",
                  "/v1/messages": "messages"}


# How a synthesis ended: its finish reason (stop, length) and the stop string it ended on,
# where the synthesizer said which.
End = tuple[str | None, str | None]


def final_answer(outcome: GroupOutcome, synthesis: End | None = None) -> Answer:
    """What the group answers: its text, and the tool calls and end of the member whose
    answer it is (a chain's last step, a fan-out's selected member; a consensus, its
    synthesizer's). A parallel group's joined answers and a consensus synthesis carry no
    tool calls, and end `stop`."""
    group = outcome.group
    source = None
    if group.type == "chain":
        done = [r for r in outcome.responses if r.ok]
        source = done[-1] if done else None
    elif group.type == "fan_out" and outcome.selected is not None:
        source = outcome.responses[outcome.selected.index]
    calls = list(source.tool_calls or []) if source is not None else []
    finish, stop = synthesis or ((source.finish, source.stop_sequence) if source else (None, None))
    end = "tool_calls" if calls else finish or "stop"
    return Answer(outcome.answer(), calls, end, outcome.usage(),
                  stop if end == "stop" else None)


async def group_as_model(request: web.Request, runner: GroupRunner, group: GroupSpec,
                         client_body: dict[str, Any], family: str) -> web.StreamResponse:
    """An exposed group asked like a model in `family` (chat, responses, messages): the
    request becomes the chat request the group runs, the answer is in the client's family.
    Its record (/admin/requests, the token counters) counts the group's summed usage under
    the group's name, however it ends: its members' calls are counted nowhere else."""
    body = translate.to_chat(family, client_body)
    if family != "chat" and "template" in client_body:
        body["template"] = client_body["template"]
    check_group_request(body)  # an exposed chain takes a request's template too
    record = request[RECORD]
    known: list[GroupOutcome] = []  # the run's outcome once there is one: what it spent
    try:
        return await _answer(request, runner, group, body, family, record, known)
    finally:
        if known:
            _count(record, known[-1])


async def _answer(request: web.Request, runner: GroupRunner, group: GroupSpec,
                  body: dict[str, Any], family: str, record: RequestRecord,
                  known: list[GroupOutcome]) -> web.StreamResponse:
    writer = writer_for(family, group.name)
    synthesis_end: list[End] = []
    if not body.get("stream"):
        async def synthesize(outcome: GroupOutcome) -> None:
            known.append(outcome)
            # As the runner would, keeping how the synthesis ended (a cut one says so).
            result = await runner.synthesize(outcome.group, body, outcome)
            synthesis_end.append((result.finish, result.stop_sequence))

        try:
            outcome = await runner.run(group, body, final_step=synthesize)
        except GroupFailed as exc:
            known.append(exc.outcome)
            return await _whole(request, failed_response(exc, runner.daemon), group)
        known.append(outcome)
        answer = final_answer(outcome, synthesis_end[0] if synthesis_end else None)
        record.first_bytes()  # the whole answer goes out now
        return await _whole(request, web.json_response(writer.whole(answer, outcome.as_dict())),
                            group)

    response = web.StreamResponse(headers=sse.sse_headers())
    # Every write has the client's deadline: one that stops reading is cut off (ClientStalled)
    # and the synthesizer's lease goes back with the relay.
    out = client_io.writer(request, response, group.name)
    opened = _Opening(out, writer, record)
    try:
        if group.type == "consensus":
            async def relay_synthesis(outcome: GroupOutcome) -> None:
                known.append(outcome)  # a client gone mid-synthesis: the members' tokens
                synthesis_end.append(
                    await _stream_synthesis(opened, runner, body, outcome))

            outcome = await runner.run(group, body, final_step=relay_synthesis)
        else:
            outcome = await runner.run(group, body)
            known.append(outcome)
            await opened.begin(outcome)
            await out.write(writer.text(outcome.answer()))
    except GroupFailed as exc:
        known.append(exc.outcome)
        if not response.prepared:
            return await _whole(request, failed_response(exc, runner.daemon), group)
        # The status line said 200: the record says what the client was told in the stream.
        shutting_down = runner.daemon.closing
        record.error_status = 503 if shutting_down else 502
        await out.write(writer.error(str(exc), "shutting_down" if shutting_down else exc.code))
        await out.finish()
        return response
    known.append(outcome)
    answer = final_answer(outcome, synthesis_end[0] if synthesis_end else None)
    end = writer.finish(answer, outcome.as_dict())
    await out.write(end)
    # The last event, kept once it is in the client's transport (a write that failed or was
    # cancelled put nothing there): a client that hangs up after that got the whole answer
    # (a 200, not a 499).
    record.tail.append(end)
    await out.finish()
    return response


class _Opening:
    """The start of a group's stream, written once: the family's head, with the time to
    first token measured when it goes out."""

    def __init__(self, out: ClientWriter, writer: FamilyWriter, record: RequestRecord):
        self.out, self.writer, self.record = out, writer, record

    async def begin(self, outcome: GroupOutcome) -> None:
        await self.out.prepare()
        await self.out.write(self.writer.start(outcome.usage()["prompt_tokens"]))
        self.record.first_bytes()


async def _stream_synthesis(opened: _Opening, runner: GroupRunner, body: dict[str, Any],
                            outcome: GroupOutcome) -> End:
    """Relay the synthesizer's own token stream, in the client's family, as it is written;
    how it ended (stop, length; the stop string where it says). A synthesizer that speaks
    another family (`api:`) is asked whole, and its answer written at once."""
    group = outcome.group
    model = group.synthesizer
    assert model
    if runner.api_of(model) != "chat":
        return await _whole_synthesis(opened, runner, body, outcome)
    payload = runner.body_for(model, runner.synthesis_body(group, body, outcome), stream=True)
    # Its usage in the last chunk: the group's usage counts the synthesis too.
    payload["stream_options"] = {"include_usage": True}
    text: list[str] = []
    finish: str | None = None
    stop: str | None = None
    try:
        # member_timeout bounds the wait for its first byte (its start included), not the
        # answer, which streams to the client as long as it streams.
        async with asyncio.timeout(group.member_timeout) as first_byte, \
                leased(runner.daemon, model) as lease:
            upstream = await open_child(runner.pool, CHAT_PATH, model, lease,
                                        json.dumps(payload).encode(), "text/event-stream",
                                        parsed=payload)
            first_byte.reschedule(None)
            try:
                await _expect_ok(upstream, model, lease)
                await opened.begin(outcome)
                out, writer = opened.out, opened.writer
                async with contextlib.aclosing(_events(upstream, model)) as events:
                    async for event in events:
                        delta, end, said = _read_chunk(event, outcome, model)
                        finish, stop = end or finish, said or stop
                        text.append(delta)
                        await out.write(writer.text(delta))
            except BaseException:
                upstream.close()  # the child must see the hang-up (and drop the generation)
                raise
            upstream.release()
    except (TimeoutError, SupervisorError, UpstreamFailed) as exc:
        raise GroupFailed(f"group {group.name!r}: synthesizer {model} failed: "
                          f"{exc or type(exc).__name__}", outcome) from exc
    outcome.final = "".join(text)
    return finish, stop


async def _whole_synthesis(opened: _Opening, runner: GroupRunner, body: dict[str, Any],
                           outcome: GroupOutcome) -> End:
    result = await runner.synthesize(outcome.group, body, outcome)
    await opened.begin(outcome)
    await opened.out.write(opened.writer.text(result.content or ""))
    return result.finish, result.stop_sequence


async def _expect_ok(upstream: ChildResponse, model: str, lease: Lease) -> None:
    if upstream.status == 200:
        return
    try:
        # A remote may quote the key it refuses: its words go to the client and the log.
        detail = without_secrets(await upstream.read(_LINE_LIMIT), lease.headers).decode(
            errors="replace")[:300]
    except ChildHttpError as exc:
        detail = str(exc) or type(exc).__name__
    raise UpstreamRejected(f"{model} answered HTTP {upstream.status}: {detail}")


# The longest line of a child's event stream read (an event is one line).
_LINE_LIMIT = 16 * 1024 * 1024


async def _events(upstream: ChildResponse, model: str) -> AsyncGenerator[dict[str, Any], None]:
    """The JSON events of a child's SSE answer. Only reading happens in here, so a broken
    stream raised from here is the child's failure; writing to the client happens in the
    caller, where a client that hung up raises its own error, never counted against the
    child."""
    pending = b""
    try:
        while data := await upstream.chunk():
            pending += data
            *lines, pending = pending.split(b"\n")
            if len(pending) > _LINE_LIMIT:
                raise ValueError(f"a line of more than {_LINE_LIMIT} bytes")
            for line in lines:
                if line.startswith(b"data: {"):  # skip separators, pings, its own [DONE]
                    event = json.loads(line[6:])
                    if isinstance(event, dict):
                        yield event
    except (ChildHttpError, ValueError, RecursionError) as exc:
        raise UpstreamFailed(f"{model} broke off its stream: "
                             f"{exc or type(exc).__name__}") from exc


def _read_chunk(event: dict[str, Any], outcome: GroupOutcome,
                model: str) -> tuple[str, str | None, str | None]:
    """One synthesizer chunk: its text, finish reason and stop string (where said); its
    usage is the group's. A chunk
    of the wrong shape (usage strings, a delta that is no object) is the synthesizer's
    failure, never read on into the group's answer."""
    try:
        delta, finish, usage, stop = translate.stream_chunk(event)
    except translate.NotAnAnswer as exc:
        raise UpstreamFailed(f"{model} streamed a chunk that is no chat chunk: {exc}") from exc
    if usage:
        outcome.extra_usage.append(usage)
    return delta, finish, stop
