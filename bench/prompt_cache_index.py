"""What counting a save from its first byte costs: the index bookkeeping of one save, as it was
(`add`: the file indexed once written, one index write) and as it is (`reserve` before the
child writes, then `commit`: two index writes under the dir's flock, each re-reading the index
only when another daemon changed it), and of one restore (`used`), for an index of --files
files of --tokens tokens each (the index keeps each file's tokens). Both save paths run in one
process, alternated round by round; medians and their ratio are printed. The child's own write
of the file (9 ms for 1,000 tokens of SmolLM2, seconds for a long chat on a big model) is not
in these figures: they are what corral adds to it.

    python bench/prompt_cache_index.py [--files 10 100] [--tokens 4000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import structlog

from corral.supervisor.prompt_cache.store import Entry, Store, fingerprint

from _harness import code_note, machine_note


def _entry(folder: Path, name: str, key: str, tokens: int, first: int) -> Entry:
    size, digest = fingerprint(folder / name)
    return Entry(file=name, key=key, model="m", tokens=list(range(first, first + tokens)),
                 n_tokens=tokens, bytes=size, fingerprint=digest, saved_at=0.0, last_used=0.0)


def _store(folder: Path, files: int, tokens: int) -> Store:
    store = Store(folder, lambda: 64 << 30)
    for i in range(files):
        (folder / f"f{i}.slot").write_bytes(b"k" * 4096)
        store.add(_entry(folder, f"f{i}.slot", f"setup{i}", tokens, i))
    return store


def _save_old(store: Store, i: int, tokens: int) -> float:
    began = time.perf_counter()
    (store.dir / f"o{i}.slot").write_bytes(b"k" * 4096)  # the child's write (4 KiB: small)
    store.add(_entry(store.dir, f"o{i}.slot", f"old{i}", tokens, 10_000 + i))
    return time.perf_counter() - began


def _save_new(store: Store, i: int, tokens: int) -> float:
    began = time.perf_counter()
    assert store.reserve(f"n{i}.part", 4096) is None
    (store.dir / f"n{i}.part").write_bytes(b"k" * 4096)
    store.commit(f"n{i}.part", _renamed(store, f"n{i}", tokens, i))
    return time.perf_counter() - began


def _renamed(store: Store, stem: str, tokens: int, i: int) -> Entry:
    entry = _entry(store.dir, f"{stem}.part", f"new{i}", tokens, 20_000 + i)
    entry.file = f"{stem}.slot"
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(machine_note())
    print(code_note())
    print(f"index bookkeeping per save and restore, {args.tokens} tokens a file, median of "
          f"{args.rounds} rounds (old and new alternated)")
    print(f"{'files':>6} {'index KB':>9} {'save old ms':>12} {'save new ms':>12} "
          f"{'new/old':>8} {'restore ms':>11}")
    for files in args.files:
        with tempfile.TemporaryDirectory() as tmp:
            store = _store(Path(tmp), files, args.tokens)
            old, new, used = [], [], []
            for i in range(args.rounds):
                paths = (_save_old, _save_new) if i % 2 == 0 else (_save_new, _save_old)
                for path in paths:
                    took = path(store, i, args.tokens)
                    (old if path is _save_old else new).append(took)
                entry = next(iter(store.entries.values()))
                began = time.perf_counter()
                store.used(entry, 10)
                used.append(time.perf_counter() - began)
                # Back to `files` files: the next round's index is the same size.
                for name in (f"o{i}.slot", f"n{i}.slot"):
                    if name in store.entries:
                        store.drop(store.entries[name], "bench")
            size = (Path(tmp) / "index.json").stat().st_size
            o, n = statistics.median(old) * 1000, statistics.median(new) * 1000
            print(f"{files:>6} {size // 1024:>9} {o:>12.1f} {n:>12.1f} {n / o:>8.2f} "
                  f"{statistics.median(used) * 1000:>11.1f}")


if __name__ == "__main__":
    main()
