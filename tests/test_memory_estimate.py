"""Memory estimates against real GGUF files, real llama-server children and shared/GPU.md's H100
figures."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from gguf import GGUFReader, GGUFWriter

from corral.supervisor.backends.llama_server import find_executable
from corral.supervisor.memory.estimate import (
    KV_TYPE_BYTES,
    EstimateError,
    MiB,
    ModelFacts,
    estimate,
    kv_bytes,
    kv_cells,
    model_facts,
)
from corral.supervisor.memory.llama_reports import (
    device_name,
    fit_params,
    fit_params_binary,
    parse_load_log,
)

from conftest import free_port, wait_until
from tinymodel import write_tiny_llama

# llama-server prints its buffer sizes at verbosity 4 and up only.
LOG_ARGS = ["-lv", "4", "--threads", "1"]
# The log prints MiB with two decimals.
LOG_ROUNDING = 0.005 * MiB
# |estimate - RSS| / RSS for a SmolLM2 child. Measured +3.8% at ctx 4096 and +4.0% at 16384:
# the estimate counts whole compute buffers where RSS counts only the pages one short
# completion touched (the KQ mask rows past the used cells stay untouched: up to 16 MiB at
# ctx 16384), and the per-process overhead was measured on other models (±4 MiB). 10% holds
# those with room for allocator and thread-stack noise, and still catches a term that is
# missing or counted twice (KV alone is 40% of the child at 4096).
RSS_BOUND = 0.10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("est") / "tiny.gguf", seed=1)


@dataclass
class Child:
    """One llama-server that was started, loaded, answered one completion, and stopped."""

    log: list[str]
    rss: int  # bytes, after the completion


def _run_child(model: Path, ctx: int, log_path: Path) -> Child:
    port = free_port()
    argv = [find_executable(None, ("llama-server",)), "--host", "127.0.0.1", "--port",
            str(port), "-m", str(model), "-c", str(ctx), "-np", "1", *LOG_ARGS]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=30)
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                   timeout=60).raise_for_status()
        rss = psutil.Process(proc.pid).memory_info().rss
        wait_until(lambda: "compute buffer size" in log_path.read_text(), timeout=5)
        return Child(log_path.read_text().splitlines(), rss)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tiny_child(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Child:
    return _run_child(tiny, 4096, tmp_path_factory.mktemp("log") / "tiny.log")


@pytest.fixture(scope="module")
def smol_children(smol_model: Path, tmp_path_factory: pytest.TempPathFactory,
                  ) -> dict[int, Child]:
    folder = tmp_path_factory.mktemp("log")
    return {ctx: _run_child(smol_model, ctx, folder / f"smol-{ctx}.log") for ctx in (4096, 16384)}


# -- model_facts ---------------------------------------------------------------------------------

def test_model_facts_of_the_tiny_model(tiny: Path) -> None:
    f = model_facts(tiny)
    assert (f.arch, f.n_layer, f.n_embd, f.n_head, f.n_head_kv) == ("llama", 2, 64, 4, 4)
    assert (f.head_dim_k, f.head_dim_v, f.n_ctx_train, f.n_vocab, f.n_ff) == (16, 16, 32768,
                                                                              259, 128)
    # f32 everywhere: per block two norms, q/k/v/o 64×64 and gate/up/down 128×64
    assert f.layer_bytes == (4 * (2 * 64 + 4 * 64 * 64 + 3 * 128 * 64),) * 2
    assert f.other_bytes == 4 * (2 * 259 * 64 + 64)  # token_embd, output, output_norm
    assert f.output_bytes == 4 * (259 * 64 + 64) and f.output_shared_bytes == 0
    assert f.weight_bytes == sum(int(t.n_bytes) for t in GGUFReader(str(tiny)).tensors)
    assert f.weight_bytes < tiny.stat().st_size


def test_model_facts_of_smollm2(smol_model: Path) -> None:
    f = model_facts(smol_model)
    assert (f.n_layer, f.n_embd, f.n_head, f.n_head_kv, f.head_dim_k) == (30, 576, 9, 3, 64)
    assert (f.n_ctx_train, f.n_vocab, f.n_ff) == (8192, 49152, 1536)
    # Tied embeddings: no output.weight; llama.cpp puts a copy of token_embd (Q8_0) on the
    # output device, so it counts there but not in the file's bytes.
    assert f.output_shared_bytes == 30081024
    assert f.weight_bytes == 96576768  # llama-server logs 92.10 MiB of CPU_Mapped model


def test_model_facts_is_cached_per_file_version(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", seed=1)
    first = model_facts(path)
    assert model_facts(path) is first
    write_tiny_llama(path, seed=2, ctx=1024)
    assert model_facts(path).n_ctx_train == 1024


def test_model_facts_errors_say_what_is_wrong(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(EstimateError, match="not a GGUF"):
        model_facts(junk)
    with pytest.raises(EstimateError, match="cannot read"):
        model_facts(tmp_path / "missing.gguf")
    bare = tmp_path / "bare.gguf"
    writer = GGUFWriter(str(bare), "llama")
    writer.add_context_length(4096)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EstimateError, match=r"lacks key llama\.block_count"):
        model_facts(bare)


# -- KV ------------------------------------------------------------------------------------------

def gpu_md_facts() -> ModelFacts:
    """shared/GPU.md's random llama: 22 layers, n_embd 2048, f16, a 2.26 GB file. The KV
    savings there (K q8_0 saved 2642 MiB at ctx 65536) need n_embd_kv 2048, so as many KV
    heads as heads; GPU.md does not say how many: 16 of 128 is the shape whose KQ matrix grows
    like the measured memory from ctx 4096 to 65536 with one slot (corral's default). Vocab
    32000 and n_ff 4608 make up the rest of the 2.26 GB."""
    n_vocab, n_embd = 32000, 2048
    other = 2 * n_vocab * n_embd * 2 + n_embd * 4  # token_embd, output (f16), output_norm
    return ModelFacts(
        path=Path("gpu-md.gguf"), arch="llama", n_layer=22, n_embd=n_embd, n_head=16,
        n_head_kv=16, head_dim_k=128, head_dim_v=128, n_ctx_train=65536,
        layer_bytes=((2_260_000_000 - other) // 22,) * 22, other_bytes=other, n_vocab=n_vocab,
        n_ff=4608, output_bytes=n_vocab * n_embd * 2 + n_embd * 4)


def test_kv_bytes_matches_the_gpu_md_savings() -> None:
    f = gpu_md_facts()
    f16 = kv_bytes(f, 65536, "f16", "f16")
    assert f16 == 11264 * MiB
    assert kv_bytes(f, 4096, "f16", "f16") == 704 * MiB
    # Measured on the H100 (NVML): K q8_0 saved 2642 MiB, K q4_0 4050 MiB.
    for cache_type, measured in (("q8_0", 2642), ("q4_0", 4050)):
        saved = (f16 - kv_bytes(f, 65536, cache_type, "f16")) / MiB
        assert saved == pytest.approx(measured, abs=3), cache_type
    assert kv_bytes(f, 65536, "f16", "f16", n_layers=11) == f16 // 2


def test_kv_rows_round_to_whole_blocks() -> None:
    # one head of 40: a q8_0 row is two 34-byte blocks, not 40 × 34/32 bytes
    f = ModelFacts(Path("x"), "llama", 1, 40, 1, 1, 40, 40, 1024, (0,), 0)
    assert kv_bytes(f, 256, "q8_0", "f16") == 256 * (2 * 34 + 40 * 2)
    assert KV_TYPE_BYTES["q4_0"] == 18 / 32 and KV_TYPE_BYTES["iq4_nl"] == 18 / 32
    with pytest.raises(EstimateError, match="unknown KV cache type"):
        kv_bytes(f, 256, "q9_9", "f16")


def test_kv_cells_pad_each_slot_like_llama_server() -> None:
    # read off llama-server's KV buffer sizes for SmolLM2
    assert kv_cells(1000, 1) == 1024
    assert kv_cells(4096, 3) == 1536  # 3 × 1536 cells: 101.25 MiB
    assert kv_cells(770, 3) == 512


# -- llama-server's own log ----------------------------------------------------------------------

def test_parse_load_log_of_a_real_child(tiny: Path, tiny_child: Child) -> None:
    parsed = parse_load_log(tiny_child.log)
    assert set(parsed) == {"cpu"}
    cpu = parsed["cpu"]
    facts = model_facts(tiny)
    assert abs(cpu["model"] - facts.weight_bytes) <= LOG_ROUNDING
    assert abs(cpu["kv"] - kv_bytes(facts, 4096, "f16", "f16")) <= LOG_ROUNDING
    assert cpu["compute"] > 0
    est = estimate(facts, ctx=4096, parallel=1, n_gpu_layers=-1, cache_type_k=None,
                   cache_type_v=None)
    assert est.compute == pytest.approx(cpu["compute"] + cpu["output"], rel=0.15)


def test_parse_load_log_names_devices_and_keeps_the_last_load() -> None:
    lines = [
        # the --fit dry run at -v: zero-size buffers, then the real load
        "0.00.010 I load_tensors:          CPU model buffer size =     0.00 MiB",
        "0.00.011 I llama_kv_cache:        CPU KV buffer size =     0.00 MiB",
        "0.00.012 I load_tensors:        CUDA0 model buffer size =  1000.00 MiB",
        "0.00.013 I load_tensors:        CUDA1 model buffer size =   900.50 MiB",
        "0.00.014 I load_tensors:   CPU_Mapped model buffer size =   125.00 MiB",
        "0.00.015 I load_tensors:   CPU_REPACK model buffer size =     2.00 MiB",
        "llama_context:  CUDA_Host  output buffer size =     0.12 MiB",
        "llama_kv_cache:      CUDA0 KV buffer size =   352.00 MiB",
        "llama_kv_cache:      CUDA1 KV buffer size =   352.00 MiB",
        "sched_reserve:      CUDA0 compute buffer size =   300.01 MiB",
        "sched_reserve:  CUDA_Host compute buffer size =    12.02 MiB",
        "~llama_context:      CUDA0 compute buffer size is 300.0100 MiB, matches expectation",
    ]
    parsed = parse_load_log(lines)
    assert parsed["gpu0"] == {"model": 1000 * MiB, "kv": 352 * MiB,
                              "compute": round(300.01 * MiB), "output": 0}
    assert parsed["gpu1"]["model"] == round(900.5 * MiB)
    assert parsed["cpu"]["model"] == 127 * MiB
    assert parsed["cpu"]["output"] == round(0.12 * MiB)
    for name, expected in [("ROCm0", "gpu0"), ("Vulkan1", "gpu1"), ("Metal", "gpu0"),
                           ("MTL0", "gpu0"), ("CPU_Mapped", "cpu"), ("Host", "cpu"),
                           ("Vulkan_Host", "cpu"), ("RPC[10.0.0.2:50052]", "rpc[10.0.0.2:50052]")]:
        assert device_name(name) == expected, name


# -- llama-fit-params ----------------------------------------------------------------------------

def test_fit_params_agrees_with_the_child(smol_model: Path, smol_children: dict[int, Child],
                                          ) -> None:
    binary = fit_params_binary(find_executable(None, ("llama-server",)))
    assert binary is not None
    started = time.monotonic()
    fit = asyncio.run(fit_params(binary, smol_model, ctx=4096, parallel=1, n_gpu_layers=-1,
                                 cache_type_k=None, cache_type_v=None))
    took = time.monotonic() - started
    assert fit is not None and fit.source == "llama-fit-params"
    assert took < 5, took  # 0.13–0.32 s measured
    logged = parse_load_log(smol_children[4096].log)["cpu"]
    assert set(fit.devices) == {"cpu"}
    assert fit.weights == logged["model"] // MiB * MiB  # whole MiB, floored
    assert fit.kv == logged["kv"] // MiB * MiB
    # The dry run reserves logits for a whole ubatch; llama-server for one row per slot.
    vocab_rows = model_facts(smol_model).n_vocab * 512 * 4
    assert logged["compute"] - MiB <= fit.compute <= logged["compute"] + vocab_rows
    gguf = estimate(model_facts(smol_model), ctx=4096, parallel=1, n_gpu_layers=-1,
                    cache_type_k=None, cache_type_v=None)
    assert fit.overhead == gguf.overhead


def test_fit_params_gives_none_when_it_cannot(tmp_path: Path, tiny: Path) -> None:
    binary = fit_params_binary(find_executable(None, ("llama-server",)))
    assert binary is not None
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 100)
    kwargs = {"ctx": 4096, "parallel": 1, "n_gpu_layers": -1, "cache_type_k": None,
              "cache_type_v": None}
    assert asyncio.run(fit_params(str(tmp_path / "no-such-binary"), tiny, **kwargs)) is None
    assert asyncio.run(fit_params(binary, junk, **kwargs)) is None
    # A run past its timeout: a stand-in that never ends (the real one on a tiny model can
    # finish within a 1 ms timeout on a busy box, where the spawn itself takes longer).
    (tmp_path / "hangs").mkdir()
    hangs = tmp_path / "hangs" / "llama-fit-params"
    hangs.write_text(f"#!/bin/sh\nexec {shutil.which('sleep')} 600\n")
    hangs.chmod(0o755)
    assert asyncio.run(fit_params(str(hangs), tiny, timeout=0.5, **kwargs)) is None
    assert not psutil.Process().children(recursive=True)  # killed, not left running
    assert fit_params_binary(str(tmp_path / "llama-server")) is None


# -- estimate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctx", [4096, 16384])
def test_estimate_vs_a_real_child(smol_model: Path, smol_children: dict[int, Child],
                                  ctx: int) -> None:
    child = smol_children[ctx]
    est = estimate(model_facts(smol_model), ctx=ctx, parallel=1, n_gpu_layers=-1,
                   cache_type_k=None, cache_type_v=None)
    assert set(est.devices) == {"cpu"} and est.devices["cpu"] == est.total
    logged = parse_load_log(child.log)["cpu"]
    assert abs(est.weights - logged["model"]) <= LOG_ROUNDING
    assert abs(est.kv - logged["kv"]) <= LOG_ROUNDING
    assert est.compute == pytest.approx(logged["compute"] + logged["output"], rel=0.15)
    error = (est.total - child.rss) / child.rss
    print(f"ctx {ctx}: estimate {est.total / MiB:.1f} MiB, RSS {child.rss / MiB:.1f} MiB, "
          f"error {error:+.1%}")
    assert abs(error) <= RSS_BOUND


def test_estimate_of_the_gpu_md_child() -> None:
    f = gpu_md_facts()
    for ctx, type_k, nvml in [(4096, None, 3620), (65536, None, 16460),
                              (65536, "q8_0", 13818), (65536, "q4_0", 12410)]:
        est = estimate(f, ctx=ctx, parallel=1, n_gpu_layers=-1, cache_type_k=type_k,
                       cache_type_v=None, gpus=["gpu0"])
        assert est.devices["gpu0"] / MiB == pytest.approx(nvml, rel=0.10), (ctx, type_k)
        assert sum(est.devices.values()) == est.total
        assert est.devices["cpu"] < 200 * MiB  # token_embd and the process itself


def test_estimate_places_layers_like_llama_cpp() -> None:
    f = gpu_md_facts()
    args = {"ctx": 4096, "parallel": 1, "cache_type_k": None, "cache_type_v": None}
    one = estimate(f, n_gpu_layers=-1, **args, gpus=["gpu0"])
    two = estimate(f, n_gpu_layers=-1, **args, gpus=["gpu0", "gpu1"])
    # llama.cpp shares out the 22 blocks and the output layer as 23 offloaded layers: block
    # il to gpu0 while il / 23 < 0.5, so 12 blocks there, 10 and the output on gpu1
    block = f.layer_bytes[0] + kv_bytes(f, 4096, "f16", "f16") // 22
    assert two.devices["gpu1"] - two.devices["gpu0"] == f.output_bytes - 2 * block
    # a --tensor-split of 1,3: a quarter of the 23 layers (0..5) on gpu0
    split = estimate(f, n_gpu_layers=-1, **args, gpus=["gpu0", "gpu1"], split=[1, 3])
    assert split.devices["gpu0"] - two.devices["gpu0"] == -6 * block
    assert two.weights == one.weights == f.weight_bytes
    assert two.devices["cpu"] == one.devices["cpu"]
    # -ngl 22 (= n_layer): every block offloaded, the output layer not
    blocks = estimate(f, n_gpu_layers=22, **args, gpus=["gpu0"])
    assert one.devices["gpu0"] - blocks.devices["gpu0"] == f.output_bytes
    # -ngl 11: the last 11 blocks and their KV; the host computes the first 11
    half = estimate(f, n_gpu_layers=11, **args, gpus=["gpu0"])
    gpu_weights_kv = 11 * (f.layer_bytes[0] + kv_bytes(f, 4096, "f16", "f16") // 22)
    assert half.devices["gpu0"] - blocks.devices["gpu0"] == -gpu_weights_kv
    assert half.devices["cpu"] > blocks.devices["cpu"] + gpu_weights_kv
    assert set(estimate(f, n_gpu_layers=0, **args, gpus=["gpu0"]).devices) == {"cpu"}
    # ctx 0 is the training context
    assert estimate(f, ctx=0, parallel=1, n_gpu_layers=-1, cache_type_k=None,
                    cache_type_v=None).kv == 11264 * MiB
    # a quantized V cache needs flash attention, which drops the KQ matrix
    quant_v = estimate(f, n_gpu_layers=-1, **{**args, "cache_type_v": "q8_0"}, gpus=["gpu0"])
    assert quant_v.compute < one.compute - 128 * MiB
