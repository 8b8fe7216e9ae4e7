"""`corral check` asks vLLM's --help for its KV cache dtypes (supervisor/backends/vllm.py); that
imports torch, 10-20 s, so the answer is kept on disk per command and installed version: each
`corral check` is a new process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAKE_VLLM = """#!{python}
import sys
with open({calls!r}, "a") as f:
    f.write("x")
print("usage: vllm serve [--kv-cache-dtype {{auto,fp8,fp8_e5m2}}]")
"""

ASK = ("import sys; from corral.supervisor.backends.vllm import vllm_kv_dtypes; "
       "print(','.join(vllm_kv_dtypes([sys.argv[1], 'serve'])))")


def _ask(executable: Path, cache: Path) -> str:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    result = subprocess.run([sys.executable, "-c", ASK, str(executable)], env=env,
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.strip()


def test_the_dtypes_are_asked_once_per_installed_version(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "vllm-0.10.0.dist-info").mkdir()
    calls = tmp_path / "calls"
    vllm = venv / "bin" / "vllm"
    vllm.write_text(FAKE_VLLM.format(python=sys.executable, calls=str(calls)))
    vllm.chmod(0o755)
    cache = tmp_path / "cache"

    assert _ask(vllm, cache) == "auto,fp8,fp8_e5m2"
    assert _ask(vllm, cache) == "auto,fp8,fp8_e5m2"
    assert calls.read_text() == "x", "a second process asked vLLM again"
    assert (cache / "corral" / "vllm-kv-dtypes.json").exists()

    # An upgrade (another dist-info) is asked again, even with the entry point untouched.
    (site / "vllm-0.10.0.dist-info").rename(site / "vllm-0.11.0.dist-info")
    assert _ask(vllm, cache) == "auto,fp8,fp8_e5m2"
    assert calls.read_text() == "xx"

    # A cache file that is not JSON is ignored and replaced, never an error.
    (cache / "corral" / "vllm-kv-dtypes.json").write_text("{not json")
    assert _ask(vllm, cache) == "auto,fp8,fp8_e5m2"
    assert calls.read_text() == "xxx"
    assert _ask(vllm, cache) == "auto,fp8,fp8_e5m2"
    assert calls.read_text() == "xxx"
