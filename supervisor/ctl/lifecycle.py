"""`corral load NAME` and `corral stop NAME [--force]`: the admin API's load and unload, each
waited for, so the command ends when the model is ready, or stopped."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from corral.supervisor.ctl.client import Client, model_path
from corral.supervisor.ctl.exits import CtlError, Exit


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a model name or alias (`corral ps` lists them)")


def add_stop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a model name or alias (`corral ps` lists them)")
    parser.add_argument("--force", action="store_true",
                        help="stop now: requests in flight are cut off instead of drained")


def load(client: Client, args: argparse.Namespace, out: TextIO = sys.stdout) -> Exit:
    began = time.monotonic()
    model = client.post(model_path(args.name, "load"), model=args.name)
    took = time.monotonic() - began
    if model.get("state") != "ready":
        # The load returned, yet the model is not serving: a stop came in meanwhile.
        raise CtlError(f"{model.get('name', args.name)}: {model.get('state')} after the load"
                       + (f": {model['last_error']}" if model.get("last_error") else ""))
    pid = f"pid {model['pid']}, " if model.get("pid") else ""
    out.write(f"{model['name']}: ready ({pid}{took:.1f}s)\n")
    return Exit.OK


def stop(client: Client, args: argparse.Namespace, out: TextIO = sys.stdout) -> Exit:
    path = model_path(args.name, "unload") + ("?force=1" if args.force else "")
    model = client.post(path, model=args.name)
    out.write(f"{model.get('name', args.name)}: {model.get('state')}\n")
    return Exit.OK
