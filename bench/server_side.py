"""What the server side alone costs per request: aiohttp's web server (corral's) beside uvicorn
(httptools + uvloop, a raw ASGI app), the same trivial handler, under wrk in one run.

Each server reads a small JSON POST body and answers 500 bytes of JSON; wrk (c8, keep-alive)
loads each for --seconds, alternating, --rounds times. Prints the server's CPU per request
(from /proc) and req/s. It measures the floor a server puts under corral's relay, nothing of
corral itself. Needs wrk and uvicorn (the vLLM venv has it: run it with that Python).

    build/vllm-venv/bin/python bench/server_side.py [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ANSWER = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":' \
         b'{"role":"assistant","content":"' + b"a" * 380 + b'"}}]}'

AIOHTTP = """
import sys, uvloop
from aiohttp import web
ANSWER = ANSWER_LITERAL
async def chat(request):
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None,
            loop=uvloop.new_event_loop())
""".replace("ANSWER_LITERAL", repr(ANSWER))

UVICORN = """
import sys, uvicorn
ANSWER = ANSWER_LITERAL
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(ANSWER)).encode())]})
    await send({"type": "http.response.body", "body": ANSWER})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools",
            access_log=False, log_level="warning", lifespan="off")
""".replace("ANSWER_LITERAL", repr(ANSWER))

LUA = """
wrk.method = "POST"
wrk.body = '{"model":"tiny","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'
wrk.headers["Content-Type"] = "application/json"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu(pid: int) -> float:
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except OSError:
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk is not installed (apt-get install -y wrk)")
        return 1
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("uvicorn is not importable here: run this with build/vllm-venv/bin/python")
        return 1
    results: dict[str, list[tuple[float, float]]] = {"aiohttp": [], "uvicorn": []}
    with tempfile.TemporaryDirectory() as tmp:
        lua = Path(tmp) / "post.lua"
        lua.write_text(LUA)
        servers = {}
        for name, code in (("aiohttp", AIOHTTP), ("uvicorn", UVICORN)):
            script = Path(tmp) / f"serve_{name}.py"  # not aiohttp.py: it would shadow the module
            script.write_text(code)
            port = free_port()
            proc = subprocess.Popen([sys.executable, str(script), str(port)])
            servers[name] = (proc, port)
        try:
            for name, (_, port) in servers.items():
                deadline = time.monotonic() + 20
                while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not start")
                    time.sleep(0.05)
            for r in range(args.rounds):
                names = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in names:
                    proc, port = servers[name]
                    before = cpu(proc.pid)
                    out = subprocess.run(
                        [wrk, "-t1", "-c8", f"-d{args.seconds}s", "-s", str(lua),
                         f"http://127.0.0.1:{port}/v1/chat/completions"],
                        capture_output=True, text=True, check=True).stdout
                    used = cpu(proc.pid) - before
                    requests = int(re.search(r"(\d+) requests in", out).group(1))
                    results[name].append((used * 1e6 / requests, requests / args.seconds))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait()
    print(f"machine: {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; wrk c8, {args.seconds} s x "
          f"{args.rounds} rounds per server, alternating")
    for name, rows in results.items():
        print(f"{name:8s} CPU {statistics.median(r[0] for r in rows):6.1f} µs/request   "
              f"req/s {statistics.median(r[1] for r in rows):8.0f}   (rounds: "
              + ", ".join(f"{c:.0f} µs" for c, _ in rows) + ")")
    a = statistics.median(r[0] for r in results["aiohttp"])
    u = statistics.median(r[0] for r in results["uvicorn"])
    print(f"uvicorn's CPU per request is {u / a:.2f} of aiohttp's ({a - u:+.1f} µs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
