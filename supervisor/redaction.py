"""The credentials corral sends, found in what comes back: some servers quote a key they refuse,
and their words go on to a client, the log or the admin API (proxy/redact.py for answers and
streams; the rpc peers' answers)."""

from __future__ import annotations

import json
from collections.abc import Mapping

REDACTED = b"[redacted]"
# Shorter values are no key (a scheme name, a placeholder) and would match ordinary text.
_SHORTEST = 8


def secrets_of(headers: Mapping[str, str]) -> list[bytes]:
    """The secret part of each header corral sends (`Authorization: Bearer <key>`: the key),
    as it is and as a JSON string quotes it (a `/` as `\\/`, as PHP's encoder writes it)."""
    found: dict[bytes, None] = {}
    for value in headers.values():
        secret = value.rpartition(" ")[2]
        if len(secret) >= _SHORTEST:
            quoted = json.dumps(secret)[1:-1]
            for form in (secret, quoted, quoted.replace("/", "\\/")):
                found[form.encode()] = None
    return list(found)


def without_secrets(payload: bytes, headers: Mapping[str, str]) -> bytes:
    """A whole upstream answer less the credentials in `headers` (the lease's)."""
    for secret in secrets_of(headers):
        if secret in payload:
            payload = payload.replace(secret, REDACTED)
    return payload
