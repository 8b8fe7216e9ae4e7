"""The port: the one way proxy/ reaches the supervisor (DESIGN: arrows point one way).

proxy/ imports this module, the read-model values it names, errors and events; never
`supervisor.daemon`, `supervisor.instance` or `supervisor.reservation`. The daemon implements
`Supervisor`; a proxy test may implement it with a few lines instead of a whole daemon.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import AsyncGenerator, Iterable, Mapping
from contextlib import AbstractContextManager
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from corral.supervisor.config import GroupSpec, LoadedConfig, ModelSpec
    from corral.supervisor.events import EventBus
    from corral.supervisor.pull import Puller
    from corral.supervisor.reload import ReloadAttempt
    from corral.supervisor.rpc.lender import Lender


class State(StrEnum):
    """An instance's state (the read model's words for it)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, slots=True)
class ModelStatus:
    """What the proxy may read of one configured model: its spec and its state over its
    replicas (ready when any replica serves, starting while one starts)."""

    name: str
    spec: ModelSpec
    state: State
    since: float  # wall clock of the first replica's last state change
    # A remote's last request: True answered, False failed, None none yet (or not a remote).
    answering: bool | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Broken:
    """What the supervisor found when a request to a child broke."""

    unresponsive: bool  # the child stopped answering and was killed for it
    detail: str | None  # the child's own words (may quote its log): for the daemon log only


@dataclasses.dataclass(frozen=True, slots=True)
class Restored:
    """A saved slot restored into this request's slot before it was sent (the prompt cache)."""

    tokens: int  # prompt tokens the child had no need to prefill again
    seconds: float  # the restore's cost (tokenizing the request included)
    file: str = ""  # the file restored, and the setup it was saved under (the cache's key)
    key: str = ""


# Who is asking: the name the proxy's auth gives the API key that authenticated the request (a
# digest of it, never the key), None when no keys are configured. Set for the request's task,
# so every lease it takes (the relay's, a group's members') is pinned in its namespace: the
# prompt cache keeps each key's saves and slots apart (docs/memory.md, "Per key").
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("corral_caller",
                                                                    default=None)


class PromptSlots(Protocol):
    """A child's slots, as the prompt cache tracks them (supervisor/prompt_cache/)."""

    async def pin(self, lease: Lease, url: str, body: Any,
                  parsed: dict[str, Any] | None = None, caller: str | None = None) -> Any: ...
    def unpin(self, lease: Lease) -> None: ...
    def verify(self, restored: Restored, cache_n: int | None) -> None: ...
    def refused(self, lease: Lease) -> None: ...


class PrefixSalter(Protocol):
    """A vLLM child's requests, each with its caller's `cache_salt` (prompt_cache/salt.py)."""

    def apply(self, url: str, body: Any, parsed: dict[str, Any] | None,
              caller: str | None) -> Any: ...


class LeaseOwner(Protocol):
    """What a lease calls back into (the instance that handed it out)."""

    def _give_back(self, lease: Lease) -> None: ...
    def _child_alive(self, lease: Lease) -> bool: ...
    async def _broken(self, lease: Lease, timed_out: bool) -> Broken: ...


class Lease:
    """The right to send one request to one ready child; `release()` exactly once (more calls
    do nothing). A value for the proxy: where to send, with which headers and deadlines."""

    __slots__ = ("_owner", "_prompt_slots", "_released", "_salts", "_slots", "base_url",
                 "first_byte_timeout", "headers", "idle_timeout", "instance", "model", "pid",
                 "ready_since", "restored", "served_name", "slot")

    def __init__(self, owner: LeaseOwner, *, model: str, instance: str, pid: int | None,
                 base_url: str, headers: Mapping[str, str], first_byte_timeout: float | None,
                 idle_timeout: float | None, ready_since: float, slots: Any = None,
                 prompt_slots: PromptSlots | None = None, served_name: str | None = None,
                 salts: PrefixSalter | None = None):
        self._owner = owner
        self._released = False
        self._slots = slots  # the slot set it came from (a reload may give the next child new)
        self.model = model  # the configured model
        self.instance = instance  # the instance's own name ("<model>#<n>" for a replica)
        self.pid = pid
        self.base_url = base_url
        self.headers = headers
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.ready_since = ready_since  # wall clock: when the child became ready
        # What the server behind it calls the model (None: the model's own name): requests
        # carry it in `model`, answers get the model's name back.
        self.served_name = served_name
        self._prompt_slots = prompt_slots
        # A vLLM child: each caller's prefix cache its own (prompt_cache/salt.py).
        self._salts = salts
        self.slot: int | None = None  # the child's slot the request was pinned to (id_slot)
        self.restored: Restored | None = None

    async def pin(self, url: str, body: Any, parsed: dict[str, Any] | None = None) -> Any:
        """Before the request goes to the child's `url` (at most once): with the prompt cache
        on, the body (bytes or a dict) pinned to a slot (`id_slot`), and a saved prefix
        restored into that slot when it is empty and one matches (`restored`), all in the
        namespace of the request's caller (`CALLER`). Otherwise the
        body as is. `parsed`: what bytes `body` parse to, when the caller has it already."""
        if self._salts is not None:
            return self._salts.apply(url, body, parsed, CALLER.get())
        if self._prompt_slots is None or self.slot is not None:
            return body
        return await self._prompt_slots.pin(self, url, body, parsed, CALLER.get())

    def pins_requests(self) -> bool:
        """Whether `pin` may change this lease's requests: the prompt cache pins them to
        slots, or salts them for the request's caller (with no keys configured there is no
        caller, and a salted child's requests go as they are). A relay worker asks the
        daemon to pin only then: one round trip fewer per request."""
        return self._prompt_slots is not None or (self._salts is not None
                                                  and bool(CALLER.get()))

    def reused(self, cache_n: int | None) -> None:
        """The child's answer said it took `cache_n` prompt tokens from its cache
        (`timings.cache_n`; None: it did not say). Only read after a restore: one the child
        did not reuse turns restores of that setup off (the prompt cache's verify)."""
        if self.restored is not None and self._prompt_slots is not None:
            self._prompt_slots.verify(self.restored, cache_n)

    def refused(self) -> None:
        """The child answered this request with an error status (a 400 for a field it does
        not take, a prompt over its context), or never answered it (a hang-up, a timeout, a
        dropped connection): it may never have touched the slot, which then
        holds what it held before, not this request. The prompt cache never saves that slot
        under this request's tokens (the file would hold another conversation's KV)."""
        if self.slot is not None and self._prompt_slots is not None:
            self._prompt_slots.refused(self)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._prompt_slots is not None:
                self._prompt_slots.unpin(self)
            self._owner._give_back(self)

    def child_alive(self) -> bool:
        """Whether the child behind this lease still runs (cheap, synchronous)."""
        return self._owner._child_alive(self)

    async def report_broken(self, timed_out: bool = False) -> Broken:
        """The request to the child broke (`timed_out`: it sent nothing in time). A dead child
        is marked failed at once, and a silent one is probed at once and killed when it does
        not answer, so the next request starts a fresh child instead of leasing this one."""
        return await self._owner._broken(self, timed_out)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestsNow:
    """A model's requests at this moment, over all its instances."""

    in_flight: int
    queued: int
    slots: int  # the requests its children take at once (each one's `parallel`)


class Reservation(Protocol):
    """A group's hold on its members: held models count as busy."""

    @property
    def names(self) -> frozenset[str]: ...
    def swap(self, failed: str, backup: str) -> None: ...
    def release(self, name: str) -> None: ...
    def release_all(self) -> None: ...


class Supervisor(Protocol):
    """What proxy/ may ask of the supervisor."""

    events: EventBus
    pulls: Puller

    @property
    def closing(self) -> bool: ...
    @property
    def loaded(self) -> LoadedConfig: ...
    @property
    def lender(self) -> Lender | None: ...
    def model_names(self) -> list[str]: ...
    def groups(self) -> Mapping[str, GroupSpec]: ...

    # the door
    async def acquire(self, name: str, *, ignore_backoff: bool = False) -> Lease: ...
    def reserve(self, names: Iterable[str]) -> AbstractContextManager[Reservation]: ...
    def check_capacity(self, names: Iterable[str], what: str) -> None: ...

    # read models
    def resolve(self, name: str) -> str | None: ...
    def status(self, name: str) -> ModelStatus: ...
    def spec(self, name: str) -> ModelSpec: ...
    def statuses(self) -> list[ModelStatus]: ...
    def ready_now(self, name: str) -> bool: ...
    def describe(self) -> list[dict[str, Any]]: ...
    def describe_one(self, name: str) -> dict[str, Any]: ...
    def requests_now(self, names: Iterable[str]) -> RequestsNow: ...
    def child_logs(self, key: str, lines: int) -> dict[str, Any]: ...
    def follow_logs(self, key: str, lines: int,
                    idle: float) -> AsyncGenerator[dict[str, Any], None]: ...
    def inventory(self, name: str) -> dict[str, Any] | None: ...
    def memory_status(self) -> dict[str, Any]: ...
    def prompt_cache_status(self) -> dict[str, Any]: ...
    def config_status(self) -> dict[str, Any]: ...
    async def gguf_info(self, name: str) -> dict[str, Any]: ...

    # admin commands (`admin`: the caller holds an admin key, or none are configured)
    async def load(self, name: str, overrides: Mapping[str, Any] | None = None,
                   restart: bool = False) -> ModelStatus: ...
    async def unload(self, name: str, force: bool = False) -> ModelStatus: ...
    def load_soon(self, name: str) -> ModelStatus: ...
    def unload_soon(self, name: str, *, admin: bool) -> ModelStatus: ...
    async def rebalance(self, name: str) -> ModelStatus: ...
    def reload(self, trigger: str) -> asyncio.Task[ReloadAttempt]: ...


__all__ = ["CALLER", "Broken", "Lease", "LeaseOwner", "ModelStatus", "PromptSlots", "Reservation",
           "Restored", "State", "Supervisor"]
