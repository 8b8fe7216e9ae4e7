"""systemd's notify protocol (sd_notify(3)), in the few lines it takes, and the notifier that
speaks it for the daemon (systemd/corral.service runs corral as Type=notify):

- READY=1 once the proxy listens (the CLI calls `ready()` after the site started), so units
  ordered After=corral.service start when requests can be served, not when Python started;
- WATCHDOG=1 from the event loop every WATCHDOG_USEC/2: a loop stuck in a blocking call stops
  the pings and systemd restarts corral (WatchdogSec=);
- RELOADING=1 with MONOTONIC_USEC when a reload begins (SIGHUP, POST /admin/reload or a config
  file edit), READY=1 when it ends, also when it failed: the running config stays and serves;
- STOPPING=1 when the daemon begins to close;
- STATUS= with what is loaded and the load on it, shown by `systemctl status corral`.

Without NOTIFY_SOCKET (not under systemd, or not Type=notify) every call does nothing. A
failing send is logged and dropped, never raised: the service manager's socket must not be a way
to take the daemon down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

from corral.supervisor.events import Event

log = structlog.get_logger("corral.sdnotify")

NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# Events after which the STATUS= line may read differently.
STATUS_EVENTS = frozenset({"state", "load", "loaded", "stop", "load_failed"})
STATUS_INTERVAL = 1.0  # at most one STATUS= update per second: a load is a burst of events
# In-flight and queue counts change with every request and publish no event: looked at this
# often, and sent only when the line changed.
STATUS_REFRESH = 5.0
NAMES_SHOWN = 6  # a long model list would make `systemctl status` wrap


def socket_address(value: str) -> bytes | None:
    """NOTIFY_SOCKET as an AF_UNIX address: a path, or "@name" for the abstract namespace.
    Other forms (vsock:, from systemd 254) are not spoken here: None."""
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    return None


def watchdog_interval(environ: MutableMapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC, as sd_watchdog_enabled(3)
    advises), or None when the watchdog is off or meant for another process."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # inherited from a parent the watchdog is for
    return usec / 2 / 1_000_000


def summarize(models: list[dict[str, Any]]) -> str:
    """One line for STATUS=: "2 loaded (smol, qwen), 1 starting, 3 in flight, 0 queued"."""
    loaded = [m["name"] for m in models if m["state"] in ("ready", "draining")]
    names = ", ".join(loaded[:NAMES_SHOWN])
    if len(loaded) > NAMES_SHOWN:
        names += f", +{len(loaded) - NAMES_SHOWN}"
    parts = [f"{len(loaded)} loaded" + (f" ({names})" if names else "")]
    for state in ("starting", "stopping", "failed"):
        count = sum(1 for m in models if m["state"] == state)
        if count or state == "starting":
            parts.append(f"{count} {state}")
    parts.append(f"{sum(int(m.get('in_flight') or 0) for m in models)} in flight")
    parts.append(f"{sum(int(m.get('queue') or 0) for m in models)} queued")
    return ", ".join(parts)


class Notifier:
    """The protocol itself: one datagram per message, newline-separated KEY=VALUE lines."""

    def __init__(self, address: bytes | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._failing = False
        if address is not None:
            # Non-blocking: a full receive queue (systemd busy) drops a message rather than
            # stalling the event loop that serves every request.
            self._sock = socket.socket(socket.AF_UNIX,
                                       socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        """Send one message; True if it went out. Never raises."""
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:  # BlockingIOError (queue full), socket gone, refused, ...
            if not self._failing:  # one line per outage, not one per watchdog ping
                log.warning("sdnotify.send_failed", error=f"{type(exc).__name__}: {exc}",
                            message=fields[0].partition("=")[0],
                            socket=self.address.decode(errors="replace").replace("\0", "@"))
            self._failing = True
            return False
        if self._failing:
            log.info("sdnotify.send_recovered")
            self._failing = False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ServiceNotifier:
    """What corral tells systemd, from the daemon's event bus (`on_event`, for
    `daemon.events.listen`) and from the CLI (`ready()`, the `run()` task)."""

    def __init__(self, describe: Callable[[], list[dict[str, Any]]],
                 environ: MutableMapping[str, str] | None = None, *,
                 status_interval: float = STATUS_INTERVAL,
                 status_refresh: float = STATUS_REFRESH) -> None:
        env = os.environ if environ is None else environ
        self._notify = Notifier(socket_address(env.get("NOTIFY_SOCKET", "")))
        self.watchdog_interval = watchdog_interval(env) if self._notify.enabled else None
        # The children (llama-server, vLLM, rpc-server) inherit the environment: the socket
        # and the watchdog are corral's alone (as sd_notify's unset_environment does).
        for name in NOTIFY_VARIABLES:
            env.pop(name, None)
        self._describe = describe
        self._status_interval = status_interval
        self._status_refresh = status_refresh
        self._ready = False
        self._stopping = False
        self._note: str | None = None  # why the status needs attention (a failed reload)
        self._last_status = ""
        self._last_status_at = -status_interval
        self._timer: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self._notify.enabled

    # -- what the CLI calls ---------------------------------------------------------------------

    def ready(self, status: str | None = None) -> None:
        """READY=1, with STATUS= (`status`, or the summary of the models)."""
        self._ready = True
        if status is None:
            self._send_with_status("READY=1")
        else:
            self._notify.send("READY=1", f"STATUS={_one_line(status)}")

    def status(self, text: str) -> None:
        self._notify.send(f"STATUS={_one_line(text)}")

    def reloading(self) -> None:
        # MONOTONIC_USEC: when the reload began. systemd 253+ (Type=notify-reload) checks it
        # against when it sent its reload signal; 252 does without. time.monotonic_ns() is
        # CLOCK_MONOTONIC, the clock it means.
        self._notify.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def stopping(self) -> None:
        self._stopping = True
        self._send_with_status("STOPPING=1")

    async def run(self) -> None:
        """The pings and the periodic status look; the caller owns the task and cancels it."""
        if not self.enabled:
            return
        await asyncio.gather(self._watchdog(), self._refresh_status())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._notify.close()

    # -- the event bus ------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        if not self.enabled:
            return
        if event.kind == "stopping":
            self.stopping()
        elif not self._ready:
            return  # ready() sends the status; a reload's READY=1 would come before listening
        elif event.kind in STATUS_EVENTS:
            self._status_soon()  # during the drain too: the children stopping one by one
        elif self._stopping:
            return  # a reload refused at shutdown: no READY=1 after STOPPING=1
        elif event.kind == "reloading":
            self.reloading()
        elif event.kind == "reload":
            # READY=1 also after a failed reload: the running config stays and serves.
            self._note = None if event.data.get("ok") else "last reload failed, config kept"
            self._send_with_status("READY=1")

    # -- internals ------------------------------------------------------------------------------

    async def _watchdog(self) -> None:
        """WATCHDOG=1 from the event loop itself: a loop that does not come round does not
        ping, which is the point."""
        if self.watchdog_interval is None:
            return
        while True:
            self._notify.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)

    async def _refresh_status(self) -> None:
        while True:
            await asyncio.sleep(self._status_refresh)
            if self._ready and self._status_text() != self._last_status:
                self._status_soon()

    def _status_soon(self) -> None:
        """Coalesce: one pending update at a time, at most one per status_interval. The update
        reads the state when it runs, so the last change is always in the last line sent.
        Deferred even when due now: the publisher may be in the middle of a change."""
        if self._timer is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last_status_at + self._status_interval - loop.time())
        self._timer = loop.call_later(delay, self._flush_status)

    def _flush_status(self) -> None:
        self._timer = None
        self._send_with_status()

    def _send_with_status(self, *fields: str) -> None:
        text = self._status_text()
        if self._notify.send(*fields, f"STATUS={text}"):
            self._last_status = text
        with contextlib.suppress(RuntimeError):  # no running loop (a test's direct call)
            self._last_status_at = asyncio.get_running_loop().time()

    def _status_text(self) -> str:
        try:
            text = summarize(self._describe())
        except Exception:  # the status line is a courtesy; the daemon must not pay for it
            log.exception("sdnotify.status_failed")
            text = "status unavailable"
        if self._stopping:
            text = f"stopping: {text}"
        if self._note:
            text = f"{text}; {self._note}"
        return _one_line(text)


def _one_line(text: str) -> str:
    # A newline would start a new KEY=VALUE field of the message.
    return " ".join(text.splitlines())
