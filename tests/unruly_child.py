#!/usr/bin/env -S python3 -S
"""A `backend: command` child that serves like tests/fake_upstream.py and misbehaves at the OS
level as `--mode` says, once it listens:

- `setsid`: forks a grandchild (`sleep`) that calls setsid(), leaving the child's group;
- `long-lines`: writes 100 lines of 256 KiB of invalid UTF-8 at once;
- `close-output`: closes its stdout and stderr and goes on serving;
- `ignore-term`: ignores SIGTERM.

Each prints `grandchild <pid>` for any process it forks. Standard library only."""

import os
import signal
import socket
import sys
import threading

from fake_upstream import answer


def serve(server: socket.socket) -> None:
    while True:
        conn, _ = server.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


def main() -> None:
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    mode = args[args.index("--mode") + 1]
    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore-term"
                  else lambda *_: os._exit(0))
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    threading.Thread(target=serve, args=(server,), daemon=True).start()
    print(f"unruly child ({mode}) listening on {port}", flush=True)
    out = sys.stdout.buffer
    if mode == "setsid":
        pid = os.fork()
        if pid == 0:
            os.setsid()
            os.execv("/bin/sleep", ["sleep", "3600"])
        print(f"grandchild {pid}", flush=True)
    elif mode == "long-lines":
        line = b"\xff" * (256 * 1024) + b"\n"
        for _ in range(100):
            out.write(line)
        out.flush()
    elif mode == "close-output":
        os.close(1)
        os.close(2)
    threading.Event().wait()


if __name__ == "__main__":
    main()
