"""urllib handlers for an exchange that must come whole within its timeout: head and body.

urllib's timeout bounds each socket read, not the exchange, and http.client reads a head line
by line: a server that sends a byte of its head every few seconds holds the caller for as
long as it likes (a fleet watcher, and its SIGTERM, with it). Here the connection's socket is
shut down when the request's timeout has passed since the connect, whatever read is under
way: that read ends at once (an OSError or http.client's "closed connection"), and so does the
exchange. The timer is stopped when the response is closed.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.request
from typing import Any


class DeadlinePassed(TimeoutError):
    """The exchange was cut at its deadline."""


class _Cut:
    """The timer of one connection and whether it fired."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.fired = False
        self.seconds = seconds
        self._sock = sock
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        # A socket closed already (its exchange over) has no descriptor any more: EBADF,
        # never another socket's.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


class _Response(http.client.HTTPResponse):
    cut: _Cut | None = None

    def close(self) -> None:
        super().close()
        if self.cut is not None:
            self.cut.cancel()


class _WholeWithin:
    """Mixed into an HTTP(S)Connection: the timer starts at the connect, with the request's
    timeout (urllib's `timeout=`). urllib closes the connection once the head is read (the
    response keeps the socket): the timer goes on until the response is closed."""

    response_class: type[http.client.HTTPResponse] = _Response
    sock: Any
    timeout: Any
    _cut: _Cut | None = None

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        if isinstance(self.timeout, (int, float)):
            self._cut = _Cut(self.sock, float(self.timeout))

    def getresponse(self) -> http.client.HTTPResponse:
        try:
            response = super().getresponse()  # type: ignore[misc]
        except BaseException as exc:
            if self._cut is not None:
                self._cut.cancel()
                if self._cut.fired and isinstance(exc, (OSError, http.client.HTTPException)):
                    raise DeadlinePassed(f"took more than {self._cut.seconds:g} s to "
                                         "answer") from None
            raise
        response.cut = self._cut
        return response  # type: ignore[no-any-return]



class _Connection(_WholeWithin, http.client.HTTPConnection):
    pass


class _SecureConnection(_WholeWithin, http.client.HTTPSConnection):
    pass


class HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_Connection, req)


class HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        # As urllib's own: its context, and (Python 3.11) its check_hostname when one was set.
        settings: dict[str, Any] = {"context": getattr(self, "_context", None)}
        if getattr(self, "_check_hostname", None) is not None:
            settings["check_hostname"] = self._check_hostname  # type: ignore[attr-defined]
        return self.do_open(_SecureConnection, req, **settings)


def fired(response: object) -> bool:
    """Whether `response`'s exchange was cut at its deadline."""
    cut = getattr(response, "cut", None)
    return isinstance(cut, _Cut) and cut.fired
