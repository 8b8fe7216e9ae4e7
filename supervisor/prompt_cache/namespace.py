"""Whose conversation a save is: a namespace per API key, so one key's saves are never
restored, matched or reused for another (docs/memory.md, "Per key").

The proxy names the caller by its key (`supervisor.port.CALLER`: a digest of the key that
authenticated the request, never the key itself). The namespace kept in the index on disk is
an HMAC-SHA256 of that name under a random salt kept beside the cache (`namespace.salt`,
0600): the index alone tells nobody which key made which file, nor lets anyone check a
guessed key against it. No keys configured: no caller, the one namespace "", as before
namespaces existed (saves made then stay usable)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

SALT = "namespace.salt"
_SALT_BYTES = 32
# Hex characters of the HMAC kept: 96 bits, far past any chance of two keys colliding.
_CHARS = 24


def load_salt(folder: Path) -> bytes:
    """The dir's salt, made once. Two daemons on one dir must agree on it: the salt is
    written whole to a temporary name and linked into place, which fails when another daemon
    linked its own first (then that one is read)."""
    path = folder / SALT
    try:
        salt = path.read_bytes()
        if len(salt) == _SALT_BYTES:
            return salt
        path.unlink()  # cut short or edited: a new salt (the old saves are unreadable anyway)
    except FileNotFoundError:
        pass
    tmp = folder / f".{SALT}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(_SALT_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()


class Namespaces:
    """Caller names to namespaces, under the dir's salt (one HMAC per key, then remembered)."""

    def __init__(self, folder: Path):
        self._salt = load_salt(folder)
        self._known: dict[str, str] = {}

    def of(self, caller: str | None) -> str:
        if not caller:
            return ""
        found = self._known.get(caller)
        if found is None:
            if len(self._known) > 4096:  # keys come from the config: a reload may replace them
                self._known.clear()
            digest = hmac.new(self._salt, caller.encode(), hashlib.sha256).hexdigest()
            found = self._known[caller] = digest[:_CHARS]
        return found

    def keyed(self, *parts: str) -> str:
        """An HMAC-SHA256 (hex) of `parts` under the dir's salt: a secret of corral's for
        each caller (salt.py's cache_salt), which nobody without the salt can compute."""
        return hmac.new(self._salt, "\0".join(parts).encode(), hashlib.sha256).hexdigest()
