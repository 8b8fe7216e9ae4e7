"""The prompt cache's index on disk (supervisor/prompt_cache/store.py): token lists packed,
older indexes read, and a restore that writes nothing on its request's path."""

from __future__ import annotations

import json
import random
from pathlib import Path

from corral.supervisor.prompt_cache.store import (
    INDEX,
    SUFFIX,
    Entry,
    Store,
    fingerprint,
    pack_tokens,
    unpack_tokens,
)

MiB = 1 << 20


def _saved(store: Store, name: str, tokens: list[int]) -> Entry:
    path = store.dir / f"{name}{SUFFIX}"
    path.write_bytes(name.encode() * 100)
    size, digest = fingerprint(path)
    entry = Entry(file=path.name, key="k", model="m", tokens=tokens, n_tokens=len(tokens),
                  bytes=size, fingerprint=digest, saved_at=1.0, last_used=1.0)
    store.add(entry)
    return entry


def test_token_lists_round_trip_packed() -> None:
    rng = random.Random(7)
    for tokens in ([], [0], [2**31 - 1, -1, 5], [rng.randrange(200_000) for _ in range(5000)]):
        packed = pack_tokens(tokens)
        assert isinstance(packed, str)
        assert unpack_tokens(packed) == tokens
    # What is neither a packed list nor a list of numbers is refused, never guessed at.
    for bad in ("not base64!", "AAA", 12, None, [1, "2"], [1.5], {"a": 1}):
        assert unpack_tokens(bad) is None, bad


def test_the_index_keeps_tokens_packed_and_reads_an_older_one(tmp_path: Path) -> None:
    store = Store(tmp_path, lambda: 64 * MiB)
    tokens = list(range(1000, 3000))
    _saved(store, "a", tokens)
    on_disk = json.loads((tmp_path / INDEX).read_text())
    (item,) = on_disk["entries"]
    assert isinstance(item["tokens"], str)  # packed: not 2,000 numbers
    assert Store(tmp_path, lambda: 64 * MiB).entries["a" + SUFFIX].tokens == tokens

    # An index written before tokens were packed (a JSON list) is read as it is, and a
    # file whose tokens are unreadable is dropped like any unreadable entry.
    item["tokens"] = tokens
    on_disk["entries"].append({**item, "file": "b" + SUFFIX, "tokens": "%%%"})
    (tmp_path / f"b{SUFFIX}").write_bytes(b"b" * 100)
    (tmp_path / INDEX).write_text(json.dumps(on_disk))
    again = Store(tmp_path, lambda: 64 * MiB)
    assert list(again.entries) == ["a" + SUFFIX]
    assert again.entries["a" + SUFFIX].tokens == tokens
    found = again.best("k", [*tokens, 1, 2], min_tokens=10)
    assert found is not None and found[1] == len(tokens)


def test_a_restore_writes_no_index_and_the_next_write_keeps_its_use(tmp_path: Path) -> None:
    store = Store(tmp_path, lambda: 64 * MiB)
    entry = _saved(store, "a", list(range(100)))
    before = (tmp_path / INDEX).stat()
    store.used(entry, 100)
    after = (tmp_path / INDEX).stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert store.status()["hits"] == 1
    used_at = entry.last_used
    assert used_at > 1.0
    _saved(store, "b", list(range(500, 600)))  # the next change writes the index
    index = json.loads((tmp_path / INDEX).read_text())
    assert {e["file"]: e["last_used"] for e in index["entries"]}["a" + SUFFIX] == used_at
