#!/usr/bin/env -S python3 -S
"""A fake member for the family tests: a command child that answers chat completions,
Responses and Messages each in its own shape, with a tool call when the request offers tools
(the first tool, arguments {"city": "Paris"}), and writes every request it gets (path and
body) as a JSON line to --log, so a test sees what corral sent it. With --break its chat
stream stops after two chunks with the connection cut. A request whose text says
`hostile:NAME` gets the hostile answer NAME in the path's family instead (HOSTILE: wrong
shapes, a giant or endless answer, an event stream where JSON was asked, corral-looking
events in its text); STREAMED names do it in a streamed chat answer (a synthesizer's), and
answer normally when asked whole. A request with stop strings (chat's `stop`, Messages'
`stop_sequences`) is answered as one that ended on the first: chat says it in the choice's
`stop_reason` (vLLM's field), Messages as `stop_reason: stop_sequence`, streamed or whole.
Standard library only."""

import argparse
import json
import re
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_upstream import requests

ARGS = {"city": "Paris"}
USAGE = (7, 3)


def tool_name(body: dict) -> str | None:
    tools = body.get("tools") or []
    if not tools:
        return None
    tool = tools[0]
    return (tool.get("function") or tool).get("name")


def first_stop(body: dict) -> str | None:
    """The stop string the answer ends on: the request's first, if it gave any."""
    stops = body.get("stop") or body.get("stop_sequences") or []
    stops = [stops] if isinstance(stops, str) else stops
    return stops[0] if stops else None


def chat(body: dict) -> dict:
    name = tool_name(body)
    message = {"role": "assistant", "content": "fake answer"}
    if name:
        message = {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_fake1", "type": "function",
            "function": {"name": name, "arguments": json.dumps(ARGS)}}]}
    return {"id": "fake", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if name else "stop",
                         "stop_reason": None if name else first_stop(body)}],
            "usage": {"prompt_tokens": USAGE[0], "completion_tokens": USAGE[1],
                      "total_tokens": sum(USAGE)}}


def responses(body: dict) -> dict:
    name = tool_name(body)
    item = {"type": "function_call", "id": "fc_fake1", "call_id": "call_fake1", "name": name,
            "arguments": json.dumps(ARGS), "status": "completed"} if name else {
        "type": "message", "id": "msg_fake", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "fake answer", "annotations": []}]}
    return {"id": "resp_fake", "object": "response", "status": "completed",
            "model": body.get("model"), "output": [item],
            "usage": {"input_tokens": USAGE[0], "output_tokens": USAGE[1],
                      "total_tokens": sum(USAGE)}}


def messages(body: dict) -> dict:
    name = tool_name(body)
    block = {"type": "tool_use", "id": "toolu_fake1", "name": name, "input": ARGS} if name \
        else {"type": "text", "text": "fake answer"}
    return {"id": "msg_fake", "type": "message", "role": "assistant",
            "model": body.get("model"), "content": [block],
            "stop_reason": "tool_use" if name else "stop_sequence" if first_stop(body)
            else "end_turn", "stop_sequence": None if name else first_stop(body),
            "usage": {"input_tokens": USAGE[0], "output_tokens": USAGE[1]}}


ANSWERS = {"/v1/chat/completions": chat, "/v1/responses": responses, "/v1/messages": messages}

# Text that looks like the end of corral's own streams: a member's words, never events.
FORGED = ('\n\nevent: message_stop\ndata: {"type": "message_stop"}\n\n'
          'event: response.completed\ndata: {"type": "response.completed"}\n\ndata: [DONE]\n\n')


def _wrong(path: str, key: str, value: object) -> dict:
    """The path's normal answer with one field replaced (key: a path of dict keys, dots)."""
    answer = ANSWERS.get(path, chat)({})
    *heads, last = key.split(".")
    target = answer
    for head in heads:
        target = target[head] if isinstance(target, dict) else target[0]
    target[last] = value
    return answer


KEYS = {"/v1/chat/completions": ("choices.0.message.content", "usage"),
        "/v1/responses": ("output.0.content", "usage"),
        "/v1/messages": ("content", "usage")}


def hostile(name: str, path: str) -> bytes | None:
    """The body of hostile answer `name` to `path` (None: it never answers)."""
    content, usage = KEYS.get(path, KEYS["/v1/chat/completions"])
    if name == "content-not-list":
        answer: object = _wrong(path, content, "just text")
        if path == "/v1/chat/completions":
            answer = _wrong(path, "choices.0.message", "just text")
    elif name == "usage-strings":
        answer = _wrong(path, usage, {"input_tokens": "many", "output_tokens": "7",
                                      "prompt_tokens": "many", "completion_tokens": "7"})
    elif name == "bad-tool-input":
        call = {"/v1/messages": {"type": "tool_use", "id": "t", "name": "w", "input": "x"},
                "/v1/responses": {"type": "function_call", "call_id": "c", "name": "w",
                                  "arguments": 5}}.get(path)
        answer = _wrong(path, "content" if call and path == "/v1/messages" else "output",
                        [call]) if call else _wrong(path, "choices.0.message.tool_calls",
                                                    [{"id": "c", "function": "w"}])
    elif name == "not-an-object":
        answer = ["an", "array"]
    elif name == "giant":
        answer = _wrong(path, "model", "x" * (3 * 1024 * 1024))
    elif name == "events":  # an event stream, out of order, where JSON was asked
        return (b"event: message_stop\ndata: {}\n\nevent: message_start\ndata: {}\n\n"
                b"data: [DONE]\n\n")
    elif name == "endless":
        return None
    elif name == "forged":  # well-formed, naming another model, corral's events in its text
        answer = ANSWERS.get(path, chat)({"model": "someone-else"})
        text = json.dumps(answer).replace("fake answer", json.dumps(FORGED)[1:-1])
        return text.encode()
    else:
        answer = {"unknown hostile answer": name}
    return json.dumps(answer).encode()


# Streamed chat chunks with wrong shapes, by hostile name: what follows the first text chunk.
STREAMED = {
    "stream-usage": [{"choices": [], "usage": {"prompt_tokens": "many",
                                               "completion_tokens": [1]}}],
    "stream-disorder": [{"choices": [{"delta": {}, "finish_reason": "stop"}]},
                        {"choices": "x"}, {"choices": [{"delta": "text"}]},
                        {"choices": [{"delta": {"content": ["a"]}, "finish_reason": ["x"]}]}],
    "stream-forged": [{"choices": [{"index": 0, "delta": {"content": FORGED},
                                    "finish_reason": "stop"}]}],
}


def stream(conn: socket.socket, body: dict, broken: bool, hostile: str | None = None) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")

    def send(event: dict) -> None:
        data = b"data: " + json.dumps(event).encode() + b"\n\n"
        conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))

    if hostile in STREAMED:
        send({"id": "fake", "object": "chat.completion.chunk",
              "choices": [{"index": 0, "delta": {"content": "fake "}, "finish_reason": None}]})
        for event in STREAMED[hostile]:
            send(event)
        conn.sendall(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        return
    for text in ("fake ", "stream "):
        send({"id": "fake", "object": "chat.completion.chunk", "model": body.get("model"),
              "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
    if broken:
        conn.shutdown(socket.SHUT_RDWR)  # cut mid-answer, as a killed server would
        return
    send({"id": "fake", "object": "chat.completion.chunk", "model": body.get("model"),
          "choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                       "stop_reason": first_stop(body)}],
          "usage": {"prompt_tokens": USAGE[0], "completion_tokens": 2,
                    "total_tokens": USAGE[0] + 2}})
    conn.sendall(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


def serve(conn: socket.socket, log: Path, broken: bool) -> None:
    with conn:
        for method, path, raw in requests(conn):
            if method == "POST":
                body = json.loads(raw or b"{}")
                with log.open("a") as out:
                    out.write(json.dumps({"path": path, "body": body}) + "\n")
                found = re.search(r"hostile:([a-z-]+)", json.dumps(body))
                named = found.group(1) if found else None
                if named and body.get("stream") and named in STREAMED:
                    stream(conn, body, broken, named)
                    return
                if named and named not in STREAMED:  # a streamed name asked whole: answers
                    data = hostile(named, path)
                    if data is None:
                        threading.Event().wait()  # endless: not a byte, ever
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                    continue
                if body.get("stream"):
                    stream(conn, body, broken)
                    return
                answer = ANSWERS.get(path, chat)(body)
            else:
                answer = {"status": "ok"}
            data = json.dumps(answer).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--break", dest="broken", action="store_true")
    args = parser.parse_args()
    listener = socket.create_server(("127.0.0.1", args.port))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, args.log, args.broken), daemon=True).start()


if __name__ == "__main__":
    main()
