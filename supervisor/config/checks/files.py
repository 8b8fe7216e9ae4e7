"""The files a resolved config names, checked on this machine: model files and checkpoints,
projectors, binaries and vLLM / command executables given as paths, and models_dir. `corral
check` reports each one missing at its key's file:line; `serve` only warns (a file may appear
before its first request, and the folder is watched)."""

from __future__ import annotations

import os
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

from corral.supervisor.config.issues import ConfigIssue, Loc
from corral.supervisor.config.loaded import LoadedConfig

__all__ = ["missing_files", "setup_step"]


def missing_files(loaded: LoadedConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []

    def missing(loc: Loc, path: Path | str, what: str = "") -> None:
        step = setup_step(path)
        issues.append(loaded.issue(loc, f"{what + ' ' if what else ''}{path} does not exist"
                                        + (f" ({step} in corral's checkout sets it up)"
                                           if step else "")))

    # The default folder (`models` beside the file) may be missing: nothing asked for it.
    if loaded.models_folder is not None and loaded.config.models_dir is not None:
        if not loaded.models_folder.exists():
            missing(("models_dir",), loaded.models_folder, "folder")
        elif not loaded.models_folder.is_dir():
            issues.append(loaded.issue(("models_dir",), f"{loaded.models_folder} is not a "
                                                        f"folder"))
    _executable(loaded.binary, ("binary",), missing)
    for name, m in loaded.config.models.items():
        spec = loaded.models[name]
        at: Loc = ("models", name)
        if m.backend == "llama-server" and m.model is not None:
            if not spec.model_path.exists():
                missing((*at, "model"), spec.model_path)
            elif spec.model_path.is_dir():
                issues.append(loaded.issue((*at, "model"), f"{spec.model_path} is a folder; "
                                                            f"llama-server reads a .gguf file"))
        elif m.backend == "vllm" and m.model is not None and spec.model_id is None \
                and not spec.model_path.exists():
            missing((*at, "model"), spec.model_path, "checkpoint")
        if spec.mmproj is not None and not spec.mmproj.exists():
            missing((*at, "mmproj"), spec.mmproj)
        if m.binary is not None:
            _executable(spec.binary, (*at, "binary"), missing)
        if m.command and m.backend in ("vllm", "command"):
            _executable(spec.command[0], (*at, "command", 0), missing)
    return issues


# What the shipped presets name that a set-up step of corral's Makefile puts in place: a
# preset that needs one is not broken on a machine that has not run it, and says which.
_SETUP_FOLDERS = {("build", "vllm-venv"): "`make vllm`", ("build", "hf-venv"): "`make hf`"}
_SETUP_FILES = {("models", "SmolLM2-135M-Instruct.Q4_1.gguf"): "`make demo-model`",
                ("models", "all-MiniLM-L6-v2.F16.gguf"): "`make embed-model`"}


def setup_step(path: Path | str) -> str | None:
    """The Makefile target that creates `path`, when it is one of those (None: any other)."""
    parts = Path(path).parts
    if parts and parts[-1] == "models":  # the folder itself, as models_dir
        return "`make demo-model`"
    pairs = list(pairwise(parts))
    if pairs and pairs[-1] in _SETUP_FILES:
        return _SETUP_FILES[pairs[-1]]
    return next((_SETUP_FOLDERS[p] for p in pairs if p in _SETUP_FOLDERS), None)


def _executable(value: str | None, loc: Loc, missing: Callable[[Loc, str], None]) -> None:
    """A path (resolved already; a bare name is PATH's business, when the child starts)."""
    if value is not None and os.path.isabs(value) and not os.path.exists(value):
        missing(loc, value)
