#!/usr/bin/env -S python3 -S
"""A fleet test's stub model (a `backend: command` child): answers /health and any POST with
a chat completion whose content is --tag, writes each request it gets (path and body) as a
JSON line to --record, so a test sees what reached the child after corral and the router; a
streamed request gets --chunks content chunks --gap seconds apart (SSE, chunked), so a test can
tell that nothing between here and the client buffered them. Standard library only.

    fleet_upstream.py --port PORT --tag TEXT --record FILE [--chunks N] [--gap S]
"""

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_upstream import requests


def chunk(conn: socket.socket, data: bytes) -> None:
    conn.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def stream(conn: socket.socket, args: argparse.Namespace) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(args.chunks):
        if i:
            time.sleep(args.gap)
        event = {"id": "fleet", "object": "chat.completion.chunk", "model": "stub",
                 "choices": [{"index": 0, "delta": {"content": f"{args.tag}{i} "},
                              "finish_reason": None}]}
        chunk(conn, b"data: " + json.dumps(event).encode() + b"\n\n")
    done = {"id": "fleet", "object": "chat.completion.chunk", "model": "stub",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    chunk(conn, b"data: " + json.dumps(done).encode() + b"\n\ndata: [DONE]\n\n")
    chunk(conn, b"")


def serve(conn: socket.socket, args: argparse.Namespace, lock: threading.Lock) -> None:
    with conn:
        for method, path, raw in requests(conn):
            if method != "POST":
                answer = {"status": "ok"}
            else:
                body = json.loads(raw or b"{}")
                with lock, open(args.record, "a") as out:
                    out.write(json.dumps({"path": path, "body": body}) + "\n")
                if body.get("stream"):
                    stream(conn, args)
                    continue
                answer = {"id": "fleet", "object": "chat.completion", "model": "stub",
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": args.tag}}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                    "total_tokens": 2}}
            data = json.dumps(answer).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tag", default="ok")
    parser.add_argument("--record", required=True)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--gap", type=float, default=0.3)
    args = parser.parse_args()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", args.port))
    server.listen(64)
    lock = threading.Lock()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn, args, lock), daemon=True).start()


if __name__ == "__main__":
    main()
