"""The config: YAML → validated, resolved config objects, with errors that point at file:line
and the offending key. Data only: nothing here starts a process.

  issues     the issue type every problem is reported as (file:line, dotted key, message)
  yaml       one YAML text as data, with the line of every key and ${VAR} expanded
  include    a file with the files it `include:`s merged in
  schema/    the pydantic models, one module per section; secrets.py: the secret types
  resolve    a validated config → ModelSpec / GroupSpec (specs) and a LoadedConfig (loaded),
             with groups, strategy and checks/ that span sections
  load       load_config / parse_config / default_config; inspect_config (`corral check`)
  watch      the watchers of the config files and of models_dir (imported by the CLI only)
"""

from corral.supervisor.config.checks import admin_exposure_problem, admin_is_exposed
from corral.supervisor.config.include import Document, read_config_file, read_config_text
from corral.supervisor.config.issues import (
    ConfigError,
    ConfigIssue,
    Lines,
    Loc,
    dotted,
    issue_at,
    line_for,
    pos_for,
)
from corral.supervisor.config.load import (
    Inspection,
    default_config,
    inspect_config,
    load_config,
    parse_config,
)
from corral.supervisor.config.loaded import LoadedConfig
from corral.supervisor.config.resolve import VLLM_START_TIMEOUT, resolve
from corral.supervisor.config.schema import (
    Config,
    Defaults,
    GroupConfig,
    KvCacheConfig,
    MemoryConfig,
    ModelConfig,
    PolicyConfig,
    ReplicasConfig,
    split_listen,
)
from corral.supervisor.config.secrets import MASK, SecretOptions
from corral.supervisor.config.specs import GroupSpec, ModelSpec

__all__ = [
    "MASK", "VLLM_START_TIMEOUT", "Config", "ConfigError", "ConfigIssue", "Defaults",
    "Document", "GroupConfig", "GroupSpec", "Inspection", "KvCacheConfig", "Lines",
    "LoadedConfig", "Loc",
    "MemoryConfig", "ModelConfig", "ModelSpec", "PolicyConfig", "ReplicasConfig",
    "SecretOptions", "admin_exposure_problem", "admin_is_exposed", "default_config", "dotted",
    "inspect_config", "issue_at", "line_for", "load_config", "parse_config", "pos_for",
    "read_config_file", "read_config_text", "resolve", "split_listen",
]
