"""How the client commands end: one exit code per kind of outcome, the same for every
command, and the error that carries one."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # the daemon answered with an error (a load that failed, a busy model)
    USAGE = 2  # bad arguments (argparse's own code)
    UNREACHABLE = 3  # nothing answers at the URL, or the connection broke
    AUTH = 4  # a key is missing or refused (HTTP 401/403)
    NO_MODEL = 5  # the daemon has no model of that name
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports it)


EPILOG = """\
exit codes:
  0    done
  1    the daemon answered with an error (a failed load, a busy model, a bad request)
  2    usage: bad arguments
  3    no daemon answers at the URL (--url, else CORRAL_URL, else http://127.0.0.1:8080),
       or the connection broke
  4    a key is missing or refused (401/403): set CORRAL_ADMIN_KEY (/admin) or
       CORRAL_API_KEY (/v1)
  5    no such model (close names are listed)
  130  interrupted (Ctrl-C)"""


class CtlError(Exception):
    """A command that cannot go on: the message for stderr and the exit code."""

    def __init__(self, message: str, code: Exit = Exit.FAILED):
        self.code = code
        super().__init__(message)
