"""Placement across several GPUs (no GPU here: their figures are injected).

The policy, as pure functions over snapshots of two and four GPUs: a model that fits one GPU
goes to one (best fit, or most free), one that fits none gets the fewest that fit with its
layers split by their room, a GPU past the critical watermark refuses only the loads that need
it, eviction frees memory on the GPU the load will use, pins, replicas spread, group budgets
per GPU, vLLM's parallel size, several models placed together.

Then a real daemon over real llama-server children, with a reader that acts like a driver
(tests/fake_gpu.py: a child holds memory on the GPUs its own CUDA_VISIBLE_DEVICES shows it):
the issue's case (gpu0 at 23,950 of 24,000 MiB, gpu1 at 1,000: the model starts on gpu1),
a split over two GPUs, a user's own CUDA_VISIBLE_DEVICES, pinned replicas; each checked on
the spawned process's own environment and command line (psutil), and in /admin."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from fake_gpu import write_driver

from corral.supervisor.config import ConfigError, parse_config
from corral.supervisor.config.schema.defaults import Defaults
from corral.supervisor.memory.amd import AmdSmiReader
from corral.supervisor.memory.devices import load_gpu_reader, visible_devices_of
from corral.supervisor.memory.estimate import estimate, model_facts
from corral.supervisor.memory.placement import GpuChoice
from corral.supervisor.memory.view import MIB, DeviceView, MemoryView
from corral.supervisor.policy import Generic, KvCache, ModelView, Snapshot

from conftest import Corral, CorralFactory, llama_server_binary, tiny_config, wait_until

FAKE_GPU = Path(__file__).with_name("fake_gpu.py")
TOTAL = 24000  # MiB per GPU; the low watermark (85%) is at 20400

# -- the policy, pure ---------------------------------------------------------------------------

# What each model takes (MiB): its weights, split over its GPUs by their shares, and a fixed
# part on every GPU it uses (context, compute buffers).
SIZES: dict[str, tuple[int, int]] = {"a": (3000, 500), "b": (1500, 500), "c": (3000, 500),
                                     "tiny": (200, 500), "big": (12000, 500),
                                     "r": (1000, 500), "p": (1000, 500), "g1": (2500, 500),
                                     "g2": (3000, 500), "x": (1000, 500), "v": (1000, 500)}


def on(name: str, choice: GpuChoice) -> dict[str, int]:
    weights, fixed = SIZES[name.split("#")[0]]
    shares = choice.split or (1,) * len(choice.gpus)
    return {g: (fixed + weights * s // sum(shares)) * MIB for g, s in
            zip(choice.gpus, shares, strict=True)}


def everywhere(name: str, kv: KvCache | None) -> dict[str, int]:
    return on(name, GpuChoice(("gpu0", "gpu1")))


def view(name: str, footprint: dict[str, int] | None = None, last_used: float = 0.0,
         stoppable: bool = True, **fields: Any) -> ModelView:
    loaded = footprint is not None
    return ModelView(name, loaded, stoppable, last_used, 300.0, ready=loaded,
                     model=name.split("#")[0],
                     footprint={g: n * MIB for g, n in (footprint or {}).items()}, **fields)


def snap(views: list[ModelView], others: dict[str, int], rule: str = "best-fit",
         budgets: dict[str, int] | None = None,
         groups: dict[str, tuple[str, ...]] | None = None) -> Snapshot:
    """GPUs of TOTAL MiB, each used by other processes as `others` says, and by the loaded
    views' footprints."""
    devices = {}
    for name, other in others.items():
        ours = sum(v.footprint.get(name, 0) for v in views if v.loaded)
        devices[name] = DeviceView(name, "gpu", TOTAL * MIB, other * MIB + ours, ours, 0, None)
    mem = MemoryView(devices, 85, 95, {g: n * MIB for g, n in (budgets or {}).items()},
                     gpu_placement=rule)
    return Snapshot(tuple(views), groups or {}, 8, 100.0, memory=mem, estimate=everywhere,
                    estimate_on=lambda name, kv, choice: on(name, choice))


def placed(s: Snapshot, name: str) -> GpuChoice | None:
    return Generic().gpus_for(s, name, None)


def test_a_model_that_fits_one_gpu_goes_to_the_best_fit_or_the_most_free() -> None:
    others = {"gpu0": 2000, "gpu1": 14000}  # room 18400 and 6400; a takes 3500
    assert placed(snap([view("a")], others), "a") == GpuChoice(("gpu1",))
    assert placed(snap([view("a")], others, rule="most-free"), "a") == GpuChoice(("gpu0",))
    placement = Generic().place(snap([view("a")], others), "a")
    assert placement.fits


def test_a_model_no_gpu_can_hold_gets_the_fewest_that_fit_split_by_their_room() -> None:
    # Room 4000, 3000, 6000, 5000. big takes 12000 + 500 a GPU: two (the roomiest, 55/45)
    # leave gpu2 short; three fit, split by their room.
    others = {"gpu0": 16400, "gpu1": 17400, "gpu2": 14400, "gpu3": 15400}
    choice = placed(snap([view("big")], others), "big")
    assert choice == GpuChoice(("gpu0", "gpu2", "gpu3"), (27, 40, 33))
    assert Generic().place(snap([view("big")], others), "big").fits


def test_the_issue_case_a_gpu_past_the_critical_watermark_refuses_only_loads_that_need_it(
        ) -> None:
    others = {"gpu0": 23950, "gpu1": 1000}
    s = snap([view("tiny"), view("p", gpus=("gpu0",))], others)
    assert placed(s, "tiny") == GpuChoice(("gpu1",))
    assert Generic().place(s, "tiny").fits
    pinned = Generic().place(s, "p")  # pinned to gpu0: that one refuses
    assert not pinned.fits and not pinned.retry
    assert "gpu0 is 100% used, at or above the critical watermark" in str(pinned.reason)


def test_eviction_frees_memory_on_the_gpu_the_load_will_use() -> None:
    # gpu0 has room 3000 in all: c (3500) can never go there, however old a is. b, more
    # recently used, is in the way on gpu1.
    others = {"gpu0": 17400, "gpu1": 16400}
    views = [view("a", {"gpu0": 2500}, last_used=1), view("b", {"gpu1": 2000}, last_used=5),
             view("c")]
    s = snap(views, others)
    assert placed(s, "c") == GpuChoice(("gpu1",))
    placement = Generic().place(s, "c")
    assert not placement.fits and placement.evict == "b"


def test_a_pinned_model_runs_on_its_gpus_only() -> None:
    others = {"gpu0": 14000, "gpu1": 2000, "gpu2": 2000, "gpu3": 2000}
    # Best fit alone would say gpu0; the pin says gpu2 or gpu3, and gpu2 is the better fit.
    s = snap([view("p", gpus=("gpu2", "gpu3"))], {**others, "gpu2": 3000})
    assert placed(s, "p") == GpuChoice(("gpu2",))
    # One whose memory corral cannot weigh on a GPU (a command child): on its GPUs all the
    # same; unpinned, it is not placed (its environment is left alone).
    cpu_only = dataclasses.replace(s, estimate_on=lambda name, kv, choice: {"cpu": MIB})
    assert placed(cpu_only, "p") == GpuChoice(("gpu2", "gpu3"))
    assert placed(dataclasses.replace(cpu_only, models=(view("a"),)), "a") is None


def test_replicas_spread_over_the_gpus_before_sharing_one() -> None:
    others = {"gpu0": 14000, "gpu1": 2000}  # best fit: gpu0 for both
    s = snap([view("r#1", {"gpu0": 1500}), view("r#2")], others)
    assert placed(s, "r#2") == GpuChoice(("gpu1",))
    s = snap([view("r#1", {"gpu0": 1500}), view("r#2", {"gpu1": 1500}), view("r#3")], others)
    assert placed(s, "r#3") == GpuChoice(("gpu0",))  # each has one: best fit again


def test_group_budgets_count_per_gpu() -> None:
    others = {"gpu0": 2000, "gpu1": 2000}
    groups = {"g": ("g1", "g2")}
    views = [view("g1", {"gpu0": 3000}), view("g2"), view("x")]
    s = snap(views, others, budgets={"g": 5000}, groups=groups)
    # g's budget is 5000 on each GPU: gpu0 has 2000 of it left, too little for g2's 3500.
    assert placed(s, "g2") == GpuChoice(("gpu1",))
    assert Generic().place(s, "g2").fits
    # The rest: each GPU less the budgets (18400 - 5000); g1's memory is not in it.
    assert placed(s, "x") == GpuChoice(("gpu0",))


def test_a_vllm_model_gets_exactly_its_parallel_size_of_gpus() -> None:
    others = {"gpu0": 2000, "gpu1": 4000, "gpu2": 1000, "gpu3": 3000}
    s = snap([view("v", gpu_count=2)], others)
    # The two with most room; vLLM splits evenly over them itself.
    assert placed(s, "v") == GpuChoice(("gpu0", "gpu2"))


def test_a_vllm_model_past_the_watermark_still_gets_its_whole_parallel_size() -> None:
    # Only gpu1 is below the critical watermark (95% of 24000 = 22800): one GPU for a model
    # that needs two would be a child that cannot start. It gets two, and the placement
    # says whether they hold it.
    others = {"gpu0": 23000, "gpu1": 1000, "gpu2": 23500}
    choice = placed(snap([view("v", gpu_count=2)], others), "v")
    assert choice is not None and len(choice.gpus) == 2 and "gpu1" in choice.gpus


def test_models_loaded_together_are_placed_one_after_another() -> None:
    # Room 3800 on each GPU; a and c take 3500 each on one GPU: one on each fits. Spread
    # over both GPUs each would take 500 + 1500 on each, 4000 a GPU for the two: too much.
    others = {"gpu0": 16600, "gpu1": 16600}
    s = snap([view("a"), view("c"), view("b")], others)
    assert Generic().memory_room_for(s, frozenset({"a", "c"})) is None
    reason = Generic().memory_room_for(s, frozenset({"a", "b", "c"}))
    assert reason is not None and "needs" in reason


def test_the_docs_example_is_a_valid_config_and_contradictions_are_not() -> None:
    page = (Path(__file__).parent.parent / "docs" / "multi-gpu.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", page, re.S)
    assert example is not None
    loaded = parse_config(example.group(1))
    assert loaded.models["embed"].gpus == (2, 3) and loaded.models["embed"].replicas_min == 2
    with pytest.raises(ConfigError) as caught:
        parse_config("""\
models:
  a: {model: a.gguf, gpus: [0], env: {CUDA_VISIBLE_DEVICES: "1"}}
  b: {backend: vllm, model: /srv/b, tensor_parallel_size: 2, gpus: [3]}
""")
    text = "\n".join(str(i) for i in caught.value.issues)
    assert "models.a.gpus: gpus and env CUDA_VISIBLE_DEVICES both choose the GPUs" in text
    assert "1 GPU(s) listed but tensor_parallel_size × pipeline_parallel_size needs 2" in text
    with pytest.raises(ConfigError) as caught:
        parse_config("models:\n  c: {model: c.gguf, gpus: [1, 1]}\n")
    assert "gpus lists GPU indices (0, 1, ...), each once" in str(caught.value.issues[0])


# -- AMD, through a stand-in of the amdsmi binding -----------------------------------------------


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


def fake_amdsmi(used_mb: list[int], procs: dict[int, list[dict[str, Any]]]) -> types.ModuleType:
    """The calls corral makes of amdsmi, with the real binding's names and return shapes
    (ROCm/amdsmi py-interface/amdsmi_interface.py): bytes from the memory calls, process
    dicts with memory_usage.vram_mem."""
    smi = types.ModuleType("amdsmi")
    smi.AmdSmiInitFlags = types.SimpleNamespace(INIT_AMD_GPUS=2)  # type: ignore[attr-defined]
    smi.AmdSmiMemoryType = types.SimpleNamespace(VRAM=0, VIS_VRAM=1, GTT=2)  # type: ignore[attr-defined]
    handles = [_Handle(i) for i in range(len(used_mb))]
    calls: list[str] = []

    def init(flags: int) -> None:
        calls.append(f"init:{flags}")

    def memory_total(handle: _Handle, kind: int) -> int:
        assert kind == 0
        return 48 * 1024 * MIB

    def memory_usage(handle: _Handle, kind: int) -> int:
        assert kind == 0
        return used_mb[handle.index] * MIB

    def asic_info(handle: _Handle) -> dict[str, Any]:
        return {"market_name": "AMD Radeon Pro W7900", "vendor_id": "0x1002"}

    def process_list(handle: _Handle) -> list[dict[str, Any]]:
        return procs.get(handle.index, [])

    smi.amdsmi_init = init  # type: ignore[attr-defined]
    smi.amdsmi_get_processor_handles = lambda: handles  # type: ignore[attr-defined]
    smi.amdsmi_get_gpu_memory_total = memory_total  # type: ignore[attr-defined]
    smi.amdsmi_get_gpu_memory_usage = memory_usage  # type: ignore[attr-defined]
    smi.amdsmi_get_gpu_asic_info = asic_info  # type: ignore[attr-defined]
    smi.amdsmi_get_gpu_process_list = process_list  # type: ignore[attr-defined]
    smi.calls = calls  # type: ignore[attr-defined]
    return smi


@pytest.fixture
def amdsmi_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    smi = fake_amdsmi([1000, 30000], {1: [
        {"name": "llama-server", "pid": 4242, "mem": 0,
         "engine_usage": {"gfx": 0, "enc": 0},
         "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": 700 * MIB},
         "cu_occupancy": "N/A"},
        {"name": "N/A", "pid": 4343, "mem": 0, "engine_usage": {"gfx": 0, "enc": 0},
         "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": "N/A"},
         "cu_occupancy": "N/A"}]})
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    yield smi


def test_the_amdsmi_reader_reads_each_gpu_and_each_process(
        amdsmi_here: types.ModuleType, tmp_path: Path) -> None:
    reader = load_gpu_reader("amdsmi", {}, tmp_path)
    assert isinstance(reader, AmdSmiReader)
    devices = reader.devices()
    assert [(d.name, d.total, d.used, d.label) for d in devices] == [
        ("gpu0", 48 * 1024 * MIB, 1000 * MIB, "AMD Radeon Pro W7900"),
        ("gpu1", 48 * 1024 * MIB, 30000 * MIB, "AMD Radeon Pro W7900")]
    # A process without a per-process figure ("N/A") is left out, not counted as 0.
    assert reader.usage_by_pid() == {4242: {"gpu1": 700 * MIB}}
    assert amdsmi_here.calls == ["init:2"]  # type: ignore[attr-defined]
    assert reader.visible_devices == "HIP_VISIBLE_DEVICES"


def test_auto_takes_amdsmi_where_nvml_finds_no_gpu(
        amdsmi_here: types.ModuleType, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVIDIA driver: import fails
    reader = load_gpu_reader("auto", {}, tmp_path)
    assert [d.name for d in reader.devices()] == ["gpu0", "gpu1"]
    assert visible_devices_of(reader) == "HIP_VISIBLE_DEVICES"


def test_without_the_binding_the_amdsmi_reader_reads_no_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    reader = load_gpu_reader("amdsmi", {}, tmp_path)
    assert reader.devices() == [] and reader.usage_by_pid() == {}


# -- a real daemon, real children ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpus") / "gpus.json"
    write_driver(path, {"gpu0": (TOTAL, 0), "gpu1": (TOTAL, 0)}, child_mb=100)
    return path


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
           gpu_file: Path) -> Corral:
    config = tiny_config(
        tiny_models, ["tiny-a", "tiny-b", "tiny-c", "tiny-a2"], policy={"max_loaded": 6},
        memory={"interval": 0.2, "reserve_mb": 0, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                "gpu_reader_options": {"path": str(gpu_file)}})
    config["models"]["tiny-b"]["env"] = {"CUDA_VISIBLE_DEVICES": "1"}
    config["models"]["tiny-c"].update(gpus=[0, 1], replicas=2)
    config["models"]["tiny-a2"]["gpus"] = [1]
    # Any server: corral cannot weigh its GPU memory, but its pin still confines it.
    config["models"]["cmd"] = {
        "backend": "command", "served_name": "tiny-served", "gpus": [1],
        "command": [llama_server_binary(), "--model", str(tiny_models["tiny-a"]),
                    "--host", "127.0.0.1", "--port", "${PORT}", "--alias", "tiny-served",
                    "--ctx-size", "2048", "--threads", "1"]}
    return start_corral_module(config)


def gpus_now(corral: Corral, gpu_file: Path, others: dict[str, float]) -> None:
    """Set what other processes use on each GPU; wait until corral has sampled it, with no
    child left running."""
    for name, m in corral.models().items():
        if m["state"] != "stopped":
            assert corral.http.post(f"/admin/models/{name.split('#')[0]}/unload").status_code \
                == 200
    write_driver(gpu_file, {g: (TOTAL, mb) for g, mb in others.items()}, child_mb=100)

    def sampled() -> bool:
        memory = corral.http.get("/admin/memory").json()
        used = {d["name"]: d["used_mib"] for d in memory["devices"] if d["kind"] == "gpu"}
        return used.keys() == others.keys() \
            and all(abs(used[g] - mb) < 0.2 for g, mb in others.items()) \
            and all(m["state"] == "stopped" for m in memory["models"])
    wait_until(sampled, timeout=30)


def child(corral: Corral, model: str) -> psutil.Process:
    pid = corral.model(model)["pid"]
    assert isinstance(pid, int), corral.model(model)
    return psutil.Process(pid)


def admin_gpus(corral: Corral, name: str) -> tuple[Any, Any]:
    """Where /admin/models and /admin/memory say `name`'s child runs."""
    memory = {m["name"]: m for m in corral.http.get("/admin/memory").json()["models"]}
    return corral.model(name)["gpus"], memory[name]["gpus"]


def test_the_issue_case_starts_the_model_on_the_gpu_with_room(corral: Corral,
                                                               gpu_file: Path) -> None:
    gpus_now(corral, gpu_file, {"gpu0": 23950, "gpu1": 1000})
    response = corral.chat("tiny-a", max_tokens=4)
    assert response.status_code == 200, response.text
    env = child(corral, "tiny-a").environ()
    assert env.get("CUDA_VISIBLE_DEVICES") == "1"
    assert env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"  # NVML's numbering, not CUDA's
    assert "--tensor-split" not in child(corral, "tiny-a").cmdline()
    assert admin_gpus(corral, "tiny-a") == ([1], [1])
    memory = {m["name"]: m for m in corral.http.get("/admin/memory").json()["models"]}
    assert set(memory["tiny-a"]["estimate_mib"]) == {"cpu", "gpu1"}
    # And the driver sees it there: what corral measured of it is on gpu1 only.
    wait_until(lambda: memory_of(corral, "tiny-a")["measured_mib"] is not None
               and "gpu1" in memory_of(corral, "tiny-a")["measured_mib"], timeout=10)
    assert "gpu0" not in memory_of(corral, "tiny-a")["measured_mib"]


def memory_of(corral: Corral, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(m for m in corral.http.get("/admin/memory").json()["models"]
                                 if m["name"] == name)
    return found


def gpu_need(model: Path, gpus: tuple[str, ...], split: tuple[int, ...] = ()) -> float:
    """MiB a tiny model's child takes on each GPU it uses (the most of them), as corral
    estimates it with the config's settings."""
    d = Defaults()
    found = estimate(model_facts(model), ctx=8192, parallel=d.parallel,
                     n_gpu_layers=d.n_gpu_layers, cache_type_k=None, cache_type_v=None,
                     gpus=gpus, split=split)
    return max(n for g, n in found.devices.items() if g != "cpu") / MIB


def test_a_model_no_gpu_can_hold_is_split_over_two(corral: Corral, gpu_file: Path,
                                                   tiny_models: dict[str, Path]) -> None:
    path = tiny_models["tiny-a"]
    one, two = gpu_need(path, ("gpu0",)), gpu_need(path, ("gpu0", "gpu1"), (50, 50))
    assert two < one  # the layers' share is what a second GPU takes off the first
    room = (one + two) / 2  # on each GPU: one is not enough, two are
    low_line = TOTAL * 0.85
    gpus_now(corral, gpu_file, {"gpu0": low_line - room, "gpu1": low_line - room})
    response = corral.chat("tiny-a", max_tokens=4)
    assert response.status_code == 200, response.text
    proc = child(corral, "tiny-a")
    assert proc.environ().get("CUDA_VISIBLE_DEVICES") == "0,1"
    argv = proc.cmdline()
    assert argv[argv.index("--tensor-split") + 1] == "50,50"
    assert admin_gpus(corral, "tiny-a") == ([0, 1], [0, 1])


def test_a_users_own_cuda_visible_devices_is_kept_and_counted(corral: Corral,
                                                              gpu_file: Path) -> None:
    gpus_now(corral, gpu_file, {"gpu0": 5000, "gpu1": 1000})  # best fit alone: gpu0
    response = corral.chat("tiny-b", max_tokens=4)
    assert response.status_code == 200, response.text
    env = child(corral, "tiny-b").environ()
    assert env.get("CUDA_VISIBLE_DEVICES") == "1"
    assert "CUDA_DEVICE_ORDER" not in env  # the user's choice, left as they wrote it
    assert admin_gpus(corral, "tiny-b") == ([1], [1])
    assert set(memory_of(corral, "tiny-b")["estimate_mib"]) == {"cpu", "gpu1"}


def test_pinned_replicas_spread_over_their_gpus(corral: Corral, gpu_file: Path) -> None:
    gpus_now(corral, gpu_file, {"gpu0": 5000, "gpu1": 1000})  # best fit: gpu0 for both
    assert corral.http.post("/admin/models/tiny-c/load").status_code == 200

    def both() -> dict[str, psutil.Process] | None:
        ready = {n: m for n, m in corral.models().items()
                 if n.startswith("tiny-c") and m["state"] == "ready"}
        return {n: psutil.Process(m["pid"]) for n, m in ready.items()} \
            if len(ready) == 2 else None
    children = wait_until(both, timeout=60)
    seen = sorted(p.environ().get("CUDA_VISIBLE_DEVICES") for p in children.values())
    assert seen == ["0", "1"]
    for name, proc in children.items():
        assert admin_gpus(corral, name) == ([int(proc.environ()["CUDA_VISIBLE_DEVICES"])],) * 2


def test_a_pinned_command_child_is_confined_to_its_gpu(corral: Corral, gpu_file: Path) -> None:
    gpus_now(corral, gpu_file, {"gpu0": 1000, "gpu1": 1000})
    response = corral.chat("cmd", max_tokens=4)
    assert response.status_code == 200, response.text
    assert child(corral, "cmd").environ().get("CUDA_VISIBLE_DEVICES") == "1"
    assert admin_gpus(corral, "cmd") == ([1], [1])


def test_eviction_makes_room_on_the_gpu_the_load_needs(corral: Corral, gpu_file: Path,
                                                       tiny_models: dict[str, Path]) -> None:
    one = gpu_need(tiny_models["tiny-a"], ("gpu0",))
    room = 1.5 * one  # each GPU holds one tiny model, not two
    low_line = TOTAL * 0.85
    gpus_now(corral, gpu_file, {"gpu0": low_line - room, "gpu1": low_line - room})
    for name in ("tiny-a", "tiny-b"):  # tiny-a on gpu0 (the first of two equal fits),
        assert corral.chat(name, max_tokens=4).status_code == 200  # tiny-b on gpu1 (its env)
    assert admin_gpus(corral, "tiny-a")[0] == [0] and admin_gpus(corral, "tiny-b")[0] == [1]
    # tiny-a2 is pinned to gpu1: tiny-b makes way there, though tiny-a was used longer ago.
    response = corral.chat("tiny-a2", max_tokens=4)
    assert response.status_code == 200, response.text
    states = {n: corral.model(n)["state"] for n in ("tiny-a", "tiny-b", "tiny-a2")}
    assert states == {"tiny-a": "ready", "tiny-b": "stopped", "tiny-a2": "ready"}, states
    stops = [e for e in corral.log_events("instance.stop") if e["model"] == "tiny-b"]
    assert stops and "tiny-a2" in stops[-1]["reason"]
    assert admin_gpus(corral, "tiny-a2") == ([1], [1])
