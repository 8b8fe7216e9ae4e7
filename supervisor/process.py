"""One child process: spawn, log capture, readiness probing, exit watch, graceful group stop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import aiohttp
import psutil
import structlog

from corral.supervisor import log_pipe, socket_dir
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.socket_dir import SocketDir

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
KILL_WAIT_S = 5.0
# The longest a start's readiness probe waits after the last one began. The log wake-up
# (wait_healthy) makes the common case immediate; this bounds the rest (a child that prints
# nothing as it turns ready, a ready line corral does not know). Cheap enough at this rate:
# a probe costs the daemon 0.2 ms of CPU refused, 0.3 ms answered 503 by a loading server
# (aiohttp, on the 2-core VM), so 1-1.5 % of a core while a child loads. The schedule before
# (10 ms growing ×1.5 to 250 ms) made a start up to 250 ms late (issue 37: +285 ms median on
# a GPU box, where a load takes under a second).
POLL_S = 0.02
# The least time between two probes' starts when output wakes them: a command child (any
# output wakes it) that logs without pause while it loads costs at most 1 / WAKE_GAP_S
# probes a second, not one per write.
WAKE_GAP_S = 0.005
# For this long after a ready line the probes keep WAKE_GAP_S apart: a line may come just
# before the port listens (uvicorn logs "Application startup complete" and then opens the
# socket vLLM hands it; nothing is printed after that).
HOT_S = 0.25
# What tells wait_healthy that a line may mean "ready": substrings of a line (a backend's
# ready_lines), or None: any output at all.
ReadyLines: TypeAlias = tuple[str, ...] | None


class ChildExited(RuntimeError):
    """The child ended before it became ready; carries its exit code and last log lines."""

    def __init__(self, message: str, returncode: int | None, tail: list[str]):
        self.returncode = returncode
        self.tail = tail
        super().__init__(message)


class ChildStartTimeout(RuntimeError):
    def __init__(self, message: str, tail: list[str]):
        self.tail = tail
        super().__init__(message)


def free_port(avoid: Collection[int] = ()) -> int:
    """A port free now, and not one of `avoid` (the kernel may hand the same free port to two
    callers in a row: children started together must not be given one port)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError("no free port outside the ones already handed out")


async def probe_health(session: aiohttp.ClientSession, url: str, timeout: float) -> str | None:
    """None when `url` answers 200 within `timeout`, else what went wrong."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}: {exc}"


async def port_open(port: int, timeout: float) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port` (a server with no health
    path: listening is all it says)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await asyncio.wait_for(writer.wait_closed(), timeout)
    return True


async def probe_lists_model(session: aiohttp.ClientSession, url: str, name: str,
                            headers: Mapping[str, str], timeout: float) -> bool:
    """Whether the OpenAI model list at `url` names `name` (vLLM answers /health before its
    API serves the model)."""
    try:
        async with session.get(url, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return False
            body = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return False
    models = body.get("data") if isinstance(body, dict) else None
    return isinstance(models, list) and any(
        isinstance(m, dict) and m.get("id") == name for m in models)


# What a child may see of the daemon's environment: enough to find its libraries, GPUs and
# caches, nothing else (the daemon's own secrets, API keys included, stay with the daemon).
_ENV_PASSED = frozenset({"PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "TZ", "LANG", "LANGUAGE",
                         "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV"})
_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "ROCR_", "HIP_", "HSA_", "ROCM_", "GGML_",
                 "VLLM_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "OMP_", "KMP_", "MKL_",
                 "XDG_")
# Secrets under those prefixes stay with the daemon too (HF_TOKEN is for corral's own pulls;
# HUGGING_FACE_HUB_TOKEN is its old name): a model that needs one names it in its `env:`.
_ENV_SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD")


def child_environment(parent: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """A minimal environment for a child: the passed-through variables, less any secret,
    plus the model's env."""
    env = {k: v for k, v in parent.items()
           if k in _ENV_PASSED or (k.startswith(_ENV_PREFIXES)
                                   and not k.upper().endswith(_ENV_SECRET_SUFFIXES))}
    env.update(extra)
    return env


def die_with_parent() -> None:
    """For a child between fork and exec (preexec_fn): SIGKILL it when the daemon dies, even
    by SIGKILL; if the daemon is already gone (reparented), exit at once instead."""
    parent = os.getppid()
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class LogRing:
    """A child's last lines, with a count of every line ever kept: a reader that remembers the
    count (its cursor) asks for what came since, and may wait for more."""

    def __init__(self, maxlen: int):
        self._lines: deque[str] = deque(maxlen=maxlen)
        self.written = 0  # lines kept so far, those that fell off the ring included
        self._grown = asyncio.Event()

    def append(self, line: str) -> None:
        self.extend((line,))

    def extend(self, lines: Sequence[str]) -> None:
        """A batch of lines, with one wake-up for the readers waiting."""
        if not lines:
            return
        self._lines.extend(lines)
        self.written += len(lines)
        self._grown.set()
        self._grown = asyncio.Event()  # re-armed: the next waiter waits for the next line

    def __iter__(self) -> Iterator[str]:
        return iter(self._lines)

    def __len__(self) -> int:
        return len(self._lines)

    def since(self, cursor: int) -> tuple[list[str], int]:
        """The lines kept after `cursor` that the ring still holds, and how many more came
        after it that it no longer holds (a reader that fell behind a chatty child)."""
        first = self.written - len(self._lines)  # the cursor of the oldest line held
        start = max(cursor, first)
        return list(self._lines)[start - first:], start - cursor

    def growth(self) -> asyncio.Event:
        """The event the next line sets (each batch of lines sets it, then arms a new one)."""
        return self._grown

    async def wait(self, timeout: float | None) -> None:
        """Until a line comes, or `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._grown.wait()


class ChildProcess:
    """A spawned native server. Knows nothing about models beyond a name for its logs."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str],
                 log_lines: int = 400, keeper: GroupKeeper | None = None,
                 stop_signal: signal.Signals = signal.SIGTERM,
                 sockets: SocketDir | None = None):
        self.name = name
        # A directory of its own for the child's Unix sockets (vLLM's), made at the spawn
        # and removed once its group is gone (supervisor/socket_dir.py says why).
        self._sockets = sockets
        self.socket_dir: str | None = None
        self.stop_signal = stop_signal  # what asks it to stop (a command child may want SIGINT)
        self._keeper = keeper
        self.argv = list(argv)
        self.env = dict(env)
        self.logs = LogRing(log_lines)
        self.started_at: float | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._output: log_pipe.LineReader | None = None
        # How long a stop waits for the exit after SIGKILL before it gives up on the child.
        self.kill_wait = KILL_WAIT_S
        # The group was swept after the child was reaped (or found gone, or not ours): it is
        # never signalled again.
        self._group_gone = False
        # Descendants seen outside the child's group (they called setsid or setpgid): a
        # signal to the group misses them, so a stop signals each (psutil checks the pid is
        # still that process's before it does).
        self._escaped: dict[int, psutil.Process] = {}
        self._log = structlog.get_logger("corral.child").bind(model=name)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    def alive(self) -> bool:
        """Whether the child still runs, asked of the kernel: a zombie the event loop has not
        reaped yet counts as dead."""
        if self._proc is None or self._proc.returncode is not None:
            return False
        try:
            return psutil.Process(self._proc.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def tail(self, n: int = 20) -> list[str]:
        return list(self.logs)[-n:]

    def exit_reason(self) -> str | None:
        """Why the child ended, when corral knows better than its last log line."""
        return None

    async def spawn(self) -> int:
        env = child_environment(os.environ, self.env)
        self._make_socket_dir(env)
        read_end, write_end = log_pipe.open_pipe()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_end,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: one killpg stops it and helpers
                preexec_fn=die_with_parent,
            )
        except BaseException:
            os.close(read_end)
            self._remove_socket_dir()  # nothing ran that could use it
            raise
        finally:
            os.close(write_end)  # the child's now: end of file comes when it (and helpers) exit
        self.started_at = time.time()
        if self._keeper is not None:
            self._keeper.watch(self._proc.pid)  # its group is the child's pid
        self._log = self._log.bind(pid=self._proc.pid)
        self._log.info("child.spawned", argv=self.argv)
        # Read in batches (supervisor/log_pipe.py): a busy llama-server logs ten lines a
        # request, and a wake-up per write was on every relayed request's bill.
        self._output = log_pipe.LineReader(self._keep)
        self._reader = asyncio.create_task(log_pipe.read_lines(self._output, read_end),
                                           name=f"logs:{self.name}")
        return self._proc.pid

    def _make_socket_dir(self, env: dict[str, str]) -> None:
        """Make the child's socket directory and name it in `env`, unless the model's env or
        the daemon's already names one: that one is the operator's, and corral removes
        nothing of it. A directory that cannot be made leaves the child the default."""
        if self._sockets is None or self._sockets.env in env:
            return
        try:
            self.socket_dir = socket_dir.make(self._sockets.kind)
        except OSError as exc:
            self._log.warning("child.socket_dir_failed", error=str(exc),
                              note="its sockets go to the system temp dir")
            return
        env[self._sockets.env] = self.socket_dir

    def _remove_socket_dir(self) -> None:
        """The child's group is gone (or never ran): its sockets go too. Once."""
        path, self.socket_dir = self.socket_dir, None
        if path is None:
            return
        try:
            socket_dir.remove(path)
        except OSError as exc:
            self._log.warning("child.socket_dir_not_removed", path=path, error=str(exc),
                              note="the next daemon start tries again")
            return
        self._log.debug("child.socket_dir_removed", path=path)

    def _keep(self, raw_lines: list[bytes]) -> None:
        lines = [line for raw in raw_lines
                 if (line := raw.decode("utf-8", "replace").rstrip())]
        self.logs.extend(lines)
        for line in lines:
            self._log.debug("child.output", line=line)

    async def exited(self) -> int:
        """The exit code, as soon as the process itself has ended (its log may still be
        draining: helpers it forked can hold the pipe open)."""
        assert self._proc
        return await self._proc.wait()

    async def wait(self) -> int:
        assert self._proc
        code = await self._proc.wait()
        await self._last_lines()
        return code

    async def _last_lines(self) -> None:
        """The output the child wrote before it exited, read now (not a batch later)."""
        if self._output is not None:
            self._output.read_to_end()
        if self._reader:
            # The pipe closes with the process (or its last holder); bounded anyway. wait()
            # neither cancels the reader at the bound nor swallows the caller's cancellation
            # (a stop during a start must stay a stop).
            await asyncio.wait({self._reader}, timeout=2)

    async def wait_healthy(self, ready: Callable[[float], Awaitable[bool]],
                           timeout: float, ready_lines: ReadyLines = None,
                           probe_path: str | None = None) -> None:
        """Probe `ready` (given the seconds it may take) until it says yes. A probe goes out
        at once when the child prints a line that says it may be ready (`ready_lines`: any
        line containing one of them; None: any output but a line naming `probe_path`, which
        a server logging each request writes for the probe itself), WAKE_GAP_S after the last one
        at the soonest and so for HOT_S after that line; otherwise POLL_S after the last one
        began: never more than POLL_S late, even for a child that prints nothing. One probe
        at a time: such a line during a probe brings the next one right after it. Each probe
        races the child's exit, so a child that dies is noticed at once, even while a probe
        hangs on a port someone else holds."""
        assert self._proc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        exit_task = asyncio.ensure_future(self._proc.wait())
        probe: asyncio.Future[bool] | None = None
        cursor = 0  # every line since the spawn may be the one that says it is ready
        hot_until = 0.0  # probes WAKE_GAP_S apart until then (a ready line was seen)
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise ChildStartTimeout(
                        f"{self.name} not ready after {timeout:g}s", self.tail())
                began = loop.time()
                probe = asyncio.ensure_future(ready(min(2.0, remaining)))
                await asyncio.wait({probe, exit_task}, return_when=asyncio.FIRST_COMPLETED)
                if exit_task.done():
                    probe.cancel()
                    self.sweep_group()
                    await self._last_lines()  # they say why (a port taken, a bad file)
                    raise self._exited_error()
                if probe.result():
                    if self._output is not None:
                        self._output.batch()  # serving now: its output read in batches
                    return
                cursor, hot_until = await self._until_probe_due(
                    cursor, ready_lines, began, deadline, hot_until, exit_task, probe_path)
        finally:
            if not exit_task.done():
                exit_task.cancel()
            if probe is not None and not probe.done():
                probe.cancel()  # cancelled mid-wait: no health request left running

    async def _until_probe_due(self, cursor: int, ready_lines: ReadyLines, began: float,
                               deadline: float, hot_until: float,
                               exit_task: asyncio.Future[int], probe_path: str | None = None,
                               ) -> tuple[int, float]:
        """Until the next probe is due or the child exits: POLL_S after the last one `began`,
        WAKE_GAP_S after it once a line since `cursor` looks like readiness, and for HOT_S
        after such a line. The new cursor and the end of the hot spell."""
        loop = asyncio.get_running_loop()
        gap = WAKE_GAP_S if loop.time() < hot_until else POLL_S
        while True:
            lines, lost = self.logs.since(cursor)
            cursor = self.logs.written
            # Lines that fell off the ring unread may have said it: probe rather than guess.
            if lost or _says_ready(lines, ready_lines, probe_path):
                gap, hot_until = WAKE_GAP_S, loop.time() + HOT_S
            wait = min(began + gap, deadline) - loop.time()
            if wait <= 0 or exit_task.done():
                return cursor, hot_until
            # The event is taken now, not when the task first runs: no line slips between.
            grown: asyncio.Future[Any] = asyncio.ensure_future(self.logs.growth().wait())
            waiting: set[asyncio.Future[Any]] = {grown, exit_task}
            try:
                await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                grown.cancel()

    def _exited_error(self) -> ChildExited:
        code = self.returncode
        tail = self.tail()
        last = f": {tail[-1]}" if tail else ""
        return ChildExited(f"{self.name} exited with code {code} before it was ready{last}",
                           code, tail)

    async def stop(self, grace: float) -> int | None:
        """Signal the group (SIGTERM unless told otherwise), wait up to `grace`, then SIGKILL the
        group. Returns the exit code."""
        if not self._proc:
            return None
        if self._proc.returncode is not None:
            # Reaped earlier (and its group swept then): its pid may belong to someone else now.
            return self._proc.returncode
        self._log.info("child.stopping", grace=grace)
        self._note_escaped()  # now, while the child's tree is whole
        self._signal_group(self.stop_signal)
        self._signal_escaped(self.stop_signal)
        try:
            await asyncio.wait_for(self._proc.wait(), grace)
        except TimeoutError:
            self._log.warning("child.kill", reason="grace expired")
        # Always sweep the group: helpers the child forked must not outlive it.
        self.sweep_group()
        try:
            # Bounded: a child in uninterruptible sleep (D state: a hung driver, a dead NFS
            # mount) ignores even SIGKILL, and a stop must not hang the daemon on it.
            code = await asyncio.wait_for(asyncio.shield(self.wait()), self.kill_wait)
        except TimeoutError:
            self._log.error("child.unkillable", kill_wait=self.kill_wait,
                            note="still there after SIGKILL; corral stops waiting for it")
            return None
        # Its group had SIGKILL before the child was reaped: nothing of it uses them now.
        self._remove_socket_dir()
        self._log.info("child.stopped", returncode=code)
        return code

    def sweep_group(self) -> None:
        """SIGKILL whatever is left of the child's process group (right after it exited, or at
        the end of a stop): the group is gone, the keeper need not watch it any more. Once the
        child has been reaped, the group is swept once at most: after that its id is free
        for the kernel to give to someone else's process."""
        if self._proc is None:
            return
        reaped = self._proc.returncode is not None
        self._note_escaped()
        self._signal_group(signal.SIGKILL)
        self._signal_escaped(signal.SIGKILL)
        self._escaped.clear()
        if reaped:
            self._group_gone = True
            self._remove_socket_dir()
        if self._keeper is not None:
            self._keeper.forget(self._proc.pid)

    def _note_escaped(self) -> None:
        """Note the child's descendants that left its process group. Only while the child is
        not reaped: its orphans belong to init after that, and are not told apart from
        anyone else's (nor, after a kill -9 of the daemon, by the keeper: docs/operations.md)."""
        assert self._proc
        if self._proc.returncode is not None:
            return
        try:
            tree = psutil.Process(self._proc.pid).children(recursive=True)
        except psutil.Error:
            return
        found = []
        for proc in tree:
            with contextlib.suppress(OSError):
                if proc.pid not in self._escaped and os.getpgid(proc.pid) != self._proc.pid:
                    self._escaped[proc.pid] = proc
                    found.append(proc.pid)
        if found:
            self._log.warning("child.left_its_group", pids=found,
                              note="signalled one by one with the child's group")

    def _signal_escaped(self, sig: signal.Signals) -> None:
        for proc in self._escaped.values():
            # NoSuchProcess: gone, or its pid is someone else's now (psutil compares the
            # start time); AccessDenied: it became another user's (setuid).
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)

    def _signal_group(self, sig: signal.Signals) -> None:
        """Signal the child's process group, only while it is provably the child's: the child
        not reaped yet (its pid cannot be reused while it is a zombie), or reaped and swept
        for the first time with no process holding its pid (then only helpers it forked can
        still be in the group: while one lives, the kernel gives that id to nobody). Never an
        error that ends the caller: a stop must always reach STOPPED."""
        assert self._proc
        if self._group_gone:
            return
        pgid = self._proc.pid
        if self._proc.returncode is not None and _pid_taken(pgid):
            # The pid belongs to another process now: its group is not ours to signal.
            self._group_gone = True
            self._log.info("child.group_reused", signal=sig.name,
                           note="the child was reaped and its pid is in use again")
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            if self._proc.returncode is not None:
                self._group_gone = True  # nothing left of it
        except OSError as exc:  # EPERM: a helper of another user's in the group?
            self._log.error("child.signal_failed", signal=sig.name, error=str(exc))
            if self._proc.returncode is not None:
                self._group_gone = True
            else:  # the child itself is ours while it is not reaped: signal it alone
                with contextlib.suppress(OSError):
                    os.kill(pgid, sig)


def _says_ready(lines: Sequence[str], ready_lines: ReadyLines,
                probe_path: str | None = None) -> bool:
    if ready_lines is None:
        if probe_path:
            # A server that logs each request would log our own probes: a line naming the
            # probe's path woke the probe that made it, and the probes fed themselves.
            return any(probe_path not in line for line in lines)
        return bool(lines)
    return any(hint in line for line in lines for hint in ready_lines)


def _pid_taken(pid: int) -> bool:
    """Whether a process (not a zombie we have reaped: that one is gone) holds `pid` now."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True
