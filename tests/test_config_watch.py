"""The config watcher against the ways a config changes on disk besides an editor's save (those
are test_reload.py's): a deploy that re-points a symlinked folder (`current -> releases/v2`,
a Kubernetes ConfigMap's `..data`), a symlinked file re-pointed, and a file deleted then
written anew. One daemon on command models that never start: no child, only the config."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Corral, CorralFactory, wait_until


def _config(name: str) -> str:
    return (f"models:\n  {name}:\n    backend: command\n"
            f"    command: [{sys.executable}, serve.py, \"${{PORT}}\"]\n")


def _relink(link: Path, target: str) -> None:
    """`ln -sfn target link` as deploy tools do it: a new link renamed over the old one."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _active(corral: Corral) -> list[str]:
    models: list[str] = corral.http.get("/admin/config").json()["active"]["models"]
    return models


def _applied(corral: Corral, models: list[str], since: float) -> dict[str, Any]:
    """Waits for `models` to be the active config through a reload that finished after
    `since`."""
    def done() -> dict[str, Any] | None:
        status = corral.http.get("/admin/config").json()
        last = status["last_reload"]
        if last and last["at"] > since and last["ok"] and status["active"]["models"] == models:
            return dict(last)
        return None
    found: dict[str, Any] = wait_until(done, timeout=15, interval=0.05)
    return found


@pytest.fixture(scope="module")
def deployed(start_corral_module: CorralFactory) -> tuple[Corral, Path]:
    root = start_corral_module.folder / "deploy"
    for release in ("v1", "v2", "v3"):
        (root / "releases" / release).mkdir(parents=True)
        (root / "releases" / release / "corral.yaml").write_text(_config(f"model-{release}"))
    (root / "current").symlink_to("releases/v1")
    path = root / "current" / "corral.yaml"
    corral = start_corral_module.serve(path)
    assert _active(corral) == ["model-v1"]
    return corral, root


def test_a_re_pointed_folder_link_reloads_and_its_new_target_is_watched(deployed):
    """Before: only the files' folders were watched (the link's target, resolved when the
    watch began); re-pointing `current` changed nothing in them, so corral went on with the
    old release, and edits to the new one went unseen too."""
    corral, root = deployed
    before = time.time()
    _relink(root / "current", "releases/v2")
    assert _applied(corral, ["model-v2"], before)["trigger"] == "file"
    before = time.time()
    (root / "releases" / "v2" / "corral.yaml").write_text(_config("model-v2b"))
    _applied(corral, ["model-v2b"], before)


def test_a_re_pointed_file_link_reloads(deployed):
    corral, root = deployed
    _relink(root / "current", "releases/v3")
    _applied(corral, ["model-v3"], 0)
    shared = root / "shared.yaml"
    shared.write_text(_config("model-shared"))
    before = time.time()
    _relink(root / "releases" / "v3" / "corral.yaml", str(shared))
    _applied(corral, ["model-shared"], before)
    before = time.time()
    shared.write_text(_config("model-shared2"))  # the new target is watched
    _applied(corral, ["model-shared2"], before)


@pytest.mark.expect_log("daemon.reload_failed")
def test_a_file_deleted_then_written_anew_applies(deployed):
    corral, root = deployed
    _relink(root / "current", "releases/v1")
    _applied(corral, ["model-v1"], 0)
    path = root / "releases" / "v1" / "corral.yaml"
    before = time.time()
    path.unlink()

    def refused() -> bool:
        last = corral.http.get("/admin/config").json()["last_reload"]
        return bool(last["at"] > before and not last["ok"])
    wait_until(refused, timeout=15, interval=0.05)
    assert _active(corral) == ["model-v1"]  # the running config stays
    before = time.time()
    path.write_text(_config("model-again"))
    _applied(corral, ["model-again"], before)


def test_an_edit_made_while_the_watch_moves_to_new_files_is_not_missed(tmp_path: Path) -> None:
    """After a reload that changes the set of files (a re-pointed link, a new include), the
    watch starts again on the new set; an edit made before it is in place came as no event,
    and corral stayed on what the reload had read. Now the config is read again once the new
    watch is in place. Here the edit comes at the worst moment: as the reload returns."""
    import asyncio
    from types import SimpleNamespace
    from typing import cast

    from corral.supervisor.config import load_config
    from corral.supervisor.config.watch import watch_config

    first, second = tmp_path / "a" / "corral.yaml", tmp_path / "b" / "corral.yaml"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text(_config("m"))
    applied: list[list[str]] = []

    async def scenario() -> None:
        stopping = asyncio.Event()
        daemon = SimpleNamespace(loaded=load_config(first), last_reload=None)

        def reload(trigger: str) -> asyncio.Future[None]:
            # The first reload moves to b/ (as a re-pointed link would), and b/ is edited
            # as it returns, before the watch is on b/'s folder.
            daemon.loaded = load_config(second)
            applied.append(list(daemon.loaded.models))
            if len(applied) == 1:
                second.write_text(_config("m-edited"))
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        daemon.reload = reload
        watching = asyncio.create_task(watch_config(cast(Any, daemon), stopping))
        await asyncio.sleep(0.5)  # the first watch is in place
        first.write_text(_config("m2"))
        deadline = asyncio.get_running_loop().time() + 15
        while len(applied) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stopping.set()
        await asyncio.wait_for(watching, 10)

    asyncio.run(scenario())
    assert applied[:2] == [["m"], ["m-edited"]], applied


def test_an_edit_made_before_the_first_watch_is_in_place_is_applied(tmp_path: Path) -> None:
    """The daemon reads its config and serves (its relay workers answer /health) before the
    watch is set up in its thread: an edit in between came as no event, and the stamps the
    watch took as it started already showed it, so corral kept the old config for good (CI's
    test-workers run lost test_reload's first edit this way, twice). Now the config is read
    again once the first watch is in place, as after a move to new files."""
    import asyncio
    from types import SimpleNamespace
    from typing import cast

    from corral.supervisor.config import load_config
    from corral.supervisor.config.watch import watch_config

    config = tmp_path / "corral.yaml"
    config.write_text(_config("m"))
    applied: list[list[str]] = []

    async def scenario() -> None:
        stopping = asyncio.Event()
        daemon = SimpleNamespace(loaded=load_config(config), last_reload=None)

        def reload(trigger: str) -> asyncio.Future[None]:
            daemon.loaded = load_config(config)
            applied.append(list(daemon.loaded.models))
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        daemon.reload = reload
        config.write_text(_config("m-edited"))  # read, not yet watched
        watching = asyncio.create_task(watch_config(cast(Any, daemon), stopping))
        deadline = asyncio.get_running_loop().time() + 10
        while not applied and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stopping.set()
        await asyncio.wait_for(watching, 10)

    asyncio.run(scenario())
    assert applied[:1] == [["m-edited"]], applied


@pytest.mark.parametrize("beside", ["nothing", "a log written all the time"])
def test_an_edit_the_file_watch_never_reports_is_applied_by_its_stamp(tmp_path: Path,
                                                                      beside: str) -> None:
    """inotify reports a change only through the folder it was made in: the config edited
    through a hard link elsewhere (as some deploy tools write) came as no event, and corral
    kept the old config for good (one lost event under load was seen too: a test's edit right
    after a reload never reloaded). Each quiet second, and at each change of another file in
    the config's folder (a log written there keeps the quiet second from ever coming), the
    watched files' inode, size and mtime are compared with what the last reload saw, and a
    difference reloads."""
    import asyncio
    import threading
    from types import SimpleNamespace
    from typing import cast

    from corral.supervisor.config import load_config
    from corral.supervisor.config.watch import watch_config

    config = tmp_path / "etc" / "corral.yaml"
    config.parent.mkdir()
    config.write_text(_config("m"))
    elsewhere = tmp_path / "deploy" / "corral.yaml"
    elsewhere.parent.mkdir()
    os.link(config, elsewhere)
    applied: list[list[str]] = []

    async def scenario() -> None:
        stopping = asyncio.Event()
        daemon = SimpleNamespace(loaded=load_config(config), last_reload=None)

        def reload(trigger: str) -> asyncio.Future[None]:
            daemon.loaded = load_config(config)
            applied.append(list(daemon.loaded.models))
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        daemon.reload = reload
        watching = asyncio.create_task(watch_config(cast(Any, daemon), stopping))
        await asyncio.sleep(0.5)  # the watch is in place
        with elsewhere.open("w") as out:  # the same file, written through the other link
            out.write(_config("m-deployed"))
        deadline = asyncio.get_running_loop().time() + 10
        while not applied and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stopping.set()
        await asyncio.wait_for(watching, 10)

    quiet = threading.Event()

    def log_beside() -> None:
        with (config.parent / "corral.log").open("a") as log:
            while not quiet.wait(0.01):
                log.write("a line\n")
                log.flush()

    noise = threading.Thread(target=log_beside, daemon=True)
    if beside != "nothing":
        noise.start()
    try:
        asyncio.run(scenario())
    finally:
        quiet.set()
    assert applied[:1] == [["m-deployed"]], applied
