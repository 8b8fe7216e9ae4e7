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
    # An admin load's overrides (docs/api.md): this start only, within the config's bounds.
    for flag, kind in (("--ctx", int), ("--cache-type-k", str), ("--cache-type-v", str),
                       ("--parallel", int), ("--draft-max", int), ("--draft-min", int)):
        parser.add_argument(flag, type=kind, help="for this start only (load_overrides: "
                            "bounds it)")
    parser.add_argument("--restart", action="store_true",
                        help="restart the model if it runs with other settings")


_OVERRIDES = ("ctx", "cache_type_k", "cache_type_v", "parallel", "draft_max", "draft_min")


def add_stop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="a model name or alias (`corral ps` lists them)")
    parser.add_argument("--force", action="store_true",
                        help="stop now: requests in flight are cut off instead of drained")


def load(client: Client, args: argparse.Namespace, out: TextIO = sys.stdout) -> Exit:
    began = time.monotonic()
    body = {field: getattr(args, field, None) for field in _OVERRIDES}
    body = {k: v for k, v in body.items() if v is not None}
    if getattr(args, "restart", False):
        body["restart"] = True
    model = client.post(model_path(args.name, "load"), body or None, model=args.name)
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
