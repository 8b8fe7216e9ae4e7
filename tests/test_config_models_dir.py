"""A config file that sets no models_dir discovers `models` beside it, as one that wrote
`models_dir: models` (docs/configuration.md's default): a model file put there is listed, and
POST /admin/pull puts its download there. A missing default folder is no error."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from corral.supervisor.config import parse_config

from conftest import CorralFactory, tiny_config, wait_until

CLI = [sys.executable, "-m", "corral.supervisor.cli"]


def test_the_default_folder_is_models_beside_the_config_file(tmp_path: Path,
                                                              tiny_models: dict[str, Path]
                                                              ) -> None:
    (tmp_path / "models").mkdir()
    shutil.copy(tiny_models["tiny-b"], tmp_path / "models" / "found.gguf")
    loaded = parse_config(yaml.safe_dump(tiny_config(tiny_models)),
                          source=tmp_path / "corral.yaml")
    assert loaded.models_folder == tmp_path / "models"
    assert set(loaded.models) == {"tiny-a", "found"}
    # What the file sets wins; a config given as text, with no file, has no folder.
    other = parse_config("models_dir: elsewhere\n", source=tmp_path / "corral.yaml")
    assert other.models_folder == tmp_path / "elsewhere" and not other.models
    assert parse_config("models: {}\n").models_folder is None


def test_check_passes_without_the_default_folder_and_names_a_set_one_missing(
        tmp_path: Path) -> None:
    config = tmp_path / "corral.yaml"
    config.write_text("models: {}\n")
    done = subprocess.run([*CLI, "check", str(config)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and f"{config}: ok (0 models)" in done.stdout, done.stderr
    config.write_text("models_dir: store\n")
    done = subprocess.run([*CLI, "check", str(config)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stdout
    assert f"{config}:1: models_dir: folder {tmp_path / 'store'} does not exist" in done.stderr


@contextmanager
def serving(folder: Path) -> Iterator[str]:
    """A plain HTTP server of `folder`'s files (pull's source), on a free port."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_daemon_lists_a_file_put_there_and_pulls_into_it(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    config = site / "corral.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_models)))
    corral = start_corral.serve(config)

    def listed() -> set[str]:
        return {m["id"] for m in corral.http.get("/v1/models").json()["data"]}

    folder = site / "models"
    assert listed() == {"tiny-a"} and not folder.exists()
    # The folder is watched from when it appears; a file renamed into place is listed.
    folder.mkdir()
    shutil.copy(tiny_models["tiny-b"], folder / ".dropped.tmp")
    (folder / ".dropped.tmp").rename(folder / "dropped.gguf")
    wait_until(lambda: "dropped" in listed(), timeout=15)
    answer = corral.chat("dropped", max_tokens=2)
    assert answer.status_code == 200, answer.text

    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(tiny_models["tiny-c"], source / "pulled.gguf")
    with serving(source) as url:
        resp = corral.http.post("/admin/pull", json={"source": f"{url}/pulled.gguf"})
        assert resp.status_code == 202, resp.text
        wait_until(lambda: "pulled" in listed(), timeout=30)
    assert (folder / "pulled.gguf").read_bytes() == (source / "pulled.gguf").read_bytes()
    assert listed() == {"tiny-a", "dropped", "pulled"}


def test_a_model_configured_through_a_link_in_the_folder_is_not_found_twice(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """A config beside `models/` naming a file there that links elsewhere (as a models folder
    of links to a cache has): one model, so an alias named like the file is no clash."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "qwen.gguf").symlink_to(tiny_models["tiny-a"])
    loaded = parse_config("models:\n  chat:\n    model: models/qwen.gguf\n"
                          "    aliases: [qwen]\n", source=tmp_path / "corral.yaml")
    assert set(loaded.models) == {"chat"} and loaded.aliases == {"qwen": "chat"}


def test_models_dir_and_worker_flags_keep_what_the_load_found_of_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --models-dir` and `serve --worker` resolve the config again: what the load
    found of the files themselves (an included file holding no YAML) went missing, so a
    reload under either flag applied an include caught empty mid-save (its models drained
    and stopped, to start again at the save's next write) instead of reading it again."""
    from corral.supervisor.cli import _as_worker, _with_models_dir
    from corral.supervisor.config import load_config

    (tmp_path / "extra.yaml").write_text("")
    (tmp_path / "corral.yaml").write_text("include: [extra.yaml]\n")
    loaded = load_config(tmp_path / "corral.yaml")
    assert loaded.empty_files
    monkeypatch.setenv("CORRAL_WORKER_TOKEN", "a-token-of-twenty-chars-or-more")
    for again in (_with_models_dir(loaded, tmp_path / "m"), _as_worker(loaded)):
        assert again.empty_files == loaded.empty_files
