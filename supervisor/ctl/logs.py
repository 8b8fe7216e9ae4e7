"""`corral logs NAME [-n LINES] [-f]`: what a model's child wrote, and with -f what it writes
next (across its restarts) until interrupted or corral stops. The child's lines go to stdout;
corral's remarks (a new child, lines missed, why the stream ended) to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from corral.supervisor.ctl.client import Client, model_path
from corral.supervisor.ctl.exits import CtlError, Exit

# The daemon sends a keep-alive every 15 s of quiet: four missed ones mean it is gone.
_QUIET = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a model name or alias, or a replica (`<model>#2`)")
    parser.add_argument("-n", "--lines", type=int, default=100,
                        help="how many of the last lines to show first (default 100; the "
                             "daemon keeps 400 per child)")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="then print new lines as the child writes them")


def run(client: Client, args: argparse.Namespace, out: TextIO = sys.stdout,
        err: TextIO = sys.stderr) -> Exit:
    if args.lines < 0:
        raise CtlError("--lines must be 0 or more", Exit.USAGE)
    if not args.follow:
        if args.lines == 0:
            return Exit.OK
        tail = client.get(model_path(args.name, "logs") + f"?lines={args.lines}",
                          model=args.name)
        for line in tail.get("lines", []):
            out.write(line + "\n")
        return Exit.OK
    path = model_path(args.name, "logs") + f"?lines={args.lines}&follow=1"
    pid: int | None = None
    first = True
    for batch in client.events("GET", path, model=args.name, quiet=_QUIET):
        if "end" in batch:
            err.write(f"corral: {batch['end']}\n")
            return Exit.OK
        if first:
            err.write(f"corral: following {batch.get('model', args.name)}'s log at "
                      f"{client.url} (Ctrl-C ends)\n")
        elif batch.get("pid") != pid and batch.get("pid") is not None:
            err.write(f"corral: {batch.get('model', args.name)}: a new child, pid "
                      f"{batch['pid']}\n")
        first = False
        pid = batch.get("pid") or pid
        if batch.get("skipped"):
            err.write(f"corral: {batch['skipped']} lines came and went before they could "
                      f"be read\n")
        for line in batch.get("lines", []):
            out.write(line + "\n")
        out.flush()
    # The stream ended without saying why: the daemon went away mid-way.
    raise CtlError(f"the log stream from {client.url} ended: is corral still running?",
                   Exit.UNREACHABLE)
