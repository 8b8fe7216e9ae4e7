"""What the daemon builds from a config (config itself stays data): the strategy and the GPU
reader, which may import plugins and touch devices, and what the strategy keeps loaded."""

from __future__ import annotations

from dataclasses import dataclass

from corral.supervisor.config import ConfigError, LoadedConfig
from corral.supervisor.memory.devices import GpuReader, load_gpu_reader
from corral.supervisor.plugins import PluginError
from corral.supervisor.policy import Strategy, StrategyError, load_strategy

__all__ = ["Runtime", "build_runtime"]


@dataclass(frozen=True)
class Runtime:
    strategy: Strategy
    gpu_reader: GpuReader
    # What the strategy keeps loaded on its own account, decided from the config alone.
    kept: frozenset[str]


def build_runtime(loaded: LoadedConfig, current: Runtime | None = None,
                  current_config: LoadedConfig | None = None) -> Runtime:
    """Build the strategy and GPU reader `loaded` names. The GPU reader of `current` is kept
    when its settings did not change (a reload must not re-open NVML for nothing). Raises
    ConfigError, with the line of the setting at fault."""
    choice = loaded.strategy
    try:
        strategy = load_strategy(choice.spec, choice.options.get_secret_value(), choice.base_dir)
    except StrategyError as exc:
        raise ConfigError([loaded.issue(choice.loc, str(exc))]) from exc
    reader_choice = loaded.gpu_reader
    if current is not None and current_config is not None \
            and current_config.gpu_reader == reader_choice:
        reader = current.gpu_reader
    else:
        try:
            reader = load_gpu_reader(reader_choice.spec, reader_choice.options.get_secret_value(),
                                     reader_choice.base_dir)
        except PluginError as exc:
            raise ConfigError([loaded.issue(reader_choice.loc, str(exc))]) from exc
    try:
        kept = frozenset(strategy.keep_loaded(loaded.snapshot())) & set(loaded.models)
    except Exception as exc:
        raise ConfigError([loaded.issue(choice.loc, f"the strategy failed: "
                                                    f"{type(exc).__name__}: {exc}")]) from exc
    policy = loaded.config.policy
    children = sum(loaded.models[m].replicas_min for m in kept)  # each replica is a child
    if children > policy.max_loaded:
        raise ConfigError([loaded.issue(("policy", "max_loaded"), (
            f"strategy {policy.strategy} keeps {len(kept)} models loaded "
            f"({', '.join(sorted(kept))}"
            f"{f'; {children} children with their replicas' if children > len(kept) else ''}"
            f") but max_loaded is {policy.max_loaded}"))])
    return Runtime(strategy, reader, kept)
