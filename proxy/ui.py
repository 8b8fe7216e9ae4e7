"""GET / and GET /ui: the status page, one static HTML file (proxy/static/status.html) with its
CSS and JavaScript inline. The page holds no data and is public; it reads the admin API with
the key the operator types, so it sees exactly what that key may see."""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from aiohttp import web

PAGE = "static/status.html"
PATHS = ("/", "/ui")

# Every other answer is data (JSON, an event stream, a child's answer relayed), never a page:
# a browser that was somehow led to show one as a document (a child that answers text/html,
# a sniffed type) runs nothing from it, fetches nothing, and cannot be framed.
_DATA_POLICY = "default-src 'none'; frame-ancestors 'none'; sandbox"


def csp_hashes(page: str, tag: str) -> list[str]:
    """CSP sources allowing exactly the inline <script> or <style> blocks of `page`: a hash
    rather than 'unsafe-inline', so injected markup could run nothing even if some slipped
    in. Browsers hash the text as parsed, with CRLF already turned into LF."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page.replace("\r\n", "\n"), re.DOTALL)
    return [f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
            for b in blocks]


def content_security_policy(page: str) -> str:
    return "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(csp_hashes(page, "script")),
        "style-src " + " ".join(csp_hashes(page, "style")),
        "connect-src 'self'",  # the admin API and its event stream, nowhere else
        "img-src data:",  # the empty favicon, which spares a 404 per load
        "base-uri 'none'",
        "form-action 'none'",  # the key form is handled in script, never submitted
        "frame-ancestors 'none'",  # no clickjacking of the load/unload buttons
    ])


def guard_answer(request: web.Request, response: web.StreamResponse) -> None:
    """The headers of every answer but the page's own (which sets stricter ones of its own):
    called as its head is prepared (proxy/app.py), so a relayed child's headers are overridden."""
    if request.path in PATHS and request.method in ("GET", "HEAD"):
        return
    headers = response.headers
    headers["X-Content-Type-Options"] = "nosniff"
    headers["Content-Security-Policy"] = _DATA_POLICY
    if request.path.startswith("/admin"):
        # What runs, the config, the logs: never kept in a browser's cache or a proxy's,
        # where the next user of the machine (or of the proxy) could read it without a key.
        headers["Cache-Control"] = "no-store"


def add_routes(app: web.Application) -> None:
    # Read once per app: the file ships in the package (package-data), and a changed page
    # needs a restart like any other code.
    body = resources.files("corral.proxy").joinpath(PAGE).read_bytes()
    headers = {
        "Content-Type": "text/html; charset=utf-8",
        # Revalidated on every load: an upgraded corral never runs yesterday's script.
        "Cache-Control": "no-cache",
        "Content-Security-Policy": content_security_policy(body.decode()),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=body, headers=headers)

    for path in PATHS:
        app.router.add_get(path, page)
