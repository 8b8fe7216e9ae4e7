"""A raw HTTP/1.1 server in threads, for stand-in upstreams that must send what no real server
would (a head that never ends, a connection cut mid-answer, a redirect): a subclass says what
`serve` does with each accepted connection; `fake_upstream.requests` reads its requests."""

from __future__ import annotations

import socket
import threading


class RawServer:
    def __init__(self) -> None:
        self.connections = 0  # accepted so far
        # Bound at once on a port the kernel picks: a port picked free and bound later may be
        # another xdist worker's by then.
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            self.connections += 1
            threading.Thread(target=self._serve_closing, args=(conn,), daemon=True).start()

    def _serve_closing(self, conn: socket.socket) -> None:
        with conn:
            self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._server.close()
