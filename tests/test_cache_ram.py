"""llama-server's own prompt cache in RAM (`--cache-ram`): corral sets it on every child and
counts it as RAM.

- the default (auto) from the RAM budget, the model's estimate and the number of user keys
  (unit), and a user's own `--cache-ram` / LLAMA_ARG_CACHE_RAM winning;
- the estimate's `cache_ram` term on "cpu", -1 counted as the child's KV cache;
- real children: the config's value, the default's and a user's own arg on their argv (read
  from /proc), and in /admin/models' estimate;
- a RAM budget that fits two children without their caches but not with one: corral evicts
  for the cache where it kept both without it;
- two user API keys: the default is 0."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from corral.supervisor.backends.llama_server import LlamaServer
from corral.supervisor.config.checks.cache_ram import cache_ram_warnings
from corral.supervisor.config.load import parse_config
from corral.supervisor.config.schema import MemoryConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory import cache_ram
from corral.supervisor.memory.devices import NoGpus
from corral.supervisor.memory.estimate import estimate, model_facts
from corral.supervisor.memory.tracker import MemoryTracker

from conftest import Corral, CorralFactory, tiny_config, wait_until

MIB = 1024 * 1024


def spec_of(text: str, name: str = "m") -> ModelSpec:
    return parse_config(text).models[name]


def model_yaml(path: Path, extra: str = "", top: str = "") -> str:
    return f"{top}models:\n  m:\n    model: {path}\n    ctx: 4096\n{extra}"


# -- the value ---------------------------------------------------------------------------------


def test_a_users_own_cache_ram_is_read_from_args_and_env() -> None:
    assert cache_ram.own_mib(["--cache-ram", "512"], {}) == 512
    assert cache_ram.own_mib(["-cram", "0"], {}) == 0
    assert cache_ram.own_mib(["--cache-ram=-1"], {}) == -1
    assert cache_ram.own_mib(["--cache-ram", "1", "-cram", "2"], {}) == 2  # the last wins
    assert cache_ram.own_mib([], {"LLAMA_ARG_CACHE_RAM": "64"}) == 64
    assert cache_ram.own_mib(["-cram", "8"], {"LLAMA_ARG_CACHE_RAM": "64"}) == 8
    assert cache_ram.own_mib(["--ctx-size", "512"], {}) is None


def test_auto_is_a_bounded_share_of_the_budget_and_off_where_ram_is_tight() -> None:
    gib = 1024 * MIB
    big_kv = 100 * gib
    assert cache_ram.auto_mib(16 * gib, 2 * gib, big_kv) == 1024  # 1/16 of the budget
    assert cache_ram.auto_mib(256 * gib, 2 * gib, big_kv) == 2048  # at most 2048 MiB
    assert cache_ram.auto_mib(16 * gib, 2 * gib, 100 * MIB) == 200  # twice the child's KV
    # Tight: the model and its share over half the budget.
    assert cache_ram.auto_mib(16 * gib, 7 * gib, big_kv) == 1024
    assert cache_ram.auto_mib(16 * gib, 7 * gib + 1, big_kv) == 0
    assert cache_ram.auto_mib(0, 0, big_kv) == 0  # no budget known


def test_config_values_defaults_and_two_user_keys(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["tiny-a"]
    assert spec_of(model_yaml(path)).cache_ram_mb is None  # auto, resolved at a start
    assert spec_of(model_yaml(path, "    cache_ram_mb: 300\n")).cache_ram_mb == 300
    assert spec_of(model_yaml(path, top="defaults: {cache_ram_mb: 0}\n")).cache_ram_mb == 0
    assert spec_of(model_yaml(path, "    cache_ram_mb: auto\n",
                              "defaults: {cache_ram_mb: 64}\n")).cache_ram_mb is None
    # Several user keys share a child: its RAM cache would hand one key's prefix to another.
    keys = "api_keys: [alice, bob]\n"
    assert spec_of(model_yaml(path, top=keys)).cache_ram_mb == 0
    assert spec_of(model_yaml(path, top="api_keys: [alice]\n")).cache_ram_mb is None
    assert spec_of(model_yaml(path, "    cache_ram_mb: 128\n", keys)).cache_ram_mb == 128
    for bad in ("-2", "lots"):
        with pytest.raises(Exception, match="cache_ram_mb"):
            spec_of(model_yaml(path, f"    cache_ram_mb: {bad}\n"))
    with pytest.raises(Exception, match="cache_ram_mb is a llama-server setting"):
        parse_config("models:\n  v: {backend: vllm, model: Qwen/Qwen2.5-0.5B-Instruct, "
                     "cache_ram_mb: 100}\n")


def test_argv_always_sets_cache_ram_unless_the_user_does(tiny_models: dict[str, Path]) -> None:
    base = spec_of(model_yaml(tiny_models["tiny-a"]))

    def flag(spec: ModelSpec) -> list[str]:
        argv = LlamaServer().argv(spec, 8081)
        return [argv[i + 1] for i, a in enumerate(argv) if a in ("--cache-ram", "-cram")]

    assert flag(dataclasses.replace(base, cache_ram_mb=96)) == ["96"]
    assert flag(base) == ["0"]  # auto no tracker resolved: off, never llama-server's 8 GiB
    assert flag(dataclasses.replace(base, cache_ram_mb=96, args=("-cram", "5"))) == ["5"]
    own_env = dataclasses.replace(base, cache_ram_mb=96, env={"LLAMA_ARG_CACHE_RAM": "7"})
    assert flag(own_env) == []


def test_the_estimate_counts_the_cache_as_ram(tiny_models: dict[str, Path]) -> None:
    base = spec_of(model_yaml(tiny_models["tiny-a"]))
    kv = (None, None)
    bare = estimate(model_facts(base.model_path), ctx=4096, parallel=1, n_gpu_layers=-1,
                    cache_type_k=None, cache_type_v=None)
    found = LlamaServer().estimate(dataclasses.replace(base, cache_ram_mb=100), kv, ())
    assert found.cache_ram == 100 * MIB
    assert found.devices["cpu"] == bare.devices["cpu"] + 100 * MIB
    assert found.total == bare.total + 100 * MIB
    # With a GPU the cache is host memory all the same.
    on_gpu = LlamaServer().estimate(dataclasses.replace(base, cache_ram_mb=100), kv, ("gpu0",))
    assert on_gpu.cache_ram == 100 * MIB and on_gpu.devices["cpu"] >= 100 * MIB
    # -1: no size limit; llama-server then holds at most ctx tokens of states.
    unlimited = LlamaServer().estimate(dataclasses.replace(base, args=("-cram", "-1")), kv, ())
    assert unlimited.cache_ram == bare.kv
    own = LlamaServer().estimate(dataclasses.replace(base, cache_ram_mb=100,
                                                     args=("--cache-ram", "3")), kv, ())
    assert own.cache_ram == 3 * MIB


def test_the_tracker_resolves_auto_from_its_budget(tiny_models: dict[str, Path]) -> None:
    spec = spec_of(model_yaml(tiny_models["tiny-a"]))
    kv = (None, None)
    bare = estimate(model_facts(spec.model_path), ctx=4096, parallel=1, n_gpu_layers=-1,
                    cache_type_k=None, cache_type_v=None)
    roomy = MemoryTracker(MemoryConfig(reserve_mb=0, budget_mb=4096), NoGpus())
    resolved = roomy.with_cache_ram(spec, kv)
    expected = cache_ram.auto_mib(4096 * MIB, bare.devices["cpu"], bare.kv)
    assert resolved.cache_ram_mb == expected > 0
    assert roomy.need(spec, kv)["cpu"] == bare.devices["cpu"] + expected * MIB
    # A budget the model alone takes most of: tight, no cache.
    tight = MemoryTracker(MemoryConfig(reserve_mb=0, budget_mb=bare.devices["cpu"] / MIB * 1.5),
                          NoGpus())
    assert tight.with_cache_ram(spec, kv).cache_ram_mb == 0
    assert tight.need(spec, kv)["cpu"] == bare.devices["cpu"]
    # A value of the config's or the user's own is left as it is.
    assert roomy.with_cache_ram(dataclasses.replace(spec, cache_ram_mb=9), kv).cache_ram_mb == 9


def test_check_warns_when_the_caches_loaded_together_pass_the_budget(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = tiny_models["tiny-a"]
    text = (f"memory: {{budget_mb: 3000}}\npolicy: {{max_loaded: 2}}\nmodels:\n"
            f"  a: {{model: {path}, cache_ram_mb: 2048}}\n"
            f"  b:\n    model: {path}\n    args: [--cache-ram, '1500']\n"
            f"  c: {{model: {path}, cache_ram_mb: 1000}}\n  d: {{model: {path}}}\n")
    (warning,) = cache_ram_warnings(parse_config(text))
    assert warning.key == "models.a.cache_ram_mb" and warning.line == 4
    assert "2 models that may be loaded together add up to 3548 MiB (a 2048, b 1500)" \
        in warning.message
    # Within the budget (max_loaded 1), or auto: no warning.
    assert cache_ram_warnings(parse_config(text.replace("max_loaded: 2", "max_loaded: 1"))) == []
    assert cache_ram_warnings(parse_config(model_yaml(path, top="memory: {budget_mb: 100}\n"))) \
        == []
    # A cache set on a child several user keys share.
    shared = cache_ram_warnings(parse_config(model_yaml(
        path, "    cache_ram_mb: 64\n", "api_keys: [alice, bob]\n")))
    assert [w.key for w in shared] == ["models.m.cache_ram_mb"]
    assert "shared by every caller, and api_keys lists 2 keys" in shared[0].message
    assert cache_ram_warnings(parse_config(model_yaml(path, top="api_keys: [alice, bob]\n"))) \
        == []
    config = tmp_path / "corral.yaml"
    config.write_text(text)
    done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"warning: {config}:4: models.a.cache_ram_mb: the RAM prompt caches" in done.stderr


# -- real children -----------------------------------------------------------------------------


def cmdline_cache_ram(corral: Corral, model: str) -> list[str]:
    argv = psutil.Process(corral.model(model)["pid"]).cmdline()
    return [argv[i + 1] for i, a in enumerate(argv) if a in ("--cache-ram", "-cram")]


def test_children_run_with_the_configured_default_or_own_cache_ram(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b", "tiny-c"],
                         policy={"max_loaded": 3},
                         memory={"reserve_mb": 512, "gpu_reader": "none"})
    config["models"]["tiny-a"]["cache_ram_mb"] = 48
    config["models"]["tiny-c"]["args"] = ["--cache-ram", "7"]
    corral = start_corral(config)
    for name in ("tiny-a", "tiny-b", "tiny-c"):
        assert corral.chat(name, max_tokens=2).status_code == 200

    facts = model_facts(tiny_models["tiny-b"])
    bare = estimate(facts, ctx=8192, parallel=1, n_gpu_layers=-1, cache_type_k=None,
                    cache_type_v=None)
    budget = psutil.virtual_memory().total - 512 * MIB
    auto = cache_ram.auto_mib(budget, bare.devices["cpu"], bare.kv)
    assert auto > 0
    expected = {"tiny-a": 48, "tiny-b": auto, "tiny-c": 7}
    models = corral.models()
    for name, mib in expected.items():
        assert cmdline_cache_ram(corral, name) == [str(mib)], name
        entry = models[name]
        assert entry["cache_ram_mb"] == mib, entry
        assert entry["estimate_breakdown_mib"]["cache_ram"] == pytest.approx(mib, abs=0.1)
        parts = entry["estimate_breakdown_mib"]
        assert entry["estimate_mib"]["cpu"] == pytest.approx(sum(parts.values()), abs=0.3)
    # The memory view's estimate error leaves the cache out (it fills only with use).
    memory = {m["name"]: m for m in corral.http.get("/admin/memory").json()["models"]}
    assert memory["tiny-a"]["estimate_breakdown_mib"]["cache_ram"] == pytest.approx(48, abs=0.1)


def test_a_ram_budget_too_small_for_the_cache_evicts_where_it_fit_without(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    names = ("tiny-a", "tiny-b")
    config = tiny_config(tiny_models, list(names), policy={"max_loaded": 4},
                         defaults={"cache_ram_mb": 0},
                         memory={"interval": 0.2, "reserve_mb": 0, "gpu_reader": "none"})
    corral = start_corral(config)
    for name in names:
        assert corral.chat(name, max_tokens=2).status_code == 200

    def measured() -> dict[str, float] | None:
        by = {m["name"]: m for m in corral.http.get("/admin/memory").json()["models"]}
        if all(by[n]["served"] and by[n]["measured_mib"] for n in names):
            return {n: by[n]["footprint_mib"]["cpu"] for n in names}
        return None
    used: dict[str, float] = wait_until(measured, timeout=10)
    margin = 0.5 * min(used.values())
    config["memory"]["budget_mb"] = sum(used.values()) + margin
    corral.reload_with(config)

    # Without a cache tiny-b starts again beside tiny-a.
    assert corral.http.post("/admin/models/tiny-b/unload").status_code == 200
    wait_until(lambda: corral.model("tiny-b")["state"] == "stopped", timeout=15)
    assert corral.chat("tiny-b", max_tokens=2).status_code == 200
    assert {n: corral.model(n)["state"] for n in names} == {"tiny-a": "ready",
                                                            "tiny-b": "ready"}

    # With a cache just bigger than the room left, the same start evicts tiny-a.
    assert corral.http.post("/admin/models/tiny-b/unload").status_code == 200
    wait_until(lambda: corral.model("tiny-b")["state"] == "stopped", timeout=15)
    cache = int(margin) + 8
    config["models"]["tiny-b"]["cache_ram_mb"] = cache
    corral.reload_with(config)
    assert corral.chat("tiny-b", max_tokens=2).status_code == 200
    states = {n: corral.model(n)["state"] for n in names}
    assert states == {"tiny-a": "stopped", "tiny-b": "ready"}, states
    stops = [e for e in corral.log_events("instance.stop") if e["model"] == "tiny-a"]
    assert stops and "evicted" in stops[-1]["reason"], stops
    assert cmdline_cache_ram(corral, "tiny-b") == [str(cache)]


def test_two_user_keys_turn_the_default_off(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    config = tiny_config(tiny_models, ["tiny-a"], api_keys=["alice", "bob"],
                         admin_api_keys=["root"], memory={"gpu_reader": "none"})
    corral = start_corral(config, api_key="root")
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    assert cmdline_cache_ram(corral, "tiny-a") == ["0"]
    entry = corral.model("tiny-a")
    assert entry["cache_ram_mb"] == 0 and entry["estimate_breakdown_mib"]["cache_ram"] == 0
