"""The edge: what a web page in the user's browser may make corral do. Nothing, by default.

corral listens on 127.0.0.1 without keys, and any page the user opens can send requests there.
A "simple" cross-origin POST (text/plain, `mode: "no-cors"`) needs no preflight: it reaches
corral and acts, though the page cannot read the answer. DNS rebinding (a name of the
attacker's that resolves to 127.0.0.1) makes the page same-origin with corral, so it can read
too. Ollama fixed the same class (CVE-2024-28224) with a Host check and an origin allow-list
(OLLAMA_ORIGINS); Jupyter checks Host and Origin by default. corral does both:

- **Host**: an IP literal, a loopback name (localhost, *.localhost), the listen address, this
  machine's hostname, or an `allowed_hosts` entry ("name", ".suffix" for its subdomains, or
  "*"); else 403 `host_not_allowed`. A rebinding attack needs a name, and names are refused.
- **Origin**: a request a browser sends from another origin carries `Origin`; one not in
  `allowed_origins` (exact "scheme://host[:port]", or "*") is refused (403
  `origin_not_allowed`) on every method that changes state and on /v1, /admin, /models, /peer,
  /metrics and the models' mounts (/w/), whatever the method. corral's own status page is
  same-origin and unaffected. The GETs a page makes without `Origin` (an <img>, a <script>, a
  link) say `Sec-Fetch-Site: cross-site` or `same-site`, and are refused the same way.
- **Content-Type**: a body a JSON route reads must say `application/json` (415
  `unsupported_media_type`; proxy/validate.require_json, where the body is read): the content
  types a page may send without a preflight never pass.
- **CORS** only for `allowed_origins`: preflights answered (204), answers carry
  `Access-Control-Allow-Origin` for that origin; a child's own CORS headers are never relayed.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp import web

from corral.proxy.errors import error_response
from corral.supervisor.config import Config

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# What browsers say in Sec-Fetch-Site of a request that another site's page made ("same-site":
# another port or subdomain of the same site; corral's own page says "same-origin", the
# address bar "none").
_OTHER_SITES = frozenset({"cross-site", "same-site"})
# The routes that act or read what runs: cross-origin requests never reach them.
GUARDED_PREFIXES = ("/v1/", "/admin", "/models", "/peer", "/metrics", "/w/")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost",
                            "ip6-loopback"})
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id, X-Api-Key, Anthropic-Version"
EXPOSED_HEADERS = "X-Request-Id, X-Corral-Node, Server-Timing, Retry-After"
# Set on a request the edge refused. A page may send thousands a second: such a refusal is
# counted in the metrics but writes no log line, event or recent-requests entry (as a 401),
# and it does not name the node, by default the machine's host name, which a page that DNS
# rebinding made same-origin could read from the 403 (a Host refusal).
REFUSED: web.RequestKey[bool] = web.RequestKey("refused_at_edge", bool)


class Edge:
    def __init__(self, config: Callable[[], Config], listen_host: str):
        self._config = config  # the config in force (a reload's lists apply at once)
        self._own_names = frozenset(
            name.lower().rstrip(".") for name in (listen_host, socket.gethostname()) if name)
        # Decisions per Host header under one config: clients send the same few, and the
        # check is on every request's path (bounded: a flood of names only refills it).
        self._hosts: dict[str, bool] = {}
        self._hosts_for: Config | None = None

    # -- Host ----------------------------------------------------------------------------------

    def host_allowed(self, host: str | None) -> bool:
        if not host:
            return True  # HTTP/1.0 without Host: no browser sends that
        config = self._config()
        if config is not self._hosts_for or len(self._hosts) > 256:
            self._hosts, self._hosts_for = {}, config
        known = self._hosts.get(host)
        if known is None:
            known = self._hosts[host] = self._decide_host(host, config)
        return known

    def _decide_host(self, host: str, config: Config) -> bool:
        name = _hostname(host)
        if name is None:
            return False
        if _is_ip(name) or name in LOOPBACK_NAMES or name.endswith(".localhost") \
                or name in self._own_names:
            return True
        for entry in config.allowed_hosts:
            entry = entry.lower().rstrip(".")
            if entry == "*" or name == entry or (entry.startswith(".") and (
                    name.endswith(entry) or name == entry[1:])):
                return True
        return False

    # -- Origin --------------------------------------------------------------------------------

    def origin_allowed(self, origin: str) -> bool:
        """An origin that `allowed_origins` lets through (not the same origin: see
        cross_origin)."""
        allowed = self._config().allowed_origins
        return "*" in allowed or origin.rstrip("/") in {o.rstrip("/") for o in allowed}

    @staticmethod
    def cross_origin(request: web.Request) -> str | None:
        """The request's Origin when it is another origin than corral's (None: no Origin, or
        the same host and port, whatever the scheme a TLS proxy in front adds)."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        try:
            netloc = urlsplit(origin).netloc
        except ValueError:  # "http://[": not a URL, so not corral's own origin either
            return origin
        if origin != "null" and netloc and request.host \
                and netloc.lower() == request.host.lower():
            return None
        return origin

    # -- the check -----------------------------------------------------------------------------

    def refusal(self, request: web.Request) -> web.StreamResponse | None:
        """None when `request` may go on; else the answer (a refusal, or a preflight's), and
        request[REFUSED] says it was a refusal."""
        denied = self._refusal(request)
        if denied is not None and denied.status == 403:
            request[REFUSED] = True
        return denied

    def _refusal(self, request: web.Request) -> web.StreamResponse | None:
        if not self.host_allowed(request.headers.get("Host")):
            return error_response(403, f"Host {request.headers.get('Host', '')[:100]!r} is not "
                                  "one corral answers to: add it to allowed_hosts in the config "
                                  "to reach corral under that name", kind="permission_error",
                                  code="host_not_allowed")
        origin = self.cross_origin(request)
        if origin is not None:
            allowed = self.origin_allowed(origin)
            if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
                return self._preflight(request, origin) if allowed else _origin_refused(origin)
            if not allowed and (request.method not in SAFE_METHODS
                                or request.path.startswith(GUARDED_PREFIXES)):
                return _origin_refused(origin)
        elif request.headers.get("Sec-Fetch-Site") in _OTHER_SITES and (
                request.method not in SAFE_METHODS
                or request.path.startswith(GUARDED_PREFIXES)) \
                and "*" not in self._config().allowed_origins:
            # No Origin, yet a browser's: another site's <img>, <script>, link or no-cors GET,
            # which carry none. Which site sent it is unknown, so no allowed origin vouches.
            return _origin_refused(f"another site (Sec-Fetch-Site: "
                                   f"{request.headers['Sec-Fetch-Site']})")
        return None

    def _preflight(self, request: web.Request, origin: str) -> web.Response:
        asked = request.headers.get("Access-Control-Request-Headers")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": asked or ALLOWED_HEADERS,
            "Access-Control-Max-Age": "600",
            "Vary": "Origin",
        })

    def add_cors(self, request: web.Request, response: web.StreamResponse) -> None:
        """An answer to an allowed origin says so (the browser lets the page read it)."""
        origin = self.cross_origin(request)
        if origin is not None and self.origin_allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
            response.headers.add("Vary", "Origin")


def _origin_refused(origin: str) -> web.Response:
    return error_response(403, f"requests from the web page at {origin[:100]!r} are refused: "
                          "add its origin to allowed_origins in the config to let it use "
                          "corral", kind="permission_error", code="origin_not_allowed")


def _hostname(host: str) -> str | None:
    """The name in a Host header, without its port (None: not a host at all)."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name, _, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
