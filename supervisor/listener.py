"""Who listens on a child's port. corral picks a free port and hands it to the child, but
between the pick and the child's bind someone else may take it (another daemon's child, a
test server); their server would then answer corral's readiness probe (llama-server's
/health asks no key) and the model would go READY in front of a stranger that refuses its
key, or worse, answers for it. These checks are blocking and not cheap (psutil reads the
host's TCP tables to match sockets to processes): callers run them in a thread, once a probe
has succeeded."""

from __future__ import annotations

import re
from collections.abc import Iterable

import psutil


def says_it_listens(lines: Iterable[str], port: int) -> bool:
    """Whether the child's own output says it listens on 127.0.0.1:`port` (llama-server's
    "listening on http://127.0.0.1:PORT", uvicorn's "running on ...", printed once bound):
    proof enough, from the only process that writes to its log, at no cost; without such a
    line the tables are asked (held_by_stranger, ~4 ms)."""
    bound = re.compile(rf"(?i)(listening on|running on)\S*\s+\S*127\.0\.0\.1:{port}(?!\d)")
    return any(bound.search(line) for line in lines)


def _listens(proc: psutil.Process, port: int, kind: str = "tcp4") -> bool:
    """IPv4 only by default: children bind 127.0.0.1, and each table psutil reads costs a
    walk of the kernel's whole socket hash (~2 ms on a small VM)."""
    # psutil 6 renamed Process.connections (5.9 is the lowest version corral allows).
    connections = getattr(proc, "net_connections", None) or proc.connections
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in connections(kind=kind))


def process_listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself has a listening socket on `port`."""
    try:
        return _listens(psutil.Process(pid), port, kind="tcp")
    except psutil.Error:
        return False


def held_by_stranger(pid: int, port: int, binds_itself: bool = False) -> bool:
    """Whether `port` is someone else's than the child `pid`'s. The child or one of its
    descendants listening there settles it: ours. Otherwise, for a server that binds its
    port itself (`binds_itself`: llama-server, vLLM), whoever answered is a stranger. For a
    command, only a listener owned by a process older than the child is provably one; a
    listener whose owner we cannot see (another user's) or that started after the child (a
    container's port proxy, which `docker run` starts) is given the benefit of the doubt:
    the child's own bind failure still ends a lost race."""
    try:
        child = psutil.Process(pid)
        tree = [child, *child.children(recursive=True)]
        born = child.create_time()
    except psutil.NoSuchProcess:
        return True  # the child is gone: whoever answers is not it
    except psutil.Error:
        return False
    if _tree_listens(tree, port, "tcp4"):
        return False
    # Both families from here on (rare: a probe answered that no IPv4 socket of ours holds):
    # a command child may bind "::", which 127.0.0.1 reaches too.
    if _tree_listens(tree, port, "tcp"):
        return False
    if binds_itself:
        return True
    ours = {proc.pid for proc in tree}
    try:
        listeners = [c for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    except psutil.Error:
        return False
    for connection in listeners:
        if connection.pid is None or connection.pid in ours:
            continue
        try:
            if psutil.Process(connection.pid).create_time() < born:
                return True
        except psutil.Error:
            continue
    return False


def _tree_listens(tree: list[psutil.Process], port: int, kind: str) -> bool:
    for proc in tree:
        try:
            if _listens(proc, port, kind):
                return True
        except psutil.Error:
            continue
    return False
