"""Each API key's own prefix cache in a vLLM child: `cache_salt`.

vLLM reuses the KV of any earlier prompt that begins as a new one does (automatic prefix
caching, on by default), whoever sent it: with several keys on one child, a key could tell
from how fast its answer starts whether another key sent a prompt beginning the same way,
token by token (the attack vLLM's `cache_salt` exists for). corral keeps each key's prefixes
apart as it does for llama-server (docs/memory.md, "Per key"): every generation it sends to a
vLLM child carries a `cache_salt` of the caller's own, an HMAC of the key's name under the
prompt cache's secret salt (namespace.py), so no client can guess another's. A client's own
`cache_salt` is kept, within its key: hashed with the key's salt, never replacing it (else a
client could share another's by naming it). No keys configured: one caller, nothing sent.
A vLLM too old to know the field ignores it (with a warning in its log)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from corral.supervisor.json_bytes import compact
from corral.supervisor.prompt_cache.namespace import Namespaces

# Where vLLM takes `cache_salt` (its chat, completions, Responses and Anthropic protocols).
SALTED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                    "/v1/messages"})
FIELD = "cache_salt"


class PrefixSalts:
    def __init__(self, namespaces: Namespaces):
        self._namespaces = namespaces
        self._known: dict[str, bytes] = {}  # caller → its salt as a JSON string's bytes

    def salt(self, caller: str, theirs: str | None = None) -> str:
        """The caller's salt (64 hex characters: what vLLM takes, at most 128 and none of
        `@ / \\`), or that of the client's own salt within it."""
        return self._namespaces.keyed("cache_salt", caller, *(() if theirs is None else
                                                              (theirs,)))

    def apply(self, url: str, body: Any, parsed: dict[str, Any] | None,
              caller: str | None) -> Any:
        """`body` (bytes or a dict) with the caller's `cache_salt`, for a generation path;
        as it is otherwise (no keys, another path, not a JSON object: the child answers)."""
        if not caller or urlsplit(url).path not in SALTED:
            return body
        if isinstance(body, (bytes, bytearray)):
            if parsed is None:
                try:
                    parsed = json.loads(body)
                except ValueError:
                    return body
            if not isinstance(parsed, dict):
                return body
            if FIELD not in parsed:  # as parsed: a name written with escapes is the same
                # In front of the object's first member, the body's bytes as they are after
                # it: no re-encoding of a long prompt.
                start = body.index(b"{") + 1
                comma = b"," if parsed else b""
                return b'{"cache_salt":' + self._quoted(caller) + comma + bytes(body[start:])
            return compact(self._salted(parsed, caller))
        if isinstance(body, dict):
            return self._salted(body, caller)
        return body

    def _quoted(self, caller: str) -> bytes:
        quoted = self._known.get(caller)
        if quoted is None:
            if len(self._known) > 4096:  # keys come from the config: a reload may replace them
                self._known.clear()
            quoted = self._known[caller] = json.dumps(self.salt(caller)).encode()
        return quoted

    def _salted(self, body: dict[str, Any], caller: str) -> dict[str, Any]:
        theirs = body.get(FIELD)
        own = self.salt(caller, theirs if isinstance(theirs, str) else
                        None if theirs is None else json.dumps(theirs))
        return {**body, FIELD: own}
