"""What a child sees of the daemon's environment: the passed-through variables less any
secret (HF_TOKEN is corral's, for its own pulls), plus what the model's `env:` gives it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from corral.supervisor.config import parse_config
from corral.supervisor.process import ChildProcess, child_environment

DAEMON = {"PATH": "/usr/bin:/bin", "HOME": "/root", "HF_HOME": "/srv/hf", "HF_HUB_OFFLINE": "1",
          "HF_TOKEN": "hf_daemon_secret", "HUGGING_FACE_HUB_TOKEN": "hf_old_name_secret",
          "HF_API_KEY": "k", "VLLM_API_KEY": "k", "CUDA_SECRET": "s", "GGML_PASSWORD": "p",
          "CUDA_VISIBLE_DEVICES": "0", "OPENAI_API_KEY": "sk-x", "AWS_SECRET_ACCESS_KEY": "a"}


def test_secrets_under_the_passed_prefixes_stay_with_the_daemon() -> None:
    env = child_environment(DAEMON, {"MODEL_ONLY": "yes"})
    assert env == {"PATH": "/usr/bin:/bin", "HOME": "/root", "HF_HOME": "/srv/hf",
                   "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "0", "MODEL_ONLY": "yes"}
    # A model that needs the token names it in its env.
    assert child_environment(DAEMON, {"HF_TOKEN": "given"})["HF_TOKEN"] == "given"


def _environ_of_a_child(tmp_path: Path, extra: dict[str, str]) -> dict[str, str]:
    dump = tmp_path / "environ"

    async def run() -> None:
        child = ChildProcess("envdump", ["/bin/sh", "-c", f"env > {dump}"], extra)
        await child.spawn()
        assert await asyncio.wait_for(child.wait(), 10) == 0

    asyncio.run(run())
    return dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)


def test_a_child_does_not_see_the_daemons_hf_token_unless_its_env_gives_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_daemon_secret")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_old_name_secret")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    seen = _environ_of_a_child(tmp_path, {})
    assert "HF_TOKEN" not in seen and "HUGGING_FACE_HUB_TOKEN" not in seen
    assert seen["HF_HOME"] == str(tmp_path / "hf")  # the rest of HF_ still passes
    # The way to give it: the model's env, with ${HF_TOKEN} from the daemon's environment.
    config = parse_config('models:\n  gated: {model: m.gguf, env: {HF_TOKEN: "${HF_TOKEN}"}}\n',
                          tmp_path / "c.yaml")
    given = config.models["gated"].env
    assert given == {"HF_TOKEN": "hf_daemon_secret"}
    assert _environ_of_a_child(tmp_path, given)["HF_TOKEN"] == "hf_daemon_secret"
