"""Loading a config: a file (with its includes) or a text, validated whole against the schema
and resolved; or the embedded default when there is no file."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from corral.supervisor import demo
from corral.supervisor.config.include import Document, read_config_file, read_config_text
from corral.supervisor.config.issues import ConfigError, issue_at
from corral.supervisor.config.loaded import LoadedConfig
from corral.supervisor.config.resolve import resolve
from corral.supervisor.config.schema import Config, ModelConfig

__all__ = ["default_config", "load_config", "parse_config"]


def load_config(path: Path | str) -> LoadedConfig:
    """The config at `path` (with its includes), validated whole: every problem, or none."""
    path = Path(path)
    return _validated(read_config_file(path), path)


def parse_config(text: str, source: Path | None = None) -> LoadedConfig:
    return _validated(read_config_text(text, source), source)


def _validated(doc: Document, source: Path | None) -> LoadedConfig:
    filename = str(source) if source else "<config>"
    try:
        config = Config.model_validate(doc.data)
    except ValidationError as exc:
        issues = [issue_at(filename, doc.lines, tuple(err["loc"]), err["msg"])
                  for err in exc.errors()]
        raise ConfigError(issues, doc.files) from exc
    base_dir = source.parent.resolve() if source else Path.cwd()
    try:
        return resolve(config, base_dir, source, doc.lines, files=doc.files, digest=doc.digest)
    except ConfigError as exc:
        raise ConfigError(exc.issues, doc.files) from exc


def default_config(models_dir: Path) -> LoadedConfig:
    """The embedded default: every *.gguf in models_dir, on demand, under the default policy;
    the demo model, when there, with the request profile that makes it answer well."""
    models = {}
    demo_path = models_dir / demo.FILE
    if demo_path.is_file():
        models[demo.NAME] = ModelConfig(model=str(demo_path.resolve()), request=demo.REQUEST)
    return resolve(Config(models_dir=str(models_dir), models=models), Path.cwd(), None, {})
