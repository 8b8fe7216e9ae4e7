"""The state file of child pids (supervisor/statefile.py) as a new daemon finds it: whatever
is in it, or however it cannot be read, the daemon starts, and only a recorded child of its
own is killed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from corral.supervisor.statefile import ChildRegistry

BAD_RECORDS = [
    {"model": "x", "pid": "123", "create_time": 1.0},  # TypeError before
    {"model": "x", "pid": 1.5, "create_time": 1.0},  # TypeError before
    {"model": "x", "pid": -3, "create_time": 1.0},  # ValueError before
    {"model": "x", "pid": 0, "create_time": 0.0},  # os.killpg(0): the daemon's own group
    {"model": "x", "pid": 1, "create_time": 1.0},
    {"model": "x", "pid": True, "create_time": 1.0},
    {"pid": 123},
    None,
    "x",
]


def test_bad_records_are_skipped_and_a_good_one_beside_them_is_reaped(tmp_path: Path) -> None:
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    try:
        good = {"model": "m", "pid": orphan.pid,
                "create_time": psutil.Process(orphan.pid).create_time()}
        path = tmp_path / "children.json"
        path.write_text(json.dumps([*BAD_RECORDS, good]))
        assert ChildRegistry(path).reap_leftovers() == [orphan.pid]
        assert orphan.wait(5) == -signal.SIGKILL
        assert not path.exists()
    finally:
        orphan.kill()
        orphan.wait()


@pytest.mark.parametrize("content", [b"{\"a\": 1}", b"null", b"\xff\xfe", b"[", b""])
def test_a_file_of_something_else_reaps_nothing(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "children.json"
    path.write_bytes(content)
    assert ChildRegistry(path).reap_leftovers() == []
    assert not path.exists()


def test_a_file_that_cannot_be_read_reaps_nothing_and_does_not_raise(tmp_path: Path) -> None:
    # A directory in its place (IsADirectoryError, as PermissionError for a file left by a
    # run as root: the daemon did not start).
    (tmp_path / "children.json").mkdir()
    assert ChildRegistry(tmp_path / "children.json").reap_leftovers() == []
