"""What the config resolves into: a model's and a group's settings with every default filled in
and every path absolute. Plain frozen data: backends, policy and the daemon read these."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from corral.supervisor.config.schema import (
    BackendKind,
    Defaults,
    Fallback,
    GroupType,
    LoadOverridesConfig,
    QuorumFallback,
    RequestFilters,
    Selector,
)

__all__ = ["GroupSpec", "ModelSpec", "VoteSpec"]

_DEFAULTS = Defaults()


@dataclass(frozen=True)
class ModelSpec:
    """One model with every default filled in and every path absolute: what a backend needs."""

    name: str
    backend: BackendKind
    model_path: Path
    aliases: tuple[str, ...]
    ttl: float
    ctx: int
    parallel: int
    n_gpu_layers: int
    threads: int
    cache_type_k: str | None
    cache_type_v: str | None
    args: tuple[str, ...]
    # The child's environment, values in clear (the config holds them as secrets): kept
    # out of the repr, so a spec that is logged shows no token.
    env: dict[str, str] = field(repr=False)
    binary: str | None
    start_timeout: float
    max_queue: int
    queue_timeout: float
    stop_grace: float
    # Defaulted so a spec can be built by hand (tests) without restating every knob.
    first_byte_timeout: float = _DEFAULTS.first_byte_timeout
    idle_timeout: float = _DEFAULTS.idle_timeout
    health_interval: float = _DEFAULTS.health_interval
    health_timeout: float = _DEFAULTS.health_timeout
    health_failures: int = _DEFAULTS.health_failures
    start_backoff: float = _DEFAULTS.start_backoff
    start_backoff_max: float = _DEFAULTS.start_backoff_max
    embeddings: bool = False
    loading_progress: bool = False
    prompt_cache: bool = False  # llama-server: slots saved at a stop, restored on demand
    # Where llama-server saves and restores slots (--slot-save-path); set at a start.
    slot_save_path: Path | None = None
    # llama-server's prompt cache in RAM (--cache-ram, MiB; -1: no limit, 0: off). None:
    # auto, a share of the RAM budget the memory tracker sets at a start (cache_ram.py).
    cache_ram_mb: int | None = None
    capabilities: tuple[str, ...] = ("chat", "completion")
    paths: tuple[str, ...] = ()  # POST /v1 paths it serves beyond its backend's
    request: RequestFilters | None = None  # applied by the proxy to every request's body
    mmproj: Path | None = None
    replicas_min: int = 1
    replicas_max: int = 1
    scale_after: float = 2.0
    kv_mode: str = "fixed"  # fixed | auto
    kv_ladder: tuple[tuple[str, str], ...] = ()  # (type_k, type_v) per step, best first
    kv_adaptive: bool = False
    kv_hold: float = 60.0
    # vLLM children (backend: vllm): cache_type_k carries vLLM's one --kv-cache-dtype.
    model_id: str | None = None  # a Hugging Face id vLLM fetches itself (model_path unused)
    command: tuple[str, ...] = ()
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # command children and remote endpoints (backend: command / remote).
    health_path: str | None = "/health"  # command: polled for 200 before ready; None: TCP only
    served_name: str | None = None  # what the server expects in `model` (rewritten both ways)
    # The API family a group's member call speaks to it: chat, responses or messages.
    api: str = "chat"
    memory_mb: float | None = None  # command: its footprint for placement until measured
    stop_signal: str = "SIGTERM"
    url: str | None = None  # remote: the base URL requests go to (a trailing /v1 removed)
    # remote: its API key in clear (the config holds it as a secret); out of the repr.
    api_key: str | None = field(default=None, repr=False)
    # Split over RPC workers (llama-server): as configured, then what a start deployed.
    rpc_workers: tuple[str, ...] = ()
    rpc_split: tuple[float, ...] | None = None
    rpc_threads: int = 1
    rpc_servers: tuple[str, ...] = ()  # host:port per worker, set when deployed
    tensor_split: tuple[int, ...] = ()  # layers per worker, set when deployed
    # GPUs (indices) the model is pinned to; empty: any.
    gpus: tuple[int, ...] = ()
    # Where a start placed it ("gpu0", ...; None: not placed, every GPU as before) and each
    # GPU's share of its layers (percent, `--tensor-split`; empty on one GPU). Set at a start.
    placed_gpus: tuple[str, ...] | None = None
    gpu_split: tuple[int, ...] = ()
    # Admin load overrides (supervisor/model/overrides.py): the bounds the config sets, and,
    # on a start's spec only, the draft settings and what the operator overrode for it.
    override_bounds: LoadOverridesConfig = field(default_factory=LoadOverridesConfig)
    draft_max: int | None = None  # llama-server: tokens drafted per step (a draft configured)
    draft_min: int | None = None
    overrides: tuple[tuple[str, int | str], ...] = ()


@dataclass(frozen=True)
class GroupSpec:
    """A validated group: every name in it is a canonical model name."""

    name: str
    type: GroupType
    models: tuple[str, ...]
    required_responses: int
    member_timeout: float
    fallback: Fallback
    replace_with: dict[str, str]
    pinned: bool
    selector: Selector
    judge: str | None
    synthesizer: str | None
    template: str | None
    expose_as_model: bool
    vote: VoteSpec | None = None  # how answers are compared; None: no vote (or exact)
    response_format: dict[str, Any] | None = None  # members get it unless the request sets one


@dataclass(frozen=True)
class VoteSpec:
    """How a group's answers are compared and counted. `extract` takes the vote out of an
    answer (regex: its first group; json: the value at `json_path`; last_line;
    first_sentence); `similar`
    clusters (the extracted votes, else the answers) by the embeddings of `similar_model`."""

    extract: Literal["regex", "json", "last_line", "first_sentence"] | None = None
    regex: str | None = None
    json_path: tuple[str | int, ...] = ()
    similar_model: str | None = None
    threshold: float = 0.9
    distinct_numbers: bool = True  # similar: a different last number never joins a cluster
    distinct_yes_no: bool = True  # similar: nor an opening yes and an opening no
    quorum: int | None = None
    on_no_quorum: QuorumFallback = "strict"

    @property
    def compare(self) -> str:
        if self.similar_model:
            return "extract+similar" if self.extract else "similar"
        return "extract" if self.extract else "exact"

