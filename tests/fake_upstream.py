#!/usr/bin/env -S python3 -S
"""A tiny fake upstream for lifecycle tests (as llama-swap's tests use one): it takes
llama-server's command line, listens on --port at once, answers /health and any POST with a
small OpenAI-shaped chat answer, and starts and stops in milliseconds. Standard library only,
started without site-packages, so a start costs a few milliseconds of interpreter."""

import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator


def requests(conn: socket.socket) -> Iterator[tuple[str, str, bytes]]:
    """Each request on a kept-alive connection: method, path and body (Content-Length bodies
    only: a fake for corral's own client, which always sends one). Ends when the peer closes."""
    for method, path, _headers, body in exchanges(conn):
        yield method, path, body


def exchanges(conn: socket.socket) -> Iterator[tuple[str, str, dict[str, str], bytes]]:
    """requests(), with each request's headers (names lowercased)."""
    buffered = b""
    while True:
        while b"\r\n\r\n" not in buffered:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buffered += chunk
        head, _, buffered = buffered.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path = lines[0].split(" ")[:2]
        headers = {name.strip().lower(): value.strip()
                   for name, _, value in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(buffered) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buffered += chunk
        body, buffered = buffered[:length], buffered[length:]
        yield method, path, headers, body


def answer(conn: socket.socket) -> None:
    with conn:
        for method, path, _body in requests(conn):
            if path.startswith("/health"):
                body = {"status": "ok"}
            elif method == "POST":
                body = {"id": "fake", "object": "chat.completion", "model": "fake",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "ok"}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                  "total_tokens": 2}}
            else:
                body = {"object": "list", "data": []}
            raw = json.dumps(body).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)


def main() -> None:
    args = sys.argv[1:]
    if "--help" in args:
        print("--cache-type-k TYPE  allowed values: f32, f16, bf16, q8_0, q4_0")
        return
    port = int(args[args.index("--port") + 1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # A slow load: seconds before the port is open (a big model, a cold vLLM).
    delay = float(os.environ.get("FAKE_UPSTREAM_DELAY", "0"))
    if delay:
        threading.Event().wait(delay)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("127.0.0.1", port))
    except OSError:
        print("couldn't bind HTTP server socket", flush=True)
        sys.exit(1)
    server.listen(64)
    print(f"fake upstream listening on {port}", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
