"""HTTP for groups: /v1/batch/execute, /v1/chain/execute, and exposed groups answering
/v1/chat/completions (whole, or streamed as ordinary SSE)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import Any

from aiohttp import web

from corral.proxy.errors import ApiError, UpstreamFailed
from corral.proxy.forward import UPSTREAM_BROKE, open_upstream, sse_headers
from corral.proxy.groups import CHAT_PATH, GroupFailed, GroupOutcome, GroupRunner
from corral.proxy.routing import group_by_name
from corral.supervisor.config import GroupSpec
from corral.supervisor.daemon import Daemon
from corral.supervisor.errors import SupervisorError
from corral.supervisor.templates import template_problem


def check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of chat messages",
                       "invalid_messages", param="messages")


def check_template(body: dict[str, Any]) -> None:
    """A request's chain template is checked before any model starts, not mid-chain."""
    template = body.get("template")
    if template is not None and not isinstance(template, str):
        raise ApiError(400, "'template' must be a string using {previous} and {input}",
                       "invalid_template", param="template")
    problem = template_problem(template) if template else None
    if problem:
        raise ApiError(400, f"bad template: {problem}", "invalid_template", param="template")


def failed_response(exc: GroupFailed) -> web.Response:
    return web.json_response({
        "error": {"message": str(exc), "type": "server_error", "code": "group_failed",
                  "param": None},
        "group": exc.outcome.as_dict()}, status=502)


async def batch_execute(request: web.Request, runner: GroupRunner,
                        body: dict[str, Any]) -> web.StreamResponse:
    group = group_by_name(runner.daemon, body.get("group"))
    check_messages(body)
    try:
        outcome = await runner.run(group, body)
    except GroupFailed as exc:
        return failed_response(exc)
    return web.json_response(outcome.as_dict())


async def chain_execute(request: web.Request, runner: GroupRunner,
                        body: dict[str, Any]) -> web.StreamResponse:
    check_messages(body)
    if "group" in body:
        group = group_by_name(runner.daemon, body["group"])
        if group.type != "chain":
            group = _as_chain(group)
    else:
        group = _ad_hoc_chain(runner.daemon, body.get("models"))
    check_template(body)
    try:
        outcome = await runner.run(group, body)
    except GroupFailed as exc:
        return failed_response(exc)
    result = outcome.as_dict()
    result["steps"] = result.pop("responses")
    return web.json_response(result)


def _as_chain(group: GroupSpec) -> GroupSpec:
    return replace(group, type="chain", required_responses=len(group.models))


def _ad_hoc_chain(daemon: Daemon, models: object) -> GroupSpec:
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        raise ApiError(400, "give 'group' or 'models' (a list of model names)", "missing_models",
                       param="models")
    canonical = []
    for name in models:
        canonical.append(daemon.instance(name).name)  # UnknownModel → 404
    return GroupSpec(
        name="+".join(canonical), type="chain", models=tuple(canonical),
        required_responses=len(canonical),
        member_timeout=daemon.loaded.config.defaults.queue_timeout,
        fallback="strict", replace_with={}, pinned=False, selector="first_ok", judge=None,
        synthesizer=None, template=None, expose_as_model=False)


# -- a group answering /v1/chat/completions --------------------------------------------------

class _Completion:
    """Builds OpenAI chat.completion objects and chunks for a group's answer."""

    def __init__(self, group: GroupSpec):
        self.group = group
        self.id = f"chatcmpl-corral-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def whole(self, outcome: GroupOutcome) -> dict[str, Any]:
        return {
            "id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.group.name,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": outcome.answer()}}],
            "usage": outcome.usage(),
            "corral_group": outcome.as_dict(),
        }

    def chunk(self, delta: dict[str, Any] | None, finish: str | None = None,
              **extra: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta,
                                             "finish_reason": finish}]
        payload = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.group.name, "choices": choices, **extra}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def chat_with_group(request: web.Request, runner: GroupRunner, group: GroupSpec,
                          body: dict[str, Any]) -> web.StreamResponse:
    check_messages(body)
    if group.type == "chain":
        check_template(body)  # an exposed chain takes a request's template too
    completion = _Completion(group)
    if not body.get("stream"):
        try:
            outcome = await runner.run(group, body)
        except GroupFailed as exc:
            return failed_response(exc)
        return web.json_response(completion.whole(outcome))

    response = web.StreamResponse(headers=sse_headers())
    try:
        if group.type == "consensus":
            async def relay_synthesis(outcome: GroupOutcome) -> None:
                await _stream_synthesis(request, response, runner, completion, body, outcome)

            outcome = await runner.run(group, body, final_step=relay_synthesis)
        else:
            outcome = await runner.run(group, body)
            await response.prepare(request)
            await response.write(completion.chunk({"role": "assistant",
                                                   "content": outcome.answer()}))
            await response.write(completion.chunk({}, finish="stop"))
    except GroupFailed as exc:
        if not response.prepared:
            return failed_response(exc)
        await response.write(b"data: " + json.dumps({"error": {
            "message": str(exc), "type": "server_error", "code": "group_failed"}}).encode()
            + b"\n\n")
        await response.write_eof()
        return response
    await response.write(completion.chunk(None, usage=outcome.usage(),
                                          corral_group=outcome.as_dict()))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _stream_synthesis(request: web.Request, response: web.StreamResponse,
                            runner: GroupRunner, completion: _Completion,
                            body: dict[str, Any], outcome: GroupOutcome) -> None:
    """Relay the synthesizer's own token stream, renamed to the group, as it is written."""
    group = outcome.group
    assert group.synthesizer
    payload = {**runner.synthesis_body(group, body, outcome), "model": group.synthesizer,
               "stream": True}
    lease = None
    try:
        async with asyncio.timeout(group.member_timeout):  # until its first byte
            lease = await runner.daemon.acquire(group.synthesizer)
            upstream = await open_upstream(runner.session, lease.base_url + CHAT_PATH,
                                           group.synthesizer, json=payload)
    except BaseException as exc:
        if lease is not None:
            if isinstance(exc, UpstreamFailed):
                await lease.upstream_broke()
            lease.release()
        if isinstance(exc, (TimeoutError, SupervisorError, UpstreamFailed)):
            raise GroupFailed(f"group {group.name!r}: synthesizer {group.synthesizer} failed: "
                              f"{exc or type(exc).__name__}", outcome) from exc
        raise
    text: list[str] = []
    try:
        if upstream.status != 200:
            detail = (await upstream.read()).decode(errors="replace")[:300]
            raise GroupFailed(f"group {group.name!r}: synthesizer answered "
                              f"HTTP {upstream.status}: {detail}", outcome)
        await response.prepare(request)
        try:
            async for line in upstream.content:
                if not line.startswith(b"data: {"):
                    continue  # blank separators, pings, and its own [DONE]
                event = json.loads(line[6:])
                event["model"] = group.name
                event["id"] = completion.id  # one id for the whole stream, details included
                for choice in event.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
                if event.get("usage"):
                    outcome.extra_usage.append(event["usage"])
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        except (*UPSTREAM_BROKE, ValueError) as exc:
            raise GroupFailed(f"group {group.name!r}: synthesizer broke off: {exc}",
                              outcome) from exc
    except BaseException:
        upstream.close()
        raise
    finally:
        lease.release()
    upstream.release()
    outcome.final = "".join(text)

