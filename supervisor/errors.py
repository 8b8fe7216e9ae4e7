"""Errors the supervisor raises through acquire(). They say what happened and carry its data
(a message, seconds until a retry may succeed, a child's last log lines); proxy/errors.py
decides what each means in HTTP."""

from __future__ import annotations

_NAME_SHOWN = 100  # characters of a requested name repeated in a message (names are input)


class SupervisorError(RuntimeError):
    retry_after: float | None = None  # seconds after which the same request may succeed


class UnknownModel(SupervisorError):
    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        super().__init__(f"model {shown(name)} does not exist; "
                         f"available: {', '.join(known) or 'none'}")


class QueueFull(SupervisorError):
    retry_after = 1.0


class QueueTimeout(SupervisorError):
    retry_after = 5.0


class NoCapacity(SupervisorError):
    """Every loaded model is busy and max_loaded forbids another."""

    retry_after = 5.0


class NotServed(SupervisorError):
    """The strategy does not load this model on demand (e.g. a fixed appliance)."""


class SlotNotCleared(SupervisorError):
    """A request llama-server places itself (/v1/messages) could not be sent safely: a slot
    it may land on holds another caller's prompt, and the child did not erase it in time."""

    retry_after = 1.0


class ShuttingDown(SupervisorError):
    retry_after = 5.0


class StartBackoff(SupervisorError):
    """The model's last start failed; corral waits (exponentially longer) before the next."""

    def __init__(self, message: str, retry_after: float):
        self.retry_after = max(retry_after, 0.001)
        super().__init__(message)


class StartFailed(SupervisorError):
    """The child could not be started or exited before it was ready. `tail` holds its last
    log lines, for operators (daemon log, admin API): they stay out of the message, which
    clients see."""

    def __init__(self, message: str, tail: list[str] | None = None,
                 for_operators: str | None = None):
        self.tail = tail or []
        # The whole story (a worker's output, a peer's answer): the admin view's last_error.
        self.for_operators = for_operators
        super().__init__(_without_log_lines(message, self.tail))


class StartTimedOut(StartFailed):
    pass


class WorkersUnavailable(StartFailed):
    """A model split over RPC workers cannot be deployed now (a worker unreachable and the
    rest too small, a protocol mismatch): worth a retry once the worker is back."""

    retry_after = 5.0


def shown(name: str) -> str:
    """A requested name as messages quote it: repr, cut short (a name can be 1 MB of input)."""
    if len(name) <= _NAME_SHOWN:
        return repr(name)
    return repr(name[:_NAME_SHOWN]) + f"… ({len(name)} characters)"


def _without_log_lines(message: str, tail: list[str]) -> str:
    # A message built as "<what happened>: <its last log line>" keeps only what happened.
    for line in tail:
        if line.strip() and message.endswith(": " + line):
            return message[:-len(line) - 2]
    return message


class Unloaded(SupervisorError):
    """The model was unloaded while the request waited for it (or is being unloaded now): an
    unload ends with the model stopped, so the request is told instead of starting it again."""

    retry_after = 1.0


class NotAllowed(SupervisorError):
    """The caller may not do this (a user key asking to stop a model the operator keeps
    loaded): only an admin key may."""


class InUse(SupervisorError):
    """The model serves others' requests now; a user key may not cut them off."""

    retry_after = 5.0


class BadOverride(SupervisorError):
    """An admin load's override is unknown, or outside the bounds its model's config sets."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class SettingsDiffer(SupervisorError):
    """An admin load asks settings other than those the model runs with; only a restart
    applies them."""
