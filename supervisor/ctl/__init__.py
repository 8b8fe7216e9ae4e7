"""The client commands for a running daemon: `corral ps | top | load | stop | logs | run`.
They speak to it over HTTP only (the admin API and /v1), so they work against a corral on
another machine as well, with its keys from CORRAL_ADMIN_KEY and CORRAL_API_KEY."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from corral.supervisor.ctl import chat, lifecycle, logs, ps
from corral.supervisor.ctl.client import DEFAULT_URL, Client, target
from corral.supervisor.ctl.exits import EPILOG, CtlError, Exit

Command = Callable[[Client, argparse.Namespace], Exit]

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Command]] = {
    "ps": ("list the models: state, pid, memory, TTL left, requests in flight, KV types",
           lambda p: ps.add_arguments(p, watching=False), ps.run),
    "top": ("`ps`, refreshed every few seconds until interrupted",
            lambda p: ps.add_arguments(p, watching=True), ps.run),
    "load": ("load a model and wait until it is ready", lifecycle.add_load_arguments,
             lifecycle.load),
    "stop": ("unload a model: drain its requests (or cut them off with --force), stop it",
             lifecycle.add_stop_arguments, lifecycle.stop),
    "logs": ("print a model's child log; -f follows it", logs.add_arguments, logs.run),
    "run": ("ask a model: one streamed answer to PROMPT, or a chat without one",
            chat.add_arguments, chat.run),
}
COMMANDS = frozenset(_COMMANDS)


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands to `corral`'s subcommands."""
    for name, (summary, add_arguments, _) in _COMMANDS.items():
        parser = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:]
                                + ".", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        parser.add_argument("--url", help=f"the daemon (default: CORRAL_URL, else "
                                          f"{DEFAULT_URL})")


def main(argv: list[str] | None = None) -> int:
    """The `corral` command. A client command starts without importing what `serve` and
    `check` need (configs, backends, numpy, gguf: a second and more on a busy machine);
    everything else is `corral.supervisor.cli`'s, where these commands are registered too."""
    given = sys.argv[1:] if argv is None else argv
    if given and given[0] in COMMANDS:
        parser = argparse.ArgumentParser(prog="corral")
        add_commands(parser.add_subparsers(dest="command", required=True))
        return run(parser.parse_args(given))
    from corral.supervisor import cli

    return cli.main(argv)


def run(args: argparse.Namespace) -> int:
    """Run the client command `args.command`; its exit code (exits.Exit)."""
    try:
        return int(_COMMANDS[args.command][2](Client(target(args.url)), args))
    except CtlError as exc:
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return int(Exit.INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (`corral logs m | head`): not an error of ours. Python would
        # complain again flushing stdout at exit; point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(Exit.OK)
