"""The daemon: owns and acts (DESIGN: supervisor/daemon/). The proxy reaches it only through
supervisor/port.py."""

from corral.supervisor.daemon.core import Daemon
from corral.supervisor.port import ModelStatus

__all__ = ["Daemon", "ModelStatus"]
