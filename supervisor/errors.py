"""Errors the supervisor raises through acquire(); the proxy maps each to an HTTP status."""

from __future__ import annotations


class SupervisorError(RuntimeError):
    status = 500
    code = "internal_error"
    kind = "server_error"
    retry_after: float | None = None


class UnknownModel(SupervisorError):
    status = 404
    code = "model_not_found"
    kind = "invalid_request_error"

    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        super().__init__(f"model {name!r} does not exist; available: {', '.join(known) or 'none'}")


class QueueFull(SupervisorError):
    status = 429
    code = "queue_full"
    kind = "rate_limit_error"
    retry_after = 1.0


class QueueTimeout(SupervisorError):
    status = 503
    code = "queue_timeout"
    retry_after = 5.0


class NoCapacity(SupervisorError):
    """Every loaded model is busy and max_loaded forbids another."""

    status = 503
    code = "no_capacity"
    retry_after = 5.0


class ShuttingDown(SupervisorError):
    status = 503
    code = "shutting_down"
    retry_after = 5.0


class StartBackoff(SupervisorError):
    """The model's last start failed; corral waits (exponentially longer) before the next."""

    status = 503
    code = "model_start_backoff"

    def __init__(self, message: str, retry_after: float):
        self.retry_after = max(retry_after, 0.001)
        super().__init__(message)


class StartFailed(SupervisorError):
    """The child could not be started or exited before it was ready."""

    status = 502
    code = "model_start_failed"

    def __init__(self, message: str, tail: list[str] | None = None):
        self.tail = tail or []
        if self.tail:
            message += "\nlast log lines:\n" + "\n".join(self.tail[-10:])
        super().__init__(message)


class StartTimedOut(StartFailed):
    status = 504
    code = "model_start_timeout"
