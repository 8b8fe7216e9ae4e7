"""The wheel, as a user installs it: built from the sources, installed into a fresh venv (the
dependencies borrowed from this one), `corral --help` runs, every module of the checkout
imports from the installed copy and every file of the packages (the status page) is there.
A package the build forgot fails here, not on a user's machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"supervisor": "corral.supervisor", "proxy": "corral.proxy"}


def source_files() -> list[Path]:
    """Every file of the packages in the checkout, relative to the repository."""
    return sorted(p.relative_to(REPO) for folder in PACKAGES for p in (REPO / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix not in (".pyc", ".pyo"))


def module_name(path: Path) -> str:
    parts = [PACKAGES[path.parts[0]], *path.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, and what the build said."""
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    assert (major, minor) >= (77, 0), (
        f"setuptools {setuptools.__version__}: the build needs >=77 (SPDX license); "
        f"pip install -e '.[test]' brings it")
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: a build in the checkout leaves build/lib and *.egg-info behind.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(REPO / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--verbose", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = (tmp / "dist").glob("corral-*.whl")
    return found, built.stdout + built.stderr


@pytest.fixture(scope="module")
def wheel(build: tuple[Path, str]) -> Path:
    return build[0]


def test_the_build_has_nothing_to_warn_of(build: tuple[Path, str]) -> None:
    # setuptools stops building a `license = {text = ...}` table after 2027-02-18.
    assert "project.license" not in build[1] and "License classifiers" not in build[1], build[1]


def test_the_wheel_holds_every_file_of_the_packages(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        held = set(zf.namelist())
    wanted = {f"corral/{path.as_posix()}" for path in source_files()}
    assert not wanted - held, sorted(wanted - held)
    assert "corral/proxy/static/status.html" in held


def test_the_installed_wheel_runs_and_imports_every_module(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    # The dependencies from this venv, as plain path entries: its .pth files (this checkout's
    # editable install among them) are not read, so `corral` comes from the wheel alone.
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "deps.pth").write_text("".join(f"{p}\n" for p in ours))
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    helped = subprocess.run([venv / "bin" / "corral", "--help"], capture_output=True,
                            text=True, timeout=60, env=env, cwd=tmp_path, check=False)
    assert helped.returncode == 0, helped.stderr
    assert "serve" in helped.stdout and "check" in helped.stdout

    # A __main__ module runs the program when imported (`python -m ...`): it is checked as a
    # file below, and the package it belongs to is imported here.
    modules = sorted({module_name(p) for p in source_files()
                      if p.suffix == ".py" and p.stem != "__main__"})
    script = ("import importlib, sys\n"
              "for name in sys.argv[1:]:\n"
              "    module = importlib.import_module(name)\n"
              "    assert module.__file__.startswith(sys.prefix), (name, module.__file__)\n")
    imported = subprocess.run([python, "-c", script, *modules], capture_output=True,
                              text=True, timeout=300, env=env, cwd=tmp_path, check=False)
    assert imported.returncode == 0, imported.stderr
    for path in source_files():
        assert (site / "corral" / path).is_file(), path
