"""Which callers' requests may be at one llama-server child at once.

corral keeps each namespace's KV apart by choosing the slot itself (`id_slot`) and erasing a
slot that may hold another namespace's before it serves a request. llama-server's Anthropic
endpoint (/v1/messages) takes no `id_slot` and no `cache_prompt`: it puts the request on the
idle slot whose prompt is most like it, reusing their common prefix. A slot is idle in the
child as soon as its answer is generated, while corral still relays that answer (to a slow
reader, for minutes), so erasing "the idle slots nobody leased" before such a request could
not cover them all: the request could land on a slot of another caller's request still in
flight, and reuse its prompt (an answer as fast as a cache hit tells the other caller's
prompt, token by token).

So such a request (`exclusive`) is at the child only while every request there is of its own
namespace: it waits for the others to end, and theirs wait while it is there (or waiting:
first come, first served, so neither side starves). Requests of one namespace never wait for
each other, and a child that serves one namespace (no API keys, or one key) never waits at
all; entering and leaving cost O(1) while nobody waits."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    who: Hashable
    namespace: str
    exclusive: bool
    admitted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class NamespaceGate:
    def __init__(self) -> None:
        self._inside: dict[Hashable, tuple[str, bool]] = {}  # who → namespace, exclusive
        self._namespaces: Counter[str] = Counter()  # requests inside, per namespace
        self._exclusive: Counter[str] = Counter()  # exclusive ones inside, per namespace
        self._waiting: deque[_Waiter] = deque()

    def enter(self, who: Hashable, namespace: str, exclusive: bool) -> asyncio.Future[None] | None:
        """Let `who` (a request's lease) in: None when it is in now, else a future that is
        done once it is (cancel it, or call `leave`, to give up its place). Entering twice is
        entering once."""
        if who in self._inside:
            return None
        if self._fits(namespace, exclusive) and not (
                self._waiting and any(_conflict(namespace, exclusive, w) for w in self._waiting)):
            self._admit(who, namespace, exclusive)
            return None
        waiter = _Waiter(who, namespace, exclusive)
        self._waiting.append(waiter)
        return waiter.admitted

    def leave(self, who: Hashable) -> None:
        """`who` is done at the child (or gave up waiting): those it held back may go in."""
        place = self._inside.pop(who, None)
        if place is None:
            for waiter in self._waiting:
                if waiter.who == who:
                    self._waiting.remove(waiter)
                    waiter.admitted.cancel()
                    break
            else:
                return
        else:
            namespace, exclusive = place
            _decrement(self._namespaces, namespace)
            if exclusive:
                _decrement(self._exclusive, namespace)
        self._wake()

    def waiting(self) -> int:
        return len(self._waiting)

    def _fits(self, namespace: str, exclusive: bool) -> bool:
        """Whether a request may join those inside now."""
        if exclusive:
            inside = self._namespaces
            return not inside or (len(inside) == 1 and namespace in inside)
        held = self._exclusive
        return not held or (len(held) == 1 and namespace in held)

    def _admit(self, who: Hashable, namespace: str, exclusive: bool) -> None:
        self._inside[who] = (namespace, exclusive)
        self._namespaces[namespace] += 1
        if exclusive:
            self._exclusive[namespace] += 1

    def _wake(self) -> None:
        """Admit waiters in order while each fits with those inside and with every waiter
        still ahead of it (none overtakes one it would hold back, or be held back by)."""
        ahead: list[_Waiter] = []
        for waiter in list(self._waiting):
            if waiter.admitted.cancelled():  # gave up without leave(): its place is gone
                self._waiting.remove(waiter)
                continue
            if self._fits(waiter.namespace, waiter.exclusive) \
                    and not any(_conflict(waiter.namespace, waiter.exclusive, other)
                                for other in ahead):
                self._waiting.remove(waiter)
                self._admit(waiter.who, waiter.namespace, waiter.exclusive)
                waiter.admitted.set_result(None)
            else:
                ahead.append(waiter)


def _conflict(namespace: str, exclusive: bool, other: _Waiter) -> bool:
    """Whether a request and a waiter may not be at the child together."""
    return namespace != other.namespace and (exclusive or other.exclusive)


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
