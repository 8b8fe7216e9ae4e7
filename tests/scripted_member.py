#!/usr/bin/env -S python3 -S
"""A group member whose behaviour a test sets on its command line (a `backend: command`
child): the answer it gives, how long it takes, how many of its starts fail, and a file where
it writes each request body it got, so a test can assert what corral sent each member. With
--chunks, a streamed request gets that many content chunks --gap seconds apart (SSE, chunked;
without, the same JSON answer as any other), so a test can tell that nothing between here and
its client buffered them. Standard library only (started with -S, like fake_upstream, whose
request reader it uses).

    scripted_member.py --port PORT [--reply TEXT] [--delay S] [--record FILE]
                       [--fail-starts N --starts FILE] [--chunks N] [--gap S]
"""

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time

from fake_upstream import requests


def chunk(conn: socket.socket, data: bytes) -> None:
    conn.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def stream(conn: socket.socket, args: argparse.Namespace) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(args.chunks):
        if i:
            time.sleep(args.gap)
        event = {"id": "scripted", "object": "chat.completion.chunk", "model": "scripted",
                 "choices": [{"index": 0, "delta": {"content": f"{args.reply}{i} "},
                              "finish_reason": None}]}
        chunk(conn, b"data: " + json.dumps(event).encode() + b"\n\n")
    done = {"id": "scripted", "object": "chat.completion.chunk", "model": "scripted",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    chunk(conn, b"data: " + json.dumps(done).encode() + b"\n\ndata: [DONE]\n\n")
    chunk(conn, b"")


def serve(conn: socket.socket, args: argparse.Namespace, lock: threading.Lock) -> None:
    with conn:
        for method, path, raw in requests(conn):
            if method == "POST":
                request = json.loads(raw or b"{}")
                if args.record:
                    with lock, open(args.record, "a") as out:
                        out.write(json.dumps({"path": path, "body": request}) + "\n")
                if args.delay:
                    threading.Event().wait(args.delay)
                if args.chunks and isinstance(request, dict) and request.get("stream"):
                    try:
                        stream(conn, args)
                    except OSError:
                        return
                    continue
                body = {"id": "scripted", "object": "chat.completion", "model": "scripted",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": args.reply}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                  "total_tokens": 5}}
            else:
                body = {"status": "ok"}
            data = json.dumps(body).encode()
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            except OSError:
                return  # corral hung up (a cancelled member): nothing to answer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reply", default="ok")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--record")
    parser.add_argument("--fail-starts", type=int, default=0)
    parser.add_argument("--starts")
    parser.add_argument("--chunks", type=int, default=0)
    parser.add_argument("--gap", type=float, default=0.3)
    args = parser.parse_args()
    if args.fail_starts:
        count = 0
        if args.starts and os.path.exists(args.starts):
            with open(args.starts) as f:
                count = int(f.read() or 0)
        if args.starts:
            with open(args.starts, "w") as f:
                f.write(str(count + 1))
        if count < args.fail_starts:
            print(f"scripted failure of start {count + 1}", flush=True)
            sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", args.port))
    server.listen(64)
    print(f"scripted member listening on {args.port}", flush=True)
    lock = threading.Lock()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn, args, lock), daemon=True).start()


if __name__ == "__main__":
    main()
