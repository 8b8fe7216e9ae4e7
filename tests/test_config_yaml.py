"""What PyYAML accepts and a config must not: a key written twice (PyYAML keeps the last one
silently), aliases that expand without bound or into themselves, bytes that are not UTF-8, a
file far larger than a config, and YAML 1.1's unquoted booleans and numbers where a name goes.
Each is one error with its file and line, the same from `corral check` as from a load, and a
running daemon keeps its config and applies the next good file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.supervisor.config import ConfigError, load_config

from conftest import CorralFactory

MODEL = f"""\
models:
  a:
    backend: command
    command: [{sys.executable}, serve.py, "${{PORT}}"]
"""


def _errors(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return [str(issue) for issue in caught.value.issues]


def _check(path: Path) -> list[str]:
    """`corral check --no-files`'s errors: what a user sees before saving into a live config."""
    done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check", "--no-files",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    return [line.removeprefix("error: ") for line in done.stderr.splitlines()]


def _write(tmp_path: Path, text: str | bytes, name: str = "corral.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


DUPLICATES = [
    # A model pasted twice: the first copy's settings were lost without a word.
    (MODEL + "  a:\n    backend: command\n    command: [cat, '${PORT}']\n",
     5, "models.a", 2),
    (MODEL + "    ttl: 5\n    ttl: 10\n", 6, "models.a.ttl", 5),
    ("listen: 127.0.0.1:1\nlisten: 127.0.0.1:2\n" + MODEL, 2, "listen", 1),
    ("models: {a: {backend: command, command: [x, '${PORT}'], ttl: 1, ttl: 2}}\n", 1,
     "models.a.ttl", 1),
]


@pytest.mark.parametrize(("text", "line", "key", "first"), DUPLICATES)
def test_a_key_written_twice_is_an_error_at_the_second(tmp_path, text, line, key, first):
    path = _write(tmp_path, text)
    expected = (f"{path}:{line}: {key}: key written twice in one mapping (first on line "
                f"{first}); YAML would keep only the last: remove or rename one")
    assert _errors(path) == [expected]
    assert _check(path) == [expected]


def test_a_merge_key_overridden_is_no_duplicate(tmp_path):
    path = _write(tmp_path, "models:\n  a: &base\n    backend: command\n"
                  "    command: [x, '${PORT}']\n    ttl: 5\n  b:\n    <<: *base\n    ttl: 9\n")
    loaded = load_config(path)
    assert loaded.models["a"].ttl == 5 and loaded.models["b"].ttl == 9


def test_a_duplicate_in_an_included_file_names_that_file(tmp_path):
    _write(tmp_path, "models:\n  b: {backend: command, command: [x, '${PORT}']}\n"
                     "  b: {backend: command, command: [y, '${PORT}']}\n", "more.yaml")
    path = _write(tmp_path, "include: more.yaml\n" + MODEL)
    assert _errors(path) == [f"{tmp_path / 'more.yaml'}:3: models.b: key written twice in one "
                             "mapping (first on line 2); YAML would keep only the last: remove "
                             "or rename one"]


def _laughs(levels: int) -> str:
    lines = ['  l0: &l0 ["ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha"]']
    lines += [f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]"
              for i in range(1, levels)]
    return MODEL + "    env:\n" + "\n".join("  " * 2 + line for line in lines) + "\n"


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """Nine lines that expand to 10**9 strings: every walk after the parse (${VAR}, the lines,
    the schema) went through the expansion, a reload ran for hours and took all memory."""
    path = _write(tmp_path, _laughs(9))
    started = time.monotonic()
    errors = _errors(path)
    assert time.monotonic() - started < 5
    assert len(errors) == 1 and "once its aliases are expanded" in errors[0], errors
    assert errors[0].startswith(f"{path}:")
    assert _check(path) == errors


def test_aliases_within_bounds_still_work(tmp_path):
    path = _write(tmp_path, MODEL + "    env: &env {A: x}\n"
                  "  b: {backend: command, command: [x, '${PORT}'], env: *env}\n"
                  "groups:\n  g: {type: parallel, models: &both [a, b]}\n"
                  "  h: {type: parallel, models: *both}\n")
    loaded = load_config(path)
    assert loaded.models["b"].env == loaded.models["a"].env == {"A": "x"}


@pytest.mark.parametrize("text", ["models: {}\nx: &a [*a]\n", "models: &m {a: *m}\n"])
def test_an_alias_inside_what_it_names_is_an_error(tmp_path, text):
    path = _write(tmp_path, text)
    errors = _errors(path)
    assert len(errors) == 1 and "an alias refers to a value that contains it" in errors[0]
    assert _check(path) == errors


def test_bytes_that_are_not_utf8_are_an_error_with_the_line(tmp_path):
    path = _write(tmp_path, MODEL.encode() + b"    env: {NAME: caf\xe9}\n")
    expected = [f"{path}:5: <top>: not UTF-8 text: byte 0xe9 cannot be read as UTF-8 (save the "
                "file as UTF-8)"]
    assert _errors(path) == expected
    assert _check(path) == expected


def test_an_included_file_that_is_not_utf8_names_that_file(tmp_path):
    _write(tmp_path, b"\xff\xfe m\x00o\x00", "more.yaml")  # UTF-16, as some editors save
    path = _write(tmp_path, "include: more.yaml\n" + MODEL)
    assert _errors(path) == [f"{tmp_path / 'more.yaml'}:1: <top>: not UTF-8 text: byte 0xff "
                             "cannot be read as UTF-8 (save the file as UTF-8)"]


def test_a_bom_is_fine(tmp_path):
    path = _write(tmp_path, "\ufeff" + MODEL)
    assert list(load_config(path).models) == ["a"]


def test_a_file_far_larger_than_a_config_is_not_read(tmp_path):
    from corral.supervisor.config.yaml import MAX_FILE_BYTES
    path = _write(tmp_path, MODEL + "# " + "x" * MAX_FILE_BYTES + "\n")
    errors = _errors(path)
    assert errors == [f"{path}: <top>: larger than a config file may be "
                      f"({MAX_FILE_BYTES // 1024 // 1024} MiB): not read"]
    assert _check(path) == errors


def test_unquoted_booleans_and_numbers_where_a_name_goes_say_so(tmp_path):
    """The Norway problem: `no` unquoted is YAML 1.1's false, in a model's name, an alias
    or a group's member list; the error says so, at the line it was written."""
    path = _write(tmp_path, MODEL + "    aliases: [no, '1.5']\n"
                  "  no:\n    backend: command\n    command: [x, '${PORT}']\n"
                  "groups:\n  g:\n    type: parallel\n    models: [a, 1.5]\n")
    boolean = ("Input should be a valid string: YAML read this unquoted value as a boolean "
               "(unquoted yes/no/on/off/true/false are booleans in YAML); put it in quotes")
    number = ("Input should be a valid string: YAML read this unquoted value as a number; "
              "put it in quotes")
    errors = _errors(path)
    assert f"{path}:5: models.a.aliases[0]: {boolean}" in errors
    assert f"{path}:6: models.False.[key]: {boolean}" in errors
    assert f"{path}:12: groups.g.models[1]: {number}" in errors


@pytest.mark.expect_log("daemon.reload_failed")
def test_a_running_corral_keeps_its_config_and_takes_the_next_good_one(start_corral:
                                                                       CorralFactory):
    path = _write(start_corral.folder, MODEL)
    corral = start_corral.spawn(["-c", str(path), "--no-watch"], path)
    hash_before = corral.http.get("/admin/config").json()["active"]["hash"]
    for bad in [MODEL + "  a:\n    backend: command\n    command: [cat, '${PORT}']\n",
                _laughs(9), MODEL.encode() + b"# caf\xe9\n", "models: &m {a: *m}\n"]:
        _write(start_corral.folder, bad)
        started = time.monotonic()
        resp = corral.http.post("/admin/reload")
        assert resp.status_code == 422, resp.text
        assert time.monotonic() - started < 10
        body = resp.json()
        assert len(body["issues"]) == 1 and body["issues"][0]["file"] == str(path), body
        assert body["issues"][0]["line"], body
        active = corral.http.get("/admin/config").json()["active"]
        assert active["hash"] == hash_before and active["models"] == ["a"]
    _write(start_corral.folder, MODEL + "  b:\n    backend: command\n    command: [y, '${PORT}']\n")
    resp = corral.http.post("/admin/reload")
    assert resp.status_code == 200 and resp.json()["changes"]["added"] == ["b"], resp.text


def test_check_says_a_reload_refuses_an_empty_file(tmp_path):
    """Parity: `corral check` passed an empty file (a save caught halfway, most often) that a
    running corral's reload refuses; it now says so."""
    path = _write(tmp_path, "# nothing yet\n")
    done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check", "--no-files",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert f"warning: {path}: the file is empty: a running corral refuses it on reload" \
        in done.stderr
