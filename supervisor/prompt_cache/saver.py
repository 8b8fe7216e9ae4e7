"""When a child's slots are written to disk: while it is idle, and what is left at its stop.

A save of a long conversation takes seconds (2.9 GB for 15,800 tokens on an H100). Made at a
stop, it sat on the next model's start path (an eviction waits for it). So a slot is saved
once its turn is over and the child has had no request for `idle_save_after` seconds; the
stop then writes only the slots that changed since (usually none), after waiting for an
idle save under way.

One save at a time per child. A request that comes while an idle save is being prepared
(the slots listed, the request tokenized) cancels it; one that comes while the child writes
the file waits for it (llama-server does one thing at a time), and the rest of that save's
slots wait for the next idle time. Each slot remembers the request it was last saved with:
a slot that served nothing since is never written again."""

from __future__ import annotations

import asyncio
import contextvars
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from corral.supervisor.prompt_cache.choice import SAVED, Record
from corral.supervisor.prompt_cache.files import TEMP_SUFFIX, kv_per_token
from corral.supervisor.prompt_cache.store import SUFFIX, Entry, fingerprint

if TYPE_CHECKING:
    from corral.supervisor.prompt_cache import PromptCache
    from corral.supervisor.prompt_cache.slots import Slots

_SAVE_ERRORS = (ValueError, RuntimeError, OSError, aiohttp.ClientError)


class Saver:
    def __init__(self, slots: Slots, cache: PromptCache, busy: Callable[[], bool],
                 log: Any):
        self._slots, self._cache, self._busy, self._log = slots, cache, busy, log
        # The request each slot was last saved with (or found not worth a file): the slot
        # holds nothing new while its record is still this one.
        self._saved: list[Record | None] = [None] * len(slots.records)
        self._timer: asyncio.TimerHandle | None = None
        self._last_end = 0.0  # the loop's time when the last request gave its slot back
        self._task: asyncio.Task[None] | None = None
        # While the child writes a file: done once it is written (or given up on). A request
        # waits for it (Slots.pin) rather than cancel the save.
        self._written: asyncio.Future[None] | None = None
        self._closed = False
        # The model's KV bytes per token (files.kv_per_token), read once: what a setup's
        # first save is expected to take before any file of it tells. None: unknown.
        self._per_token: float | None = None
        self._per_token_read = False

    def changed(self) -> list[int]:
        """Slots whose last request was never saved (nor found not worth it), not leased, and
        sure to hold it: a slot an unpinned request may have taken since (slots.py) holds
        what corral cannot tell, never saved under its record's tokens."""
        records, slots = self._slots.records, self._slots
        return [i for i, r in enumerate(records)
                if r is not None and r is not self._saved[i] and not slots.leased(i)
                and i not in slots.unsure]

    # -- idle ----------------------------------------------------------------------------------

    def _idle_after(self) -> float | None:
        settings = self._cache.settings()
        if not (settings.enabled and self._slots.spec.prompt_cache) or self._closed:
            return None
        return settings.idle_save_after or None

    def turn_ended(self) -> None:
        """A request gave its slot back: the debounce starts again. One timer per child, moved
        on when it goes off early: no timer made and cancelled per request."""
        delay = self._idle_after()
        if delay is None:
            return
        loop = asyncio.get_running_loop()
        self._last_end = loop.time()
        if self._timer is None:
            # A fresh context: the request's (its id in every log line) must not follow.
            self._timer = loop.call_later(delay, self._idle, context=contextvars.Context())

    def request_came(self) -> asyncio.Future[None] | None:
        """A request for the child: an idle save not sent to it yet is cancelled (nothing
        lost); while the child writes a file, what to wait for before the request is sent.
        llama-server would make the request wait for the save all the same, but only once
        the save's own request is in its queue: one sent right after it on another
        connection may be queued first, and the file would then hold what that request (an
        erase, a restore, another key's prompt) left in the slot, under this one's tokens."""
        written, task = self._written, self._task
        if written is not None:
            return written
        if task is not None and not task.done():
            task.cancel()
        return None

    def _writing_began(self) -> None:
        self._written = asyncio.get_running_loop().create_future()

    def _writing_ended(self) -> None:
        written, self._written = self._written, None
        if written is not None:
            written.set_result(None)

    def _idle(self) -> None:
        self._timer = None
        delay = self._idle_after()
        if delay is None:
            return
        loop = asyncio.get_running_loop()
        left = self._last_end + delay - loop.time()
        if left > 0:  # a turn ended since the timer was set
            self._timer = loop.call_later(left, self._idle, context=contextvars.Context())
            return
        if self._busy() or (self._task is not None and not self._task.done()):
            return  # a request in flight, or a save under way: the next turn's end re-arms
        if not self.changed():
            return
        self._task = asyncio.create_task(self._idle_save(),
                                         name=f"prompt-cache-idle:{self._slots.instance}")

    async def _idle_save(self) -> None:
        # Bounded as a stop's saves are: a child that hangs on a save must not keep the
        # next idle save (one at a time) from ever beginning.
        timeout = self._cache.settings().save_timeout
        try:
            async with asyncio.timeout(timeout):
                await self._save_changed(idle=True)
        except TimeoutError:
            self._log.warning("prompt_cache.save_cut_short", error="TimeoutError",
                              timeout=timeout, idle=True)

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _abandoned(self, post: asyncio.Future[tuple[int, Any]], part: str) -> None:
        """A save corral gave up on has ended in the child (answered, or the child went): its
        temporary file is deleted now, and its reservation with it."""
        if not post.cancelled():
            post.exception()  # seen: whatever it was, the file is not wanted
        try:
            self._cache.store.release(part)
        except OSError as exc:  # a full disk: the next start deletes it (its owner gone)
            self._log.warning("prompt_cache.partial_not_deleted", file=part, error=str(exc))
            return
        self._log.info("prompt_cache.partial_deleted", file=part,
                       reason="a save cut short ended in the child")

    # -- the stop ------------------------------------------------------------------------------

    async def at_stop(self, until: float | None = None) -> None:
        """Before the child goes: an idle save under way is waited for (not begun again), then
        the slots changed since their last save are saved. Bounded by save_timeout in all,
        and by `until` (the loop's clock: corral's shutdown budget), never raises: a stop must
        never hang on it."""
        settings = self._cache.settings()
        timeout = settings.save_timeout
        if until is not None:
            timeout = max(0.0, min(timeout, until - asyncio.get_running_loop().time()))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        try:
            async with asyncio.timeout(timeout):
                if task is not None and not task.done():
                    self._log.info("prompt_cache.save_awaited")
                    await asyncio.wait([task])
                self._closed = True
                await self._save_changed(idle=False)
        except TimeoutError:
            self._log.warning("prompt_cache.save_cut_short", error="TimeoutError",
                              timeout=round(timeout, 3))
        finally:
            self.close()  # an idle save still writing past the deadline: the child goes

    async def _save_changed(self, idle: bool) -> None:
        """Each changed slot holding at least min_tokens, saved (room in the budget allowing).
        An idle save stops at the first sign of a request. Never raises but CancelledError."""
        slots, settings = self._slots, self._cache.settings()
        if not slots.spec.prompt_cache or not settings.enabled:
            return
        # A request whose body is shorter than half of min_tokens in bytes cannot have filled
        # a slot with min_tokens tokens (a token is a byte of text or more, and the template
        # adds a few dozen): not worth asking the child, which may be the one not answering.
        todo = []
        for i in self.changed():
            record = slots.records[i]
            assert record is not None
            if record.path in SAVED and record.size() * 2 >= settings.min_tokens:
                todo.append((i, record))
            else:
                self._saved[i] = record
        if not todo:
            return
        try:
            key = await slots.key()
            if key in self._cache.store.off:
                return  # its restores are off: a file of it would never be read
            # A child that does not say what its slots hold within a health probe's time is
            # not asked to write them either.
            async with asyncio.timeout(slots.spec.health_timeout):
                listing = await slots.listing()
            held = {s.get("id"): s.get("n_prompt_tokens", 0) for s in listing
                    if isinstance(s, dict)} if isinstance(listing, list) else {}
            for slot, record in todo:
                if idle and (self._busy() or slots.leased(slot)):
                    return  # a request came: the rest waits for the next idle time
                if slots.records[slot] is not record or slots.leased(slot) \
                        or slot in slots.unsure:
                    continue  # served another request since: saved when that one is done
                n = int(held.get(slot) or 0)
                if n < settings.min_tokens:
                    self._saved[slot] = record
                    continue
                try:
                    await self._save(slot, record, key, idle, n)
                except _SAVE_ERRORS as exc:
                    self._log.warning("prompt_cache.save_skipped", slot=slot,
                                      error=str(exc) or type(exc).__name__)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._log.warning("prompt_cache.save_cut_short", error=str(exc) or type(exc).__name__,
                              idle=idle)

    async def _expected(self, key: str, n: int) -> int | None:
        if not self._per_token_read:
            self._per_token = await asyncio.to_thread(kv_per_token, self._slots.spec)
            self._per_token_read = True
        return self._cache.store.expected(key, n, self._per_token)

    async def _save(self, slot: int, record: Record, key: str, idle: bool, n: int) -> None:
        """Slot `slot` (holding `n` tokens) into a file: its expected size reserved in the
        budget first (or the save skipped), written under a temporary name, renamed into
        place and indexed once the child answered and the file's fingerprint was read;
        deleted otherwise, once the child no longer writes it."""
        slots, store = self._slots, self._cache.store
        expected = await self._expected(key, n)
        stem = secrets.token_hex(12)
        part, name = f"{stem}{TEMP_SUFFIX}", f"{stem}{SUFFIX}"
        room = store.reserve(part, expected)
        if room is not None:
            self._saved[slot] = record
            self._log.info("prompt_cache.save_skipped", slot=slot, tokens=n, reason=room)
            self._cache.events.publish("prompt_cache_save_skipped", model=slots.model,
                                       instance=slots.instance, slot=slot, tokens=n,
                                       bytes=expected, reason=room)
            return
        began = time.monotonic()
        post: asyncio.Future[tuple[int, Any]] | None = None
        indexed = False
        try:
            tokens = await slots.tokens(record)
            if n < len(tokens):
                # The slot holds less than its last request's prompt: a prefill cut short
                # (the client hung up), or context shifted. A file of it indexed under those
                # tokens would claim a prefix it does not hold (and supersede the real one).
                self._saved[slot] = record
                raise ValueError(f"slot {slot} holds {n} tokens, fewer than its last "
                                 f"request's {len(tokens)}")
            # From the request to the child until the file is in the index, a request that
            # comes does not cancel the save: the file would be written and never found.
            self._writing_began()
            # The request runs on its own: cut short here (save_timeout, a stop), it still
            # ends when the child answers or goes, and only then is its file deleted (deleted
            # before, the child would write it again under the same name, unseen).
            post = asyncio.ensure_future(
                slots.post(f"/slots/{slot}?action=save", {"filename": part}))
            status, data = await asyncio.shield(post)
            if status != 200 or not isinstance(data, dict):
                raise RuntimeError(f"slot {slot}: save answered {status}: {str(data)[:200]}")
            size, digest = await asyncio.to_thread(fingerprint, store.dir / part)
            written = data.get("n_written")
            if isinstance(written, int) and written != size:
                # A full disk at the file's end: llama-server's last buffered write fails at
                # its close, unchecked, and it answers 200 all the same. Indexed, the short
                # file would make the child that restores it abort (and supersede the whole
                # file of the same conversation).
                raise OSError(f"slot {slot}: the child wrote {written} bytes, {size} reached "
                              f"the disk (disk full?)")
            saved = data.get("n_saved")
            if isinstance(saved, int) and saved < len(tokens):
                # The slot changed under the save (erased, or another request there first):
                # the file does not hold the prefix it would be indexed under.
                raise ValueError(f"slot {slot}: the child saved {saved} tokens, fewer than "
                                 f"its last request's {len(tokens)}")
            now = time.time()
            store.commit(part, Entry(file=name, key=key, model=slots.model, tokens=tokens,
                                     n_tokens=int(saved or len(tokens)),
                                     bytes=size, fingerprint=digest, saved_at=now,
                                     last_used=now, head=record.head,
                                     namespace=record.namespace))
            indexed = True
        finally:
            self._writing_ended()
            if not indexed:
                if post is None or post.done():
                    try:
                        store.release(part)
                    except OSError as exc:  # a full disk: not over the error under way
                        self._log.warning("prompt_cache.partial_not_deleted", file=part,
                                          error=str(exc))
                else:
                    post.add_done_callback(lambda done: self._abandoned(done, part))
        self._saved[slot] = record
        seconds = time.monotonic() - began
        when = "idle" if idle else "stop"
        self._log.info("prompt_cache.saved", slot=slot, file=name, tokens=len(tokens),
                       bytes=size, ms=round(seconds * 1000, 1), when=when)
        self._cache.events.publish("prompt_cache_saved", model=slots.model,
                                   instance=slots.instance, slot=slot, file=name,
                                   tokens=len(tokens), bytes=size, seconds=round(seconds, 4),
                                   when=when)
