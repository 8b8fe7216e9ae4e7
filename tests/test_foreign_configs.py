"""Configs in other tools' shapes (llama-swap, EIE, llm-pool): `corral check` and `corral serve`
recognise them and say, at each foreign key's file:line, which corral key to use instead, in
the issue shape every config error has."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from corral.supervisor.config import ConfigError, inspect_config, load_config

CLI = [sys.executable, "-m", "corral.supervisor.cli"]

LLAMA_SWAP = """\
healthCheckTimeout: 500
globalTTL: 300
macros:
  "latest-llama": /usr/bin/llama-server --port ${PORT}
apiKeys: ["sk-1"]
models:
  qwen:
    cmd: llama-server --port ${PORT} -m Qwen.gguf
    ttl: 60
    checkEndpoint: /health
    useModelName: qwen2.5
    env:
      - "CUDA_VISIBLE_DEVICES=0"
groups:
  g1:
    swap: true
    exclusive: true
    members: [qwen]
"""

EIE = """\
groups:
  - name: core
    models: [a, b]
    type: parallel
vram:
  reserve_mb: 512
  group_isolation: true
inference:
  kv_cache:
    mode: auto
"""

LLM_POOL = """\
{
  "service": {"host": "127.0.0.1", "port": 8000},
  "engine": {
    "models": {
      "gemma": {
        "backend": "llama_server",
        "model_path": "/models/gemma.gguf",
        "llama_server_n_ctx": 4096,
        "llama_server_binary": "/opt/llama.cpp/bin/llama-server",
        "enabled": true
      }
    }
  }
}
"""


def said(tmp_path: Path, name: str, text: str) -> dict[str, str]:
    """`corral check`'s errors for the config `text`: {"line: key": message}."""
    path = tmp_path / name
    path.write_text(text)
    done = subprocess.run([*CLI, "check", "--no-files", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1, done.stdout
    found = {}
    for line in done.stderr.splitlines():
        assert line.startswith(f"error: {path}"), line
        where, key, message = line.removeprefix(f"error: {path}").split(": ", 2)
        found[f"{where.lstrip(':')}: {key}"] = message
    return found


def test_llama_swap_keys_point_at_corrals(tmp_path: Path) -> None:
    errors = said(tmp_path, "swap.yaml", LLAMA_SWAP)
    assert errors[": <top>"].startswith("this looks like llama-swap's config")
    assert errors["1: healthCheckTimeout"] == (
        "llama-swap's `healthCheckTimeout:` → corral: `defaults: {start_timeout: SECONDS}`")
    assert errors["2: globalTTL"].startswith("llama-swap's `globalTTL:` → corral: "
                                             "`defaults: {ttl: SECONDS}`")
    assert "`${VAR}`" in errors["3: macros"] and "`${PORT}`" in errors["3: macros"]
    assert errors["5: apiKeys"] == "llama-swap's `apiKeys:` → corral: `api_keys:`"
    cmd = errors["8: models.qwen.cmd"]
    assert cmd.startswith("llama-swap's `cmd:` → corral: `model: FILE.gguf`")
    assert "`command:` as an argv list" in cmd
    assert errors["10: models.qwen.checkEndpoint"].endswith("`health:` (a path, or `none`)")
    assert errors["11: models.qwen.useModelName"].endswith("`served_name:`")
    assert "`env: {NAME: value}`" in errors["12: models.qwen.env"]
    assert errors["18: groups.g1.members"].endswith("`models:` (the group's members)")
    assert "`policy: {max_loaded: N}`" in errors["16: groups.g1.swap"]
    assert "`policy: {max_loaded: N}`" in errors["17: groups.g1.exclusive"]
    # Keys corral shares with llama-swap (ttl) are no error.
    assert not [k for k in errors if k.endswith(".ttl")]


def test_eie_keys_point_at_corrals(tmp_path: Path) -> None:
    errors = said(tmp_path, "eie.yaml", EIE)
    assert errors[": <top>"].startswith("this looks like EIE's config")
    assert "`groups:` as a mapping by name" in errors["1: groups"]
    assert errors["5: vram"].startswith("EIE's `vram:` → corral: `memory:`")
    assert errors["7: vram.group_isolation"].endswith("`memory: {budgets: {GROUP: MB}}`")
    assert errors["8: inference"].startswith("EIE's `inference:` → corral: `defaults:`")
    assert errors["9: inference.kv_cache"].endswith("`defaults: {kv_cache: {mode: auto}}`")


def test_llm_pool_keys_point_at_corrals(tmp_path: Path) -> None:
    errors = said(tmp_path, "settings.json", LLM_POOL)
    assert errors[": <top>"].startswith("this looks like llm-pool's config")
    assert "`listen: HOST:PORT`" in errors["2: service"]
    assert "`models:` at the top" in errors["3: engine"]
    # Under the refused `engine:`, each model key still gets its pointer.
    assert errors["7: engine.models.gemma.model_path"].endswith("→ corral: `model:`")
    assert errors["8: engine.models.gemma.llama_server_n_ctx"].endswith("→ corral: `ctx:`")
    assert errors["9: engine.models.gemma.llama_server_binary"].endswith("→ corral: `binary:`")
    assert "llama_server → llama-server" in errors["6: engine.models.gemma.backend"]
    assert "no such setting" in errors["10: engine.models.gemma.enabled"]


@pytest.mark.parametrize("text", [LLAMA_SWAP, EIE, LLM_POOL])
def test_serve_refuses_them_with_the_same_pointers(tmp_path: Path, text: str) -> None:
    path = tmp_path / "foreign.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "→ corral: " in str(refused.value)
    assert refused.value.issues == inspect_config(path).issues


def test_a_corral_config_with_a_typo_is_not_taken_for_another_tools(tmp_path: Path) -> None:
    errors = said(tmp_path, "typo.yaml", "models:\n  smol:\n    model: x.gguf\n    paralel: 2\n")
    assert errors == {"4: models.smol.paralel": "Extra inputs are not permitted"}
