"""A prompt cache you can trust: what a save on a full disk leaves behind is never indexed (a
truncated file restored makes llama-server abort), and what changes a KV cache's meaning
through the child's environment is in the setup key.

A real llama-server child (SmolLM2) behind a wrapper that gives it a file-size limit: the
disk is "full" at a byte count the test picks, with no root and no tmpfs."""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Any

import yaml
from test_prompt_cache import _cold, _conversation, _files, _next_turn, _restored

from conftest import Corral, CorralFactory, llama_server_binary, wait_until


def _limited_binary(folder: Path) -> tuple[Path, Path]:
    """A llama-server that runs with RLIMIT_FSIZE (bytes) read from a file at each start and
    SIGXFSZ ignored: a write past the limit fails with EFBIG as on a full disk, instead of
    killing the child (an ignored signal stays ignored across exec)."""
    limit = folder / "limit"
    wrapper = folder / "llama-server"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, resource, signal, sys\n"
        f"limit = {str(limit)!r}\n"
        "if os.path.exists(limit):\n"
        "    n = int(open(limit).read())\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"os.execv({llama_server_binary()!r}, [{llama_server_binary()!r}, *sys.argv[1:]])\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, limit


def _turn(corral: Corral, messages: list[dict[str, str]]) -> Any:
    # ignore_eos: the slot holds the same number of tokens at every save, so the same bytes.
    return corral.http.post("/v1/chat/completions", json={
        "model": "smol", "messages": messages, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def test_a_save_cut_short_by_a_full_disk_is_never_indexed(start_corral: CorralFactory,
                                                          smol_model: Path) -> None:
    wrapper, limit = _limited_binary(Path(start_corral.folder))
    corral = start_corral({
        "defaults": {"ttl": 300, "stop_grace": 5},
        "prompt_cache": {"min_tokens": 64, "idle_save_after": 0},
        "models": {"smol": {"model": str(smol_model), "ctx": 2048, "threads": 1,
                            "binary": str(wrapper)}}})
    messages = _conversation("the forge")

    def unload_and_wait(saves: int) -> None:
        corral.http.post("/admin/models/smol/unload").raise_for_status()
        wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
        wait_until(lambda: len(corral.log_events("prompt_cache.saved")) == saves)

    assert _turn(corral, messages).status_code == 200
    unload_and_wait(1)
    (good,) = _files(corral)

    # The disk fills a few hundred bytes before the end of the next save of the same slot:
    # llama-server's last buffered write fails at its close, unchecked, and it answers 200
    # with the bytes it meant to write (`n_written`), the file on disk shorter.
    limit.write_text(str(good["bytes"] - 100))
    resp = _turn(corral, messages)
    assert resp.status_code == 200, resp.text
    assert _restored(resp.json(), resp.headers)
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    skipped = wait_until(lambda: [e for e in corral.log_events("prompt_cache.save_skipped")
                                  if "disk" in e.get("error", "")])
    assert str(good["bytes"]) in skipped[0]["error"]
    # The truncated file neither superseded the whole one nor stayed on disk.
    assert [f["file"] for f in _files(corral)] == [good["file"]]
    folder = Path(start_corral.folder) / "state" / "prompt-cache"
    assert not list(folder.glob("*.part"))

    # The next turn is restored from the whole file, by a child that lives.
    resp = _turn(corral, messages)
    assert resp.status_code == 200, resp.text
    assert _restored(resp.json(), resp.headers)
    assert corral.model("smol")["state"] == "ready"


def test_a_reload_that_changes_llama_servers_flags_in_env_gets_a_new_key(
        start_corral: CorralFactory, smol_model: Path) -> None:
    """LLAMA_ARG_ROPE_FREQ_BASE is --rope-freq-base given through the environment: the KV of
    a child started with another RoPE base is rotated under the old one, and restored into
    the new child it would be reused as if valid."""
    config: dict[str, Any] = {
        "defaults": {"ttl": 300, "stop_grace": 5},
        "prompt_cache": {"min_tokens": 64, "idle_save_after": 0},
        "models": {"smol": {"model": str(smol_model), "ctx": 2048, "threads": 1}}}
    corral = start_corral(config)
    messages = _conversation("the chapel")
    first = _turn(corral, messages)
    assert first.status_code == 200 and _cold(first.json())

    config["models"]["smol"]["env"] = {"LLAMA_ARG_ROPE_FREQ_BASE": "50000"}
    corral.config_path.write_text(yaml.safe_dump(config))
    assert corral.http.post("/admin/reload").status_code == 200
    wait_until(lambda: corral.log_events("prompt_cache.saved"), timeout=30)

    again = _turn(corral, _next_turn(messages, first.json(), "And another?"))
    assert again.status_code == 200, again.text
    assert _cold(again.json()), again.json()["timings"]
    assert "prompt-cache" not in again.headers.get("Server-Timing", "")
    assert not corral.log_events("prompt_cache.restored")
