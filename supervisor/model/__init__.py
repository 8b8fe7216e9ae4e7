"""One configured model's state machine above its instances (DESIGN: supervisor/model/)."""

from corral.supervisor.model.core import Host, Model
from corral.supervisor.model.state import ModelState, OperationRefused, Wish

__all__ = ["Host", "Model", "ModelState", "OperationRefused", "Wish"]
