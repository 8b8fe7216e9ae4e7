"""What loading a config gives the daemon: the validated file, the resolved model and group
tables, where every key was written, and which strategy and GPU reader it names (as data: the
daemon builds them, supervisor/runtime.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.supervisor.config.issues import ConfigIssue, Lines, Loc, issue_at
from corral.supervisor.config.schema import Config
from corral.supervisor.config.secrets import SecretOptions
from corral.supervisor.config.specs import GroupSpec, ModelSpec
from corral.supervisor.discovery import Signature
from corral.supervisor.policy import ModelView, Snapshot

__all__ = ["LoadedConfig", "PluginChoice"]


@dataclass(frozen=True)
class PluginChoice:
    """A strategy or GPU reader the config names: a built-in name or `plugin:...`, the options
    it is built with (secret: a plugin's options may hold tokens), the folder a plugin file is
    found relative to, and where in the config it was named (for errors)."""

    spec: str
    options: SecretOptions = field(default_factory=SecretOptions)
    base_dir: Path = Path()
    loc: Loc = ()


@dataclass(frozen=True)
class LoadedConfig:
    """The validated file plus the resolved model table the daemon runs."""

    config: Config
    models: dict[str, ModelSpec]
    source: Path | None
    aliases: dict[str, str] = field(default_factory=dict)
    groups: dict[str, GroupSpec] = field(default_factory=dict)
    # File and line of every key, for checks made after loading (`corral check`'s listen).
    lines: Lines = field(default_factory=dict)
    # Every file the config was read from (the main one first, then what it includes) and a
    # hash of their contents: what a reload watches, and how /admin/config names a version.
    files: tuple[Path, ...] = ()
    digest: str = ""
    # Of the included files, those holding no YAML at all (include.Document.empty).
    empty_files: frozenset[Path] = frozenset()
    strategy: PluginChoice = field(default_factory=lambda: PluginChoice("generic"))
    # Members of groups marked `pinned: true`.
    pinned: frozenset[str] = frozenset()
    gpu_reader: PluginChoice = field(default_factory=lambda: PluginChoice("auto"))
    # The folder discovery read (models_dir, relative to the file that set it); None: none.
    models_folder: Path | None = None
    # What discovery listed there when this config was read, with each file's size and mtime:
    # the models folder's watch compares the folder with it once in place, for what changed
    # before it was (the daemon serves before its watch is set up).
    models_signature: Signature | None = None
    # The top-level `binary` (a path made absolute like every path of the config's; a bare
    # name stays a name, looked up on PATH), state_dir and prompt_cache.dir, resolved.
    binary: str | None = None
    state_dir: Path | None = None
    prompt_cache_dir: Path | None = None

    def snapshot(self, views: tuple[Any, ...] = (), now: float = 0.0) -> Snapshot:
        """The strategy's view: the models given (default: every model, none loaded)."""
        if not views:
            views = tuple(ModelView(name=n, loaded=False, stoppable=False, last_used=0.0,
                                    ttl=s.ttl) for n, s in self.models.items())
        return Snapshot(models=views, groups={g.name: g.models for g in self.groups.values()},
                        max_loaded=self.config.policy.max_loaded, now=now, pinned=self.pinned,
                        options=self.config.policy.options.get_secret_value())

    def issue(self, loc: Loc, message: str) -> ConfigIssue:
        return issue_at(str(self.source) if self.source else "<config>", self.lines, loc,
                        message)
