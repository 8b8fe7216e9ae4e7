"""The config file's schema: every section and key, with its type, default and description
(pydantic; `corral schema` prints it as JSON Schema). Resolving it into specs is config.py's job,
checks that span sections live beside their concern (config_backends, config_policy)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from corral.supervisor.backends.binaries import STANDARD_KV_TYPES, TURBO_KV_TYPES
from corral.supervisor.config_memory import KvCacheConfig, MemoryConfig
from corral.supervisor.config_request import RequestFilters
from corral.supervisor.config_rpc import PeerConfig, RpcConfig, WorkerConfig

__all__ = ["BackendKind", "Config", "Defaults", "GroupConfig", "ModelConfig", "PolicyConfig",
           "ReplicasConfig", "RequestFilters", "split_listen"]

# Checked against what the binary accepts (its --help), when the config is resolved.
KvCacheType = str
BackendKind = Literal["llama-server", "vllm"]
# What a model answers; each OpenAI path needs one (proxy/capabilities.py).
Capability = Literal["chat", "completion", "embeddings", "rerank", "vision"]


class _Strict(BaseModel):
    # Unknown keys are errors: a typo like `tll: 60` must not pass silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Defaults(_Strict):
    ttl: float = Field(300, ge=0, description="idle seconds before a model is stopped; 0 = never")
    ctx: int = Field(4096, ge=0)
    start_timeout: float = Field(
        120, gt=0, description="seconds a child has to become ready (vllm children: 900 unless "
        "set here or on the model: model load plus graph capture)")
    parallel: int = Field(1, ge=1)
    n_gpu_layers: int = -1
    threads: int | None = Field(
        None, ge=1, description="CPU threads per child; default: cores / policy.max_loaded")
    max_queue: int = Field(64, ge=0, description="requests waiting per model before 429")
    queue_timeout: float = Field(300, gt=0, description="seconds a request waits for a slot")
    stop_grace: float = Field(10, ge=0, description="seconds between SIGTERM and SIGKILL")
    first_byte_timeout: float = Field(
        600, gt=0, description="seconds until the child's first response byte (CPU prefill)")
    idle_timeout: float = Field(120, gt=0, description="longest silence between stream chunks")
    health_interval: float = Field(5, gt=0, description="seconds between /health probes")
    health_timeout: float = Field(3, gt=0, description="timeout of one /health probe")
    health_failures: int = Field(
        3, ge=1, description="consecutive failed probes before the child is killed")
    start_backoff: float = Field(
        1, ge=0, description="back-off after a failed start, doubling per consecutive failure")
    start_backoff_max: float = Field(60, ge=0, description="cap of that back-off")
    kv_cache: KvCacheConfig | None = Field(
        None, description="KV cache mode for every model (default: cache_type_k/v as set)")
    request: RequestFilters | None = Field(
        None, description="request filters for every model that sets none of its own")
    loading_progress: bool = Field(
        False, description="a streamed chat request that waits for a cold model gets the load's "
        "progress first, as reasoning_content (what Open WebUI shows as thinking); a request "
        "asks for it itself with the header X-Corral-Progress: 1")


class PolicyConfig(_Strict):
    strategy: str = Field(
        "generic", description="generic | pinned-group | multi-group | fixed-appliance | "
        "plugin:package.module:Class | plugin:file.py:Class | an entry point in the group "
        "corral.strategies")
    max_loaded: int = Field(4, ge=1, description="children loaded at once, at most")
    evict_timeout: float = Field(
        30, gt=0, description="seconds a cold start waits for a busy model to drain before 503"
    )
    groups: list[str] = Field(
        [], description="pinned-group: the groups kept loaded; other models load on demand")
    shares: dict[str, int] = Field(
        {}, description="multi-group: group -> load slots its members use, and no other model")
    models: list[str] = Field(
        [], description="fixed-appliance: the fixed set loaded at boot (default: every model)")
    options: dict[str, Any] = Field({}, description="settings passed to a plugin strategy")


# Flags corral sets itself: a child listens on 127.0.0.1 at a port corral picks (the proxy and
# the pid file rely on both), and corral gives every child an API key of its own so no other
# local user can talk to its port. A user's value would break or weaken that.
_OWNED_FLAGS = {
    "--host": "corral binds every child to 127.0.0.1 itself",
    "--port": "corral gives every child a free port of its own",
    "--api-key": "corral gives every child an API key of its own",
    "--api-key-file": "corral gives every child an API key of its own",
}


class ReplicasConfig(_Strict):
    min: int = Field(1, ge=1, description="children started when the model loads")
    max: int = Field(1, ge=1, description="children at most, started as the queue waits")
    scale_after: float = Field(
        2.0, gt=0, description="seconds a request waits with every replica busy before one "
        "more starts")


class ModelConfig(_Strict):
    backend: BackendKind = Field(
        "llama-server", description="llama-server (GGUF files) or vllm (safetensors "
        "checkpoints or Hugging Face ids)")
    model: str = Field(description="llama-server: a .gguf file; vllm: a checkpoint folder or a "
                       "Hugging Face id (relative paths are relative to this file)")
    aliases: list[str] = []
    ttl: float | None = Field(None, ge=0)
    ctx: int | None = Field(None, ge=0)
    parallel: int | None = Field(None, ge=1)
    n_gpu_layers: int | None = None
    threads: int | None = Field(None, ge=1)
    cache_type_k: KvCacheType | None = Field(
        None, description="f16, q8_0, q4_0, ... as the binary's --help lists them (turbo2/3/4 "
        "with a TurboQuant build)")
    cache_type_v: KvCacheType | None = None
    kv_cache: KvCacheConfig | None = Field(
        None, description="auto / adaptive KV cache types from a ladder (default: "
        "defaults.kv_cache, else cache_type_k/v as set)")
    args: list[str] = []
    env: dict[str, str] = {}
    binary: str | None = None
    start_timeout: float | None = Field(None, gt=0)
    max_queue: int | None = Field(None, ge=0)
    queue_timeout: float | None = Field(None, gt=0)
    stop_grace: float | None = Field(None, ge=0)
    first_byte_timeout: float | None = Field(None, gt=0)
    idle_timeout: float | None = Field(None, gt=0)
    health_interval: float | None = Field(None, gt=0)
    health_timeout: float | None = Field(None, gt=0)
    health_failures: int | None = Field(None, ge=1)
    start_backoff: float | None = Field(None, ge=0)
    start_backoff_max: float | None = Field(None, ge=0)
    embeddings: bool = False
    loading_progress: bool | None = None
    capabilities: list[Capability] | None = Field(
        None, description="what it answers: chat, completion, embeddings, rerank, vision "
        "(default: from the model's settings: embeddings: true → embeddings (+ rerank with "
        "--reranking in args); else chat and completion, + vision with an mmproj)")
    request: RequestFilters | None = Field(
        None, description="request defaults, overrides, stripped fields and a default system "
        "prompt (default: defaults.request)")
    mmproj: str | None = Field(None, description="multimodal projector; relative like model")
    # vLLM only (backend: vllm); config_backends says which keys belong to which backend.
    command: list[str] | None = Field(
        None, min_length=1, description="vllm: how to start it, e.g. [/opt/vllm/bin/python, -m, "
        "vllm.entrypoints.openai.api_server] for a venv of its own (default: `vllm serve`)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm: the fraction of the WHOLE GPU it takes (default: "
        "its memory estimate over the GPU's size, so several vLLM children share a GPU)")
    kv_cache_dtype: str | None = Field(
        None, description="vllm: --kv-cache-dtype (auto, fp8, ... as the installed vLLM lists)")
    tensor_parallel_size: int | None = Field(None, ge=1, description="vllm: GPUs per layer")
    pipeline_parallel_size: int | None = Field(None, ge=1, description="vllm: pipeline stages")
    distributed_executor_backend: str | None = Field(
        None, description="vllm: mp or ray (multi-GPU, multi-node)")
    rpc: RpcConfig | None = Field(
        None, description="llama-server: split the layers over rpc-server workers (local "
        "children or peers' ones); the head and its workers start, stop and die together")
    replicas: int | ReplicasConfig = Field(
        1, description="identical children behind this name (least busy first): a number, or "
        "{min, max, scale_after} to scale with the queue and back down on ttl")

    @field_validator("replicas")
    @classmethod
    def _check_replicas(cls, value: int | ReplicasConfig) -> int | ReplicasConfig:
        if isinstance(value, int) and value < 1:
            raise ValueError("replicas is at least 1")
        if isinstance(value, ReplicasConfig) and value.max < value.min:
            raise ValueError(f"replicas.max ({value.max}) is below replicas.min ({value.min})")
        return value

    @field_validator("cache_type_k", "cache_type_v")
    @classmethod
    def _known_kv_type(cls, value: str | None) -> str | None:
        # A typo is caught here with every other error; whether this model's binary accepts
        # the type (turbo types need a TurboQuant build) is asked of the binary later.
        if value is not None and value not in (*STANDARD_KV_TYPES, *TURBO_KV_TYPES):
            raise ValueError(f"unknown cache type {value!r}; llama.cpp knows "
                             f"{', '.join(STANDARD_KV_TYPES)} (and {', '.join(TURBO_KV_TYPES)} "
                             f"with a TurboQuant build)")
        return value

    @field_validator("args")
    @classmethod
    def _check_args(cls, args: list[str]) -> list[str]:
        problems = []
        for arg in args:
            # `--port=8081` is the same flag as `--port 8081`.
            flag = arg.split("=", 1)[0] if arg.startswith("--") else arg
            if flag in _OWNED_FLAGS:
                problems.append(f"{flag} is not allowed in args: {_OWNED_FLAGS[flag]}")
        if problems:
            raise ValueError("; ".join(problems))
        return args


GroupType = Literal["parallel", "chain", "fan_out", "consensus"]
Fallback = Literal["strict", "partial", "retry_once", "replace_with"]
Selector = Literal["first_ok", "longest", "shortest", "majority", "judge"]


class GroupConfig(_Strict):
    models: list[str] = Field(min_length=1)
    type: GroupType = "parallel"
    required_responses: int | None = Field(
        None, ge=1, description="ok answers that make the result complete; default: all")
    member_timeout: float = Field(60, gt=0)
    fallback: Fallback = "strict"
    replace_with: dict[str, str] = {}
    pinned: bool = False
    selector: Selector = "first_ok"
    judge: str | None = None
    synthesizer: str | None = None
    template: str | None = None
    expose_as_model: bool = False


class Config(_Strict):
    include: list[str] | str = Field(
        [], description="files merged in before this one (relative to it), in order; "
        "one name or a list")
    listen: str = "127.0.0.1:8080"
    models_dir: str | None = None
    api_keys: list[str] = []
    admin_api_keys: list[str] = []
    admin_open: bool = Field(
        False, description="allow /admin without keys on a non-loopback listen address")
    max_body_mb: float = Field(32, gt=0)
    shutdown_grace: float = Field(30, ge=0)
    client_write_timeout: float = Field(
        30, gt=0, description="seconds a write to a client may wait for the client to take "
        "bytes; past that the client is cut off, its upstream request dropped and the model's "
        "slot freed")
    state_dir: str | None = None
    binary: str | None = None
    defaults: Defaults = Defaults()
    policy: PolicyConfig = PolicyConfig()
    memory: MemoryConfig = MemoryConfig()
    models: dict[str, ModelConfig] = {}
    groups: dict[str, GroupConfig] = {}
    peers: dict[str, PeerConfig] = Field(
        {}, description="other corrals that lend their devices (worker mode), by name; a "
        "model's rpc.workers may name them")
    worker: WorkerConfig = Field(
        WorkerConfig(), description="lend this machine's devices to heads (rpc-servers on "
        "request, authenticated by token)")

    @field_validator("listen")
    @classmethod
    def _listen_has_port(cls, value: str) -> str:
        split_listen(value)
        return value


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)
