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
