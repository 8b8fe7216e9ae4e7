"""A relay worker process: `python -m corral.proxy.workers.main`, spawned by the daemon
(proxy/workers/processes.py), never by hand. It serves the daemon's port beside it until the
daemon says stop or goes away."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

import structlog

from corral.proxy import listener
from corral.proxy.workers.app import create_worker_app
from corral.proxy.workers.forward import ToDaemon
from corral.proxy.workers.remote import Link, RemoteDaemon
from corral.supervisor import logs
from corral.supervisor.config import split_listen

log = structlog.get_logger("corral.proxy.worker")

# What the daemon waits for a worker's in-flight requests at a stop, at most: its own drain
# (shutdown_grace) decides before that; this only bounds a worker left behind.
_HANDLERS_S = 60.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral-relay-worker")
    parser.add_argument("--rpc", required=True, help="the daemon's socket for leases")
    parser.add_argument("--forward", required=True, help="the daemon's socket for requests")
    parser.add_argument("--listen", required=True, help="HOST:PORT, the daemon's")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--forward-limit", type=int, required=True,
                        help="requests forwarded to the daemon at once, at most")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="auto")
    args = parser.parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    structlog.contextvars.bind_contextvars(worker=args.index)

    import uvloop

    return uvloop.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    host, port = split_listen(args.listen)
    link = await Link.connect(args.rpc)
    first = await asyncio.wait_for(link.snapshots.get(), 30)
    remote = RemoteDaemon(link, first)
    following = asyncio.create_task(remote.follow(), name="snapshots")
    to_daemon = ToDaemon(args.forward, args.forward_limit)
    runner = listener.runner(create_worker_app(remote, link, to_daemon, host, args.index),
                             handler_cancellation=True, access_log=None,
                             shutdown_timeout=_HANDLERS_S)
    await runner.setup()
    site = listener.Listener(runner, host, port, reuse_port=True)
    try:
        await site.start()
    except OSError as exc:
        log.error("relay_worker.listen_failed", listen=args.listen, error=str(exc))
        return 1
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, link.stop.set)
    link.note("ready", args.index, os.getpid())
    await link.stop.wait()
    # No new connections; the open ones finish (their leases go back to the daemon as they
    # do), then the worker ends.
    await site.stop()
    await runner.cleanup()
    following.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await following
    await to_daemon.close()
    await link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
