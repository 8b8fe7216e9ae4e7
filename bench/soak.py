"""Churn soak: nothing may leak while corral starts, stops, evicts and loses children for a while.

Three tiny models, `max_loaded: 2` (so requests evict the least recently used), a tiny `ttl`
(so idle models stop), `parallel: 2`. For --minutes, client workers send streamed and plain
chats to random models and hang up mid-stream, while a chaos task kill -9s children, unloads
models (drained and forced) and loads them; every ~20 s everything goes quiet for longer than
the ttl, so TTL stops happen too. Every request has a deadline (--hang-after): one that passes
it counts as hung.

At the end it waits until every model has stopped (TTL), checks that no llama-server of this
run is left while corral is still up, compares corral's open fds with the count taken after
the warm-up (the same all-stopped state), stops corral with SIGTERM, and then looks for:

    leaked processes   children alive after corral exited, by the pids and create times
                       recorded during the run, and by command line (anything running one of
                       this run's model files, children reparented to init included)
    fd growth          corral's open fds at the end minus after the warm-up
    ports left         ports of this run's children (and corral's own) still listening

Target: 0 of each, no hung request, corral exits 0. Exits 1 otherwise.

    python bench/soak.py [--minutes 30] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from _harness import QUIET, code_note, corral_daemon, machine_note, tiny_model

MODELS = ["m1", "m2", "m3"]
TTL = 1.0
STOP_GRACE = 2.0
QUIET_EVERY = 20.0


@dataclass
class Child:
    pid: int
    create_time: float
    cmdline: list[str]


@dataclass
class Run:
    url: str
    corral_pid: int
    folder: Path  # model files live here: a command line naming it is one of ours
    hang_after: float
    rng: random.Random
    outcomes: Counter[str] = field(default_factory=Counter)
    children: dict[tuple[int, float], Child] = field(default_factory=dict)
    ports: set[int] = field(default_factory=set)
    zombies: set[int] = field(default_factory=set)
    quiet_until: float = 0.0
    stop: bool = False

    # -- watching corral's children --------------------------------------------------------------

    def watch_children(self) -> None:
        try:
            procs = psutil.Process(self.corral_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                key = (proc.pid, proc.create_time())
                if key not in self.children:
                    self.children[key] = Child(proc.pid, key[1], proc.cmdline())
                if proc.status() == psutil.STATUS_ZOMBIE:
                    self.zombies.add(proc.pid)
                for conn in proc.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN:
                        self.ports.add(conn.laddr.port)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue

    async def watcher(self) -> None:
        while not self.stop:
            self.watch_children()
            await asyncio.sleep(0.1)

    # -- clients -------------------------------------------------------------------------------

    async def quiet(self) -> None:
        now = time.monotonic()
        if now < self.quiet_until:
            await asyncio.sleep(self.quiet_until - now)

    async def chat(self, session: aiohttp.ClientSession, stream: bool, cancel: bool) -> str:
        model = self.rng.choice(MODELS)
        tokens = 400 if cancel else self.rng.randint(8, 64)
        body = {"model": model, "max_tokens": tokens, "ignore_eos": True, "stream": stream,
                "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(self.url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                if resp.status in (429, 503) and resp.headers.get("Retry-After"):
                    return f"refused {resp.status}"
                if resp.status in (502, 504):
                    return f"broken {resp.status} (child killed or failed)"
                return f"UNEXPECTED HTTP {resp.status}"
            if cancel:
                chunks = self.rng.randint(1, 5)
                async for _ in resp.content.iter_any():
                    chunks -= 1
                    if chunks == 0:
                        break
                resp.close()  # hang up mid-stream
                return "cancelled mid-stream"
            data = await resp.read()
        if not stream:
            return "ok"
        if b'"error"' in data:
            return "broken stream (error event)"
        if not data.rstrip().endswith(b"data: [DONE]"):
            return "broken stream (no [DONE])"
        return "ok"

    async def worker(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self.stop:
                await self.quiet()
                pick = self.rng.random()
                kind = "stream" if pick < 0.5 else "plain" if pick < 0.7 else "cancel"
                try:
                    outcome = await asyncio.wait_for(
                        self.chat(session, kind != "plain", kind == "cancel"), self.hang_after)
                except TimeoutError:
                    outcome = "HUNG"
                except (aiohttp.ClientError, OSError) as exc:
                    outcome = f"UNEXPECTED {type(exc).__name__}"
                self.outcomes[f"{kind}: {outcome}"] += 1

    async def admin(self, session: aiohttp.ClientSession, method: str, path: str) -> dict:
        async with session.request(method, self.url + path) as resp:
            data = await resp.json(content_type=None)
            return data if isinstance(data, dict) else {}

    async def chaos(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.hang_after)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            last_quiet = time.monotonic()
            while not self.stop:
                await asyncio.sleep(self.rng.uniform(1.0, 3.0))
                if time.monotonic() - last_quiet > QUIET_EVERY:
                    # longer than the ttl and a stop: idle models stop by TTL
                    self.quiet_until = time.monotonic() + TTL + STOP_GRACE + 1.5
                    last_quiet = self.quiet_until
                    self.outcomes["chaos: quiet period (TTL stops)"] += 1
                    await self.quiet()
                    continue
                try:
                    models = (await self.admin(session, "GET", "/admin/models"))["models"]
                    for m in models:
                        if m.get("port"):
                            self.ports.add(m["port"])
                    ready = [m for m in models if m["state"] == "ready" and m["pid"]]
                    pick = self.rng.random()
                    if pick < 0.4 and ready:
                        victim = self.rng.choice(ready)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(victim["pid"], signal.SIGKILL)
                        self.outcomes["chaos: kill -9 a child"] += 1
                    elif pick < 0.7 and ready:
                        force = self.rng.random() < 0.4
                        name = self.rng.choice(ready)["name"]
                        await self.admin(session, "POST", f"/admin/models/{name}/unload"
                                         + ("?force=true" if force else ""))
                        self.outcomes[f"chaos: unload{' (forced)' if force else ''}"] += 1
                    else:
                        await self.admin(session, "POST",
                                         f"/admin/models/{self.rng.choice(MODELS)}/load")
                        self.outcomes["chaos: load"] += 1
                except TimeoutError:
                    self.outcomes["chaos: HUNG admin call"] += 1
                except (aiohttp.ClientError, OSError, KeyError, ValueError) as exc:
                    self.outcomes[f"chaos: UNEXPECTED {type(exc).__name__}"] += 1


# -- checks ------------------------------------------------------------------------------------

def open_fds(pid: int) -> Counter[str]:
    """The open fds of corral: the daemon's and its relay workers' (relay_workers)."""
    kinds: Counter[str] = Counter()
    workers = []
    for child in psutil.Process(pid).children():
        # A child the chaos killed a moment ago is a zombie until corral reaps it: no
        # command line to read, and no worker.
        with contextlib.suppress(psutil.Error):
            if "corral.proxy.workers.main" in " ".join(child.cmdline()):
                workers.append(child.pid)
    for each in (pid, *workers):
        try:
            fds = os.listdir(f"/proc/{each}/fd")
        except FileNotFoundError:
            continue  # a worker gone since (spawned again by the daemon)
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{each}/fd/{fd}")
            except OSError:
                continue
            kind = target.split(":")[0] if ":" in target and not target.startswith("/") \
                else target
            kinds[kind] += 1
    return kinds


def ours(run: Run) -> list[psutil.Process]:
    """Processes running one of this run's model files (whoever their parent is now)."""
    found = []
    marker = str(run.folder)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in arg for arg in proc.info["cmdline"] or []):
                found.append(proc)
    return found


def alive(child: Child) -> bool:
    try:
        proc = psutil.Process(child.pid)
        return (abs(proc.create_time() - child.create_time) < 0.01
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def listening(ports: set[int]) -> dict[int, int | None]:
    found = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports:
            found[conn.laddr.port] = conn.pid
    return found


async def models_state(url: str) -> list[dict]:
    async with aiohttp.ClientSession() as session, session.get(url + "/admin/models") as resp:
        return (await resp.json())["models"]


async def wait_all_stopped(url: str, within: float) -> list[dict]:
    deadline = time.monotonic() + within
    while True:
        models = await models_state(url)
        if all(m["state"] in ("stopped", "failed") for m in models) \
                or time.monotonic() > deadline:
            return models
        await asyncio.sleep(0.2)


async def settle_fds(pid: int, baseline: int, within: float) -> Counter[str]:
    """corral's fds once back at (or under) the baseline, or after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        fds = open_fds(pid)
        if sum(fds.values()) <= baseline or time.monotonic() > deadline:
            return fds
        await asyncio.sleep(0.5)


async def warm_up(run: Run) -> Counter[str]:
    """Every model started once, every code path walked once, then all stopped by TTL: the
    state the end is compared with."""
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            for name in MODELS:
                for stream in (False, True):
                    async with session.post(run.url + "/v1/chat/completions", json={
                            "model": name, "max_tokens": 4, "stream": stream,
                            "messages": [{"role": "user", "content": "hi"}]}) as resp:
                        await resp.read()
    run.watch_children()
    await wait_all_stopped(run.url, TTL + STOP_GRACE + 10)
    await asyncio.sleep(1.0)
    return open_fds(run.corral_pid)


async def soak(run: Run, seconds: float, workers: int) -> None:
    tasks = [asyncio.create_task(run.watcher()), asyncio.create_task(run.chaos()),
             *(asyncio.create_task(run.worker()) for _ in range(workers))]
    started = time.monotonic()
    next_report = started + 60
    while time.monotonic() - started < seconds:
        await asyncio.sleep(min(1.0, seconds - (time.monotonic() - started)))
        if time.monotonic() >= next_report:
            next_report += 60
            total = sum(v for k, v in run.outcomes.items() if not k.startswith("chaos"))
            print(f"  {(time.monotonic() - started) / 60:4.1f} min: {total} requests, "
                  f"{len(run.children)} children seen, corral fds "
                  f"{sum(open_fds(run.corral_pid).values())}", flush=True)
    run.stop = True
    await asyncio.wait(tasks, timeout=run.hang_after + 5)
    for task in tasks:
        task.cancel()
    run.watch_children()


def plant_leak(folder: Path) -> int:
    """A process in its own session, listening on a port, with this run's folder in its
    command line: what an escaped child looks like. Returns its port."""
    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
            "s.listen(); print(s.getsockname()[1], flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder / "planted-leak")],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    print(f"planted a leak: pid {proc.pid} listening on {port}")
    return port


def log_counts(log: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event", "")
        reason = str(event.get("reason", ""))
        if name == "child.spawned":
            counts["child starts"] += 1
        elif name == "daemon.ttl_expired":
            counts["TTL stops"] += 1
        elif name == "instance.stop" and "evicted" in reason:
            counts["LRU evictions"] += 1
        elif name == "instance.stop" and "unloaded" in reason:
            counts["admin unloads"] += 1
        elif name == "instance.state" and event.get("new") == "failed":
            counts["children failed (kill -9 seen)"] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hang-after", type=float, default=60.0,
                        help="seconds after which a request counts as hung")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--relay-workers", type=int, default=0,
                        help="corral's relay_workers (their fds count as corral's)")
    parser.add_argument("--plant-leak", action="store_true",
                        help="negative control: leave a process listening on a port, named "
                             "like one of this run's children; the soak must fail")
    args = parser.parse_args()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="corral-soak-") as tmp:
        folder = Path(tmp)
        models = {name: {"model": str(tiny_model(folder, seed)), "ctx": 1024, "parallel": 2,
                         "ttl": TTL, "args": QUIET}
                  for seed, name in enumerate(MODELS, 1)}
        print(code_note())
        print(f"machine: {machine_note()}")
        print(f"soak: {args.minutes:g} min, {len(MODELS)} models, max_loaded 2, ttl {TTL:g} s, "
              f"parallel 2, {args.workers} client workers + chaos (kill -9, unload, load), "
              f"seed {args.seed}, relay_workers {args.relay_workers}", flush=True)
        with corral_daemon(models, log_level="info", stop_timeout=60,
                           policy={"max_loaded": 2, "evict_timeout": 10},
                           defaults={"queue_timeout": 30, "max_queue": 64,
                                     "stop_grace": STOP_GRACE},
                           shutdown_grace=5, relay_workers=args.relay_workers) as proxied:
            run = Run(proxied.url, proxied.pid, folder, args.hang_after,
                      random.Random(args.seed))
            before = asyncio.run(warm_up(run))
            print(f"after warm-up (all models stopped): corral has {sum(before.values())} "
                  f"open fds {dict(before)}", flush=True)
            if args.plant_leak:
                run.ports.add(plant_leak(folder))
            asyncio.run(soak(run, args.minutes * 60, args.workers))
            states = asyncio.run(wait_all_stopped(proxied.url, TTL + STOP_GRACE + 30))
            not_stopped = [f"{m['name']} {m['state']}" for m in states
                           if m["state"] not in ("stopped", "failed")]
            if not_stopped:
                failures.append(f"models still up {TTL + STOP_GRACE + 30:g} s after the "
                                f"load stopped: {', '.join(not_stopped)}")
            time.sleep(STOP_GRACE)
            strays = ours(run)
            if strays:
                failures.append(f"{len(strays)} process(es) of this run alive while corral "
                                f"says every model is stopped: "
                                f"{[(p.pid, p.ppid()) for p in strays]}")
            zombies = []
            for child in psutil.Process(proxied.pid).children():
                with contextlib.suppress(psutil.NoSuchProcess):  # reaped meanwhile
                    if child.status() == psutil.STATUS_ZOMBIE:
                        zombies.append(child.pid)
            if zombies:
                failures.append(f"unreaped (zombie) children of corral: {zombies}")
            after = asyncio.run(settle_fds(proxied.pid, sum(before.values()), 35))
            growth = sum(after.values()) - sum(before.values())
            print(f"at the end (all models stopped): corral has {sum(after.values())} open fds "
                  f"{dict(after)}")
            if growth > 0:
                diff = {k: after[k] - before[k] for k in after | before if after[k] != before[k]}
                failures.append(f"corral's open fds grew by {growth}: {diff}")
            corral_port = int(proxied.url.rsplit(":", 1)[1])
            proxied.proc.send_signal(signal.SIGTERM)
            try:
                code = proxied.proc.wait(60)
            except subprocess.TimeoutExpired:
                code = None
                failures.append("corral did not exit within 60 s of SIGTERM")
            if code not in (0, None):
                failures.append(f"corral exited with code {code}")
            counts = log_counts(proxied.log)
        time.sleep(0.5)
        leaked = [c for c in run.children.values() if alive(c)]
        strays = [p for p in ours(run) if p.pid not in {c.pid for c in leaked}]
        left = {port: pid for port, pid in listening(run.ports | {corral_port}).items()
                if pid is None or pid in {c.pid for c in leaked} | {p.pid for p in strays}
                or port == corral_port}
        for c in leaked:
            failures.append(f"leaked process {c.pid}: {' '.join(c.cmdline)[:120]}")
        for p in strays:
            with contextlib.suppress(psutil.Error):
                failures.append(f"leaked process {p.pid} (parent {p.ppid()}, not seen as "
                                f"corral's child): {' '.join(p.cmdline())[:120]}")
        for port, pid in left.items():
            failures.append(f"port {port} still listening (pid {pid})")
        for proc in [psutil.Process(c.pid) for c in leaked] + strays:  # clean up after us
            with contextlib.suppress(psutil.Error):
                proc.kill()

    print(f"machine: {machine_note()}")
    print("churn seen in corral's log: " + ", ".join(f"{k} {v}" for k, v in sorted(
        counts.items())))
    print("outcomes:")
    for kind, count in sorted(run.outcomes.items()):
        print(f"  {count:6d} × {kind}")
    hung = sum(v for k, v in run.outcomes.items() if "HUNG" in k)
    if hung:
        failures.append(f"{hung} hung requests (no answer within {args.hang_after:g} s)")
    unexpected = sum(v for k, v in run.outcomes.items() if "UNEXPECTED" in k)
    for kind in ("child starts", "TTL stops", "LRU evictions", "admin unloads",
                 "children failed (kill -9 seen)"):
        if not counts[kind]:
            print(f"note: no {kind} in this run; too short to cover that path")
    print(f"children seen {len(run.children)}, ports seen {len(run.ports)}")
    print(f"leaked processes {len(leaked) + len(strays)}   fd growth {max(growth, 0)}   "
          f"ports left listening {len(left)}   hung requests {hung}   "
          f"unexpected answers {unexpected} (reported, not failed)")
    if failures:
        print("SOAK FAILED:")
        for failure in failures:
            print(f"  - {failure}")
        return 1
    print("soak passed: nothing leaked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
