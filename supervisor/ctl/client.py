"""The client commands' one way to reach a running daemon: JSON requests and event streams
over urllib, with the right key for each path, and every failure turned into a CtlError that
says what to do about it."""

from __future__ import annotations

import difflib
import http.client
import ipaddress
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from corral.supervisor.ctl import deadline
from corral.supervisor.ctl.exits import CtlError, Exit

DEFAULT_URL = "http://127.0.0.1:8080"  # `corral serve`'s default listen address
# A plain request: the daemon answers from memory. Loads, unloads and answers have no
# deadline of ours: the daemon bounds them (start timeouts, drains) and says why it gave up.
JSON_TIMEOUT = 30.0


@dataclass(frozen=True)
class Key:
    value: str | None
    env: str | None  # the variable it came from


@dataclass(frozen=True)
class Target:
    url: str
    source: str  # where the URL came from, for "looked at ... (from CORRAL_URL)"


def target(given: str | None) -> Target:
    """--url, else CORRAL_URL, else the default; `host:port` alone means http."""
    if given:
        url, source = given, "--url"
    elif os.environ.get("CORRAL_URL"):
        url, source = os.environ["CORRAL_URL"], "CORRAL_URL"
    else:
        url, source = DEFAULT_URL, "the default; set --url or CORRAL_URL"
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CtlError(f"{source}: {url!r} is not an http(s) URL like {DEFAULT_URL}", Exit.USAGE)
    return Target(url.rstrip("/"), source)


def _key(*names: str) -> Key:
    for name in names:
        value = os.environ.get(name)
        if value:
            return Key(value, name)
    return Key(None, None)


class _Unredirected(urllib.request.HTTPRedirectHandler):
    """A 3xx is answered as it is (an HTTPError) rather than followed: urllib would send the
    Authorization header on to wherever it points, another host included."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> None:
        return None


class Client:
    def __init__(self, where: Target, *, follow_redirects: bool = True):
        """`follow_redirects=False`: a redirect is a CtlError that says where it points."""
        self.url, self.source = where.url, where.source
        # /admin takes the admin key; without one, the daemon's admin falls back to its API
        # keys. An admin key opens /v1 too.
        self.admin_key = _key("CORRAL_ADMIN_KEY", "CORRAL_API_KEY")
        self.api_key = _key("CORRAL_API_KEY", "CORRAL_ADMIN_KEY")
        host = urllib.parse.urlsplit(self.url).hostname or ""
        # A daemon on this machine is reached directly, whatever http_proxy says.
        proxies: dict[str, str] | None = {} if _loopback(host) else None
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler(proxies)]
        if not follow_redirects:
            handlers.append(_Unredirected())
        self._opener = urllib.request.build_opener(*handlers)
        # For an answer that must come whole within its timeout, head included.
        self._whole_opener = urllib.request.build_opener(
            *handlers, deadline.HTTPHandler(), deadline.HTTPSHandler())

    # -- requests --------------------------------------------------------------------------

    def get(self, path: str, *, model: str | None = None, timeout: float = JSON_TIMEOUT,
            max_bytes: int | None = None) -> Any:
        """`max_bytes`: a longer answer is refused (CtlError) rather than read whole, and
        then the whole answer must come within `timeout` too (a server that drips it out
        byte by byte would hold the caller forever)."""
        with self._open("GET", path, None, timeout, model,
                        whole=max_bytes is not None) as response:
            if max_bytes is None:
                return _json(response, self.url + path)
            return _json(response, self.url + path,
                         _bounded(response, self.url + path, max_bytes, timeout))

    def post(self, path: str, body: dict[str, Any] | None = None, *,
             model: str | None = None, timeout: float | None = None) -> Any:
        with self._open("POST", path, body, timeout, model) as response:
            return _json(response, self.url + path)

    def events(self, method: str, path: str, body: dict[str, Any] | None = None, *,
               model: str | None = None, quiet: float | None = None) -> Iterator[Any]:
        """The `data:` payloads of a server-sent event stream, parsed, until `[DONE]` or the
        end of the stream. `quiet`: seconds without a byte (keep-alives count) that mean the
        connection is gone."""
        with self._open(method, path, body, quiet, model) as response:
            data: list[str] = []
            while True:
                try:
                    raw = response.readline()
                except (TimeoutError, OSError, http.client.HTTPException) as exc:
                    raise self._broken(exc) from None
                if not raw:
                    return
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line and data:
                    text = "\n".join(data)
                    data.clear()
                    if text == "[DONE]":
                        return
                    try:
                        yield json.loads(text)
                    except ValueError:
                        raise CtlError(f"{self.url}{path} sent an event that is not JSON: "
                                       f"{text[:200]!r}") from None

    def _open(self, method: str, path: str, body: dict[str, Any] | None,
              timeout: float | None, model: str | None,
              whole: bool = False) -> http.client.HTTPResponse:
        """`whole`: the exchange is cut once `timeout` has passed since the connect, whatever
        it is reading (a head dripped a byte at a time included)."""
        key = self.admin_key if path.startswith("/admin") else self.api_key
        headers = {"Accept": "application/json"}
        if key.value:
            headers["Authorization"] = f"Bearer {key.value}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method=method)
        try:
            opener = self._whole_opener if whole else self._opener
            response: http.client.HTTPResponse = opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                raise self._refused(exc, path, key, model) from None
        except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:
            raise self._unreachable(exc) from None
        return response

    # -- what went wrong ---------------------------------------------------------------------

    def _unreachable(self, exc: Exception) -> CtlError:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(reason, socket.gaierror):
            why = f"unknown host ({reason.strerror})"
        elif isinstance(reason, deadline.DeadlinePassed):
            why = str(reason)
        elif isinstance(reason, TimeoutError):
            why = "no answer in time"
        else:
            why = str(reason) or type(reason).__name__
        return CtlError(f"no corral daemon answers at {self.url} ({self.source}): {why}. "
                        "Start one with `corral serve`, or point --url or CORRAL_URL at it.",
                        Exit.UNREACHABLE)

    def _broken(self, exc: Exception) -> CtlError:
        why = "no word from it in time" if isinstance(exc, TimeoutError) else \
            (str(exc) or type(exc).__name__)
        return CtlError(f"the connection to {self.url} broke: {why}", Exit.UNREACHABLE)

    def _refused(self, exc: urllib.error.HTTPError, path: str, key: Key,
                 model: str | None) -> CtlError:
        try:
            error = json.loads(exc.read()).get("error")
        except (ValueError, AttributeError, OSError, http.client.HTTPException):
            error = None
        if 300 <= exc.code < 400:
            return self._redirected(exc, path)
        if not isinstance(error, dict):
            return CtlError(f"{self.url}{path} answered HTTP {exc.code} {exc.reason}, not "
                            f"corral's error shape: is {self.url} a corral?")
        message = str(error.get("message") or exc.reason)
        if exc.code in (401, 403):
            return CtlError(self._key_advice(exc.code, path, key, message), Exit.AUTH)
        if exc.code == 404 and error.get("code") == "model_not_found" and model is not None:
            return CtlError(self._no_such_model(model), Exit.NO_MODEL)
        return CtlError(f"{message} (HTTP {exc.code})")

    def _redirected(self, exc: urllib.error.HTTPError, path: str) -> CtlError:
        where = str(exc.headers.get("Location", ""))[:200]
        return CtlError(f"{self.url}{path} redirects (HTTP {exc.code}) to {where!r}, which "
                        "is not followed: give the URL of the corral itself")

    def _key_advice(self, status: int, path: str, key: Key, message: str) -> str:
        admin = path.startswith("/admin")
        wanted = "CORRAL_ADMIN_KEY" if admin else "CORRAL_API_KEY"
        what = "an admin key (the config's admin_api_keys; api_keys when it has none)" \
            if admin else "an API key (the config's api_keys, or an admin key)"
        if status == 403:
            return (f"{self.url} refused {path} (403): {message}. It takes {what}: set "
                    f"{wanted}" + (f" (the key now comes from {key.env})" if key.env else ""))
        if key.env is None:
            return f"{self.url} wants {what} for {path}: set {wanted} (it is not set)"
        fix = f"set {wanted} to one" if key.env != wanted else f"check {wanted}"
        return (f"{self.url} refused the key in {key.env} for {path} (401): it takes "
                f"{what}; {fix}")

    def _no_such_model(self, model: str) -> str:
        names = self.model_names()
        # The closest first, ties in name order (difflib.get_close_matches puts them last
        # name first).
        scored = sorted((-difflib.SequenceMatcher(None, model.lower(), n.lower()).ratio(), n)
                        for n in names)
        close = [n for score, n in scored if -score >= 0.6][:5]
        if close:
            hint = "did you mean: " + ", ".join(close)
        else:
            hint = "models: " + (", ".join(sorted(names)) if names else "none")
        return f"{self.url} has no model {model!r}; {hint}"

    def model_names(self) -> list[str]:
        """Every name a request may use (models, aliases, groups served as models); empty
        when even that cannot be read."""
        try:
            data = self.get("/v1/models").get("data", [])
        except CtlError:
            return []
        names: set[str] = set()
        for entry in data if isinstance(data, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                names.add(entry["id"])
                names.update(a for a in entry.get("aliases") or [] if isinstance(a, str))
        return sorted(names)


def model_path(name: str, action: str) -> str:
    """/admin/models/<name>/<action>, the name quoted whole (a replica's "#" and all)."""
    return f"/admin/models/{urllib.parse.quote(name, safe='')}/{action}"


def _bounded(response: http.client.HTTPResponse, url: str, max_bytes: int,
             timeout: float) -> bytes:
    until = time.monotonic() + timeout
    parts: list[bytes] = []
    size = 0
    try:
        while chunk := response.read1(65536):
            size += len(chunk)
            if size > max_bytes:
                raise CtlError(f"{url} answered more than {max_bytes:,} bytes: is it a corral?")
            if time.monotonic() > until:
                break
            parts.append(chunk)
    except (OSError, http.client.HTTPException) as exc:
        if not deadline.fired(response):
            raise CtlError(f"the connection to {url} broke: {exc}", Exit.UNREACHABLE) from None
    if deadline.fired(response) or time.monotonic() > until:
        raise CtlError(f"{url} took more than {timeout:g} s to answer", Exit.UNREACHABLE)
    return b"".join(parts)


def _json(response: http.client.HTTPResponse, url: str, body: bytes | None = None) -> Any:
    try:
        return json.loads(response.read() if body is None else body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        raise CtlError(f"{url} answered something that is not JSON: is it a corral?") from None
    except (OSError, http.client.HTTPException) as exc:
        raise CtlError(f"the connection to {url} broke: {exc}", Exit.UNREACHABLE) from None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
