"""The vLLM adapter without starting vLLM: argv from the spec, the command's discovery, the
environment, the GPU share computed from the estimate, the checkpoint estimate, and how the
config resolves vLLM models (Hugging Face ids, defaults, keys). tests/test_vllm.py runs the
real thing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tinyhf import write_tiny_hf_llama

from corral.supervisor.backends import BACKENDS
from corral.supervisor.backends.binaries import BinaryNotFound
from corral.supervisor.backends.vllm import Vllm, gpu_fraction, vllm_command
from corral.supervisor.config import ConfigError, parse_config
from corral.supervisor.memory.checkpoint import (
    CPU_PROCESS_OVERHEAD,
    GPU_OVERHEAD,
    GiB,
    checkpoint_facts,
    estimate_vllm,
    kv_bytes_per_token,
)

MiB = 1024 * 1024


def write_header_only_checkpoint(folder: Path, *, layers: int, hidden: int, heads: int,
                                 kv_heads: int, ff: int, vocab: int) -> Path:
    """A checkpoint of a big model's shape whose safetensors file holds the header only (the
    estimate reads nothing else): a 7B without 14 GB on disk."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": ff,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}))
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "q": [hidden, hidden], p + "k": [kv_heads * head_dim, hidden],
                   p + "v": [kv_heads * head_dim, hidden], p + "o": [hidden, hidden],
                   p + "gate": [ff, hidden], p + "up": [ff, hidden], p + "down": [hidden, ff]}
    header = {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
              for name, shape in shapes.items()}
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_llama(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Llama-3-8B's shape: 32 layers, 4096 hidden, 32 heads of 128, 8 KV heads.
    return write_header_only_checkpoint(tmp_path_factory.mktemp("big") / "llama8b", layers=32,
                                        hidden=4096, heads=32, kv_heads=8, ff=14336,
                                        vocab=128256)


def vllm_yaml(model: str, **keys: object) -> str:
    extra = "".join(f"    {k}: {json.dumps(v)}\n" for k, v in keys.items())
    return ("models:\n  v:\n    backend: vllm\n"
            f"    model: {json.dumps(model)}\n    command: [/bin/true]\n" + extra)


def test_argv_carries_every_setting_from_the_spec(tiny_hf: Path, tmp_path: Path) -> None:
    spec = parse_config(vllm_yaml(str(tiny_hf), ctx=1024, parallel=8, kv_cache_dtype="auto",
                                  gpu_memory_utilization=0.3, tensor_parallel_size=2,
                                  pipeline_parallel_size=2, distributed_executor_backend="ray",
                                  args=["--enforce-eager"]), tmp_path / "c.yaml").models["v"]
    assert Vllm().argv(spec, 4321) == [
        "/bin/true", "--model", str(tiny_hf), "--served-model-name", "v",
        "--host", "127.0.0.1", "--port", "4321", "--max-num-seqs", "8",
        "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
        "--kv-cache-dtype", "auto", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
        "--enforce-eager"]
    assert BACKENDS["vllm"].lists_models and not BACKENDS["llama-server"].lists_models


def test_a_hugging_face_id_is_passed_as_is_and_a_path_is_made_absolute(tmp_path: Path) -> None:
    loaded = parse_config(
        "models:\n"
        "  hub: {backend: vllm, model: Qwen/Qwen2.5-0.5B-Instruct, command: [/bin/true]}\n"
        "  local: {backend: vllm, model: ./ckpt/qwen, command: [/bin/true]}\n",
        tmp_path / "c.yaml")
    hub, local = loaded.models["hub"], loaded.models["local"]
    assert hub.model_id == "Qwen/Qwen2.5-0.5B-Instruct"
    assert Vllm().argv(hub, 1)[1:3] == ["--model", "Qwen/Qwen2.5-0.5B-Instruct"]
    assert local.model_id is None and local.model_path == tmp_path / "ckpt" / "qwen"
    # No files to read: vLLM's own default KV space, and no estimate (measured once it runs).
    assert "VLLM_CPU_KVCACHE_SPACE" not in Vllm().env(hub)
    with pytest.raises(Exception, match=r"no config\.json"):
        Vllm().estimate(hub, (None, None), ())


def test_the_command_is_found_or_the_error_says_how_to_install_vllm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_config(vllm_yaml("org/m"), tmp_path / "c.yaml").models["v"]
    missing = parse_config(vllm_yaml("org/m").replace("/bin/true", "/opt/none/bin/python"),
                           tmp_path / "c.yaml").models["v"]
    with pytest.raises(BinaryNotFound, match="command '/opt/none/bin/python' does not exist; "
                                             "install vLLM in a venv of its own"):
        vllm_command(missing)
    assert vllm_command(spec) == ["/bin/true"]
    # Without `command`: `vllm serve` from PATH, or the same advice.
    bare = parse_config("models:\n  v: {backend: vllm, model: org/m}\n",
                        tmp_path / "c.yaml").models["v"]
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BinaryNotFound, match="vllm is not on PATH"):
        vllm_command(bare)
    launcher = tmp_path / "vllm"
    launcher.write_text("#!/bin/true\n")
    launcher.chmod(0o755)
    assert vllm_command(bare) == [str(launcher), "serve"]


def test_environment_sizes_the_cpu_kv_cache_and_keeps_the_users_own(tiny_hf: Path,
                                                                     big: Path,
                                                                     tmp_path: Path) -> None:
    tiny = parse_config(vllm_yaml(str(tiny_hf), ctx=512), tmp_path / "c.yaml").models["v"]
    assert Vllm().env(tiny)["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the 1 GiB minimum
    # 8B shape: 128 KiB a token (bf16); 32768 tokens × 2 sequences = 8 GiB.
    large = parse_config(vllm_yaml(str(big), ctx=32768, parallel=2),
                         tmp_path / "c.yaml").models["v"]
    assert Vllm().env(large)["VLLM_CPU_KVCACHE_SPACE"] == "8"
    own = parse_config(vllm_yaml(str(big), env={"VLLM_CPU_KVCACHE_SPACE": "3"}),
                       tmp_path / "c.yaml").models["v"]
    assert Vllm().env(own)["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert Vllm().auth_env("k") == {"VLLM_API_KEY": "k"}


def test_checkpoint_facts_and_kv_bytes(big: Path, tiny_hf: Path) -> None:
    facts = checkpoint_facts(big)
    assert (facts.n_layer, facts.n_kv_head, facts.head_dim) == (32, 8, 128)
    assert 8.0e9 < facts.params < 8.1e9  # Llama-3-8B has 8.03 B parameters
    assert kv_bytes_per_token(facts, "auto") == 128 * 1024
    assert kv_bytes_per_token(facts, "fp8") == 64 * 1024
    assert kv_bytes_per_token(facts, "auto", ["--dtype", "float32"]) == 256 * 1024
    tiny = checkpoint_facts(tiny_hf)
    assert tiny.head_dim == 64 and tiny.dtype == "float32" and not tiny.quantized


def test_gpu_estimate_and_the_share_two_vllm_children_take_of_one_gpu(big: Path,
                                                                     tmp_path: Path) -> None:
    h100 = 80 * 1024 * MiB
    chat = parse_config(vllm_yaml(str(big), ctx=8192, parallel=4),
                        tmp_path / "c.yaml").models["v"]
    est = estimate_vllm(checkpoint_facts(big), ctx=8192, parallel=4, kv_cache_dtype=None,
                        gpus=["gpu0"])
    weights = checkpoint_facts(big).params * 2
    assert est.weights == weights and est.kv == 8192 * 4 * 128 * 1024  # 4 GiB
    assert est.devices["gpu0"] == weights + est.kv + est.compute + GPU_OVERHEAD
    assert est.devices["cpu"] == CPU_PROCESS_OVERHEAD
    tuned = Vllm().tune(chat, est.devices, {"gpu0": h100})
    share = tuned.gpu_memory_utilization
    assert share is not None and share * h100 >= est.devices["gpu0"]
    assert share - 0.01 < est.devices["gpu0"] / h100 <= share  # rounded up by one step at most
    assert 0.25 < share < 0.35  # ~16 GB weights + 4 GB KV + activations of an 80 GB GPU
    # A second vLLM child of the same kind fits beside it: vLLM's default (0.9) would not.
    assert 2 * share < 0.9
    # tensor parallel splits weights and KV over two GPUs.
    split = estimate_vllm(checkpoint_facts(big), ctx=8192, parallel=4, kv_cache_dtype=None,
                          gpus=["gpu0", "gpu1"], tensor_parallel=2)
    assert split.devices["gpu0"] == split.devices["gpu1"] < est.devices["gpu0"]
    # An explicit share, and a box without GPUs, are left as they are.
    fixed = parse_config(vllm_yaml(str(big), gpu_memory_utilization=0.5),
                         tmp_path / "c.yaml").models["v"]
    assert Vllm().tune(fixed, est.devices, {"gpu0": h100}).gpu_memory_utilization == 0.5
    assert Vllm().tune(chat, est.devices, {}).gpu_memory_utilization is None
    assert gpu_fraction(1, h100) == 0.01 and gpu_fraction(2 * h100, h100) == 1.0


def test_cpu_estimate_counts_the_kv_space_it_asks_for(big: Path) -> None:
    est = estimate_vllm(checkpoint_facts(big), ctx=4096, parallel=1, kv_cache_dtype=None)
    assert set(est.devices) == {"cpu"} and est.kv == 1 * GiB  # 512 MiB rounds up to 1 GiB
    assert est.devices["cpu"] == est.weights + est.kv + est.compute + CPU_PROCESS_OVERHEAD


def test_a_port_taken_by_someone_else_is_recognised() -> None:
    assert Vllm().lost_port_race(["ERROR: [Errno 98] error while attempting to bind on "
                                  "address ('127.0.0.1', 8000): address already in use"])
    assert not Vllm().lost_port_race(["ValueError: head size 16 is not supported"])


def test_config_defaults_for_vllm_models(tmp_path: Path) -> None:
    text = ("defaults:\n  kv_cache: {mode: auto, ladder: [f16, q8_0]}\n"
            "models:\n  g: {model: g.gguf}\n"
            "  v: {backend: vllm, model: org/m, command: [/bin/true]}\n")
    loaded = parse_config(text, tmp_path / "c.yaml")
    g, v = loaded.models["g"], loaded.models["v"]
    # vLLM loads and captures graphs before it answers: 900 s unless the config says.
    assert (g.start_timeout, v.start_timeout) == (120, 900)
    # The defaults' ladder holds llama.cpp types: it is not vLLM's.
    assert g.kv_ladder and not v.kv_ladder
    set_here = parse_config(text.replace("defaults:\n", "defaults:\n  start_timeout: 60\n"),
                            tmp_path / "c.yaml")
    assert set_here.models["v"].start_timeout == 60


def test_vllm_ladder_steps_are_one_dtype(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(vllm_yaml("org/m", kv_cache={"mode": "auto", "ladder": ["auto", "fp8/auto"]}),
                     tmp_path / "c.yaml")
    assert "models.v.kv_cache.ladder[1]: ladder step 'fp8/auto': vLLM has one KV cache dtype " \
           "for K and V" in str(err.value)

