"""llama-server's own prompt cache in RAM (`--cache-ram N`): how big corral lets it grow.

llama-server keeps the KV state of prompts its slots moved away from in host memory, to
reuse them when a prompt comes back (tools/server: `server_prompt_cache`). `N` is MiB, 0
turns it off and -1 lifts the size limit (the cache then holds at most `ctx` tokens of
states: about the child's whole KV cache). The binary's default is 8192 MiB per child,
reached only with use, so a fresh child measures small and three busy ones take 24 GiB that
placement never saw. corral therefore always passes the flag and counts the value as RAM.

The default ("auto") is a bounded share of the RAM budget (the machine's RAM less
`memory.reserve_mb`, capped by `memory.budget_mb`): 1/16 of it, at most 2048 MiB, and at
most twice the child's own KV cache (two whole contexts of conversations held aside; a
small model's cache needs no more, and does not take a big one's room). It is 0 where RAM
is tight, that is where the model's own RAM estimate plus that share would take more than
half the budget (a model that needs that much leaves no room for its cache and a
neighbour). Pure arithmetic: the tracker knows the budget and the model's estimate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["AUTO_CAP_MIB", "AUTO_SHARE", "ENV_VAR", "KV_MULTIPLE", "TIGHT_SHARE", "auto_mib",
           "counted_bytes", "own_mib"]

MiB = 1024 * 1024

AUTO_SHARE = 1 / 16
AUTO_CAP_MIB = 2048
TIGHT_SHARE = 0.5
KV_MULTIPLE = 2
# llama-server reads the same setting from its environment (common/arg.cpp: env for each flag).
ENV_VAR = "LLAMA_ARG_CACHE_RAM"
_FLAGS = ("--cache-ram", "-cram")


def own_mib(args: Sequence[str], env: Mapping[str, str]) -> int | None:
    """The value a model's own `args` (`--cache-ram N`, `-cram N`, `--cache-ram=N`) or env
    (LLAMA_ARG_CACHE_RAM) give; None: neither sets it, or not as a number (llama-server then
    refuses to start and says why). The last one in args wins, as llama-server reads them;
    args win over env."""
    found: int | None = None
    for i, arg in enumerate(args):
        value: str | None = None
        if arg in _FLAGS and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--cache-ram="):
            value = arg.split("=", 1)[1]
        if value is not None:
            found = _number(value)
    if found is None and ENV_VAR in env:
        found = _number(env[ENV_VAR])
    return found


def _number(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def auto_mib(ram_budget: int, model_ram: int, kv_bytes: int) -> int:
    """The default for a model whose own estimate takes `model_ram` bytes of RAM and
    `kv_bytes` of KV cache (any device), with a RAM budget of `ram_budget` bytes (0:
    unknown, the cache stays off)."""
    if ram_budget <= 0:
        return 0
    share = min(int(ram_budget * AUTO_SHARE) // MiB, AUTO_CAP_MIB,
                -(-KV_MULTIPLE * kv_bytes // MiB))
    if model_ram + share * MiB > ram_budget * TIGHT_SHARE:
        return 0
    return share


def counted_bytes(mib: int, kv_bytes: int) -> int:
    """The RAM a cache of `mib` takes at most: `mib`, or with no size limit (-1) about the
    child's KV cache (llama-server keeps at most ctx tokens of states then)."""
    if mib < 0:
        return kv_bytes
    return mib * MiB
