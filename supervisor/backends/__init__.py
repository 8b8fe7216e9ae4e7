"""Adapters, one per kind of child server, and the registry that picks one for a model."""

from __future__ import annotations

from corral.supervisor.backends.base import Backend
from corral.supervisor.backends.command import Command
from corral.supervisor.backends.llama_server import LlamaServer
from corral.supervisor.backends.remote import Remote
from corral.supervisor.backends.vllm import Vllm

__all__ = ["BACKENDS", "Backend", "backend_for"]

BACKENDS: dict[str, Backend] = {"llama-server": LlamaServer(), "vllm": Vllm(),
                                "command": Command(), "remote": Remote()}


def backend_for(kind: str) -> Backend:
    return BACKENDS[kind]
