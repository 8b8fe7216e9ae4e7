"""The memory section and KV cache settings of the config: KV types checked against the
binary's --help (a TurboQuant build's turbo types pass only where its help lists them), every
mistake reported with file:line; and the device readers on this machine (RAM for real; NVML
absent here must read as no GPUs, never an error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from corral.supervisor.backends.binaries import (
    STANDARD_KV_TYPES,
    find_executable,
    kv_cache_types,
    parse_kv_cache_types,
)
from corral.supervisor.config import ConfigError, parse_config
from corral.supervisor.memory.devices import NvmlReader, RamReader
from corral.supervisor.runtime import build_runtime

LLAMA_SERVER = find_executable(None, ("llama-server",))


def issues(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build_runtime(parse_config(text))  # the GPU reader is built by the daemon's runtime
    return [str(i) for i in caught.value.issues]


def test_the_binarys_help_lists_the_kv_types_it_accepts() -> None:
    assert kv_cache_types(LLAMA_SERVER) == STANDARD_KV_TYPES
    help_text = "  -ctk, --cache-type-k TYPE  KV cache data type for K\n" \
                "    allowed values: f16, q8_0, turbo3, turbo4\n    (default: f16)\n"
    assert parse_kv_cache_types(help_text) == ("f16", "q8_0", "turbo3", "turbo4")
    assert parse_kv_cache_types("no such option here") == ()


def test_turbo_types_need_a_turboquant_build(tmp_path: Path) -> None:
    found = issues("models:\n  a:\n    model: a.gguf\n    cache_type_k: turbo3\n")
    assert len(found) == 1 and "<config>:4: models.a.cache_type_k" in found[0]
    assert "TurboQuant build" in found[0] and "accepts f32, f16" in found[0]
    # A build whose --help lists them (a wrapper standing in for a TurboQuant build, which this
    # machine does not have) accepts them, asymmetric with a standard V type too.
    turbo = tmp_path / "llama-server-turbo"
    turbo.write_text(f"#!/bin/sh\nexec {LLAMA_SERVER} \"$@\" | sed "
                     f"'s/allowed values: \\(.*\\)q5_1$/allowed values: \\1q5_1, turbo2, "
                     f"turbo3, turbo4/'\n")
    turbo.chmod(0o755)
    assert "turbo3" in kv_cache_types(str(turbo))
    loaded = parse_config(f"binary: {turbo}\nmodels:\n  a:\n    model: a.gguf\n"
                          f"    cache_type_k: turbo3\n    cache_type_v: q8_0\n"
                          f"    kv_cache: {{mode: auto, ladder: [turbo4, turbo3/q8_0]}}\n")
    assert loaded.models["a"].kv_ladder == (("turbo4", "turbo4"), ("turbo3", "q8_0"))


def test_kv_mistakes_are_reported_with_their_lines() -> None:
    found = issues("""\
defaults:
  kv_cache: {ladder: [f16, q9_0]}
models:
  a:
    model: a.gguf
    cache_type_v: q3_k
    kv_cache: {mode: sometimes, ladder: [f16, f16]}
""")
    text = "\n".join(found)
    assert "models.a.cache_type_v: Value error, unknown cache type 'q3_k'" in text
    assert "models.a.kv_cache.mode" in text
    assert "a ladder step is listed twice" in text
    found = issues("defaults:\n  kv_cache: {ladder: [f16, q9_0]}\nmodels: {}\n")
    assert found == ["<config>:2: defaults.kv_cache.ladder[1]: unknown cache type 'q9_0': "
                     f"{LLAMA_SERVER} accepts {', '.join(STANDARD_KV_TYPES)}"]


def test_memory_mistakes_are_reported_with_their_lines(tmp_path: Path) -> None:
    text = "\n".join(issues("memory: {low_watermark: 90, critical_watermark: 80}\n"))
    assert "critical_watermark (80) is below low_watermark (90)" in text
    text = "\n".join(issues("""\
memory:
  budget_mb: 1000
  budgets: {core: 800, other: 400, nope: 10}
models:
  a: {model: a.gguf}
groups:
  core: {models: [a]}
  other: {models: [a]}
"""))
    assert "<config>:3: memory.budgets.nope: unknown group 'nope'" in text
    assert "'a' is in the budgets of both 'core' and 'other'" in text
    assert "the group budgets add up to 1210 MiB but budget_mb is 1000" in text
    text = "\n".join(issues(f"""\
memory:
  gpu_reader: plugin:{tmp_path}/missing.py:Reader
models:
  a: {{model: a.gguf}}
"""))
    assert "<config>:2: memory.gpu_reader: plugin file" in text and "does not exist" in text


def test_ram_is_read_for_real_with_each_childs_process_tree() -> None:
    ram = RamReader()
    device = ram.device()
    assert device.name == "cpu" and device.total == psutil.virtual_memory().total
    assert 0 < device.used < device.total
    # A parent that holds 64 MiB and forks a child holding another 64 MiB: both count.
    script = ("import os, time, sys\nblock = bytearray(64 << 20)\nos.fork()\n"
              "sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        proc.stdout.readline()
        alone = psutil.Process(proc.pid).memory_info().rss
        with_tree = ram.usage([proc.pid])[proc.pid]
        assert with_tree >= alone + (60 << 20)
        assert ram.usage([2 ** 22 + 12345]) == {}  # gone: no figure, no error
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_nvml_without_a_driver_reads_no_gpus() -> None:
    reader = NvmlReader()
    devices = reader.devices()  # here: no libnvidia-ml; on a GPU box: the GPUs
    assert isinstance(devices, list)
    assert all(d.kind == "gpu" and d.total > 0 for d in devices)
    assert isinstance(reader.usage_by_pid(), dict)
