"""`corral fleet manifest URL...`: smg's discovery file for a fleet of corral nodes.

smg (`smg launch --discovery-provider file --discovery-file FILE`) takes one model per worker
URL, so each (node, model) becomes a worker of its own whose URL is the node's per-model mount,
`{node}/w/{quoted name}`: smg keeps a worker URL's path on every call it makes (health, loads,
models and the requests themselves). The file is smg 1.13's manifest, version 1: smg refuses
unknown fields in it, so a worker carries only `url` and `model_id` (the id smg would read from
the mount's own /v1/models; named here so smg needs no extra round trip to route by it).

smg re-reads the file when it changes; the write is atomic (a temporary file in the same folder
renamed over it), so smg never reads half a manifest."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from corral.supervisor.ctl.client import Client, Key, Target, target
from corral.supervisor.ctl.exits import CtlError, Exit

MANIFEST_VERSION = 1  # the one version smg 1.13 reads ("this gateway reads version 1")
DEFAULT_INTERVAL = 2.0
# A node's /v1/models must come whole within this and be no longer than that, or the node is
# left out: a broken or hostile one must neither hold the watcher (nor its SIGTERM) nor fill
# its memory.
NODE_TIMEOUT = 10.0
MAX_MODELS_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Node:
    """One node's answer: the model ids it serves, or why it did not answer."""

    url: str
    models: tuple[str, ...] = ()
    error: str | None = None


def mount_url(node: str, model: str) -> str:
    """The node's per-model mount for `model`: the name quoted whole (it may hold / and :)."""
    return f"{node}/w/{urllib.parse.quote(model, safe='')}"


def manifest(nodes: Sequence[Node]) -> dict[str, object]:
    """smg's manifest: one worker per (node, model) of every node that answered, in the order
    the nodes were given, each node's models by name (a stable file: it changes only when
    the fleet does)."""
    workers = [{"url": mount_url(node.url, model), "model_id": model}
               for node in nodes if node.error is None for model in sorted(node.models)]
    return {"version": MANIFEST_VERSION, "workers": workers}


def render(nodes: Sequence[Node]) -> str:
    return json.dumps(manifest(nodes), indent=2) + "\n"


def read_node(url: str, api_key: str | None) -> Node:
    """The ids of the node's /v1/models (models, and groups served as models) and the
    models' aliases."""
    # A redirect is not followed: the key would go along, and the models of whatever it
    # points at would be listed as this node's, under this URL.
    client = Client(Target(target(url).url, "a node of the fleet"), follow_redirects=False)
    if api_key:
        client.api_key = Key(api_key, "--api-key")
    try:
        data = client.get("/v1/models", timeout=NODE_TIMEOUT,
                          max_bytes=MAX_MODELS_BYTES).get("data")
    except CtlError as exc:
        # The client's advice for one daemon (`corral serve`, --url) is not this command's.
        return Node(client.url, error=str(exc).split(". Start one with")[0])
    except AttributeError:
        return Node(client.url, error=f"{client.url}/v1/models is not an OpenAI model list")
    if not isinstance(data, list):
        return Node(client.url, error=f"{client.url}/v1/models is not an OpenAI model list")
    # Each alias is a worker of its own: smg routes by the manifest's model_id alone, so a
    # name missing here is a 404 at the router however the node would have answered it. The
    # alias's mount answers as its model (the same load, health and requests).
    ids: set[str] = set()
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            ids.add(entry["id"])
            aliases = entry.get("aliases")
            if isinstance(aliases, list):
                ids.update(a for a in aliases if isinstance(a, str) and a)
    return Node(client.url, tuple(sorted(ids)))


def read_nodes(urls: Sequence[str], api_key: str | None) -> list[Node]:
    """Every node at once: a node that does not answer delays none of the others."""
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return list(pool.map(lambda url: read_node(url, api_key), urls))


def write_atomically(path: Path, text: str) -> bool:
    """Replace `path` with `text` unless it holds that already; whether it was written.

    The temporary file is in the same folder (a rename within one file system is atomic),
    so a reader sees the old manifest or the new one, never a part of one."""
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    folder = path.parent
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would keep a router of another user out
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True


class Manifester:
    """Reads the nodes and writes the manifest; says on stderr when a node stops or starts
    answering (once each time, not at every poll)."""

    def __init__(self, urls: Sequence[str], out: Path | None, api_key: str | None):
        self.urls, self.out, self.api_key = list(urls), out, api_key
        self.down: set[str] = set()

    def once(self, write_empty: bool = True) -> list[Node]:
        """One poll and the write it calls for. Without `write_empty`, a poll no node
        answered writes nothing (a one-off run keeps the file it would empty)."""
        nodes = read_nodes(self.urls, self.api_key)
        for node in nodes:
            if node.error is not None and node.url not in self.down:
                self.down.add(node.url)
                _say(f"{node.url}: left out of the manifest: {node.error}")
            elif node.error is None and node.url in self.down:
                self.down.discard(node.url)
                _say(f"{node.url}: answers again: {len(node.models)} model(s) back in")
        if not write_empty and all(n.error is not None for n in nodes):
            return nodes
        text = render(nodes)
        if self.out is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        elif write_atomically(self.out, text):
            workers = sum(len(n.models) for n in nodes if n.error is None)
            _say(f"wrote {self.out}: {workers} worker(s) on "
                 f"{len(nodes) - len(self.down)} of {len(nodes)} node(s)")
        return nodes


def _say(message: str) -> None:
    print(f"corral fleet manifest: {message}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", required=True)
    manifest_parser = sub.add_parser(
        "manifest", help="write smg's discovery file: one worker per (node, model)",
        description="Read each node's /v1/models and write smg's discovery manifest "
                    "(`smg launch --discovery-provider file --discovery-file FILE`): one "
                    "worker per (node, model), its URL the node's per-model mount "
                    "NODE/w/MODEL. A node that does not answer is left out.")
    manifest_parser.add_argument("nodes", nargs="+", metavar="URL",
                                 help="a corral node, e.g. http://10.0.0.2:8080")
    manifest_parser.add_argument("--out", type=Path,
                                 help="write the manifest here, atomically and only when it "
                                      "changes (default: print it)")
    manifest_parser.add_argument("--watch", action="store_true",
                                 help="keep polling the nodes and rewrite --out when the "
                                      "fleet changes, until SIGINT or SIGTERM")
    manifest_parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL,
                                 help=f"seconds between polls under --watch (default: "
                                      f"{DEFAULT_INTERVAL:g})")
    manifest_parser.add_argument("--api-key",
                                 help="the nodes' API key (default: CORRAL_API_KEY; prefer "
                                      "that: a command line is every local user's to read)")


def run(args: argparse.Namespace) -> int:
    """`corral fleet manifest`: exit 0, or 1 when no node answered (without --watch), 2 on
    bad arguments."""
    if args.api_key and args.watch:
        # Every local user reads a process's argv (ps), for as long as --watch runs.
        _say("warning: --api-key shows in `ps` to every local user while this runs: "
             "give the key in CORRAL_API_KEY instead")
    if args.watch and args.out is None:
        print("error: --watch needs --out FILE (the file smg watches)", file=sys.stderr)
        return int(Exit.USAGE)
    if args.interval <= 0:
        print("error: --interval must be more than 0 seconds", file=sys.stderr)
        return int(Exit.USAGE)
    try:
        for url in args.nodes:
            target(url)
    except CtlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(exc.code)
    api_key = args.api_key or os.environ.get("CORRAL_API_KEY") or None
    manifester = Manifester(args.nodes, args.out, api_key)
    if not args.watch:
        nodes = manifester.once(write_empty=False)
        if all(n.error is not None for n in nodes):
            _say("no node answered: nothing written")
            return int(Exit.FAILED)
        return int(Exit.OK)
    return _watch(manifester, args.interval)


def _watch(manifester: Manifester, interval: float) -> int:
    """Poll until SIGINT or SIGTERM; either ends it with 0 (a stop asked for)."""
    stop = threading.Event()

    def stopping(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, stopping) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.is_set():
            manifester.once()
            stop.wait(interval)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return int(Exit.OK)
