"""What a vLLM child will hold, from a Hugging Face checkpoint folder: config.json for the shape,
the safetensors headers for the parameter count (no tensor data is read).

vLLM's memory is: the weights in the serving dtype, a KV cache (on a GPU, whatever is left of
`--gpu-memory-utilization` × the GPU; on CPU, exactly VLLM_CPU_KVCACHE_SPACE), activations of
one profiling batch, and three Python processes (API server, engine core, worker) with torch
loaded. Pure arithmetic and small file reads; the daemon calls it from a thread or once cached.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.supervisor.memory.estimate import Estimate, EstimateError, MiB

__all__ = ["CheckpointFacts", "checkpoint_facts", "cpu_kv_space_gib", "estimate_vllm",
           "kv_bytes_per_token"]

GiB = 1024 * MiB
# Element sizes of the safetensors dtypes.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# Three Python processes with torch and vLLM imported, on CPU, measured on vllm-cpu 0.32
# (tests/test_vllm.py checks the estimate against the child's real RSS).
CPU_PROCESS_OVERHEAD = 1900 * MiB
# On a GPU: CUDA context, cuBLAS workspaces and CUDA graphs of the default capture sizes.
# Not calibrated on hardware (no GPU this round); vLLM's own profile run is the authority.
GPU_OVERHEAD = 1536 * MiB
# Tokens in vLLM's profiling batch (max_num_batched_tokens on a GPU, V1's default).
PROFILE_TOKENS = 8192


@dataclass(frozen=True)
class CheckpointFacts:
    path: str
    n_layer: int
    n_kv_head: int
    head_dim: int
    hidden: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    params: int  # parameters, from the safetensors headers
    file_bytes: int  # tensor data as stored
    dtype: str  # torch_dtype of the checkpoint
    quantized: bool  # a quantization_config: weights stay as stored


def checkpoint_facts(folder: Path) -> CheckpointFacts:
    """The facts of the checkpoint in `folder` (cached per folder and config.json version).
    EstimateError when it is not a readable Hugging Face checkpoint."""
    config = folder / "config.json"
    try:
        st = config.stat()
    except OSError as exc:
        raise EstimateError(f"{folder}: no config.json ({exc.strerror or exc})") from exc
    return _facts_cached(folder, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _facts_cached(folder: Path, mtime_ns: int, size: int) -> CheckpointFacts:
    try:
        cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EstimateError(f"{folder}/config.json: {exc}") from exc
    # Multimodal checkpoints keep the language model's shape under text_config.
    text = cfg.get("text_config") or cfg
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        n_layer = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EstimateError(f"{folder}/config.json lacks {exc}") from exc
    params, stored = _tensor_totals(folder)
    return CheckpointFacts(
        path=str(folder), n_layer=n_layer,
        n_kv_head=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads), hidden=hidden,
        n_ff=int(text.get("intermediate_size") or 4 * hidden),
        n_vocab=int(text.get("vocab_size") or cfg.get("vocab_size") or 0),
        n_ctx_train=int(text.get("max_position_embeddings") or 0),
        params=params, file_bytes=stored,
        dtype=str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype")
                  or "bfloat16"),
        quantized="quantization_config" in cfg)


def _tensor_totals(folder: Path) -> tuple[int, int]:
    """(parameters, bytes) over every *.safetensors file: each starts with an 8-byte header
    length and a JSON header naming each tensor's dtype and shape."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EstimateError(f"{folder}: no *.safetensors files")
    params = stored = 0
    for path in files:
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 * MiB:
                    raise EstimateError(f"{path}: a {length}-byte header is not safetensors")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as exc:
            raise EstimateError(f"{path}: {exc}") from exc
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(tensor["shape"])
            params += count
            stored += count * _DTYPE_BYTES.get(tensor["dtype"], 2)
    return params, stored


def _serving_elem_bytes(facts: CheckpointFacts, args: Sequence[str]) -> int:
    """vLLM's `--dtype auto` serves float32 and float16 checkpoints in half precision (bf16 on
    CPU) and bf16 as bf16: two bytes either way, unless `--dtype float32` is asked for."""
    dtype = _arg_value(args, "--dtype") or "auto"
    return 4 if dtype in ("float32", "float") else 2


# Bytes per cached value of vLLM's --kv-cache-dtype choices (scales left out); `auto` is the
# serving dtype, and a type not listed counts as two bytes.
_KV_DTYPE_BYTES = {"float16": 2.0, "bfloat16": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0,
                   "fp8_e5m2": 1.0, "fp8_inc": 1.0, "fp8_ds_mla": 1.0,
                   "fp8_per_token_head": 1.0, "int8_per_token_head": 1.0,
                   "int4_per_token_head": 0.5, "nvfp4": 0.5, "nvfp4_4over6": 0.5,
                   "nvfp4_ds_mla": 0.5, "turboquant_4bit_nc": 0.5, "ultraquant_4bit": 0.5,
                   "turboquant_3bit_nc": 0.375, "turboquant_k8v4": 0.75,
                   "turboquant_k3v4_nc": 0.4375}


def kv_bytes_per_token(facts: CheckpointFacts, kv_cache_dtype: str | None,
                       args: Sequence[str] = ()) -> int:
    """K and V of every layer for one token."""
    dtype = kv_cache_dtype or "auto"
    elem = _serving_elem_bytes(facts, args) if dtype == "auto" else \
        _KV_DTYPE_BYTES.get(dtype, 2.0)
    return math.ceil(2 * facts.n_layer * facts.n_kv_head * facts.head_dim * elem)


def cpu_kv_space_gib(facts: CheckpointFacts, ctx: int, parallel: int,
                     kv_cache_dtype: str | None, args: Sequence[str] = ()) -> int:
    """VLLM_CPU_KVCACHE_SPACE for `parallel` sequences of `ctx` tokens, in whole GiB (at
    least 1): vLLM on CPU allocates exactly that much KV cache at start."""
    tokens = (ctx or facts.n_ctx_train) * max(1, parallel)
    return max(1, math.ceil(tokens * kv_bytes_per_token(facts, kv_cache_dtype, args) / GiB))


def estimate_vllm(facts: CheckpointFacts, *, ctx: int, parallel: int,
                  kv_cache_dtype: str | None, gpus: Sequence[str] = (),
                  tensor_parallel: int = 1, pipeline_parallel: int = 1,
                  args: Sequence[str] = ()) -> Estimate:
    """Bytes per device for a vLLM child serving `parallel` sequences of `ctx` tokens. On a
    GPU box the weights, KV and activations go to the first tensor × pipeline GPUs, split
    evenly; on CPU everything is RAM and the KV cache is the whole GiB that will be asked for."""
    weights = facts.file_bytes if facts.quantized else \
        facts.params * _serving_elem_bytes(facts, args)
    n_ctx = ctx or facts.n_ctx_train
    kv_per_token = kv_bytes_per_token(facts, kv_cache_dtype, args)
    devices: dict[str, int] = {"cpu": CPU_PROCESS_OVERHEAD}
    if not gpus:
        kv = cpu_kv_space_gib(facts, ctx, parallel, kv_cache_dtype, args) * GiB
        compute = _activation_bytes(facts, min(n_ctx, PROFILE_TOKENS), parallel)
        devices["cpu"] += weights + kv + compute
        return Estimate(devices, weights, kv, compute, CPU_PROCESS_OVERHEAD, "config.json")
    used = list(gpus[:max(1, tensor_parallel * pipeline_parallel)])
    kv = n_ctx * max(1, parallel) * kv_per_token
    compute = _activation_bytes(facts, PROFILE_TOKENS, parallel)
    for gpu in used:
        devices[gpu] = (weights + kv) // len(used) + compute + GPU_OVERHEAD
    return Estimate(devices, weights, kv, compute * len(used),
                    CPU_PROCESS_OVERHEAD + GPU_OVERHEAD * len(used), "config.json")


def _activation_bytes(facts: CheckpointFacts, tokens: int, seqs: int) -> int:
    """One profiling forward pass: hidden states and the MLP's intermediate for every token
    (float32 temporaries), and the logits of every sequence."""
    return tokens * 4 * (4 * facts.hidden + 2 * facts.n_ff) + \
        max(1, seqs) * facts.n_vocab * 4


def _arg_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
