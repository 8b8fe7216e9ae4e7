"""The import and CLI smoke of `make test-lowest`, which runs it (with the relay, client-io and
streaming modules) in a venv holding the lowest versions pyproject.toml allows; in the main
venv it checks the same against the newest. Every declared dependency imports, at a version
its floor allows, and the corral command starts, checks a config and prints its schema."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / ".ci"))
from floors import floors, release  # noqa: E402

CLI = [sys.executable, "-m", "corral.supervisor.cli"]
# The module each distribution is imported as.
MODULES = {"aiohttp": "aiohttp", "httptools": "httptools", "uvloop": "uvloop",
           "structlog": "structlog", "watchfiles": "watchfiles", "psutil": "psutil",
           "nvidia-ml-py": "pynvml", "pyyaml": "yaml", "pydantic": "pydantic", "gguf": "gguf",
           "prometheus_client": "prometheus_client"}


@pytest.mark.parametrize("name", sorted(floors()))
def test_each_declared_dependency_imports_at_a_version_its_floor_allows(name: str) -> None:
    importlib.import_module(MODULES[name])
    assert release(metadata.version(name)) >= release(floors()[name]), metadata.version(name)


def test_the_whole_of_corral_imports() -> None:
    """Every module of both packages (a dependency's missing name fails at import)."""
    done = subprocess.run([sys.executable, "-c", """
import pkgutil, importlib, corral.supervisor, corral.proxy
for pkg in (corral.supervisor, corral.proxy):
    for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if not mod.name.endswith("__main__"):  # runs the CLI
            importlib.import_module(mod.name)
print("ok")
"""], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_cli_starts_checks_a_config_and_prints_the_schema(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "serve" in done.stdout and "check" in done.stdout, done
    done = subprocess.run([*CLI, "check", str(REPO / "presets" / "groups.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and ": ok (" in done.stdout, done.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text("models:\n  smol:\n    model: x.gguf\n    paralel: 2\n")
    done = subprocess.run([*CLI, "check", "--no-files", str(typo)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and f"{typo}:4: models.smol.paralel" in done.stderr, done
    done = subprocess.run([*CLI, "schema"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["type"] == "object", done.stderr
