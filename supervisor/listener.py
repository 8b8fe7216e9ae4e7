"""Who listens on a child's port. corral picks a free port and hands it to the child, but
between the pick and the child's bind someone else may take it (another daemon's child, a
test server); their server would then answer corral's readiness probe (llama-server's
/health asks no key) and the model would go READY in front of a stranger that refuses its
key, or worse, answers for it. These checks are blocking and not cheap (psutil reads the
host's TCP tables to match sockets to processes): callers run them in a thread, once a probe
has succeeded."""

from __future__ import annotations

import psutil


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


def held_by_stranger(pid: int, port: int) -> bool:
    """Whether `port` is provably held by someone other than the child `pid`: neither the
    child nor any of its descendants listens there, and a process that started before the
    child does. A listener we cannot see the owner of (another user's, or a container's
    proxy, which starts after the child that runs `docker run`) is given the benefit of the
    doubt: the child's own bind failure still tells a lost race apart."""
    try:
        child = psutil.Process(pid)
        tree = [child, *child.children(recursive=True)]
        born = child.create_time()
    except psutil.NoSuchProcess:
        return True  # the child is gone: whoever answers is not it
    except psutil.Error:
        return False
    ours = {proc.pid for proc in tree}
    for proc in tree:
        try:
            if _listens(proc, port):
                return False
        except psutil.Error:
            continue
    try:
        # Both families here: a command child may bind "::", which 127.0.0.1 reaches too.
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
