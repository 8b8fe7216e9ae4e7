"""One running llama-server child's slots, as the prompt cache sees them.

llama-server's GET /slots tells how many tokens a slot holds, never which: corral pins every
chat and completion request to a slot itself (`id_slot`) and keeps the last request each slot
served. At a stop, the child's own /apply-template and /tokenize turn that request into the
tokens the slot holds, and the slot is saved with them. When a request lands on an empty slot
and a saved prefix of its own tokens exists, that file is restored into the slot first.

Neither step can make an answer wrong: llama-server compares the restored tokens with the new
prompt and reuses only their common prefix. Both are bounded in time and skipped on any error."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import structlog

from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.port import Lease, Restored
from corral.supervisor.prompt_cache.store import SUFFIX, Entry, fingerprint

if TYPE_CHECKING:
    from corral.supervisor.prompt_cache import PromptCache

log = structlog.get_logger("corral.prompt_cache")

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Request fields that are not the prompt: left out when corral asks the child for its tokens.
_NOT_PROMPT = ("id_slot", "stream", "stream_options", "n_probs", "max_tokens")


@dataclasses.dataclass(slots=True)
class Record:
    """The last request a slot served: what its KV cache begins with. Kept as it came (bytes
    or a dict) and parsed only when its tokens are needed (a restore, a save)."""

    path: str
    raw: bytes | dict[str, Any]
    tokens: list[int] | None = None  # known when a restore tokenized it already
    used: float = 0.0
    _body: dict[str, Any] | None = None

    def size(self) -> int:
        raw = self.raw
        return len(raw) if isinstance(raw, (bytes, bytearray)) else len(json.dumps(raw))

    @property
    def body(self) -> dict[str, Any]:
        """The request without the fields that are not its prompt."""
        if self._body is None:
            parsed = json.loads(self.raw) if isinstance(self.raw, (bytes, bytearray)) \
                else self.raw
            if not isinstance(parsed, dict):
                raise ValueError("the request body is not a JSON object")
            self._body = {k: v for k, v in parsed.items() if k not in _NOT_PROMPT}
        return self._body


def _conversation(path: str, body: dict[str, Any]) -> list[Any] | str | None:
    if path == CHAT:
        messages = body.get("messages")
        return messages if isinstance(messages, list) else None
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _shared(old: list[Any] | str, new: list[Any] | str) -> tuple[int, bool]:
    """(how much of `old` begins `new`, whether all of it does) for messages or text."""
    if type(old) is not type(new):
        return 0, False
    if isinstance(old, str):  # a completion prompt: only a continuation counts (C speed)
        return (len(old), True) if isinstance(new, str) and new.startswith(old) else (0, False)
    n = min(len(old), len(new))
    i = 0
    while i < n and old[i] == new[i]:
        i += 1
    return i, i == len(old)


class Slots:
    def __init__(self, cache: PromptCache, *, model: str, instance: str, spec: ModelSpec,
                 binary: str, base_url: str, headers: dict[str, str],
                 session: aiohttp.ClientSession):
        self._cache = cache
        self.model, self.instance, self.spec, self.binary = model, instance, spec, binary
        self._base, self._headers, self._session = base_url, headers, session
        self.records: list[Record | None] = [None] * spec.parallel
        self._leased: dict[int, Lease] = {}
        self._key: str | None = None
        self._log = log.bind(model=model, instance=instance)

    async def key(self) -> str:
        if self._key is None:
            self._key = await self._cache.cache_key(self.spec, self.binary)
        return self._key

    # -- requests ------------------------------------------------------------------------------

    async def pin(self, lease: Lease, url: str, body: Any,
                  parsed: dict[str, Any] | None = None) -> Any:
        # The relay's URL is this child's base and a path: split only what is not.
        rest = url[len(self._base):]
        path = rest if url.startswith(self._base) and rest[:1] == "/" else urlsplit(url).path
        if path not in (CHAT, COMPLETIONS):
            return body  # embeddings and the rest: no conversation to keep
        if len(self.records) == 1:
            # One slot: llama-server can use no other, so the body goes as it is (not parsed
            # on the hot path: only a restore or a save reads it).
            if 0 in self._leased:
                return body
            self._leased[0] = lease
            lease.slot = 0
            record = Record(path, body, used=time.monotonic())
            if self.records[0] is None:
                await self._restore(lease, 0, record)
            self.records[0] = record
            return body
        if parsed is None:
            try:
                parsed = json.loads(body) if isinstance(body, (bytes, bytearray)) else body
            except ValueError:
                return body  # the child answers that itself
        if not isinstance(parsed, dict):
            return body
        conversation = _conversation(path, parsed)
        free = [i for i in range(len(self.records)) if i not in self._leased]
        if conversation is None or not free:
            return body
        slot = self._choose(free, path, conversation)
        self._leased[slot] = lease
        lease.slot = slot
        record = Record(path, parsed, used=time.monotonic())
        if self.records[slot] is None:
            await self._restore(lease, slot, record)
        self.records[slot] = record
        if not isinstance(body, (bytes, bytearray)):
            return {**parsed, "id_slot": slot}
        if "id_slot" not in parsed:
            # The field goes in front of the object's first member, the body's bytes as they
            # are after it: no re-encoding (it cost 10 µs of a small chat's relay, more with
            # every message). The body parsed as a JSON object above: `{` is its first byte
            # after any whitespace, and a member follows (it has a conversation).
            start = body.index(b"{") + 1
            return b'{"id_slot":%d,' % slot + bytes(body[start:])
        # Compact, UTF-8 as it came: the body must not grow (\u escapes, spaces).
        return json.dumps({**parsed, "id_slot": slot}, ensure_ascii=False,
                          separators=(",", ":")).encode()

    def unpin(self, lease: Lease) -> None:
        if lease.slot is not None and self._leased.get(lease.slot) is lease:
            del self._leased[lease.slot]

    def _choose(self, free: list[int], path: str, conversation: list[Any] | str) -> int:
        """The slot this request continues (its last request is all a prefix of this one),
        else an empty one (a new conversation keeps the others' caches), else the one
        sharing most with it, else the least recently used."""
        best, best_len, whole = None, 0, False
        for i in free:
            rec = self.records[i]
            old = _conversation(rec.path, rec.body) if rec is not None else None
            if old is None or rec is None or rec.path != path:
                continue
            shared, all_of_it = _shared(old, conversation)
            if (all_of_it, shared) > (whole, best_len) and shared > 0:
                best, best_len, whole = i, shared, all_of_it
        if best is not None and whole:
            return best
        empty = next((i for i in free if self.records[i] is None), None)
        if empty is not None:
            return empty
        if best is not None:
            return best
        return min(free, key=lambda i: r.used if (r := self.records[i]) else 0.0)

    # -- the child's words -----------------------------------------------------------------------

    async def _post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        async with self._session.post(self._base + path, json=payload,
                                      headers=self._headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def tokens(self, record: Record) -> list[int]:
        """The tokens llama-server makes of the request: its chat template applied, then
        tokenized as a completion prompt is (special tokens added and parsed)."""
        if record.tokens is not None:
            return record.tokens
        if record.path == CHAT:
            status, data = await self._post("/apply-template", record.body)
            if status != 200 or not isinstance(data.get("prompt"), str):
                raise RuntimeError(f"/apply-template answered {status}")
            prompt = data["prompt"]
        else:
            prompt = record.body["prompt"]
        status, data = await self._post("/tokenize", {"content": prompt, "add_special": True,
                                                      "parse_special": True})
        tokens = data.get("tokens") if status == 200 and isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise RuntimeError(f"/tokenize answered {status}")
        record.tokens = tokens
        return tokens

    # -- restore -------------------------------------------------------------------------------

    async def _restore(self, lease: Lease, slot: int, record: Record) -> None:
        """Into the empty `slot`: the saved file that shares the longest prefix with this
        request, if one does. Bounded by restore_timeout; any doubt, any error: skipped."""
        cache, store = self._cache, self._cache.store
        if not self.spec.prompt_cache or not store.entries:
            return
        settings = cache.settings()
        began = time.monotonic()
        entry: Entry | None = None
        try:
            async with asyncio.timeout(settings.restore_timeout):
                key = await self.key()
                if not store.has_key(key):
                    return
                tokens = await self.tokens(record)
                found = store.best(key, tokens, settings.min_tokens)
                if found is None:
                    store.counters.misses += 1
                    return
                entry, shared = found
                problem = await asyncio.to_thread(store.check, entry)
                if problem is not None:
                    store.drop(entry, problem)
                    store.counters.misses += 1
                    return
                status, data = await self._post(f"/slots/{slot}?action=restore",
                                                {"filename": entry.file})
        except Exception as exc:
            store.counters.misses += 1
            self._log.warning("prompt_cache.restore_skipped", slot=slot,
                              error=str(exc) or type(exc).__name__)
            return
        if status != 200:
            # The child refused the file (its own check of the header and sizes).
            store.drop(entry, f"llama-server refused it: {str(data)[:200]}")
            store.counters.misses += 1
            return
        seconds = time.monotonic() - began
        store.used(entry, shared)
        lease.restored = Restored(tokens=shared, seconds=seconds)
        self._log.info("prompt_cache.restored", slot=slot, file=entry.file, tokens=shared,
                       ms=round(seconds * 1000, 1))
        cache.events.publish("prompt_cache_restored", model=self.model, instance=self.instance,
                             slot=slot, file=entry.file, tokens=shared,
                             seconds=round(seconds, 4))

    # -- save ----------------------------------------------------------------------------------

    async def save_all(self) -> None:
        """At a stop, before the child goes: every idle slot holding at least min_tokens is
        saved. Bounded by save_timeout and never raises: a stop must never hang on it."""
        settings = self._cache.settings()
        # A request whose body is shorter than half of min_tokens in bytes cannot have filled
        # a slot with min_tokens tokens (a token is a byte of text or more, and the template
        # adds a few dozen): not worth asking the child, which may be the one not answering.
        todo = [i for i, r in enumerate(self.records) if r is not None and i not in self._leased
                and r.size() * 2 >= settings.min_tokens]
        if not todo or not self.spec.prompt_cache or not settings.enabled:
            return
        try:
            async with asyncio.timeout(settings.save_timeout):
                # A child that does not say what its slots hold within a health probe's
                # time is not asked to write them either.
                async with asyncio.timeout(self.spec.health_timeout), \
                        self._session.get(self._base + "/slots", headers=self._headers) as resp:
                    listing = await resp.json(content_type=None)
                held = {s.get("id"): s.get("n_prompt_tokens", 0) for s in listing
                        if isinstance(s, dict)} if isinstance(listing, list) else {}
                for slot in todo:
                    n = int(held.get(slot) or 0)
                    if n < settings.min_tokens:
                        continue
                    room = self._cache.store.room_for(await self.key(), n)
                    if room is not None:
                        self._log.info("prompt_cache.save_skipped", slot=slot, tokens=n,
                                       reason=room)
                        continue
                    try:
                        await self._save(slot)
                    except (ValueError, RuntimeError, OSError, aiohttp.ClientError) as exc:
                        self._log.warning("prompt_cache.save_skipped", slot=slot,
                                          error=str(exc) or type(exc).__name__)
        except Exception as exc:
            self._log.warning("prompt_cache.save_cut_short", error=str(exc) or type(exc).__name__,
                              timeout=settings.save_timeout)

    async def _save(self, slot: int) -> None:
        record = self.records[slot]
        assert record is not None
        tokens = await self.tokens(record)
        key = await self.key()
        name = f"{secrets.token_hex(12)}{SUFFIX}"
        began = time.monotonic()
        status, data = await self._post(f"/slots/{slot}?action=save", {"filename": name})
        if status != 200 or not isinstance(data, dict):
            raise RuntimeError(f"slot {slot}: save answered {status}: {str(data)[:200]}")
        store = self._cache.store
        size, digest = await asyncio.to_thread(fingerprint, store.dir / name)
        now = time.time()
        store.add(Entry(file=name, key=key, model=self.model, tokens=tokens,
                        n_tokens=int(data.get("n_saved") or len(tokens)), bytes=size,
                        fingerprint=digest, saved_at=now, last_used=now))
        seconds = time.monotonic() - began
        self._log.info("prompt_cache.saved", slot=slot, file=name, tokens=len(tokens),
                       bytes=size, ms=round(seconds * 1000, 1))
        self._cache.events.publish("prompt_cache_saved", model=self.model,
                                   instance=self.instance, slot=slot, file=name,
                                   tokens=len(tokens), bytes=size, seconds=round(seconds, 4))
