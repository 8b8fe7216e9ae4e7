"""`corral ps` (what runs: state, pid, memory, TTL left, requests in flight, KV types) and
its refreshing forms, `corral ps --watch` and `corral top`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from corral.supervisor.ctl import table
from corral.supervisor.ctl.client import Client
from corral.supervisor.ctl.exits import CtlError, Exit

# Home the cursor and clear the screen: each refresh of `top` on a terminal draws over the last.
_CLEAR = "\x1b[H\x1b[2J"


def add_arguments(parser: argparse.ArgumentParser, watching: bool) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print JSON (with --watch: one object per line and refresh)")
    if not watching:
        parser.add_argument("-w", "--watch", action="store_true",
                            help="refresh until interrupted (like `corral top`)")
    parser.add_argument("--interval", type=float, metavar="SECONDS",
                        help="seconds between refreshes (default 2)")
    parser.add_argument("--count", type=int, metavar="N",
                        help="stop after N refreshes (default: until Ctrl-C)")


def run(client: Client, args: argparse.Namespace, out: TextIO = sys.stdout) -> Exit:
    watching = getattr(args, "watch", False) or args.command == "top"
    if not watching and (args.interval is not None or args.count is not None):
        raise CtlError("--interval and --count are for a refreshing view: add --watch",
                       Exit.USAGE)
    interval = 2.0 if args.interval is None else args.interval
    if interval <= 0:
        raise CtlError("--interval must be more than 0 seconds", Exit.USAGE)
    if args.count is not None and args.count < 1:
        raise CtlError("--count must be 1 or more", Exit.USAGE)
    frames = args.count if watching else 1
    shown = 0
    while True:
        snapshot = rows(client.get("/admin/models")["models"])
        if args.json:
            out.write(json.dumps({"url": client.url, "time": time.time(), "models": snapshot},
                                 indent=None if watching else 2) + "\n")
        elif watching:
            clear = _CLEAR if out.isatty() else ("\n" if shown else "")
            out.write(f"{clear}corral at {client.url}  {time.strftime('%H:%M:%S')}\n"
                      f"{render(snapshot)}\n")
        else:
            out.write(render(snapshot) + "\n")
        out.flush()
        shown += 1
        if frames is not None and shown >= frames:
            return Exit.OK
        time.sleep(interval)


def rows(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `ps --json` prints per model (replicas as `<model>#<n>`), from GET /admin/models."""
    out = []
    for m in models:
        memory = m.get("memory_mib") or {}
        out.append({
            "name": m["name"], "state": m["state"], "pid": m.get("pid"),
            "backend": m.get("backend"),
            "memory_mib": memory,
            "memory_total_mib": round(sum(memory.values()), 1) if memory else None,
            "ttl": m.get("ttl"), "ttl_left": m.get("ttl_left"), "pinned": m.get("pinned"),
            "in_flight": m.get("in_flight"), "parallel": m.get("parallel"),
            "queue": m.get("queue"),
            "cache_type_k": m.get("cache_type_k"), "cache_type_v": m.get("cache_type_v"),
            "last_error": m.get("last_error"),
        })
    return out


def render(snapshot: list[dict[str, Any]]) -> str:
    if not snapshot:
        return "no models configured"
    headers = ["NAME", "STATE", "PID", "MEMORY", "TTL", "IN FLIGHT", "QUEUE", "KV"]
    body = [[r["name"], r["state"], str(r["pid"] or "-"), _memory(r), _ttl(r),
             f"{r['in_flight']}/{r['parallel']}", str(r["queue"]), _kv(r)] for r in snapshot]
    notes = [_note(r) for r in snapshot]
    if any(notes):
        headers.append("NOTE")
        body = [[*row, note] for row, note in zip(body, notes, strict=True)]
    return table.render(headers, body, right=frozenset({2, 3, 5, 6}))


def _memory(r: dict[str, Any]) -> str:
    memory: dict[str, float] = r["memory_mib"]
    if not memory:
        return "-"
    if len(memory) == 1:
        return table.mib(next(iter(memory.values())))
    return ", ".join(f"{device} {table.mib(v)}" for device, v in memory.items())


def _ttl(r: dict[str, Any]) -> str:
    if r["state"] != "ready":
        return "-"
    if r["pinned"]:
        return "kept"
    if not r["ttl"]:
        return "never"
    return table.duration(r["ttl_left"]) if r["ttl_left"] is not None else "-"


def _kv(r: dict[str, Any]) -> str:
    if r["backend"] != "llama-server":
        return "-"  # KV types are llama.cpp's settings
    return f"{r['cache_type_k'] or 'f16'}/{r['cache_type_v'] or 'f16'}"


def _note(r: dict[str, Any]) -> str:
    if r["state"] != "failed" or not r["last_error"]:
        return ""
    first = str(r["last_error"]).splitlines()[0]
    return first if len(first) <= 60 else first[:59] + "…"
