"""The credentials corral sends upstream, kept out of what an upstream sends back: some servers
quote a key they refuse, in a whole error answer or in an error event of a stream they already
began, and their words go on to the client and into the log."""

from __future__ import annotations

from collections.abc import Iterable

# The credentials' own search, shared with the supervisor (a peer's answer in its log).
from corral.supervisor.redaction import REDACTED, secrets_of, without_secrets

__all__ = ["REDACTED", "StreamRedactor", "secrets_of", "without_secrets"]


class StreamRedactor:
    """The same for a stream, whose chunks may cut a key anywhere: a chunk's end that could be
    the start of a key is held back until the next chunk says whether it is one. An event
    stream's chunks end in a blank line, which no key starts, so in practice nothing is held."""

    __slots__ = ("_held", "_secrets")

    def __init__(self, secrets: Iterable[bytes]):
        self._secrets = [s for s in secrets if s]
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk if self._held else chunk
        for secret in self._secrets:
            if secret in data:
                data = data.replace(secret, REDACTED)
        keep = self._partial(data)
        self._held = data[len(data) - keep:] if keep else b""
        return data[:len(data) - keep] if keep else data

    def flush(self) -> bytes:
        """What was held back, at the stream's end (no key followed it)."""
        held, self._held = self._held, b""
        return held

    def _partial(self, data: bytes) -> int:
        """The length of the longest end of `data` that some key starts with, short of it."""
        longest = 0
        for secret in self._secrets:
            window = len(secret) - 1
            start = max(0, len(data) - window)
            at = data.find(secret[:1], start)
            while at >= 0:
                if secret.startswith(data[at:]):
                    longest = max(longest, len(data) - at)
                    break
                at = data.find(secret[:1], at + 1)
        return longest
