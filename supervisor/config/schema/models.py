"""The `models:` section: one model's settings (llama-server and vLLM keys side by side; which
backend reads which is checks/backends.py's business)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from corral.supervisor.backends.binaries import STANDARD_KV_TYPES, TURBO_KV_TYPES
from corral.supervisor.config.schema.base import STRICT, SentKey
from corral.supervisor.config.schema.memory import CacheRamMb, KvCacheConfig
from corral.supervisor.config.schema.overrides import LoadOverridesConfig
from corral.supervisor.config.schema.request import RequestFilters
from corral.supervisor.config.schema.rpc import RpcConfig

__all__ = ["BackendKind", "Capability", "ModelConfig", "ReplicasConfig"]

# Checked against what the binary accepts (its --help), when the config is resolved.
KvCacheType = str
BackendKind = Literal["llama-server", "vllm", "command", "remote"]
# What a model answers; each OpenAI path needs one (proxy/capabilities.py).
Capability = Literal["chat", "completion", "embeddings", "rerank", "vision"]

# Flags corral sets itself: a child listens on 127.0.0.1 at a port corral picks (the proxy and
# the pid file rely on both), and corral gives every child an API key of its own so no other
# local user can talk to its port. A user's value would break or weaken that.
_OWNED_FLAGS = {
    "--host": "corral binds every child to 127.0.0.1 itself",
    "--port": "corral gives every child a free port of its own",
    "--api-key": "corral gives every child an API key of its own",
    "--api-key-file": "corral gives every child an API key of its own",
}
# Flags whose value is a secret: argv is every local user's to read (ps, /proc/<pid>/cmdline),
# and corral shows it in /admin/config and the log. llama-server and vLLM read the token from
# their environment, which only the child's user can read and corral never shows.
_SECRET_FLAGS = dict.fromkeys(
    ("--hf-token", "-hft"), "a token in argv shows in `ps` to every local user, in /admin/config "
    "and in the log; give it in the environment instead: env: {HF_TOKEN: \"${HF_TOKEN}\"}")


class ReplicasConfig(BaseModel):
    model_config = STRICT

    min: int = Field(1, ge=1, description="children started when the model loads")
    max: int = Field(1, ge=1, description="children at most, started as the queue waits")
    scale_after: float = Field(
        2.0, gt=0, description="seconds a request waits with every replica busy before one "
        "more starts")


class ModelConfig(BaseModel):
    # `model` is optional only for command and remote models (checks/backends.py says so to
    # `corral check`); the JSON Schema says it to editors.
    model_config = ConfigDict(**STRICT, json_schema_extra={
        "if": {"required": ["backend"],
               "properties": {"backend": {"enum": ["command", "remote"]}}},
        "else": {"required": ["model"]}})

    backend: BackendKind = Field(
        "llama-server", description="llama-server (GGUF files), vllm (safetensors checkpoints "
        "or Hugging Face ids), command (any OpenAI-compatible server corral starts from "
        "`command`) or remote (an OpenAI-compatible endpoint at `url`, no process)")
    model: str | None = Field(
        None, description="llama-server: a .gguf file; vllm: a checkpoint folder or a Hugging "
        "Face id (relative paths are relative to this file); required by both, unused by "
        "command and remote")
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
    load_overrides: LoadOverridesConfig | None = Field(
        None, description="bounds of what an admin load may override for one start (ctx, "
        "cache types, parallel, draft settings); default: defaults.load_overrides")
    args: list[str] = []
    # Environment values often carry tokens (HF_TOKEN, ...): secret, so never shown.
    env: dict[str, SecretStr] = {}
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
    prompt_cache: bool | None = Field(
        None, description="false: this model's slots are never saved or restored")
    cache_ram_mb: CacheRamMb | None = Field(
        None, description="llama-server's prompt cache in RAM (--cache-ram, MiB; 0: off, -1: "
        "no limit; auto: a share of the RAM budget); default: defaults.cache_ram_mb")
    capabilities: list[Capability] | None = Field(
        None, description="what it answers: chat, completion, embeddings, rerank, vision "
        "(default: from the model's settings: embeddings: true → embeddings (+ rerank with "
        "--reranking in args); else chat and completion, + vision with an mmproj)")
    paths: list[str] = Field(
        [], description="more POST /v1 paths this model serves, beyond its backend's (a "
        "command child's /v1/tokenize, say): only these and the backend's own reach it")
    request: RequestFilters | None = Field(
        None, description="request defaults, overrides, stripped fields and a default system "
        "prompt (default: defaults.request)")
    mmproj: str | None = Field(None, description="multimodal projector; relative like model")
    # vLLM and command; checks/backends.py says which keys belong to which backend.
    command: list[str] | None = Field(
        None, min_length=1, description="vllm: how to start it, e.g. [/opt/vllm/bin/python, -m, "
        "vllm.entrypoints.openai.api_server] for a venv of its own (default: `vllm serve`); "
        "command: the whole argv (no shell), with ${PORT} where the port corral picked goes")
    # command and remote (checks/backends.py).
    health: str | None = Field(
        None, description="command: the path polled for 200 before the child is ready "
        "(default /health); `none`: ready once its port accepts connections")
    served_name: str | None = Field(
        None, description="command, remote: the name the server expects in `model` (corral "
        "rewrites it in requests, and back to this model's name in answers)")
    api: Literal["chat", "responses", "messages"] | None = Field(
        None, description="command, remote: the API family the server speaks when a group "
        "asks it (chat: /v1/chat/completions, the default; responses: /v1/responses only; "
        "messages: Anthropic's /v1/messages only); corral translates a member's request and "
        "answer")
    memory_mb: float | None = Field(
        None, gt=0, description="command: the child's memory (MiB of RAM) for placement "
        "before it is measured (corral cannot estimate an arbitrary server)")
    stop_signal: Literal["SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP"] | None = Field(
        None, description="command: the signal that asks it to stop (default SIGTERM; "
        "SIGKILL follows after stop_grace)")
    url: str | None = Field(
        None, description="remote: the endpoint's OpenAI-compatible base URL "
        "(http(s)://host[:port][/prefix], with or without a trailing /v1)")
    api_key: SentKey = Field(
        None, description="remote: sent as `Authorization: Bearer` (a secret: never shown)")
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
    gpus: list[int] | None = Field(
        None, min_length=1, description="GPU indices (NVML's / amdsmi's order) this model may "
        "run on; its replicas spread over them (default: any GPU, placed by free memory)")
    replicas: int | ReplicasConfig = Field(
        1, description="identical children behind this name (least busy first): a number, or "
        "{min, max, scale_after} to scale with the queue and back down on ttl")

    @field_validator("paths")
    @classmethod
    def _check_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            if not re.fullmatch(r"/v1(?:/[A-Za-z0-9_-]+)+", path):
                raise ValueError(f"{path[:80]!r} is not a /v1 path (plain segments: "
                                 f"/v1/tokenize)")
        return value

    @field_validator("replicas")
    @classmethod
    def _check_replicas(cls, value: int | ReplicasConfig) -> int | ReplicasConfig:
        if isinstance(value, int) and value < 1:
            raise ValueError("replicas is at least 1")
        if isinstance(value, ReplicasConfig) and value.max < value.min:
            raise ValueError(f"replicas.max ({value.max}) is below replicas.min ({value.min})")
        return value

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (any(i < 0 for i in value) or len(set(value)) != len(value)):
            raise ValueError("gpus lists GPU indices (0, 1, ...), each once")
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
            why = _OWNED_FLAGS.get(flag) or _SECRET_FLAGS.get(flag)
            if why:
                problems.append(f"{flag} is not allowed in args: {why}")
        if problems:
            raise ValueError("; ".join(problems))
        return args
