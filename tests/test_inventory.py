"""The model inventory: models_dir scanned with its subfolders (hidden ones and partial
downloads skipped, split models and projectors per folder, clashing names told apart by their
folder), each model's GGUF header facts for /v1/models, and the folder watched so files added,
removed or still being written show up right without a restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from corral.supervisor import discovery, inventory
from corral.supervisor.config import default_config, load_config, parse_config
from corral.supervisor.config.watch import models_folder, watch_models_dir
from corral.supervisor.daemon import Daemon
from corral.supervisor.discovery import MAX_DEPTH, discover

from conftest import Corral, CorralFactory, wait_until
from tinymodel import N_EMBD, N_FF, N_LAYER, vocab, write_tiny_llama


def _touch(root: Path, *files: str) -> None:
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")  # discovery goes by names; nothing reads the files


def _found(root: Path) -> dict[str, tuple[str, str]]:
    """{name: (model file relative to root, projector file relative to root or '')}."""
    return {m.name: (m.path.relative_to(root).as_posix(),
                     m.mmproj.relative_to(root).as_posix() if m.mmproj else "")
            for m in discover(root)}


# -- discovery -------------------------------------------------------------------------------

def test_subfolders_are_scanned_and_projectors_pair_within_their_folder(tmp_path):
    _touch(tmp_path, "top.gguf", "org/repo/gem-Q4_K_M.gguf", "org/repo/gem-Q8_0.gguf",
           "org/repo/mmproj-gem-f16.gguf", "other/solo.gguf", "readme.txt", "other/notes.md")
    assert _found(tmp_path) == {
        "top": ("top.gguf", ""),
        "gem-Q4_K_M": ("org/repo/gem-Q4_K_M.gguf", "org/repo/mmproj-gem-f16.gguf"),
        "gem-Q8_0": ("org/repo/gem-Q8_0.gguf", "org/repo/mmproj-gem-f16.gguf"),
        "solo": ("other/solo.gguf", ""),
    }
    # models_dir first, then each subfolder depth first in name order
    assert [m.name for m in discover(tmp_path)] == ["top", "gem-Q4_K_M", "gem-Q8_0", "solo"]


def test_a_projector_never_pairs_with_a_model_of_another_folder(tmp_path):
    # foo's projector sits beside bar only; a nameless projector pairs with its own folder's
    # single model, not with the model one folder up.
    _touch(tmp_path, "a/mmproj-foo.gguf", "a/bar.gguf", "b/foo.gguf",
           "c/mmproj-F16.gguf", "c/vis-Q4_K_M.gguf", "mmproj-vis.gguf")
    assert _found(tmp_path) == {"bar": ("a/bar.gguf", ""), "foo": ("b/foo.gguf", ""),
                                "vis-Q4_K_M": ("c/vis-Q4_K_M.gguf", "c/mmproj-F16.gguf")}


def test_hidden_files_hidden_folders_and_partial_downloads_are_never_listed(tmp_path):
    _touch(tmp_path, ".cache/x.gguf", ".git/objects/y.gguf", "org/.hidden/z.gguf",
           ".half.gguf", ".pulling.gguf.part", "org/.pulling.gguf.part", "plain.gguf.part",
           "notes.gguf.txt", "org/real.gguf")
    assert _found(tmp_path) == {"real": ("org/real.gguf", "")}


def test_a_split_model_in_a_subfolder_is_one_model_at_its_first_shard(tmp_path):
    _touch(tmp_path, "big/m-Q4_K_M-00001-of-00003.gguf", "big/m-Q4_K_M-00002-of-00003.gguf",
           "big/m-Q4_K_M-00003-of-00003.gguf", "big/mmproj-m-f16.gguf",
           "orphans/lost-00002-of-00002.gguf")
    assert _found(tmp_path) == {
        "m-Q4_K_M": ("big/m-Q4_K_M-00001-of-00003.gguf", "big/mmproj-m-f16.gguf")}


def test_clashing_names_are_told_apart_by_their_folder(tmp_path):
    _touch(tmp_path, "x.gguf", "org1/x.gguf", "org2/deep/x.gguf", "org1/y.gguf", "org2/y.gguf",
           "org2/unique.gguf")
    first = _found(tmp_path)
    assert first == {
        "x": ("x.gguf", ""),  # the one in models_dir itself keeps the plain name
        "org1/x": ("org1/x.gguf", ""),
        "org2/deep/x": ("org2/deep/x.gguf", ""),
        "org1/y": ("org1/y.gguf", ""),
        "org2/y": ("org2/y.gguf", ""),
        "unique": ("org2/unique.gguf", ""),
    }
    # deterministic: the same files give the same names, whatever order they were made in
    again = tmp_path.parent / f"{tmp_path.name}-again"
    _touch(again, "org2/y.gguf", "org2/unique.gguf", "org2/deep/x.gguf", "org1/y.gguf",
           "org1/x.gguf", "x.gguf")
    assert _found(again) == first


def test_names_with_a_folder_route_and_validate_like_any_model(tmp_path):
    _touch(tmp_path, "m/org1/x.gguf", "m/org2/x.gguf")
    loaded = parse_config("models_dir: m\nmodels:\n  mine: {model: m/org1/x.gguf, "
                          "aliases: [fav]}\n", source=tmp_path / "c.yaml")
    # the configured file is not discovered again; its twin keeps the folder-qualified name
    assert sorted(loaded.models) == ["mine", "org2/x"]
    assert loaded.models["org2/x"].model_path == (tmp_path / "m/org2/x.gguf").resolve()
    daemon = Daemon(loaded, tmp_path / "children.json")
    assert daemon.resolve("org2/x") == "org2/x" and daemon.resolve("fav") == "mine"


def test_symlinked_folder_loops_end_and_symlinked_files_keep_their_names(tmp_path):
    root = tmp_path / "models"
    _touch(root, "a/real.gguf")
    (root / "a" / "loop").symlink_to("..", target_is_directory=True)
    (root / "a" / "again").symlink_to("../a", target_is_directory=True)
    # A Hugging Face cache: the file named by its content hash, linked by its real name.
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "3f9ad0c1").write_bytes(b"")
    (root / "hf").mkdir()
    (root / "hf" / "gem-Q4_K_M.gguf").symlink_to(blobs / "3f9ad0c1")
    (root / "hf" / "dangling.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (root / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    _touch(tmp_path / "elsewhere", "far.gguf")
    result: list[dict[str, tuple[str, str]]] = []
    scan = threading.Thread(target=lambda: result.append(_found(root)), daemon=True)
    scan.start()
    scan.join(5)
    assert result, "discovery did not finish within 5 s: it followed a link loop"
    assert result[0] == {"real": ("a/real.gguf", ""), "gem-Q4_K_M": ("hf/gem-Q4_K_M.gguf", ""),
                         "far": ("linked/far.gguf", "")}
    # the link is what llama-server gets: split shards are found beside its name
    assert next(m.path for m in discover(root) if m.name == "gem-Q4_K_M").is_symlink()


def test_folders_deeper_than_the_limit_are_not_scanned(tmp_path):
    deepest = "/".join(f"d{i}" for i in range(MAX_DEPTH))
    _touch(tmp_path, f"{deepest}/ok.gguf", f"{deepest}/d{MAX_DEPTH}/too-deep.gguf")
    assert list(_found(tmp_path)) == ["ok"]


def test_held_back_files_are_left_out_until_released(tmp_path):
    _touch(tmp_path, "org/copying.gguf", "org/done.gguf", "org/big-00001-of-00002.gguf",
           "org/big-00002-of-00002.gguf")
    held = [str(tmp_path.resolve() / "org" / name)
            for name in ("copying.gguf", "big-00002-of-00002.gguf")]
    discovery.hold_back(held, True)
    try:
        # a split model goes whole while any of its shards is being written
        assert list(_found(tmp_path)) == ["done"]
    finally:
        discovery.hold_back(held, False)
    assert list(_found(tmp_path)) == ["big", "copying", "done"]


# -- facts -----------------------------------------------------------------------------------

def _tiny_parameters(n_layer: int = N_LAYER) -> int:
    n_vocab = len(vocab()[0])
    per_layer = 2 * N_EMBD + 4 * N_EMBD * N_EMBD + 3 * N_FF * N_EMBD
    return 2 * n_vocab * N_EMBD + N_EMBD + n_layer * per_layer


def test_facts_of_a_tiny_model_and_their_cache(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "tiny.gguf", seed=1, ctx=4096)
    assert inventory.cached_facts(path) is None  # not read yet: nothing, and no reading
    facts = inventory.read_facts(path)
    assert facts == {"architecture": "llama", "parameters": _tiny_parameters(),
                     "parameters_label": inventory.parameters_label(_tiny_parameters()),
                     "quantization": "F32",  # no general.file_type: the type of most bytes
                     "context_length": 4096, "size_bytes": path.stat().st_size}
    assert facts["parameters_label"].endswith("K")
    assert inventory.cached_facts(path) == facts

    def no_reading(_path: Path) -> Any:
        raise AssertionError("read again although the file did not change")

    monkeypatch.setattr(inventory, "_header", no_reading)
    assert inventory.read_facts(path) == facts
    monkeypatch.undo()
    # rewritten (another size): read again
    write_tiny_llama(path, seed=1, ctx=2048, n_layer=3)
    again = inventory.read_facts(path)
    assert again is not None and again["context_length"] == 2048
    assert again["parameters"] == _tiny_parameters(3)


def test_a_split_model_counts_every_shard(tmp_path):
    first = write_tiny_llama(tmp_path / "m-00001-of-00002.gguf", seed=1)
    second = write_tiny_llama(tmp_path / "m-00002-of-00002.gguf", seed=2)
    facts = inventory.read_facts(first)
    assert facts is not None
    assert facts["size_bytes"] == first.stat().st_size + second.stat().st_size
    assert facts["parameters"] == 2 * _tiny_parameters()
    second.unlink()  # a missing shard: the model is not readable, and says so
    assert inventory.read_facts(first) is None


def test_unreadable_files_have_no_facts(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 100)
    truncated = tmp_path / "truncated.gguf"
    whole = write_tiny_llama(tmp_path / "whole.gguf").read_bytes()
    truncated.write_bytes(whole[:2000])  # inside the tokenizer's strings
    for path in (garbage, truncated, tmp_path / "missing.gguf"):
        assert inventory.read_facts(path) is None
        assert inventory.cached_facts(path) is None


def test_facts_of_the_demo_model(smol_model):
    began = time.perf_counter()
    facts = inventory.read_facts(smol_model)
    took = time.perf_counter() - began
    assert facts == {"architecture": "llama", "parameters": 134_515_008,
                     "parameters_label": "135M", "quantization": "Q4_1",
                     "context_length": 8192, "size_bytes": smol_model.stat().st_size}
    # 49k tokens of vocabulary: skipped, not decoded (gguf's GGUFReader takes seconds)
    assert took < 2.0, took


def test_the_daemon_answers_facts_from_memory_after_each_reload(tmp_path):
    folder = tmp_path / "models"
    (folder / "org").mkdir(parents=True)
    write_tiny_llama(folder / "tiny-a.gguf", seed=1)
    (folder / "mmproj-tiny-b.gguf").write_bytes(b"")  # not beside tiny-b: not its projector

    async def scenario() -> None:
        daemon = Daemon(default_config(folder), tmp_path / "children.json",
                        config_loader=lambda: default_config(folder))
        assert daemon.inventory("tiny-a") is None  # not read yet
        assert daemon.inventory("nobody") is None
        write_tiny_llama(folder / "org" / "tiny-b.gguf", seed=2)
        shutil.move(folder / "mmproj-tiny-b.gguf", folder / "org" / "mmproj-tiny-b.gguf")
        attempt = await daemon.reload("models_dir")
        assert attempt.ok and attempt.changes and attempt.changes["added"] == ["tiny-b"]
        await asyncio.wait_for(_until(lambda: daemon.inventory("tiny-b") is not None), 5)
        assert daemon.inventory("tiny-b") == {
            "architecture": "llama", "parameters": _tiny_parameters(),
            "parameters_label": inventory.parameters_label(_tiny_parameters()),
            "quantization": "F32", "context_length": 32768,
            "size_bytes": (folder / "org" / "tiny-b.gguf").stat().st_size, "mmproj": True}
        # read after the reload too: models that were there before
        assert (daemon.inventory("tiny-a") or {}).get("mmproj") is False

    asyncio.run(scenario())


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


# -- the watcher, in process -----------------------------------------------------------------

def test_models_folder_is_read_relative_to_the_config_that_sets_it(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    loaded = parse_config("models_dir: ../m\n", source=tmp_path / "conf" / "c.yaml")
    assert models_folder(loaded) == (tmp_path / "m").resolve()
    monkeypatch.chdir(tmp_path)
    assert models_folder(default_config(Path("here"))) == tmp_path / "here"
    # A config file that sets none: `models` beside it; a text with no file: none.
    assert models_folder(parse_config("", source=tmp_path / "c.yaml")) == tmp_path / "models"
    assert models_folder(parse_config("")) is None


def test_a_model_added_before_the_watch_is_in_place_is_listed(tmp_path):
    """The daemon reads its config and serves before the models folder's watch is set up (in
    a thread, after the listening line): a model dropped in between came as no event, and the
    watch's first listing, taken as it started, already held it, so corral never listed it.
    Now the watch compares the folder with what the config's discovery listed when it was
    read, once it is in place."""
    folder = tmp_path / "models"
    folder.mkdir()
    source = write_tiny_llama(tmp_path / "source.gguf", seed=1)
    old = time.time() - 60
    os.utime(source, (old, old))

    async def scenario() -> None:
        loaded = default_config(folder)
        daemon = Daemon(loaded, tmp_path / "children.json",
                        config_loader=lambda: default_config(folder))
        assert not daemon.models
        # Between the daemon's load and its watch: renamed into place (mtime old, settled).
        shutil.copy2(source, folder / ".late.gguf.part")
        os.rename(folder / ".late.gguf.part", folder / "late.gguf")
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_models_dir(daemon, stop, settle=1.0))
        try:
            await asyncio.wait_for(_until(lambda: "late" in daemon.models), 10)
        finally:
            stop.set()
            await asyncio.wait_for(watcher, 5)
        reloads = [a for a in daemon.reloader.recent if a.trigger == "models_dir"]
        assert [a.changes["added"] for a in reloads if a.changes] == [["late"]], reloads

    asyncio.run(scenario())


def test_the_watcher_lists_a_growing_file_only_once_it_is_complete(tmp_path):
    """In process, a settle time of 1 s: a file written in two halves half a second apart is
    never listed half-written; a file renamed into place (its mtime old) is listed at once;
    removing a folder of models removes them all."""
    folder = tmp_path / "models"
    folder.mkdir()
    source = write_tiny_llama(tmp_path / "source.gguf", seed=1)
    old = time.time() - 60
    os.utime(source, (old, old))
    data = source.read_bytes()
    seen: list[tuple[float, frozenset[str]]] = []

    async def scenario() -> None:
        daemon = Daemon(default_config(folder), tmp_path / "children.json",
                        config_loader=lambda: default_config(folder))
        stop = asyncio.Event()
        with capture_logs() as logs:
            watcher = asyncio.create_task(watch_models_dir(daemon, stop, settle=1.0))
            # The line comes after the watcher's first listing, and its watch is set up in
            # the same step of the loop (awatch's first step): what changes from here on
            # has an event. Waited for, not guessed.
            await asyncio.wait_for(_until(lambda: any(
                e["event"] == "models_dir.watching" for e in logs)), 5)

        async def record() -> None:
            while True:
                seen.append((time.monotonic(), frozenset(daemon.models)))
                await asyncio.sleep(0.02)

        recorder = asyncio.create_task(record())
        try:
            (folder / "org").mkdir()
            with open(folder / "org" / "slow.gguf", "wb") as f:
                f.write(data[:len(data) // 2])
                f.flush()
                await asyncio.sleep(0.5)
                f.write(data[len(data) // 2:])
            complete = time.monotonic()
            await asyncio.wait_for(_until(lambda: "slow" in daemon.models), 5)
            listed = time.monotonic()
            # renamed into place from a hidden name: listed without waiting to settle
            shutil.copy2(source, folder / "org" / ".fast.gguf.part")
            os.rename(folder / "org" / ".fast.gguf.part", folder / "org" / "fast.gguf")
            renamed = time.monotonic()
            await asyncio.wait_for(_until(lambda: "fast" in daemon.models), 5)
            fast = time.monotonic() - renamed
            shutil.rmtree(folder / "org")
            await asyncio.wait_for(_until(lambda: not daemon.models), 5)
        finally:
            stop.set()
            recorder.cancel()
            await asyncio.wait_for(watcher, 5)
        assert not discovery.held_back()  # the watcher released what it held
        assert all("slow" not in names for at, names in seen if at < complete), \
            "listed while half written"
        assert listed - complete < 1.0 + 1.0
        assert fast < 0.8, f"a renamed file waited {fast:.2f} s"
        reloads = [a for a in daemon.reloader.recent if a.trigger == "models_dir"]
        assert all(a.ok for a in reloads) and len(reloads) == 3, \
            [a.changes for a in reloads]

    asyncio.run(scenario())


# -- end to end: `corral serve --models-dir`, no config file ---------------------------------

@pytest.fixture
def served_folder(start_corral: CorralFactory, tmp_path: Path) -> tuple[Corral, Path]:
    folder = tmp_path / "models"
    folder.mkdir()
    corral = start_corral.spawn(["--models-dir", str(folder)], tmp_path / "none.yaml")
    return corral, folder


def test_served_folder_follows_files_without_a_restart(served_folder, tmp_path):
    corral, folder = served_folder
    assert corral.models() == {}
    began = time.monotonic()
    (folder / "org").mkdir()
    shutil.copy(write_tiny_llama(tmp_path / "tiny.gguf", seed=1), folder / "org" / "tiny.gguf")
    wait_until(lambda: "tiny" in corral.models(), timeout=8)
    appeared = time.monotonic() - began
    resp = corral.chat("tiny", max_tokens=4)
    assert resp.status_code == 200, resp.text
    pid = corral.model("tiny")["pid"]
    assert pid and psutil.pid_exists(pid)

    # the same name in models_dir itself: the subfolder's model takes its folder's name, so
    # its URL-encoded admin path works
    shutil.copy(tmp_path / "tiny.gguf", folder / "tiny.gguf")
    wait_until(lambda: {"tiny", "org/tiny"} <= set(corral.models()), timeout=8)
    assert corral.http.post("/admin/models/org%2Ftiny/load").status_code == 200
    assert corral.chat("org/tiny", max_tokens=4).status_code == 200

    # removing a served model's file drains and stops it
    (folder / "org" / "tiny.gguf").unlink()
    wait_until(lambda: "org/tiny" not in corral.models(), timeout=8)
    wait_until(lambda: not psutil.pid_exists(pid) or
               psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, timeout=10)
    assert corral.chat("org/tiny").status_code == 404
    # Logged once the reload returns, just after the model left the list.
    removed = wait_until(lambda: corral.log_events("inventory.removed"), timeout=5)
    assert removed[0]["model"] == "org/tiny"
    assert appeared < 6, appeared


def test_a_file_written_slowly_into_the_served_folder_never_fails_to_start(served_folder,
                                                                          tmp_path):
    corral, folder = served_folder
    data = write_tiny_llama(tmp_path / "tiny.gguf", seed=2).read_bytes()
    states: list[str | None] = []
    with open(folder / "slow.gguf", "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        for _ in range(10):  # a client asking for it meanwhile finds no such model
            time.sleep(0.1)
            states.append(corral.models().get("slow", {}).get("state"))
        assert corral.chat("slow", max_tokens=4).status_code == 404
        f.write(data[len(data) // 2:])
    wait_until(lambda: "slow" in corral.models(), timeout=8)
    resp = corral.chat("slow", max_tokens=4)
    assert resp.status_code == 200, resp.text
    assert states == [None] * 10
    assert not [e for e in corral.log_events("instance.state") if e["new"] == "failed"]


def test_a_config_file_empty_from_the_start_takes_the_models_folder_beside_it(tmp_path):
    """A config file of comments alone is a config of defaults, its models the folder beside
    it (docs/paths-and-check.md): a model added there is listed. Every such reload was
    refused ("the config file is empty"), meant for a file caught empty mid-save."""
    config = tmp_path / "corral.yaml"
    config.write_text("# defaults: the models folder beside this file\n")
    (tmp_path / "models").mkdir()

    async def scenario() -> None:
        daemon = Daemon(load_config(config), tmp_path / "children.json",
                        config_loader=lambda: load_config(config))
        assert not daemon.models
        write_tiny_llama(tmp_path / "models" / "tiny-a.gguf", seed=1)
        attempt = await daemon.reload("models_dir")
        assert attempt.ok and attempt.changes and attempt.changes["added"] == ["tiny-a"], \
            attempt
        # One that held something and is found empty is still refused.
        config.write_text("models_dir: models\n")
        assert (await daemon.reload("file")).ok
        config.write_text("")
        attempt = await daemon.reload("file")
        assert not attempt.ok and "tiny-a" in daemon.models

    asyncio.run(scenario())


def test_a_re_pointed_link_on_the_way_to_the_models_folder_moves_the_watch(tmp_path):
    """A release switched by re-pointing a link (`ln -sfn releases/v2 current`) on the way to
    models_dir: the watch stayed on the old release's folder, resolved once, and never saw
    the new one's files."""
    old = time.time() - 60
    for release, name in (("v1", "tiny-a"), ("v2", "tiny-b")):
        (tmp_path / release / "models").mkdir(parents=True)
        made = write_tiny_llama(tmp_path / release / "models" / f"{name}.gguf", seed=1)
        os.utime(made, (old, old))
    current = tmp_path / "current"
    current.symlink_to(tmp_path / "v1")
    folder = current / "models"
    source = write_tiny_llama(tmp_path / "source.gguf", seed=2)
    os.utime(source, (old, old))

    def placed(target: Path) -> None:  # renamed into place: settled at once
        shutil.copy2(source, target.with_name(".part"))
        os.rename(target.with_name(".part"), target)

    async def scenario() -> None:
        daemon = Daemon(default_config(folder), tmp_path / "children.json",
                        config_loader=lambda: default_config(folder))
        assert set(daemon.models) == {"tiny-a"}
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_models_dir(daemon, stop, settle=1.0))
        try:
            placed(tmp_path / "v1" / "models" / "tiny-c.gguf")  # the watch is in place
            await asyncio.wait_for(_until(lambda: "tiny-c" in daemon.models), 10)
            link = tmp_path / "current.new"
            link.symlink_to(tmp_path / "v2")
            os.replace(link, current)
            await asyncio.wait_for(_until(lambda: set(daemon.models) == {"tiny-b"}), 10)
            placed(tmp_path / "v2" / "models" / "tiny-d.gguf")
            await asyncio.wait_for(_until(lambda: "tiny-d" in daemon.models), 10)
        finally:
            stop.set()
            await asyncio.wait_for(watcher, 5)

    asyncio.run(scenario())
