"""Where corral's CPU goes per request: py-spy on the daemon under the proxy_overhead load.

corral serves the tiny model with `parallel: 8`; 8 concurrent clients send one-token chats
(the proxy_overhead c8 load) for --seconds while `py-spy record --native` samples the daemon.
Prints corral's CPU per request (user and kernel, from /proc), then, over the samples outside
syscalls (py-spy counts a thread that is runnable but preempted as busy, and on 2 cores corral
is preempted right after each write that wakes the child, so syscall samples overstate the
kernel; /proc has the real figure):

- Python functions by self time (with the C they call), as % and µs of user CPU per request;
- corral's own functions (proxy/, supervisor/), inclusive;
- buckets: aiohttp client (corral → child), aiohttp server (client → corral), corral's own
  code, JSON, child log capture, logging, the event loop.

Needs py-spy (`.venv/bin/pip install py-spy`) and the right to ptrace the daemon (root, or
kernel.yama.ptrace_scope 0). For a flame graph, run `py-spy record --format speedscope -o
profile.json --pid <corral's pid>` under the same load.

    python bench/profile_hot_path.py [--seconds 15] [--concurrency 8] [--raw FILE]
    python bench/profile_hot_path.py --streams --tokens 500 --concurrency 2   # the chunk loop
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

from _harness import code_note, corral_and_its_child, machine_note, tiny_model

REPO = Path(__file__).resolve().parent.parent
CORRAL_FILE = re.compile(r"(^|/)(proxy|supervisor)/")  # py-spy names files from sys.path
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

# A sample goes to the bucket of its innermost frame that matches one (shared aiohttp code
# such as http_writer.py or streams.py goes to whichever side called it).
BUCKETS = {
    "child log capture (process._read_output / _keep)": ("_read_output", "_keep"),
    "JSON (json.loads/dumps)": ("json/decoder.py", "json/encoder.py", "json/__init__.py"),
    "logging (structlog)": ("structlog",),
    "aiohttp client (corral → child)": ("aiohttp/client.py", "aiohttp/client_reqrep.py",
                                        "aiohttp/connector.py", "aiohttp/client_proto.py"),
    "aiohttp server (client → corral)": ("aiohttp/web_protocol.py", "aiohttp/web_response.py",
                                         "aiohttp/web_request.py", "aiohttp/web_app.py",
                                         "aiohttp/web_urldispatcher.py",
                                         "aiohttp/web_middlewares.py"),
}


def bucket(frames: list[str]) -> str:
    for frame in reversed(frames):
        if corral_frame(frame):
            return "corral's own code (proxy/, supervisor/)"
        for name, needles in BUCKETS.items():
            if any(needle in frame for needle in needles):
                return name
    return "event loop (uvloop, asyncio), nothing above it"


def short(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    path = m["file"]
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = path.replace(str(REPO) + "/", "")
    return f"{m['func']} ({path}:{m['line']})" if m["line"] else f"{m['func']} ({path})"


def corral_frame(frame: str) -> bool:
    """A frame in corral's code, other than the CLI's (which holds the event loop)."""
    m = FRAME.match(frame)
    path = m["file"] if m else frame
    return bool(CORRAL_FILE.search(path)) and not path.endswith("cli.py")


def parse(raw: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
            if any(f.startswith("Thread._bootstrap (") for f in frames):
                # Another thread (the default executor's, anyio's): idle ones waiting on a
                # lock, which py-spy --native counts as busy. corral's relay runs on the
                # event loop's thread; /proc/PID/task shows the others near 0 CPU.
                continue
            stacks.append((frames, int(count)))
    return stacks


async def load(url: str, seconds: float, concurrency: int, streams: bool,
               tokens: int) -> tuple[int, int]:
    """Requests done and SSE events received in `seconds` of `concurrency` clients."""
    body = {"model": "tiny", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": streams, "messages": [{"role": "user", "content": "hi"}]}
    done = events = 0
    failed: Counter[int] = Counter()
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal done, events
            while time.monotonic() < deadline:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    data = await resp.read()
                if resp.status != 200:
                    failed[resp.status] += 1
                done += 1
                events += data.count(b"data: ")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    if failed:
        print(f"  (not 200: {dict(failed)} of {done} requests)")
    return done, events


SYSCALLS = ("write", "writev", "send", "sendmsg", "sendto", "read", "readv", "recv", "recvmsg",
            "recvfrom", "epoll_wait", "epoll_pwait", "epoll_ctl", "connect", "accept4", "close",
            "syscall", "__GI___libc_write", "__GI___libc_read")


def in_syscall(frames: list[str]) -> bool:
    leaf = frames[-1]
    return "(libc.so" in leaf and leaf.split(" ")[0] in SYSCALLS


def python_leaf(frames: list[str]) -> str:
    """The innermost Python frame: native frames below it are its C calls."""
    for frame in reversed(frames):
        m = FRAME.match(frame)
        if m and m["file"].endswith(".py"):
            return short(frame)
    return short(frames[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--streams", action="store_true", help="stream: true requests")
    parser.add_argument("--tokens", type=int, default=1, help="max_tokens (with ignore_eos)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed: .venv/bin/pip install py-spy")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        raw = Path(tmp) / "profile.txt"
        with corral_and_its_child(model, args.concurrency,
                                  defaults={"max_queue": 1024}) as (proxied, _):
            print(code_note())
            print(f"machine: {machine_note()}")
            asyncio.run(load(proxied.url, 2, args.concurrency, args.streams, args.tokens))
            spy = subprocess.Popen([py_spy, "record", "--pid", str(proxied.pid), "--rate",
                                    str(args.rate), "--duration", str(int(args.seconds) + 1),
                                    "--format", "raw", "--output", str(raw), "--native"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.5)  # py-spy attaches
            daemon = psutil.Process(proxied.pid)
            t0 = daemon.cpu_times()
            requests, events = asyncio.run(load(proxied.url, args.seconds, args.concurrency,
                                                args.streams, args.tokens))
            t1 = daemon.cpu_times()
            _, err = spy.communicate(timeout=60)
            if spy.returncode != 0 or not raw.exists():
                print(f"py-spy failed ({spy.returncode}): {err.decode()[-1000:]}")
                return 1
        stacks = parse(raw)
        if args.raw:
            shutil.copy(raw, args.raw)

    n_req = max(requests, 1)
    user_us = (t1.user - t0.user) * 1e6 / n_req
    sys_us = (t1.system - t0.system) * 1e6 / n_req
    total = sum(n for _, n in stacks)
    kernel = sum(n for frames, n in stacks if in_syscall(frames))
    work = [(frames, n) for frames, n in stacks if not in_syscall(frames)]
    busy = max(sum(n for _, n in work), 1)
    print(f"{requests} requests in {args.seconds:g} s at concurrency {args.concurrency} "
          f"({requests / args.seconds:.0f} req/s, {'streamed' if args.streams else 'plain'}, "
          f"max_tokens {args.tokens}, {events / n_req:.1f} SSE events per request)")
    print(f"corral CPU per request: {(user_us + sys_us) / 1000:.3f} ms = user {user_us:.0f} µs "
          f"+ kernel {sys_us:.0f} µs (from /proc, 10 ms ticks over the whole window)"
          + (f"; {(user_us + sys_us) * n_req / events:.1f} µs per SSE event" if events else ""))
    print(f"py-spy: {total} samples of a non-idle daemon thread; {100 * kernel / total:.0f} % "
          f"of them sat in a syscall. py-spy cannot tell running from runnable, so that share "
          f"also holds the time corral waits, preempted, after waking the child on 2 cores; "
          f"the kernel's real share is the /proc figure. The {busy} samples outside syscalls "
          f"are spread over user CPU below.")

    def us(n: int) -> str:
        return f"{100 * n / busy:5.1f} %  {user_us * n / busy:6.1f} µs/req"

    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    for frames, n in work:
        self_time[python_leaf(frames)] += n
        for f in {FRAME.sub(r"\g<func> (\g<file>)", short(f)) for f in frames
                  if corral_frame(f)}:
            inclusive[f] += n
        buckets[bucket(frames)] += n
    print(f"\nPython self time (with the C it calls), top {args.top}:")
    for name, n in self_time.most_common(args.top):
        print(f"  {us(n)}  {name}")
    print("\ncorral's own functions (proxy/, supervisor/), inclusive:")
    for name, n in inclusive.most_common(args.top):
        print(f"  {us(n)}  {name}")
    print("\nbuckets (each sample once, by its innermost frame that tells):")
    for name, n in buckets.most_common():
        print(f"  {us(n)}  {name}")
    print(f"\nmachine: {machine_note()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
