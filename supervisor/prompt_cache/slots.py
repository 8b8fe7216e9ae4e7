"""One running llama-server child's slots, as the prompt cache sees them.

llama-server's GET /slots tells how many tokens a slot holds, never which: corral pins every
chat, completion and Responses request to a slot itself (`id_slot`) and keeps the last request
each slot served (which slot a request goes to: choice.py; a Responses request's slot is kept
for its key, never saved: choice.SAVED). Once the child is idle, and at its stop, the
child's own /apply-template and /tokenize turn that request into the tokens the slot holds,
and the slot is saved with them (saver.py). When a request lands on an empty slot and a saved
prefix of its own tokens exists, that file is restored into the slot first, and the answer's
`timings.cache_n` then tells whether the child reused it (`verify`).

Neither step can make an answer wrong: llama-server compares the restored tokens with the new
prompt and reuses only their common prefix. Both are bounded in time and skipped on any error.

Every request is its caller's (the API key's namespace, namespace.py): it is restored only from
its own namespace's files, matched only to slots its own namespace used last, and a slot that
may hold another namespace's KV is erased in the child before it serves it (docs/memory.md,
"Per key")."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import structlog

from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.errors import QueueTimeout, SlotNotCleared
from corral.supervisor.json_bytes import compact
from corral.supervisor.port import Lease, Restored
from corral.supervisor.prompt_cache.choice import (
    CHAT,
    COMPLETIONS,
    PINNED,
    SAVED,
    SLOTLESS,
    Choice,
    Record,
    conversation,
)
from corral.supervisor.prompt_cache.gate import NamespaceGate
from corral.supervisor.prompt_cache.identity import Setup
from corral.supervisor.prompt_cache.saver import Saver
from corral.supervisor.prompt_cache.store import Entry

if TYPE_CHECKING:
    from corral.supervisor.prompt_cache import PromptCache

__all__ = ["Record", "Slots"]

log = structlog.get_logger("corral.prompt_cache")

# A restore counts as reused when the child's answer says it took at least this share of the
# restored tokens from its cache (`timings.cache_n`). Never all of them: llama-server
# evaluates the prompt's last token again, and a model with sliding-window or recurrent
# layers goes back to its last checkpoint. The failure seen (llama.cpp #26676, #25913) is all
# or nothing: a cache_n of 0 or a handful after a restore of thousands.
REUSED_SHARE = 0.5


class Slots:
    def __init__(self, cache: PromptCache, *, model: str, instance: str, spec: ModelSpec,
                 setup: Setup, base_url: str, headers: dict[str, str],
                 session: aiohttp.ClientSession, busy: Callable[[], bool] = lambda: False,
                 live: Callable[[], ModelSpec] | None = None):
        self._cache = cache
        self.model, self.instance, self.spec = model, instance, spec
        # The model's spec now: a reload changes its queue limits at once, not `spec` (the
        # one the child started with, whose KV layout its slots hold).
        self._live = live or (lambda: self.spec)
        self.setup = setup  # taken at the child's spawn: its saves are under it for life
        self._stale = False  # a file of its setup was replaced under it: no more restores
        self._base, self._headers, self._session = base_url, headers, session
        self._choice = Choice(spec.parallel)
        self.records = self._choice.records  # each slot's last request (None: empty)
        self.unsure = self._choice.unsure  # slots an unpinned request may have taken
        self._unpinned: dict[Lease, str] = {}  # such requests in flight, and their namespaces
        self._leased: dict[int, Lease] = {}
        # Leased slots taken from another namespace, and whether their erase is done (True),
        # under way, or failed or cut short (False): idle in the child with another's KV until
        # it is, though leased to the caller's own (a /v1/messages request must not go then).
        self._clearing: dict[int, asyncio.Future[bool]] = {}
        self._gate = NamespaceGate()  # whose generations may be at the child together
        self._namespaces: set[str] = set()  # whose requests this child has served
        self._log = log.bind(model=model, instance=instance)
        self.saver = Saver(self, cache, busy, self._log)

    @property
    def cache(self) -> PromptCache:
        return self._cache

    def leased(self, slot: int) -> bool:
        return slot in self._leased

    async def key(self) -> str:
        return self.setup.key

    def replaced(self) -> bool:
        """Whether a file the child maps was replaced since its spawn (one stat a file): its
        KV then no longer matches what the path holds, so it restores nothing more. Said
        once, in the log and as an event."""
        if self._stale:
            return True
        changed = self.setup.replaced()
        if changed is None:
            return False
        self._stale = True
        self._log.warning("prompt_cache.model_replaced", file=changed.path,
                          restores_off=True)
        self._cache.events.publish("prompt_cache_model_replaced", model=self.model,
                                   instance=self.instance, file=changed.path)
        return True

    # -- requests ------------------------------------------------------------------------------

    async def pin(self, lease: Lease, url: str, body: Any,
                  parsed: dict[str, Any] | None = None, caller: str | None = None) -> Any:
        """`caller`: who sent it (supervisor.port.CALLER): its namespace decides which saves
        and which slots' KV it may use."""
        # A request for this child: an idle save not yet sent to it waits for the next idle
        # time; a file the child is writing is finished first (it would make the request
        # wait for it anyway, once the save is in its queue).
        writing = self.saver.request_came()
        if writing is not None:
            await asyncio.wait([writing])  # not cancelled with this request
        # The relay's URL is this child's base and a path: split only what is not.
        rest = url[len(self._base):]
        path = rest if url.startswith(self._base) and rest[:1] == "/" else urlsplit(url).path
        namespace = self._cache.namespaces.of(caller)
        if namespace not in self._namespaces:
            self._namespaces.add(namespace)
        if path in _GENERATIONS:
            turn = self._gate.enter(lease, namespace, path in _IGNORES_CACHE_PROMPT)
            if turn is not None:
                await self._wait_turn(lease, turn, path)
        if path not in PINNED:
            # No conversation to keep, no id_slot.
            return self._astray(lease, path, await self._shared(path, body, namespace),
                                namespace)
        choice = self._choice
        if len(self.records) == 1:
            # One slot: llama-server can use no other, so the body goes as it is (not parsed
            # on the hot path: only a restore or a save reads it).
            if 0 in self._leased:
                # Runs there once the other is done.
                return self._astray(lease, path, await self._shared(path, body, namespace),
                                    namespace)
            self._leased[0] = lease
            lease.slot = 0
            record = Record(path, body, used=time.monotonic(), namespace=namespace)
            foreign = choice.foreign(0, namespace)
            empty = self.records[0] is None or 0 in self.unsure
            choice.take(0, record)
            if (empty or foreign) and not await self._ready(lease, 0, record, foreign):
                return _without_reuse(body, None)
            return body
        if parsed is None:
            parsed = _object_of(body)
        if not isinstance(parsed, dict):
            return body  # not a JSON object: the child answers that itself
        conv = conversation(path, parsed)
        slot = choice.choose(path, conv, namespace) if conv is not None else None
        if slot is None:
            # A prompt array, token ids, every slot leased: the child picks the slot.
            return self._astray(lease, path, await self._shared(path, body, namespace, parsed),
                                namespace)
        self._leased[slot] = lease
        lease.slot = slot
        record = Record(path, parsed, used=time.monotonic(), namespace=namespace)
        foreign = choice.foreign(slot, namespace)
        # An unsure slot may hold another request's KV: restored like an empty one.
        empty = self.records[slot] is None or slot in self.unsure
        choice.take(slot, record, conv)  # leased: no other request gets it while it restores
        if (empty or foreign) and not await self._ready(lease, slot, record, foreign):
            return _without_reuse(body, parsed, slot)
        if not isinstance(body, (bytes, bytearray)):
            return {**parsed, "id_slot": slot}
        if "id_slot" not in parsed:
            # The field goes in front of the object's first member, the body's bytes as they
            # are after it: no re-encoding (it cost 10 µs of a small chat's relay, more with
            # every message). The body parsed as a JSON object above: `{` is its first byte
            # after any whitespace, and a member follows (it has a conversation).
            start = body.index(b"{") + 1
            return b'{"id_slot":%d,' % slot + bytes(body[start:])
        return compact({**parsed, "id_slot": slot})  # the body must not grow

    async def _ready(self, lease: Lease, slot: int, record: Record, foreign: bool) -> bool:
        """The taken `slot` made ready for `record`: erased first when it may hold another
        namespace's KV (`foreign`), or this request would reuse the prefix it shares with it
        (a faster answer, and `timings.cache_n` would say how much); then the caller's own
        save restored into it, if one matches. False: the erase failed (the request must go
        with `cache_prompt: false`)."""
        try:
            if foreign and not await self._cleared(slot):
                # The request goes with cache_prompt false, and the child may never run it
                # (a 400, a hang-up): the slot may still hold the other's KV, whoever's
                # request comes next (`_unknown`: erased first).
                self._choice.take(slot, _unknown(record.path))
                self.unsure.add(slot)
                return False
            await self._restore(lease, slot, record)
        except BaseException:
            # Cancelled (the client hung up): the request never reaches the child, but the
            # erase or the restore may have: the slot's KV is nobody's the next request can
            # trust (erased before any reuse), and never saved under this request's tokens.
            self._choice.take(slot, _unknown(record.path))
            self.unsure.add(slot)
            raise
        return True

    async def _cleared(self, slot: int) -> bool:
        """The leased `slot` erased (`_erase`), what came of it told to `_shared` meanwhile."""
        clearing = self._clearing[slot] = asyncio.get_running_loop().create_future()
        erased = False
        try:
            erased = await self._erase(slot)
        finally:
            clearing.set_result(erased)
            if erased and self._clearing.get(slot) is clearing:
                del self._clearing[slot]
        return erased

    async def _wait_turn(self, lease: Lease, turn: asyncio.Future[None], path: str) -> None:
        """Until the gate lets this request in (gate.py: a /v1/messages request and another
        caller's requests are never at the child together), within the model's queue_timeout
        (the wait is one for the child, as a wait for a slot is)."""
        began = time.monotonic()
        limit = self._live().queue_timeout
        self._log.info("prompt_cache.waiting_for_other_callers", path=path,
                       waiting=self._gate.waiting())
        try:
            async with asyncio.timeout(limit):
                await turn
        except BaseException as exc:
            self._gate.leave(lease)  # its place in the line, or what it was let in to
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(
                    f"{self.instance}: other API keys' requests held the model within "
                    f"{limit:g}s (queue_timeout); a /v1/messages request "
                    "waits for them (docs/memory.md, per key)") from None
            raise
        waited = time.monotonic() - began
        self._log.info("prompt_cache.waited_for_other_callers", path=path,
                       ms=round(waited * 1000, 1))
        self._cache.events.publish("prompt_cache_key_wait", model=self.model,
                                   instance=self.instance, path=path,
                                   seconds=round(waited, 4))

    async def _shared(self, path: str, body: Any, namespace: str,
                      parsed: dict[str, Any] | None = None) -> Any:
        """An unpinned request: llama-server puts it on the idle slot whose prompt is most
        like it, maybe another namespace's. With several namespaces on this child, a
        generation goes with `cache_prompt: false`; where llama-server ignores that field
        (/v1/messages), the idle slots that may hold another namespace's KV are erased first,
        so the one it picks holds the caller's own or nothing (theirs is lost to them)."""
        if len(self._namespaces) < 2 or path not in _GENERATIONS:
            return body
        if path in _IGNORES_CACHE_PROMPT:
            # No other caller's request is at the child now (the gate): every slot another
            # may have used is idle, and erased here. A slot leased now is the caller's own
            # namespace's, its KV too once the erase its request made is done: until then
            # (or when that erase failed, or was cut short) it is idle in the child with
            # another's KV, and this request could land on it.
            for slot in range(len(self.records)):
                clearing = self._clearing.get(slot)
                if slot in self._leased:
                    if clearing is None or await asyncio.shield(clearing):
                        continue
                elif not self._choice.foreign(slot, namespace):
                    continue
                if not await self._erase(slot):
                    # It would land on that slot, maybe, and reuse what it holds.
                    raise SlotNotCleared(
                        f"{self.model}: another caller's cached prompt could not be cleared "
                        "from the slot this request may land on; try again")
                if slot not in self._leased:
                    self._choice.forget(slot)  # nothing left of it to save or match
                elif clearing is not None and self._clearing.get(slot) is clearing:
                    del self._clearing[slot]  # erased here: nothing of another's left
        return _without_reuse(body, parsed)

    async def _erase(self, slot: int) -> bool:
        """Another namespace's KV out of `slot` (`POST /slots/N?action=erase`), within
        restore_timeout. False: not erased (the request then goes with `cache_prompt: false`)."""
        try:
            async with asyncio.timeout(self._cache.settings().restore_timeout):
                status, _ = await self.post(f"/slots/{slot}?action=erase", {})
        except Exception as exc:
            self._log.warning("prompt_cache.erase_skipped", slot=slot,
                              error=str(exc) or type(exc).__name__)
            return False
        if status != 200:
            self._log.warning("prompt_cache.erase_skipped", slot=slot, status=status)
            return False
        self._log.info("prompt_cache.slot_erased", slot=slot)
        return True

    def unpin(self, lease: Lease) -> None:
        self._gate.leave(lease)
        if lease.slot is not None and self._leased.get(lease.slot) is lease:
            del self._leased[lease.slot]
            self._clearing.pop(lease.slot, None)
            self._choice.release(lease.slot)
            if self._unpinned:
                # A request waiting for any slot (llama-server's queue) gets this one next.
                self._choice.suspect(lease.slot, self._unpinned.values())
        elif lease in self._unpinned:
            # Done on a slot of the child's choosing (any given back while it waited was
            # suspected then): what it left there is its namespace's.
            self._choice.doubt(self._unpinned.pop(lease))
        # Any request's end (one that had no slot too: it put the debounce off all the same).
        self.saver.turn_ended()

    def refused(self, lease: Lease) -> None:
        """The child answered the lease's request with an error, or never answered it: its
        slot holds what it held before (or a prompt cut short), not that request. Unsure until
        a request is pinned there again: never saved under the refused request's tokens
        (Saver.changed). Its KV is the caller's own or nothing (another's was erased before
        it was sent)."""
        slot = lease.slot
        if slot is not None and self._leased.get(slot) is lease:
            self.unsure.add(slot)

    def _astray(self, lease: Lease, path: str, body: Any, namespace: str) -> Any:
        """`body` goes to the child without an id_slot: llama-server gives it whichever idle
        slot it likes (/v1/messages and /v1/embeddings ignore id_slot; a prompt array has
        no conversation to match; every slot may be leased). The
        slots it may take are unsure until corral pins a request to them again: never saved
        under their last conversation's tokens (the file would hold another request's KV
        and supersede that conversation's genuine one)."""
        if path not in SLOTLESS:
            self._choice.doubt(namespace)
            self._unpinned[lease] = namespace
        return body

    def close(self) -> None:
        """The child is going (or gone): no idle save begins any more."""
        self.saver.close()

    async def save_all(self, until: float | None = None) -> None:
        """At a stop, before the child goes (Saver.at_stop), by `until` when given: never
        raises."""
        await self.saver.at_stop(until)

    # -- the child's words -----------------------------------------------------------------------

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        async with self._session.post(self._base + path, json=payload,
                                      headers=self._headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def listing(self) -> Any:
        async with self._session.get(self._base + "/slots", headers=self._headers) as resp:
            return await resp.json(content_type=None)

    async def tokens(self, record: Record) -> list[int]:
        """The tokens llama-server makes of the request: its chat template applied, then
        tokenized as a completion prompt is (special tokens added and parsed)."""
        if record.tokens is not None:
            return record.tokens
        if record.path == CHAT:
            status, data = await self.post("/apply-template", record.body)
            if status != 200 or not isinstance(data.get("prompt"), str):
                raise RuntimeError(f"/apply-template answered {status}")
            prompt = data["prompt"]
        else:
            prompt = record.body["prompt"]
        status, data = await self.post("/tokenize", {"content": prompt, "add_special": True,
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
        if not self.spec.prompt_cache or not store.entries or record.path not in SAVED:
            return
        settings = cache.settings()
        began = time.monotonic()
        entry: Entry | None = None
        try:
            async with asyncio.timeout(settings.restore_timeout):
                key = await self.key()
                # Only the caller's own saves: another key's are not there for it.
                namespace = record.namespace
                if not store.has_key(key, namespace) or key in store.off or self.replaced():
                    return
                if record.body.get("cache_prompt") is False:
                    return  # the child is asked not to reuse its cache: nothing to restore
                if not store.may_match(key, record.head, namespace):
                    # No file of this setup began as this request does: not one can share
                    # a file's worth with it, and the child is not asked for its tokens.
                    store.counters.misses += 1
                    return
                tokens = await self.tokens(record)
                found = store.best(key, tokens, settings.min_tokens, namespace)
                if found is None:
                    store.counters.misses += 1
                    return
                entry, shared = found
                problem = await asyncio.to_thread(store.check, entry)
                if problem is not None:
                    store.drop(entry, problem)
                    store.counters.misses += 1
                    return
                status, data = await self.post(f"/slots/{slot}?action=restore",
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
        lease.restored = Restored(tokens=shared, seconds=seconds, file=entry.file, key=key)
        self._log.info("prompt_cache.restored", slot=slot, file=entry.file, tokens=shared,
                       ms=round(seconds * 1000, 1))
        cache.events.publish("prompt_cache_restored", model=self.model, instance=self.instance,
                             slot=slot, file=entry.file, tokens=shared,
                             seconds=round(seconds, 4))

    def verify(self, restored: Restored, cache_n: int | None) -> None:
        """The child's answer to a request whose slot was restored said it took `cache_n`
        prompt tokens from its cache: a restore it did not reuse (llama.cpp can load a file
        and then prefill everything again) is a miss, an event, and no more restores of
        that setup (each costs a file's read and gains nothing)."""
        if cache_n is None or cache_n >= restored.tokens * REUSED_SHARE:
            return
        store = self._cache.store
        first = restored.key not in store.off
        store.restore_unused(restored.key, f"{restored.file}: {cache_n} of "
                                           f"{restored.tokens} restored tokens reused")
        self._log.warning("prompt_cache.restore_unused", file=restored.file,
                          tokens=restored.tokens, cache_n=cache_n, restores_off=first)
        self._cache.events.publish("prompt_cache_restore_unused", model=self.model,
                                   instance=self.instance, file=restored.file,
                                   tokens=restored.tokens, cache_n=cache_n)


# Where an unpinned request reuses the child's KV (llama-server's prompt cache): its
# generations. Embeddings, rerank and the rest are left as sent.
_GENERATIONS = frozenset({CHAT, COMPLETIONS, "/v1/messages", "/v1/responses", "/completion",
                          "/completions", "/chat/completions", "/infill"})
# Of those, where llama-server takes neither `id_slot` nor `cache_prompt` (seen on its
# Anthropic-shaped endpoint: `cache_read_input_tokens` the same with `cache_prompt: false`).
_IGNORES_CACHE_PROMPT = frozenset({"/v1/messages"})
# A slot whose KV corral cannot vouch for (a restore or an erase cut off by a hang-up): a
# namespace nobody has, so the next request, whoever's, erases it first. Never saved (unsure
# until a request is pinned there again).
_UNKNOWN = "\0unknown"


def _unknown(path: str) -> Record:
    return Record(path, b"{}", namespace=_UNKNOWN)


def _object_of(body: Any) -> dict[str, Any] | None:
    """The request body as a JSON object (None: it is not one)."""
    try:
        parsed = json.loads(body) if isinstance(body, (bytes, bytearray)) else body
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _without_reuse(body: Any, parsed: dict[str, Any] | None, slot: int | None = None) -> Any:
    """The body with `cache_prompt: false` (and `id_slot`): the child reuses nothing of what
    the slot held. `parsed`: `body` parsed already, when the caller has it."""
    if parsed is not None and parsed and isinstance(body, (bytes, bytearray)) \
            and "cache_prompt" not in parsed and (slot is None or "id_slot" not in parsed):
        # The fields in front of the object's first member, the rest as it came (as pin
        # adds id_slot): nothing re-encoded.
        start = body.index(b"{") + 1
        head = b'{"cache_prompt":false,' if slot is None \
            else b'{"cache_prompt":false,"id_slot":%d,' % slot
        return head + bytes(body[start:])
    if parsed is None:
        parsed = _object_of(body)
        if parsed is None:
            return body  # the child refuses it itself
    changed = {**parsed, "cache_prompt": False}
    if slot is not None:
        changed["id_slot"] = slot
    if not isinstance(body, (bytes, bytearray)):
        return changed
    return compact(changed)
