"""Memory-aware placement on real llama-server children: RAM measured for real (psutil), GPU
numbers injected through a reader plugin (tests/fake_gpu.py: this machine has no GPU).

- a RAM budget sized for two children evicts by memory where max_loaded would not;
- a load that nothing can make room for gets a 503 naming what is in the way and how much is
  missing;
- `kv_cache.mode: auto` starts with q8_0 where f16 does not fit the budget;
- the sampler evicts the least recently used idle model past the low watermark, never a kept
  one, and the critical watermark refuses new loads at once;
- adaptive KV under injected GPU pressure, with a request loop running: the child restarts with
  q8_0, no request fails, and it steps back up once the pressure has been gone for the hold."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from fake_gpu import write as write_gpu

from corral.supervisor.memory.estimate import estimate, model_facts

from conftest import Corral, CorralFactory, tiny_config, wait_until
from tinymodel import write_tiny_llama

MIB = 1024 * 1024
FAKE_GPU = Path(__file__).with_name("fake_gpu.py")


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Heads of 32 dims: quantized KV types store blocks of 32 (16-dim heads refuse them).
    return write_tiny_llama(tmp_path_factory.mktemp("kv") / "tiny-kv.gguf", seed=5, n_head=2)


def memory_of(corral: Corral) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in corral.http.get("/admin/memory").json()["models"]}


def measured_after_serving(corral: Corral, names: tuple[str, ...]) -> dict[str, float]:
    """Each model's RAM once it has answered a request and been sampled since (MiB)."""
    def ready() -> dict[str, float] | None:
        by = memory_of(corral)
        if all(by[n]["served"] and by[n]["measured_mib"] for n in names):
            return {n: by[n]["footprint_mib"]["cpu"] for n in names}
        return None
    found: dict[str, float] = wait_until(ready, timeout=10)
    return found


def argv_of(corral: Corral, model: str) -> list[list[str]]:
    return [e["argv"] for e in corral.spawned(model)]


def test_a_ram_budget_for_two_children_evicts_by_memory_for_the_third(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    names = ("tiny-a", "tiny-b", "tiny-c")
    config = tiny_config(tiny_models, list(names), policy={"max_loaded": 4},
                         memory={"interval": 0.2, "reserve_mb": 0, "gpu_reader": "none"})
    corral = start_corral(config)
    for name in names[:2]:
        assert corral.chat(name, max_tokens=4).status_code == 200
    used = measured_after_serving(corral, names[:2])
    # Room for both and half of another: tiny-c, about as big as either, does not fit.
    config["memory"]["budget_mb"] = sum(used.values()) + 0.5 * min(used.values())
    corral.reload_with(config)

    assert corral.chat("tiny-c", max_tokens=4).status_code == 200
    states = {n: m["state"] for n, m in corral.models().items()}
    assert states == {"tiny-a": "stopped", "tiny-b": "ready", "tiny-c": "ready"}, states
    stops = [e for e in corral.log_events("instance.stop") if e["model"] == "tiny-a"]
    assert stops and "evicted" in stops[-1]["reason"] and "tiny-c" in stops[-1]["reason"]
    memory = corral.http.get("/admin/memory").json()
    cpu = next(d for d in memory["devices"] if d["name"] == "cpu")
    assert cpu["budget_mib"] == pytest.approx(config["memory"]["budget_mb"], abs=0.1)
    by = memory_of(corral)
    assert by["tiny-c"]["estimate_mib"]["cpu"] > 0 and by["tiny-b"]["measured_mib"]["cpu"] > 0


@pytest.mark.expect_log("proxy.request_failed")
def test_a_load_nothing_can_make_room_for_names_what_is_in_the_way(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"],
                         groups={"core": {"models": ["tiny-a"], "pinned": True}},
                         policy={"max_loaded": 4, "evict_timeout": 0.5},
                         memory={"interval": 0.2, "reserve_mb": 0, "gpu_reader": "none"})
    corral = start_corral(config)
    wait_until(lambda: corral.model("tiny-a")["state"] == "ready", timeout=15)
    assert corral.chat("tiny-a", max_tokens=4).status_code == 200
    used = measured_after_serving(corral, ("tiny-a",))["tiny-a"]
    config["memory"]["budget_mb"] = used * 1.5
    corral.reload_with(config)

    response = corral.chat("tiny-b", max_tokens=4)
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "tiny-b needs" in message and "MiB on cpu" in message, message
    assert "tiny-a (" in message and "kept loaded" in message, message
    assert corral.model("tiny-a")["state"] == "ready" and not corral.spawned("tiny-b")


def test_auto_kv_mode_picks_q8_0_where_f16_does_not_fit_the_budget(
        start_corral: CorralFactory, kv_model: Path) -> None:
    ctx = 131072  # KV: 64 MiB at f16, 34 MiB at q8_0 (2 layers, 2 heads of 32)
    facts = model_facts(kv_model)

    def total(kv_type: str) -> int:
        return estimate(facts, ctx=ctx, parallel=1, n_gpu_layers=-1, cache_type_k=kv_type,
                        cache_type_v=kv_type).total

    assert total("q8_0") < total("f16")
    config = {
        "defaults": {"ttl": 300, "stop_grace": 5},
        "memory": {"interval": 0.2, "reserve_mb": 0, "gpu_reader": "none",
                   "budget_mb": (total("f16") + total("q8_0")) / 2 / MIB},
        # -lv 4: llama-server logs its buffer sizes, which /admin/memory shows beside ours.
        "models": {"kv": {"model": str(kv_model), "ctx": ctx, "args": ["-lv", "4"],
                          "kv_cache": {"mode": "auto", "ladder": ["f16", "q8_0", "q4_0"]}}},
    }
    corral = start_corral(config)
    assert corral.chat("kv", max_tokens=4).status_code == 200
    argv = argv_of(corral, "kv")[-1]
    assert argv[argv.index("--cache-type-k") + 1] == "q8_0"
    assert argv[argv.index("--cache-type-v") + 1] == "q8_0"
    entry = memory_of(corral)["kv"]
    assert (entry["cache_type_k"], entry["cache_type_v"]) == ("q8_0", "q8_0")
    assert entry["kv_cache"]["mode"] == "auto"
    # llama-server's own account of its q8_0 KV cache equals the estimate's.
    logged_kv = wait_until(lambda: (memory_of(corral)["kv"]["llama_log_mib"] or {})
                           .get("cpu", {}).get("kv"), timeout=5)
    expected_kv = estimate(facts, ctx=ctx, parallel=1, n_gpu_layers=-1, cache_type_k="q8_0",
                           cache_type_v="q8_0").kv
    assert logged_kv == pytest.approx(expected_kv / MIB, rel=0.01)

    # With room for f16 it takes f16 at its next start.
    config["memory"]["budget_mb"] = total("f16") * 2 / MIB
    corral.reload_with(config)
    assert corral.http.post("/admin/models/kv/unload").status_code == 200
    assert corral.chat("kv", max_tokens=4).status_code == 200
    argv = argv_of(corral, "kv")[-1]
    assert argv[argv.index("--cache-type-k") + 1] == "f16"


def test_adaptive_kv_steps_down_under_gpu_pressure_and_back_up_with_no_request_failing(
        start_corral: CorralFactory, kv_model: Path, tmp_path: Path) -> None:
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu, total_mb=10000, others_mb=3000)
    config = {
        "defaults": {"ttl": 300, "stop_grace": 5},
        "policy": {"strategy": "fixed-appliance"},
        "memory": {"interval": 0.2, "low_watermark": 85, "critical_watermark": 95,
                   "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                   "gpu_reader_options": {"path": str(gpu)}},
        "models": {"kv": {"model": str(kv_model), "ctx": 8192,
                          "kv_cache": {"adaptive": True, "ladder": ["f16", "q8_0"],
                                       "hold": 1.5}}},
    }
    corral = start_corral(config)
    wait_until(lambda: corral.model("kv")["state"] == "ready", timeout=15)
    assert corral.http.get("/admin/memory").json()["devices"][0]["name"] == "gpu0"

    statuses: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            statuses.append(corral.chat("kv", max_tokens=8).status_code)

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        wait_until(lambda: len(statuses) >= 5, timeout=15)
        # Others take 8000 MiB: with the child's 700, 87% used, above the low watermark.
        write_gpu(gpu, total_mb=10000, others_mb=8000)
        wait_until(lambda: any(a[a.index("--cache-type-k") + 1] == "q8_0"
                               for a in argv_of(corral, "kv")), timeout=15)
        wait_until(lambda: corral.model("kv")["cache_type_k"] == "q8_0"
                   and corral.model("kv")["state"] == "ready", timeout=15)
        during = len(statuses)
        write_gpu(gpu, total_mb=10000, others_mb=3000)  # the pressure is gone
        wait_until(lambda: argv_of(corral, "kv")[-1][
            argv_of(corral, "kv")[-1].index("--cache-type-k") + 1] == "f16"
            and corral.model("kv")["cache_type_k"] == "f16"
            and corral.model("kv")["state"] == "ready", timeout=15)
        wait_until(lambda: len(statuses) >= during + 5, timeout=15)
    finally:
        stop.set()
        worker.join(60)
    assert statuses and set(statuses) == {200}, statuses  # none failed, none refused
    changes = corral.log_events("daemon.kv_cache_changed")
    assert [(c["direction"], c["new"]) for c in changes] == [("down", "q8_0/q8_0"),
                                                             ("up", "f16/f16")]
    assert "low watermark" in changes[0]["reason"] and "no memory pressure" in changes[1]["reason"]
    entry = memory_of(corral)["kv"]
    assert entry["kv_cache"]["changes"] == {"down": 1, "up": 1}
    assert entry["kv_cache"]["level"] == 0


@pytest.mark.expect_log("proxy.request_failed")
def test_the_sampler_evicts_idle_models_past_the_low_watermark_and_critical_refuses_loads(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu, total_mb=10000, others_mb=3000)
    config = tiny_config(
        tiny_models, ["tiny-a", "tiny-b", "tiny-c"],
        groups={"core": {"models": ["tiny-a"], "pinned": True}},
        memory={"interval": 0.2, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                "gpu_reader_options": {"path": str(gpu)}})
    corral = start_corral(config)
    wait_until(lambda: corral.model("tiny-a")["state"] == "ready", timeout=15)
    for name in ("tiny-b", "tiny-c"):
        assert corral.chat(name, max_tokens=4).status_code == 200
    # Three children at 700 MiB each + 6000 others = 81 %: calm.
    write_gpu(gpu, total_mb=10000, others_mb=6000)
    # + 1000 more: 91 %, past the low watermark (85 %): the least recently used idle model
    # (tiny-b) goes; 84 % after that, and tiny-c stays. The kept tiny-a is never a candidate.
    write_gpu(gpu, total_mb=10000, others_mb=7000)
    wait_until(lambda: corral.model("tiny-b")["state"] == "stopped", timeout=10)
    evictions = corral.log_events("daemon.memory_evict")
    assert [e["model"] for e in evictions] == ["tiny-b"], evictions
    assert "low watermark" in evictions[0]["reason"]
    assert {n: m["state"] for n, m in corral.models().items()} == {
        "tiny-a": "ready", "tiny-b": "stopped", "tiny-c": "ready"}

    # Past the critical watermark (95 %) with nothing idle left to evict: a new load is
    # refused at once, naming the device and the watermark.
    assert corral.http.post("/admin/models/tiny-c/unload").status_code == 200
    write_gpu(gpu, total_mb=10000, others_mb=8900)  # 8900 + tiny-a's 700 = 96 %
    wait_until(lambda: next(d for d in corral.http.get("/admin/memory").json()["devices"]
                            if d["name"] == "gpu0")["pressure"] == "critical", timeout=5)
    response = corral.chat("tiny-b", max_tokens=4)
    assert response.status_code == 503, response.text
    assert "critical watermark" in response.json()["error"]["message"]
    assert corral.model("tiny-a")["state"] == "ready"  # kept: never evicted for pressure
    write_gpu(gpu, total_mb=10000, others_mb=3000)
    wait_until(lambda: next(d for d in corral.http.get("/admin/memory").json()["devices"]
                            if d["name"] == "gpu0")["pressure"] == "none", timeout=5)
    assert corral.chat("tiny-b", max_tokens=4).status_code == 200


@pytest.mark.expect_log("daemon.memory_read_slow", "memory.gpu_reader_failed")
def test_a_gpu_reader_that_hangs_stops_neither_start_up_nor_a_pinned_model(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Every await has a deadline, a driver's read too: corral starts, starts what it keeps
    loaded and answers while NVML (here its stand-in) does not answer, and samples again once
    it does, with one read at a time meanwhile. RAM and the children go on being measured
    meanwhile (the GPU read has its own deadline)."""
    gpu, hang = tmp_path / "gpu.json", tmp_path / "hang"
    write_gpu(gpu, total_mb=10000, others_mb=1234)
    hang.touch()
    config = tiny_config(
        tiny_models, ["tiny-a"], groups={"core": {"models": ["tiny-a"], "pinned": True}},
        memory={"interval": 0.2, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                "gpu_reader_options": {"path": str(gpu), "hang_while": str(hang)}})
    corral = start_corral(config)
    wait_until(lambda: corral.model("tiny-a")["state"] == "ready", timeout=30)
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    wait_until(lambda: corral.log_events("memory.gpu_reader_failed"), timeout=30)
    # The child is measured while the GPU reader hangs: RAM is read without it.
    wait_until(lambda: memory_of(corral)["tiny-a"]["measured_mib"], timeout=30)
    hang.unlink()

    def gpu_seen() -> bool:
        devices = corral.http.get("/admin/memory").json()["devices"]
        return any(d["name"] == "gpu0" for d in devices)
    wait_until(gpu_seen, timeout=30)
    wait_until(lambda: corral.log_events("memory.gpu_reader_recovered"), timeout=30)
