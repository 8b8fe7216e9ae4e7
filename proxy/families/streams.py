"""A group's answer written in the family its client asked for: a whole object, or the
family's event stream (start, text deltas, the end with tool calls and usage, or an error),
in the shapes the official SDKs parse (openai-python's `types/responses`, Anthropic's
`types` and `lib/streaming`). One writer per family; a group's own report rides along as a
top-level `corral_group` key, which the SDKs keep as an extra field."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar

from corral.proxy import request_id, sse
from corral.proxy.families.answers import Answer, arguments_object
from corral.proxy.families.wire import MESSAGES

Details = dict[str, Any]


def _hex() -> str:
    return uuid.uuid4().hex[:24]


def _tokens(answer: Answer) -> tuple[int, int]:
    usage = answer.usage or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


class FamilyWriter:
    """The interface, and chat completions: objects and `data:` chunks, `[DONE]` last."""

    def __init__(self, model: str):
        self.model = model
        self.created = int(time.time())
        self.id = f"chatcmpl-corral-{_hex()}"

    def whole(self, answer: Answer, details: Details) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "finish_reason": answer.finish, "message": message}],
                "usage": answer.usage, "corral_group": details}

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None,
               **extra: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta,
                                             "finish_reason": finish}]
        return sse.frame({"id": self.id, "object": "chat.completion.chunk",
                          "created": self.created, "model": self.model, "choices": choices,
                          **extra})

    def start(self, input_tokens: int) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, delta: str) -> bytes:
        return self._chunk({"content": delta}) if delta else b""

    def finish(self, answer: Answer, details: Details) -> bytes:
        out = b""
        if answer.tool_calls:
            out += self._chunk({"tool_calls": [{"index": i, **call} for i, call in
                                               enumerate(answer.tool_calls)]})
        return (out + self._chunk({}, finish=answer.finish)
                + self._chunk(None, usage=answer.usage, corral_group=details) + sse.DONE)

    def error(self, message: str, code: str) -> bytes:
        return sse.error_event(message, code=code)


class ResponsesWriter(FamilyWriter):
    """OpenAI's Responses: a `response` object; its stream from `response.created` to
    `response.completed` (a cut answer: status `incomplete`, still in `response.completed`,
    which is the event the SDK's stream helper ends on)."""

    def __init__(self, model: str):
        super().__init__(model)
        self.id = f"resp_corral_{_hex()}"
        self.message_id = f"msg_corral_{_hex()}"
        self.sequence = 0
        self.streamed: list[str] = []

    def _event(self, kind: str, **payload: Any) -> bytes:
        self.sequence += 1
        return sse.typed(kind, {"type": kind, "sequence_number": self.sequence, **payload})

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._part(text)]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _call(n: int, call: dict[str, Any], status: str) -> dict[str, Any]:
        function = call.get("function") or {}
        return {"type": "function_call", "id": f"fc_corral_{n}_{call.get('id') or n}",
                "call_id": call.get("id") or f"call_{n}", "name": function.get("name") or "",
                "arguments": (function.get("arguments") or "{}") if status == "completed"
                else "", "status": status}

    def _response(self, status: str, output: list[dict[str, Any]],
                  answer: Answer | None = None, details: Details | None = None,
                  ) -> dict[str, Any]:
        usage = None
        if answer is not None:
            tokens_in, tokens_out = _tokens(answer)
            usage = {"input_tokens": tokens_in, "output_tokens": tokens_out,
                     "total_tokens": tokens_in + tokens_out,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        cut = status == "incomplete"
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "model": self.model, "output": output,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"}
               if cut else None, "instructions": None, "metadata": {},
               "parallel_tool_calls": True, "temperature": None, "top_p": None,
               "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
               "usage": usage}
        if details is not None:
            out["corral_group"] = details
        return out

    def _output(self, answer: Answer) -> list[dict[str, Any]]:
        output = [self._message(answer.text, "completed")] \
            if answer.text or not answer.tool_calls else []
        return output + [self._call(n, call, "completed")
                         for n, call in enumerate(answer.tool_calls)]

    @staticmethod
    def _status(answer: Answer) -> str:
        return "incomplete" if answer.finish == "length" else "completed"

    def whole(self, answer: Answer, details: Details) -> dict[str, Any]:
        return self._response(self._status(answer), self._output(answer), answer, details)

    def start(self, input_tokens: int) -> bytes:
        head = self._response("in_progress", [])
        return (self._event("response.created", response=head)
                + self._event("response.in_progress", response=head)
                + self._event("response.output_item.added", output_index=0,
                              item=self._message("", "in_progress"))
                + self._event("response.content_part.added", item_id=self.message_id,
                              output_index=0, content_index=0, part=self._part("")))

    def text(self, delta: str) -> bytes:
        if not delta:
            return b""
        self.streamed.append(delta)
        return self._event("response.output_text.delta", item_id=self.message_id,
                           output_index=0, content_index=0, delta=delta, logprobs=[])

    def finish(self, answer: Answer, details: Details) -> bytes:
        text = "".join(self.streamed)
        out = (self._event("response.output_text.done", item_id=self.message_id,
                           output_index=0, content_index=0, text=text, logprobs=[])
               + self._event("response.content_part.done", item_id=self.message_id,
                             output_index=0, content_index=0, part=self._part(text))
               + self._event("response.output_item.done", output_index=0,
                             item=self._message(text, "completed")))
        output = [self._message(text, "completed")]
        for n, call in enumerate(answer.tool_calls, 1):
            item = self._call(n, call, "completed")
            out += (self._event("response.output_item.added", output_index=n,
                                item=self._call(n, call, "in_progress"))
                    + self._event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=n, delta=item["arguments"])
                    + self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=n, name=item["name"],
                                  arguments=item["arguments"])
                    + self._event("response.output_item.done", output_index=n, item=item))
            output.append(item)
        final = self._response(self._status(answer), output, answer, details)
        return out + self._event("response.completed", response=final)

    def error(self, message: str, code: str) -> bytes:
        """The relay's ending of a broken Responses stream (wire.py), in this stream's
        sequence: `response.failed` with what was written so far, then `error`."""
        text = request_id.tagged(message)
        failed = self._response("failed", [self._message("".join(self.streamed), "incomplete")])
        failed["error"] = {"code": "server_error", "message": text}
        return (self._event("response.failed", response=failed)
                + self._event("error", code=code, message=text, param=None, error={
                    "message": text, "type": "server_error", "code": code, "param": None}))


class MessagesWriter(FamilyWriter):
    """Anthropic's Messages: a `message` object; its stream from `message_start` to
    `message_stop`, every event with its `event:` line (the SDKs skip unnamed ones)."""

    _STOP: ClassVar[dict[str, str]] = {"stop": "end_turn", "length": "max_tokens",
                                       "tool_calls": "tool_use"}

    def __init__(self, model: str):
        super().__init__(model)
        self.id = f"msg_corral_{_hex()}"

    @staticmethod
    def _event(kind: str, **payload: Any) -> bytes:
        return sse.typed(kind, {"type": kind, **payload})

    @classmethod
    def _end(cls, answer: Answer) -> dict[str, Any]:
        """`stop_reason` and `stop_sequence`, as Anthropic says them: an answer that ended on
        one of the request's stop strings is `stop_sequence`, naming it (where the member
        said which: otherwise it is told from an end of turn no better than `end_turn`)."""
        if answer.finish == "stop" and answer.stop_sequence is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": answer.stop_sequence}
        return {"stop_reason": cls._STOP.get(answer.finish, "end_turn"), "stop_sequence": None}

    @staticmethod
    def _tool_use(n: int, call: dict[str, Any]) -> dict[str, Any]:
        function = call.get("function") or {}
        return {"type": "tool_use", "id": call.get("id") or f"toolu_corral_{n}",
                "name": function.get("name") or "",
                "input": arguments_object(function.get("arguments"))}

    def whole(self, answer: Answer, details: Details) -> dict[str, Any]:
        tokens_in, tokens_out = _tokens(answer)
        content = [{"type": "text", "text": answer.text}] \
            if answer.text or not answer.tool_calls else []
        content += [self._tool_use(n, call) for n, call in enumerate(answer.tool_calls)]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, **self._end(answer),
                "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out},
                "corral_group": details}

    def start(self, input_tokens: int) -> bytes:
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return (self._event("message_start", message=message)
                + self._event("content_block_start", index=0,
                              content_block={"type": "text", "text": ""})
                + self._event("ping"))

    def text(self, delta: str) -> bytes:
        if not delta:
            return b""
        return self._event("content_block_delta", index=0,
                           delta={"type": "text_delta", "text": delta})

    def finish(self, answer: Answer, details: Details) -> bytes:
        out = self._event("content_block_stop", index=0)
        for n, call in enumerate(answer.tool_calls, 1):
            block = self._tool_use(n, call)
            arguments = json.dumps(block["input"])
            out += (self._event("content_block_start", index=n,
                                content_block={**block, "input": {}})
                    + self._event("content_block_delta", index=n, delta={
                        "type": "input_json_delta", "partial_json": arguments})
                    + self._event("content_block_stop", index=n))
        tokens_in, tokens_out = _tokens(answer)
        return (out + self._event(
            "message_delta",
            delta=self._end(answer),
            usage={"input_tokens": tokens_in, "output_tokens": tokens_out},
            corral_group=details)
            + self._event("message_stop"))

    def error(self, message: str, code: str) -> bytes:
        return MESSAGES.broken(message, code, self.model, None)


def writer_for(family: str, model: str) -> FamilyWriter:
    if family == "responses":
        return ResponsesWriter(model)
    if family == "messages":
        return MessagesWriter(model)
    return FamilyWriter(model)
