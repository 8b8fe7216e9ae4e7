"""corral's shutdown within one budget, `shutdown_timeout` seconds from SIGTERM to exit, which
the service manager's stop timeout (systemd/corral.service: TimeoutStopSec=60) stays above:
past it systemd SIGKILLs the daemon, and with it the prompt-cache saves promised at the stop.

The order, each phase bounded by what is left of the budget:

1. stop accepting connections (the listening socket closes; `STOPPING=1`);
2. drain: requests in flight get up to `shutdown_grace`, cut short so that what follows fits;
3. the models' and the daemon's tasks cancelled (each ends at once: TASKS_S at most);
4. every child at once: its changed slots saved (up to `save_timeout`), then SIGTERM, then
   SIGKILL after its `stop_grace`; both shortened so that the last SIGKILL goes out by
   `kill_by`, KILL_WAIT_S for a child to be reaped after it;
5. the proxy's last connections closed, the keeper and the log: EXIT_S.

Saves come first: when the budget cannot hold all of it, the drain shrinks first, then a
child's `stop_grace` (its SIGKILL comes sooner), the saves last."""

from __future__ import annotations

import asyncio
import dataclasses

from corral.supervisor.process import KILL_WAIT_S

__all__ = ["EXIT_S", "HANDLERS_S", "TASKS_S", "ShutdownBudget"]

# Cancelled tasks end at their next await; one that does not is logged and left.
TASKS_S = 1.0
# What aiohttp gives each connection still open after the children are gone (the drain had
# its time): it waits this long, cancels the handler, then waits as long again.
HANDLERS_S = 0.5
# After the last child: the proxy's connections (HANDLERS_S twice), the HTTP session, the
# keeper, the pid file, the log's last lines and the interpreter's own exit.
EXIT_S = 2.0


@dataclasses.dataclass(frozen=True)
class ShutdownBudget:
    """`total` seconds from `began` (the event loop's clock when the signal came)."""

    total: float
    began: float

    @classmethod
    def starting_now(cls, total: float) -> ShutdownBudget:
        return cls(total, asyncio.get_running_loop().time())

    @property
    def deadline(self) -> float:
        return self.began + self.total

    @property
    def kill_by(self) -> float:
        """When every child must have had its SIGKILL: a child that ignores it (uninterruptible
        sleep) is waited for KILL_WAIT_S, and corral's own exit takes EXIT_S."""
        return self.deadline - KILL_WAIT_S - EXIT_S

    def drain_until(self, grace: float, stops: float) -> float:
        """When the drain ends: `grace` after the signal, or sooner so that the tasks' end and
        `stops` seconds (the longest child's save and stop_grace) still fit before `kill_by`."""
        return min(self.began + grace, self.kill_by - TASKS_S - stops)

    def left(self, until: float) -> float:
        return max(0.0, until - asyncio.get_running_loop().time())
