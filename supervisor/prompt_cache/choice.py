"""Which of a child's slots a request goes to, in time that does not grow with the slots.

The rule (unchanged from a scan over every free slot): the slot whose last request is all a
prefix of this one (the conversation it continues), else an empty slot (a new conversation
keeps the others' caches), else the free slot sharing most with it, else the least recently
used free slot. Lowest slot number on ties.

Only slots whose last request began like this one (same first message, or same first
characters of a completion prompt) can share anything with it, and only those with its first
two messages (or a single message, its first) can be the conversation it continues: two
indexes from those beginnings to their slots find them without looking at the others (an
agent's slots all share one system prompt: the second message tells them apart). Empty slots
are a queue (a slot is never emptied again), and the free slots' last use a heap (stale
entries skipped, rebuilt when it holds too many)."""

from __future__ import annotations

import collections
import dataclasses
import heapq
import json
from collections.abc import Collection, Hashable, Iterable
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RESPONSES = "/v1/responses"
# Requests corral pins to a slot itself (`id_slot`): it reads their conversation.
PINNED = frozenset({CHAT, COMPLETIONS, RESPONSES})
# Of those, the ones whose slots are saved and restored: the child tells their tokens
# (/apply-template takes a chat body, /tokenize a prompt). A Responses body becomes a chat
# inside llama-server, by rules of its own that corral would have to copy to know the tokens.
SAVED = frozenset({CHAT, COMPLETIONS})
# Paths llama-server answers without a slot (tokenizing only): nothing of a slot changes.
SLOTLESS = frozenset({"/tokenize", "/detokenize", "/apply-template",
                      "/v1/messages/count_tokens"})
# Request fields that are not the prompt: left out when corral asks the child for its tokens.
_NOT_PROMPT = ("id_slot", "stream", "stream_options", "n_probs", "max_tokens")
# How much of a completion prompt (characters) its index entry is made of. Shorter prompts
# share one entry of their own, looked at for every completion.
_PROMPT_HEAD = 16
# How much of the first message's text (characters) a saved conversation's head keeps.
HEAD_CHARS = 32
_SHORT, _END = object(), object()
_NONE: frozenset[int] = frozenset()


@dataclasses.dataclass(slots=True)
class Record:
    """The last request a slot served: what its KV cache begins with. Kept as it came (bytes
    or a dict) and parsed only when its tokens are needed (a restore, a save)."""

    path: str
    raw: bytes | dict[str, Any]
    tokens: list[int] | None = None  # known when a restore tokenized it already
    used: float = 0.0
    # Whose request it was (namespace.py): a slot is matched only to requests of its own
    # namespace, and given to another's only once its KV is erased (Slots.pin).
    namespace: str = ""
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

    @property
    def head(self) -> str | None:
        """What the request's text begins with, before the child tokenizes it (`head_of`)."""
        try:
            return head_of(self.path, self.body)
        except ValueError:
            return None


def conversation(path: str, body: dict[str, Any]) -> list[Any] | str | None:
    if path == CHAT:
        messages = body.get("messages")
        return messages if isinstance(messages, list) else None
    if path == RESPONSES:
        return _responses_turns(body)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _responses_turns(body: dict[str, Any]) -> list[Any] | None:
    """A Responses request's conversation as llama-server reads it: `instructions` (its
    system message) first, then the `input` items (a string: one user message). Compared
    item by item, as chat messages are (a coding agent sends the whole input every turn)."""
    given = body.get("input")
    if isinstance(given, str):
        turns: list[Any] = [{"role": "user", "content": given}]
    elif isinstance(given, list):
        turns = given
    else:
        return None
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        return [{"role": "system", "content": instructions}, *turns]
    return turns


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], dict):
        text = value[0].get("text")  # content parts: the first one's text
        return f"[{text}" if isinstance(text, str) else None
    return None


def head_of(path: str, body: dict[str, Any]) -> str | None:
    """The role and first HEAD_CHARS characters of a chat's first message, or a completion
    prompt's first HEAD_CHARS: two requests whose heads differ share at most the chat
    template's first tokens and under HEAD_CHARS characters, never a file's worth (a file
    holds min_tokens or more). None when it cannot tell (then any file may match)."""
    conv = conversation(path, body)
    if isinstance(conv, str):
        return f"p:{conv[:HEAD_CHARS]}" if len(conv) >= HEAD_CHARS else None
    if not conv or not isinstance(conv[0], dict):
        return None
    role, text = conv[0].get("role"), _text(conv[0].get("content"))
    if not isinstance(role, str) or text is None:
        return None
    return f"c:{role}:{text[:HEAD_CHARS]}"


def shared(old: list[Any] | str, new: list[Any] | str) -> tuple[int, bool]:
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


def _message_key(message: object) -> Hashable:
    """Equal for equal messages, and cheap: never the whole message."""
    if not isinstance(message, dict):
        return type(message).__name__
    role, content = message.get("role"), message.get("content")
    role_key = role if isinstance(role, str) else type(role).__name__
    if isinstance(content, str):
        return (role_key, len(content), content[:64])
    size = len(content) if isinstance(content, (list, dict)) else -1
    return (role_key, type(content).__name__, size)


_Key = tuple[Any, ...]


def _keys(path: str, conv: list[Any] | str, namespace: str = "") -> tuple[_Key, _Key] | None:
    """A conversation's two index entries: `wide`, shared by every conversation with its
    first message (all that can share anything with it), and `narrow`, by those with its
    first two (all whose last request it can continue, but those of one message). A
    completion prompt has one entry, its first characters. None: shares nothing. Each entry
    begins with the namespace: another key's slots are never found."""
    if isinstance(conv, str):
        key = (namespace, path, conv[:_PROMPT_HEAD]) if len(conv) >= _PROMPT_HEAD \
            else (namespace, path, _SHORT)
        return key, key
    if not conv:
        return None
    first = _message_key(conv[0])
    second = _message_key(conv[1]) if len(conv) > 1 else _END
    return (namespace, path, first), (namespace, path, first, second)


class Choice:
    """The slots' last requests, which are leased, and the indexes over them."""

    def __init__(self, n: int):
        self.records: list[Record | None] = [None] * n
        self.leased: set[int] = set()
        # Slots a request without an id_slot may have taken since their last request
        # (llama-server chose its slot): what they hold is unknown. Sure again once corral
        # pins a request to them (`take`).
        self.unsure: set[int] = set()
        # Each slot's namespaces whose KV it may hold: its last pinned request's, and those of
        # unpinned requests that llama-server may have put there since. Another namespace's
        # request may use it only once it is erased (Slots.pin).
        self.maybe: list[set[str]] = [set() for _ in range(n)]
        self._empty = collections.deque(range(n))
        self._wide: dict[Hashable, set[int]] = {}
        self._narrow: dict[Hashable, set[int]] = {}
        self._keys: list[tuple[_Key, _Key] | None] = [None] * n
        self._lru: list[tuple[float, int]] = []

    def choose(self, path: str, conv: list[Any] | str, namespace: str = "") -> int | None:
        """The slot for a request (None: every slot is leased); not taken yet (`take`). Only
        slots whose last request was of `namespace` are matched to it; the empty and least
        recently used ones may be another's (the caller erases those)."""
        if len(self.leased) >= len(self.records):
            return None
        keys = _keys(path, conv, namespace)
        if keys is not None:
            wide, narrow = keys
            # The slots whose last request this one may continue: same first two messages,
            # or a last request of one message that is this one's first.
            if isinstance(conv, str):
                continued = self._narrow.get(narrow, _NONE)
                if len(conv) >= _PROMPT_HEAD:  # a shorter prompt may begin this one too
                    continued = continued | self._narrow.get((namespace, path, _SHORT), _NONE)
            else:
                continued = self._narrow.get(narrow, _NONE)
                if len(conv) > 1:
                    continued = continued | self._narrow.get((*wide, _END), _NONE)
            found = self._most_shared(continued, conv, whole=True)
            if found is not None:
                return found
        if self._empty:
            return self._empty[0]  # an empty slot is never leased (taking it fills it)
        if keys is not None and not isinstance(conv, str):
            found = self._most_shared(self._wide.get(keys[0], _NONE), conv, whole=False)
            if found is not None:
                return found
        return self._least_used()

    def _most_shared(self, candidates: Collection[int], conv: list[Any] | str,
                     whole: bool) -> int | None:
        """Of the free `candidates`, the one whose last request shares most with `conv` (all
        of it a prefix of `conv`, when `whole`); the lowest slot on ties."""
        best, best_len = None, 0
        for i in sorted(candidates):
            rec = self.records[i]
            if i in self.leased or rec is None:
                continue
            old = conversation(rec.path, rec.body)
            if old is None:
                continue
            n, all_of_it = shared(old, conv)
            if n > best_len and (all_of_it or not whole):
                best, best_len = i, n
        return best

    def take(self, slot: int, record: Record, conv: list[Any] | str | None = None) -> None:
        """`slot` now serves `record` (leased until `release`); `conv`: its conversation,
        when the caller has it."""
        self.leased.add(slot)
        self.unsure.discard(slot)  # this request replaces whatever the slot held
        self.maybe[slot] = {record.namespace}
        if self._empty and self._empty[0] == slot:
            self._empty.popleft()
        elif slot in self._empty:
            self._empty.remove(slot)  # a caller's own choice (one slot): rare
        self._unindex(slot)
        self.records[slot] = record
        if conv is None and isinstance(record.raw, dict):
            conv = conversation(record.path, record.body)
        keys = _keys(record.path, conv, record.namespace) if conv is not None else None
        self._keys[slot] = keys
        if keys is not None:
            self._wide.setdefault(keys[0], set()).add(slot)
            self._narrow.setdefault(keys[1], set()).add(slot)

    def forget(self, slot: int) -> None:
        """`slot` holds nothing (erased in the child): empty again, out of the indexes. Still
        leased until `release`, if it was."""
        self._unindex(slot)
        self.records[slot] = None
        self.unsure.discard(slot)
        self.maybe[slot] = set()
        self._keys[slot] = None
        if slot not in self._empty:
            self._empty.appendleft(slot)

    def _unindex(self, slot: int) -> None:
        old = self._keys[slot]
        if old is not None:
            for index, key in ((self._wide, old[0]), (self._narrow, old[1])):
                group = index.get(key)
                if group is not None:
                    group.discard(slot)
                    if not group:
                        del index[key]

    def doubt(self, namespace: str = "") -> None:
        """A request of `namespace` went to the child without an id_slot: any slot may be the
        one llama-server gives it (an empty one holds nothing to lose, but may hold its KV
        afterwards). A leased one too: a slot is idle in the child once its answer is
        generated, while corral may still relay that answer to a slow reader."""
        maybe, unsure = self.maybe, self.unsure
        for i, r in enumerate(self.records):
            maybe[i].add(namespace)
            if r is not None:
                unsure.add(i)

    def suspect(self, slot: int, namespaces: Iterable[str]) -> None:
        """`slot` was given back while unpinned requests of `namespaces` waited: llama-server
        may give it to one of them next."""
        self.maybe[slot].update(namespaces)
        if self.records[slot] is not None:
            self.unsure.add(slot)

    def foreign(self, slot: int, namespace: str) -> bool:
        """Whether `slot` may hold KV of a namespace other than `namespace`."""
        maybe = self.maybe[slot]
        return bool(maybe) and (len(maybe) > 1 or namespace not in maybe)

    def release(self, slot: int) -> None:
        self.leased.discard(slot)
        rec = self.records[slot]
        if rec is not None:
            heapq.heappush(self._lru, (rec.used, slot))
            if len(self._lru) > 4 * len(self.records) + 16:
                # Stale entries (slots taken again since) piled up: one rebuild, O(slots).
                self._lru = [(r.used, i) for i, r in enumerate(self.records)
                             if r is not None and i not in self.leased]
                heapq.heapify(self._lru)

    def _least_used(self) -> int | None:
        while self._lru:
            used, slot = self._lru[0]
            rec = self.records[slot]
            if slot not in self.leased and rec is not None and rec.used == used:
                return slot
            heapq.heappop(self._lru)
        return None
