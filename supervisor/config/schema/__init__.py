"""The config file's schema: every section and key, with its type, default and description
(pydantic; `corral schema` prints it as JSON Schema), one module per section. Secrets are typed
as such (config/secrets.py), so any dump of the config to JSON shows them masked. Resolving the
schema into specs, and the checks that span sections, live beside it in config/."""

from corral.supervisor.config.schema.defaults import Defaults
from corral.supervisor.config.schema.groups import (
    CompareConfig,
    ExtractConfig,
    Fallback,
    GroupConfig,
    GroupType,
    QuorumFallback,
    Selector,
    SimilarConfig,
)
from corral.supervisor.config.schema.memory import KvCacheConfig, MemoryConfig, ladder_step
from corral.supervisor.config.schema.models import (
    BackendKind,
    Capability,
    ModelConfig,
    ReplicasConfig,
)
from corral.supervisor.config.schema.overrides import LoadOverridesConfig
from corral.supervisor.config.schema.policy import PolicyConfig
from corral.supervisor.config.schema.prompt_cache import PromptCacheConfig
from corral.supervisor.config.schema.request import RequestFilters
from corral.supervisor.config.schema.root import Config, split_listen
from corral.supervisor.config.schema.rpc import PeerConfig, RpcConfig, WorkerConfig

__all__ = ["BackendKind", "Capability", "CompareConfig", "Config", "Defaults", "ExtractConfig",
           "Fallback", "GroupConfig", "GroupType", "KvCacheConfig", "LoadOverridesConfig",
           "MemoryConfig",
           "ModelConfig", "PeerConfig", "PolicyConfig", "PromptCacheConfig", "QuorumFallback",
           "ReplicasConfig", "RequestFilters", "RpcConfig", "Selector", "SimilarConfig",
           "WorkerConfig", "ladder_step", "split_listen"]
