"""The config file's top level: every section, and the settings of corral itself (listen
address, API keys, ...)."""

from __future__ import annotations

import functools
import socket

from pydantic import BaseModel, Field, field_validator

from corral.supervisor.config.schema.base import STRICT, HeaderKey
from corral.supervisor.config.schema.defaults import Defaults
from corral.supervisor.config.schema.groups import GroupConfig
from corral.supervisor.config.schema.memory import MemoryConfig
from corral.supervisor.config.schema.models import ModelConfig
from corral.supervisor.config.schema.policy import PolicyConfig
from corral.supervisor.config.schema.prompt_cache import PromptCacheConfig
from corral.supervisor.config.schema.rpc import PeerConfig, WorkerConfig

__all__ = ["Config", "split_listen"]


class Config(BaseModel):
    model_config = STRICT

    include: list[str] | str = Field(
        [], description="files merged in before this one (relative to it), in order; "
        "one name or a list")
    listen: str = "127.0.0.1:8080"
    node_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$",
        description="this node's name in a fleet: every answer says it in X-Corral-Node, and "
        "/admin/models in `node`. Default: this machine's host name")
    models_dir: str | None = Field(
        None, description="folder whose *.gguf files become on-demand models (relative to "
        "this file). Default: `models` beside the config file, if it is there")
    api_keys: list[HeaderKey] = []
    admin_api_keys: list[HeaderKey] = []
    admin_open: bool = Field(
        False, description="allow /admin without keys on a non-loopback listen address")
    allowed_origins: list[str] = Field(
        [], description="web pages (origins, \"http://host:port\") whose requests corral "
        "answers, with CORS; \"*\" for any. Default: none besides corral's own status page "
        "(like Ollama's OLLAMA_ORIGINS)")
    allowed_hosts: list[str] = Field(
        [], description="names corral answers to besides IP addresses, localhost, its "
        "listen address and this machine's hostname: \"name\", \".example.com\" for its "
        "subdomains, \"*\" for any (a DNS-rebinding guard)")
    max_body_mb: float = Field(32, gt=0)
    max_answer_mb: float = Field(
        64, gt=0, description="a whole (not streamed) answer of a child or remote is held in "
        "memory up to this size; a bigger or endless one is a 502")
    shutdown_grace: float = Field(
        30, ge=0, description="seconds SIGTERM lets in-flight requests finish (also an "
        "unload's and a reload's drain); at a shutdown, less when shutdown_timeout needs the "
        "time for the saves and the children's stops")
    shutdown_timeout: float = Field(
        50, ge=10, description="seconds from SIGTERM to corral's exit, all of it: drain, "
        "prompt-cache saves, children's stop_grace and SIGKILL (8 s of it are fixed: tasks, "
        "a killed child's reaping, the exit). Keep it below the service manager's stop "
        "timeout (systemd/corral.service: TimeoutStopSec=60)")
    client_write_timeout: float = Field(
        30, gt=0, description="seconds a write to a client may wait for the client to take "
        "bytes; past that the client is cut off, its upstream request dropped and the model's "
        "slot freed. A request body that stops coming for as long is a 408")
    relay_workers: int = Field(
        0, ge=0, le=64, description="processes that serve requests beside the daemon on the "
        "same port (SO_REUSEPORT), each on a core of its own: a burst of requests is spread "
        "over them instead of waiting for one event loop. The daemon keeps the decisions "
        "(leases, queue, starts); 0 (the default): the daemon serves alone. Applies at the "
        "next start of corral")
    state_dir: str | None = None
    binary: str | None = None
    defaults: Defaults = Defaults()
    policy: PolicyConfig = PolicyConfig()
    memory: MemoryConfig = MemoryConfig()
    prompt_cache: PromptCacheConfig = PromptCacheConfig()
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

    def node(self) -> str:
        """This node's name: `node_name`, else the host name."""
        return self.node_name or _host_name()

    def several_callers(self) -> bool:
        """Whether more than one key reaches /v1 (the api_keys, and the admin keys beside
        them): each is a caller of its own, whose prompts another must not reuse. What a child
        shares with every caller (llama-server's RAM cache) is off by default then."""
        if not self.api_keys:
            return False  # no keys: /v1 is open, one caller as far as corral can tell
        keys = {k.get_secret_value() for k in (*self.api_keys, *self.admin_api_keys)}
        return len(keys) > 1


@functools.cache
def _host_name() -> str:
    # Once: it is read for every answer's X-Corral-Node.
    return socket.gethostname() or "localhost"


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)
