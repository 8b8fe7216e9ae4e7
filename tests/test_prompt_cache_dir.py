"""The prompt cache's dir shared and private: a daemon killed mid-save frees its reservation
while the other runs, a start's drops write the index once and its file reads happen outside
the dir's lock, and nobody but the user reads the cache (0700 dirs, 0600 files)."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path

import pytest
import structlog
from test_prompt_cache_files import MiB, _args, _cache, _Loaded, _mode

from corral.supervisor import cli
from corral.supervisor.prompt_cache.files import TEMP_SUFFIX
from corral.supervisor.prompt_cache.store import INDEX, PENDING, SUFFIX, Entry, Store, fingerprint
from corral.supervisor.statefile import ChildRegistry

from conftest import tiny_config, wait_until


def test_a_peer_killed_mid_save_frees_its_reservation_while_this_daemon_runs(tmp_path):
    """Two daemons on one dir; one is SIGKILLed with a save in flight. The other, still
    running, no longer counts its reservation at its next change (it would evict real files
    and refuse saves until a restart) and deletes its temporary file."""
    peer, store = Store(tmp_path, lambda: 4 * MiB), Store(tmp_path, lambda: 4 * MiB)
    kept = _file(store, "kept", 512 << 10)
    assert peer.reserve(f"peer{TEMP_SUFFIX}", 3 * MiB) is None
    (tmp_path / f"peer{TEMP_SUFFIX}").write_bytes(b"x" * (1 << 20))
    # The peer dies: its reservation stays in pending.json under an owner no longer alive.
    peer.pending[f"peer{TEMP_SUFFIX}"]["owner"] = "1:12.0"
    peer._write_pending()
    with structlog.testing.capture_logs() as logs:
        assert store.reserve(f"mine{TEMP_SUFFIX}", 3 * MiB) is None
    assert not (tmp_path / f"peer{TEMP_SUFFIX}").exists()
    assert list(store.pending) == [f"mine{TEMP_SUFFIX}"]
    assert [p["file"] for p in json.loads((tmp_path / PENDING).read_text())["pending"]] \
        == [f"mine{TEMP_SUFFIX}"]
    assert kept.file in store.entries and (tmp_path / kept.file).exists()
    assert [e["file"] for e in logs if e["event"] == "prompt_cache.partial_deleted"] \
        == [f"peer{TEMP_SUFFIX}"]


def _file(store: Store, stem: str, size: int, tokens: list[int] | None = None) -> Entry:
    (store.dir / f"{stem}{SUFFIX}").write_bytes(os.urandom(size))
    nbytes, digest = fingerprint(store.dir / f"{stem}{SUFFIX}")
    entry = Entry(file=f"{stem}{SUFFIX}", key="k", model="m", tokens=tokens or [len(stem)],
                  n_tokens=1, bytes=nbytes, fingerprint=digest, saved_at=0.0, last_used=0.0)
    store.add(entry)
    return entry


def test_a_start_that_drops_bad_files_writes_the_index_once(tmp_path, monkeypatch):
    """A start checks every file and drops the bad ones in one batch: one index write, never
    one per drop (a kill between those would leave an index naming only the files kept so
    far, and the next start would delete the rest as orphans)."""
    store = Store(tmp_path, lambda: 64 * MiB)
    entries = [_file(store, name, 4096, [i]) for i, name in enumerate("abcde")]
    for bad in (entries[1], entries[3]):
        (tmp_path / bad.file).write_bytes(b"cut")  # truncated
    writes: list[list[str]] = []
    write = Store._write

    def counted(self: Store) -> None:
        write(self)
        writes.append([e["file"] for e in json.loads((self.dir / INDEX).read_text())["entries"]])

    monkeypatch.setattr(Store, "_write", counted)
    again = Store(tmp_path, lambda: 64 * MiB)
    good = sorted(e.file for e in (entries[0], entries[2], entries[4]))
    assert [sorted(w) for w in writes] == [good]
    assert sorted(again.entries) == good == sorted(p.name for p in tmp_path.glob("*" + SUFFIX))
    assert again.counters.dropped == 2


def test_a_start_reads_its_files_without_holding_the_dirs_lock(tmp_path):
    """A second daemon starting fingerprints every file (1 MiB read each): the first one's
    event loop blocks on the lock for its next change, so the reads happen outside it."""
    store = Store(tmp_path, lambda: 64 * MiB)
    for i in range(3):
        _file(store, f"f{i}", 4096, [i])
    checked = threading.Event()
    calls: list[int] = []
    check = Store.check

    def watched(self: Store, entry: Entry) -> str | None:
        calls.append(1)
        if len(calls) == 3:
            checked.set()
        return check(self, entry)

    holder = os.open(tmp_path / ".lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another daemon mid-change
    started: list[Store] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Store, "check", watched)
        thread = threading.Thread(target=lambda: started.append(Store(tmp_path,
                                                                      lambda: 64 * MiB)))
        thread.start()
        try:
            assert checked.wait(30), "the files were not read while another held the lock"
            assert thread.is_alive()  # it waits for the lock only to apply what it read
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)
            os.close(holder)
        thread.join(30)
    assert len(calls) == 3 and sorted(started[0].entries) == [f"f{i}{SUFFIX}" for i in range(3)]


def test_the_cache_is_readable_by_its_user_alone(tmp_path, monkeypatch):
    """Every key's conversations (token ids, decodable) and their KV: the state dir and the
    cache dir 0700, every file in them 0600, whatever the umask (022 here)."""
    old = os.umask(0o022)
    try:
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        state = cli._state_dir(_args(), _Loaded())  # type: ignore[arg-type]
        given = cli._state_dir(_args(tmp_path / "given"), _Loaded())  # type: ignore[arg-type]
        ChildRegistry(state / "children-1.json").record([("m", os.getpid())])
        cache = _cache(state / "prompt-cache")
        store = cache.store
        assert store.reserve(f"s{TEMP_SUFFIX}", 1000) is None
        # llama-server writes the file itself, under corral's umask.
        (store.dir / f"s{TEMP_SUFFIX}").write_bytes(b"kv" * 500)
        nbytes, digest = fingerprint(store.dir / f"s{TEMP_SUFFIX}")
        store.commit(f"s{TEMP_SUFFIX}", Entry(
            file=f"s{SUFFIX}", key="k", model="m", tokens=[1], n_tokens=1, bytes=nbytes,
            fingerprint=digest, saved_at=0.0, last_used=0.0))
    finally:
        os.umask(old)
    assert _mode(state) == _mode(given) == _mode(store.dir) == 0o700
    files = [p for d in (state, store.dir) for p in d.iterdir() if p.is_file()]
    assert {p.name for p in files} >= {"children-1.json", INDEX, PENDING, ".lock",
                                       f"s{SUFFIX}", "namespace.salt"}
    assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}


def test_a_reload_that_lowers_max_mb_applies_it_at_once(start_corral, tiny_models):
    """The disk budget a reload lowers is met when the reload is applied, least recently used
    files first, not at the next save (which may never come: the disk held more than the
    config allowed until then)."""
    config = tiny_config(tiny_models, prompt_cache={"max_mb": 64})
    corral = start_corral(config)
    folder = Path(start_corral.folder) / "state" / "prompt-cache"
    # Three 1 MiB saves, used oldest to newest, written by a peer's Store on the same dir
    # (the daemon reads them at its next change, as it would another daemon's saves).
    peer = Store(folder, lambda: 64 * MiB)
    for age, stem in enumerate(("old", "mid", "new"), start=1):
        (folder / f"{stem}{SUFFIX}").write_bytes(os.urandom(1 << 20))
        nbytes, digest = fingerprint(folder / f"{stem}{SUFFIX}")
        peer.add(Entry(file=f"{stem}{SUFFIX}", key="k", model="m", tokens=[age], n_tokens=1,
                       bytes=nbytes, fingerprint=digest, saved_at=0.0, last_used=float(age)))
    config["prompt_cache"]["max_mb"] = 2
    corral.reload_with(config)
    wait_until(lambda: not (folder / f"old{SUFFIX}").exists(), timeout=10)
    assert sorted(p.name for p in folder.glob("*" + SUFFIX)) == [f"mid{SUFFIX}", f"new{SUFFIX}"]
    dropped = corral.log_events("prompt_cache.dropped")
    assert [e["file"] for e in dropped] == [f"old{SUFFIX}"]
    assert dropped[0]["reason"] == "disk budget (2 MiB)"
