"""`kv_cache.mode: auto` beside a pinned model, on a running daemon (issue 36).

A pinned model holds most of a fake GPU (tests/fake_gpu.py: this machine has none). A second
model's f16 KV fits the GPU as a whole but not beside the pinned one, which placement may
never evict; its q4_0 step does. auto must start it at q4_0 (a 200, not a 503 naming the
pinned model), leave the pinned child alone, and say why in the log."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fake_gpu import write as write_gpu
from test_policy_memory import LADDER, memory, snap, view

from corral.supervisor.memory.estimate import estimate, model_facts
from corral.supervisor.policy import Generic

from conftest import CorralFactory, wait_until
from tinymodel import write_tiny_llama

MIB = 1024 * 1024
FAKE_GPU = Path(__file__).with_name("fake_gpu.py")
LOW_WATERMARK = 85  # % used: new loads stop there (placement's ceiling)
PINNED_CTX = 32768
AUTO_CTX = 131072  # KV 64 / 34 / 18 MiB at f16 / q8_0 / q4_0 (2 layers, 2 heads of 32)


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Heads of 32 dims: quantized KV types store blocks of 32 (16-dim heads refuse them).
    return write_tiny_llama(tmp_path_factory.mktemp("kv") / "tiny-kv.gguf", seed=5, n_head=2)


def gpu0_mib(model: Path, ctx: int, kv: str) -> float:
    """What corral estimates a start takes on gpu0 (all layers offloaded, one slot)."""
    est = estimate(model_facts(model), ctx=ctx, parallel=1, n_gpu_layers=-1,
                   cache_type_k=kv, cache_type_v=kv, gpus=["gpu0"])
    return est.devices["gpu0"] / MIB


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_auto_starts_at_the_step_that_fits_beside_a_pinned_model(
        start_corral: CorralFactory, kv_model: Path, tmp_path: Path) -> None:
    pinned = gpu0_mib(kv_model, PINNED_CTX, "f16")
    f16, q8, q4 = (gpu0_mib(kv_model, AUTO_CTX, t) for t in ("f16", "q8_0", "q4_0"))
    # Room for the pinned model and q4_0, not q8_0 (nor f16) beside it; f16 alone fits, so
    # "best step that fits the GPU as a whole" picks f16 and placement refuses it.
    room = pinned + (q4 + q8) / 2
    assert q4 < q8 < f16 <= room < pinned + q8
    total = room * 100 / LOW_WATERMARK
    gpu = tmp_path / "gpu.json"
    # Each child shows less than its estimate on the fake GPU: it counts at its estimate.
    write_gpu(gpu, total_mb=total, others_mb=0, per_child_mb=100)
    config = {
        "defaults": {"ttl": 300, "stop_grace": 5},
        "policy": {"max_loaded": 4, "evict_timeout": 0.5},
        "memory": {"interval": 0.2, "reserve_mb": 0, "low_watermark": LOW_WATERMARK,
                   "critical_watermark": 95, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                   "gpu_reader_options": {"path": str(gpu)}},
        "models": {
            "keeper": {"model": str(kv_model), "ctx": PINNED_CTX},
            "auto": {"model": str(kv_model), "ctx": AUTO_CTX,
                     "kv_cache": {"mode": "auto", "ladder": ["f16", "q8_0", "q4_0"]}},
        },
        "groups": {"core": {"models": ["keeper"], "pinned": True}},
    }
    corral = start_corral(config)
    wait_until(lambda: corral.model("keeper")["state"] == "ready", timeout=15)
    keeper_pid = corral.model("keeper")["pid"]
    memory = corral.http.get("/admin/memory").json()
    # The test's arithmetic is the daemon's: the pinned child counts at this estimate.
    entry = next(m for m in memory["models"] if m["name"] == "keeper")
    assert entry["footprint_mib"]["gpu0"] == pytest.approx(pinned, abs=0.1), entry
    device = next(d for d in memory["devices"] if d["name"] == "gpu0")
    assert device["total_mib"] == pytest.approx(total, abs=0.1), device

    response = corral.chat("auto", max_tokens=4)
    assert response.status_code == 200, response.text

    # The child runs q4_0, as its argv (from /proc) and /admin/models say.
    pid = corral.model("auto")["pid"]
    argv = cmdline(pid)
    assert argv[argv.index("--cache-type-k") + 1] == "q4_0", argv
    assert argv[argv.index("--cache-type-v") + 1] == "q4_0", argv
    model = corral.model("auto")
    assert (model["cache_type_k"], model["cache_type_v"]) == ("q4_0", "q4_0"), model
    entry = next(m for m in corral.http.get("/admin/memory").json()["models"]
                 if m["name"] == "auto")
    assert entry["estimate_mib"]["gpu0"] == pytest.approx(q4, abs=0.1), entry
    assert entry["kv_cache"]["mode"] == "auto" and entry["kv_cache"]["level"] == 0

    # The pinned model was never touched: the same child, serving.
    assert corral.model("keeper")["pid"] == keeper_pid
    assert corral.model("keeper")["state"] == "ready"
    assert os.path.exists(f"/proc/{keeper_pid}")
    assert corral.spawned_pids("keeper") == [keeper_pid]
    assert not corral.log_events("instance.stop")
    assert corral.chat("keeper", max_tokens=4).status_code == 200

    # Why q4_0: the decision log names the kept model and what did not fit beside it.
    chosen = [e for e in corral.log_events("daemon.kv_cache_chosen") if e["model"] == "auto"]
    assert len(chosen) == 1, chosen
    assert chosen[0]["kv"] == "q4_0/q4_0" and chosen[0]["step"] == 2
    reason = chosen[0]["reason"]
    assert "keeper" in reason and "kept loaded" in reason and "gpu0" in reason, reason
    assert "f16/f16" in reason and "q8_0/q8_0" in reason, reason

    # With the pinned model unloaded, nothing is in the way: the next start is at f16.
    for name in ("keeper", "auto"):
        assert corral.http.post(f"/admin/models/{name}/unload").status_code == 200
    assert corral.chat("auto", max_tokens=4).status_code == 200
    argv = cmdline(corral.model("auto")["pid"])
    assert argv[argv.index("--cache-type-k") + 1] == "f16", argv
    chosen = [e for e in corral.log_events("daemon.kv_cache_chosen") if e["model"] == "auto"]
    assert [(e["kv"], e["step"]) for e in chosen] == [("q4_0/q4_0", 2), ("f16/f16", 0)]
    assert "the ladder's top, fits" in chosen[1]["reason"], chosen[1]


def test_the_reason_says_what_did_not_fit_and_beside_what() -> None:
    # The policy's arithmetic (tests/test_policy_memory.py's sizes: 1000 / 700 / 550 MiB).
    auto = view("a", loaded=False, kv_ladder=LADDER, kv_auto=True)
    level, reason = Generic().auto_choice(
        snap([view("k", 700, kv_ladder=LADDER), auto], memory(budget=1300), pinned=("k",)),
        auto)
    assert level == 2
    assert reason == ("beside what is kept loaded (k: 700 MiB on gpu0): f16/f16 needs "
                      "1000 MiB on gpu0 where 600 MiB of 1300 MiB are left; q8_0/q8_0 needs "
                      "700 MiB on gpu0 where 600 MiB of 1300 MiB are left; q4_0/q4_0 fits")
    level, reason = Generic().auto_choice(
        snap([view("k", 1000), auto], memory(budget=1300), pinned=("k",)), auto)
    assert level == 0
    assert reason.startswith("no step fits beside what is kept loaded (k: 1000 MiB on gpu0)")
    assert reason.endswith("f16/f16 fits the budget as a whole")
    level, reason = Generic().auto_choice(snap([auto], memory(budget=900)), auto)
    assert (level, reason) == (1, "f16/f16 needs 1000 MiB on gpu0 where 900 MiB are free; "
                                  "q8_0/q8_0 fits")
    level, reason = Generic().auto_choice(snap([auto], memory(budget=100)), auto)
    assert level == 2 and reason.startswith("no step fits: f16/f16 needs 1000 MiB")
    assert reason.endswith("the last, q4_0/q4_0")


def test_auto_counts_a_load_overrides_ctx(start_corral: CorralFactory, kv_model: Path,
                                          tmp_path: Path) -> None:
    """An admin load's ctx is what auto must fit: the config's ctx runs at f16, a load with
    twice that ctx at the step that fits it (f16 would not), not a 503."""
    big = 2 * AUTO_CTX
    f16, q8, big_f16, big_q8 = (gpu0_mib(kv_model, c, t) for c, t in (
        (AUTO_CTX, "f16"), (AUTO_CTX, "q8_0"), (big, "f16"), (big, "q8_0")))
    room = (f16 + big_f16) / 2
    assert q8 < big_q8 < f16 < room < big_f16
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu, total_mb=room * 100 / LOW_WATERMARK, others_mb=0, per_child_mb=100)
    corral = start_corral({
        "defaults": {"ttl": 300, "stop_grace": 5},
        "memory": {"interval": 0.2, "reserve_mb": 0, "low_watermark": LOW_WATERMARK,
                   "critical_watermark": 95, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                   "gpu_reader_options": {"path": str(gpu)}},
        "models": {"auto": {"model": str(kv_model), "ctx": AUTO_CTX,
                            "kv_cache": {"mode": "auto", "ladder": ["f16", "q8_0", "q4_0"]},
                            "load_overrides": {"max_ctx": big}}},
    })
    plain = corral.http.post("/admin/models/auto/load")
    assert plain.status_code == 200, plain.text
    assert cmdline(plain.json()["pid"])[cmdline(plain.json()["pid"]).index(
        "--cache-type-k") + 1] == "f16"
    bigger = corral.http.post("/admin/models/auto/load", json={"ctx": big, "restart": True})
    assert bigger.status_code == 200, bigger.text
    argv = cmdline(bigger.json()["pid"])
    assert argv[argv.index("--ctx-size") + 1] == str(big)
    assert argv[argv.index("--cache-type-k") + 1] == "q8_0", argv
    chosen = [e for e in corral.log_events("daemon.kv_cache_chosen") if e["model"] == "auto"]
    assert [e["kv"] for e in chosen] == ["f16/f16", "q8_0/q8_0"], chosen
