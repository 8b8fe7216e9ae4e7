"""Which capability each OpenAI-style path needs, and the check that refuses a request its
model cannot answer: a clear 400 before anything starts, instead of the child's 501 (or, for
an embeddings-only llama-server asked to chat, an empty answer) after a cold start."""

from __future__ import annotations

from typing import Any

from corral.proxy.errors import ApiError
from corral.supervisor.config import ModelSpec

# What each capability's paths need; a model's backend decides which paths reach it at all.
NEEDS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/messages": "chat",  # Anthropic's Messages API, which llama-server also speaks
    "/v1/messages/count_tokens": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/reranking": "rerank",
}
# The OpenAI paths corral answers POST on: the models' and its own groups'. Another method on
# one is a client's mistake to name (405), and only these are metrics labels.
POSTED = frozenset({*NEEDS, "/v1/batch/execute", "/v1/chain/execute"})
# The POST /v1 paths each backend serves: only these (and a model's own `paths:`) reach a
# model, for user and admin keys alike. Anything else is a 404 before anything starts: no
# provider's fine-tuning, assistants or files API with the operator's key, no command child's
# model or adapter loading, no cold start to relay a child's own 404.
_COMMON = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                     "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                     "/v1/rerank"})
SERVED: dict[str, frozenset[str]] = {
    "llama-server": _COMMON | {"/v1/reranking"},
    "vllm": _COMMON | {"/v1/score", "/v1/pooling", "/v1/classify"},
    "remote": _COMMON,
    "command": _COMMON,
}


def serves(spec: ModelSpec, path: str) -> bool:
    return path in SERVED.get(spec.backend, _COMMON) or path in spec.paths


def refuse_path(spec: ModelSpec, path: str) -> None:
    """404 for a path the model's backend does not serve (nothing starts for it)."""
    if not serves(spec, path):
        raise ApiError(404, f"{path[:100]} is not served by {spec.name!r} (a {spec.backend} "
                            f"model answers {', '.join(sorted(SERVED.get(spec.backend, _COMMON)))}"
                            f"; `paths:` on the model adds more)", "unknown_path")


# Content parts that carry an image, in the chat, Responses and Messages shapes.
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
# Where a picture can sit inside a part or an input item: a message's content, a Messages
# tool_result's content, a Responses function_call_output's output.
_NESTED = ("content", "output")
# How deep a picture is looked for: a tool result in a message is two levels down.
_DEPTH = 4


def check(spec: ModelSpec, path: str, body: dict[str, Any]) -> None:
    need = NEEDS.get(path)
    if need is not None and need not in spec.capabilities:
        if need == "embeddings" and spec.backend == "llama-server":
            raise ApiError(400, f"{spec.name!r} does not serve embeddings; set "
                                f"`embeddings: true` on it in the config", "embeddings_disabled",
                           param="model")
        raise ApiError(400, f"{spec.name!r} does not serve {path} (it answers "
                            f"{', '.join(spec.capabilities)}); set `capabilities:` on it in the "
                            f"config if it does", "unsupported_capability", param="model")
    if need == "chat" and "vision" not in spec.capabilities and has_image(body):
        field = "input" if path == "/v1/responses" else "messages"
        raise ApiError(400, f"{spec.name!r} cannot see images ({vision_hint(spec)})",
                       "vision_unsupported", param=field)


def vision_hint(spec: ModelSpec) -> str:
    """What makes `spec` see: a llama-server child needs its projector file; any other
    backend is told by the config that its server takes images."""
    if spec.backend == "llama-server":
        return "`mmproj:` in the config"
    return "`capabilities: [chat, vision]` on it in the config if it is a vision model"


def has_image(body: dict[str, Any]) -> bool:
    """Whether a chat, Responses or Messages body carries a picture anywhere a server reads
    one: a message's content, an input item that is itself an image, a tool's result."""
    return any(_holds_image(body.get(key), 0) for key in ("messages", "input"))


def _holds_image(value: object, depth: int) -> bool:
    if depth > _DEPTH or not isinstance(value, list):
        return False
    for item in value:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if isinstance(kind, str) and kind in IMAGE_PARTS:  # a client may send any JSON there
            return True
        if any(_holds_image(item.get(key), depth + 1) for key in _NESTED):
            return True
    return False
