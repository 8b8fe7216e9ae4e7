"""How much memory a llama-server child will take, known before it starts.

Three sources:
- `llama_reports.fit_params`: llama.cpp's own dry run (`llama-fit-params --fit-print on`),
  when the binary is there. Exact for weights and KV; its compute figure is high for
  llama-server (see there).
- `estimate`: arithmetic on the GGUF metadata (`model_facts`), calibrated against real
  llama-server children on this CPU box and against the H100 figures in shared/GPU.md.
- `parse_load_log`: what a started child says it allocated, to correct either afterwards.
  llama-server prints its buffer sizes only at `-lv 4` (or LLAMA_ARG_LOG_VERBOSITY=4) and up;
  at the default verbosity 3 the lines are not there.

llama-server's prompt cache in RAM (`--cache-ram`) is the `cache_ram` term, on "cpu": its
limit, which corral always sets (memory/cache_ram.py), since it fills only with use.

Not covered: recurrent state (Mamba/RWKV layers),
DeepSeek's MLA cache (overestimated: counted as full K/V heads), CPU_REPACK copies of
Q4_0/IQ4_NL weights on CPUs that repack them.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.supervisor.gguf_header import Array, read_header

MiB = 1024 * 1024

__all__ = [
    "KV_TYPE_BYTES",
    "Estimate",
    "EstimateError",
    "MiB",
    "ModelFacts",
    "estimate",
    "kv_bytes",
    "kv_cells",
    "model_facts",
]


class EstimateError(Exception):
    """The file cannot be estimated: not a GGUF, or its metadata lacks what llama.cpp needs."""


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of one GGUF, read from its metadata and tensor table."""

    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int  # the largest, where it varies by layer (see kv_heads)
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    layer_bytes: tuple[int, ...]  # tensor bytes of each repeating block blk.N.*
    other_bytes: int  # tensors outside the blocks (token_embd, output, norms), as in the file
    n_vocab: int = 0
    # The widest FFN activation a token makes: feed_forward_length, or for MoE the expert
    # width times the experts each token uses. Sizes the compute buffer.
    n_ff: int = 0
    # The output layer (output_norm + output) as placed on its device. A file with tied
    # embeddings has no output.weight: llama.cpp then puts a copy of token_embd there,
    # counted in output_shared_bytes (a copy, so not in other_bytes).
    output_bytes: int = 0
    output_shared_bytes: int = 0
    # KV heads of each layer where the file gives a per-layer list (0: a layer without KV,
    # e.g. a recurrent layer of a hybrid model); empty: every layer has n_head_kv.
    kv_heads: tuple[int, ...] = ()
    sliding_window: int = 0  # n_swa; 0: none
    swa_layers: tuple[bool, ...] = ()  # which layers use the window; empty: none

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.other_bytes

    def layer_kv_heads(self, il: int) -> int:
        return self.kv_heads[il] if self.kv_heads else self.n_head_kv

    def is_swa(self, il: int) -> bool:
        return bool(self.sliding_window) and il < len(self.swa_layers) and self.swa_layers[il]


# -- GGUF metadata -------------------------------------------------------------------------------

# Where llama.cpp hardcodes the sliding-window pattern rather than reading it from the file:
# period n means layers il % n < n - 1 use the window and every n-th is full
# (llama_hparams::set_swa_pattern). An arch with a window that is not listed here and gives no
# pattern in the file counts every layer as full: an overestimate, never an underestimate.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2, "llama4": 4, "exaone4": 4}

_OUTPUT_TENSORS = ("output.weight", "output.bias", "output_norm.weight", "output_norm.bias")


def model_facts(path: Path) -> ModelFacts:
    """The facts of one GGUF, read once per file version (cached by resolved path, st_mtime_ns
    and st_size). Raises EstimateError for a file that is missing, not GGUF, or lacks the keys
    llama.cpp needs."""
    try:
        resolved = Path(path).resolve()
        st = resolved.stat()
    except OSError as e:
        raise EstimateError(f"{path}: cannot read: {e.strerror or e}") from e
    return _model_facts_cached(resolved, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=128)
def _model_facts_cached(path: Path, mtime_ns: int, size: int) -> ModelFacts:
    del mtime_ns, size  # part of the cache key only: a rewritten file is read again
    fields, tensors = _read_gguf(path)
    meta = _Meta(path, fields)
    arch = meta.get_str("general.architecture")
    tensors += _split_tensors(path, meta.int_or("split.count", 1))
    return _facts(path, arch, meta, tensors)


def _read_gguf(path: Path) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """Key/values and (tensor name, bytes) of a GGUF file, from its header alone."""
    try:
        header = read_header(path)
    except OSError as e:
        raise EstimateError(f"{path}: cannot read: {e.strerror or e}") from e
    except ValueError as e:  # truncated, not GGUF, an unknown type: never a crash upstream
        raise EstimateError(f"{path}: {e}") from e
    return header.fields, [(t.name, t.n_bytes) for t in header.tensors]


class _Meta:
    """Typed reads of GGUF key/values, with errors that name the file and key."""

    def __init__(self, path: Path, fields: dict[str, Any]):
        self.path = path
        self.fields = fields

    def raw(self, key: str) -> Any:
        value = self.fields.get(key)
        return list(value) if isinstance(value, Array) else value

    def get_str(self, key: str) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise EstimateError(f"{self.path}: GGUF lacks key {key}")
        return value

    def int_or(self, key: str, default: int) -> int:
        value = self.raw(key)
        if value is None:
            return default
        try:
            if isinstance(value, list):  # a per-layer list: the widest layer sizes the buffers
                return max((int(v) for v in value), default=default)
            return int(value)
        except (TypeError, ValueError) as e:
            raise EstimateError(f"{self.path}: metadata key {key} is not a number") from e

    def get_int(self, key: str) -> int:
        if self.raw(key) is None:
            raise EstimateError(f"{self.path}: GGUF lacks key {key}")
        return self.int_or(key, 0)

    def int_list(self, key: str) -> list[int] | None:
        value = self.raw(key)
        try:
            return [int(v) for v in value] if isinstance(value, list) else None
        except (TypeError, ValueError) as e:
            raise EstimateError(f"{self.path}: metadata key {key} is not a list of numbers") \
                from e

    def count(self, key: str) -> int:
        value = self.fields.get(key)
        return value.length if isinstance(value, Array) else 0


def _split_tensors(path: Path, count: int) -> list[tuple[str, int]]:
    """Tensors of the other files of a split GGUF (name-00001-of-00003.gguf): llama.cpp loads
    them all from the first."""
    if count <= 1:
        return []
    m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
    if not m:
        raise EstimateError(f"{path}: split into {count} files, but its name is not -NNNNN-of-")
    out: list[tuple[str, int]] = []
    for i in range(2, count + 1):
        part = path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf")
        out += _read_gguf(part)[1]
    return out


def _facts(path: Path, arch: str, meta: _Meta, tensors: list[tuple[str, int]]) -> ModelFacts:
    n_layer = meta.get_int(f"{arch}.block_count")
    n_embd = meta.get_int(f"{arch}.embedding_length")
    n_head = meta.get_int(f"{arch}.attention.head_count")
    if n_layer <= 0 or n_embd <= 0 or n_head <= 0:
        raise EstimateError(f"{path}: block_count, embedding_length and head_count must be > 0")
    kv_list = meta.int_list(f"{arch}.attention.head_count_kv")
    n_head_kv = meta.int_or(f"{arch}.attention.head_count_kv", n_head)
    layer_bytes = [0] * n_layer
    other = output = 0
    sizes = dict(tensors)
    for name, nbytes in tensors:
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += nbytes
        else:
            other += nbytes
            output += nbytes if name in _OUTPUT_TENSORS else 0
    shared = 0 if "output.weight" in sizes else sizes.get("token_embd.weight", 0)
    return ModelFacts(
        path=path, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=meta.int_or(f"{arch}.attention.key_length", n_embd // n_head),
        head_dim_v=meta.int_or(f"{arch}.attention.value_length", n_embd // n_head),
        n_ctx_train=meta.get_int(f"{arch}.context_length"),
        layer_bytes=tuple(layer_bytes), other_bytes=other,
        n_vocab=meta.int_or(f"{arch}.vocab_size", meta.count("tokenizer.ggml.tokens")),
        n_ff=_n_ff(meta, arch, n_embd),
        output_bytes=output + shared, output_shared_bytes=shared,
        kv_heads=tuple(kv_list) if kv_list and len(kv_list) == n_layer else (),
        sliding_window=meta.int_or(f"{arch}.attention.sliding_window", 0),
        swa_layers=_swa_layers(meta, arch, n_layer),
    )


def _n_ff(meta: _Meta, arch: str, n_embd: int) -> int:
    dense = meta.int_or(f"{arch}.feed_forward_length", 0)
    experts = (meta.int_or(f"{arch}.expert_feed_forward_length", 0)
               * meta.int_or(f"{arch}.expert_used_count", 0))
    return max(dense, experts) or 4 * n_embd


def _swa_layers(meta: _Meta, arch: str, n_layer: int) -> tuple[bool, ...]:
    if not meta.int_or(f"{arch}.attention.sliding_window", 0):
        return ()
    pattern = meta.raw(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == n_layer:
        return tuple(bool(p) for p in pattern)
    period = int(pattern) if isinstance(pattern, int) and pattern > 0 else _SWA_PERIOD.get(arch)
    if not period:
        return ()
    return tuple(il % period < period - 1 for il in range(n_layer))


# -- KV cache ------------------------------------------------------------------------------------

# (elements per block, bytes per block), as ggml stores each type (ggml-common.h; the same
# table as gguf.GGML_QUANT_SIZES). A row of n elements takes ceil(n / block) blocks.
_KV_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "iq4_nl": (32, 18),
    "q5_0": (32, 22), "q5_1": (32, 24),
    # TurboQuant forks (not upstream ggml): a fp16 norm plus 2/3/4-bit codebook indices per
    # 32 values (block_turbo2_0/3_0/4_0: 10, 14 and 18 bytes). Forks differ in details; these
    # are the block layouts their ggml-common.h declares.
    "turbo2": (32, 10), "turbo3": (32, 14), "turbo4": (32, 18),
}
KV_TYPE_BYTES: dict[str, float] = {name: b / n for name, (n, b) in _KV_BLOCKS.items()}

# llama.cpp pads each KV stream to a multiple of 256 cells.
KV_PAD = 256
# llama-server's default physical batch; n_batch is 2048 and n_ubatch min(512, n_batch, ctx).
N_UBATCH = 512


def _row_bytes(cache_type: str, n: int) -> int:
    block = _KV_BLOCKS.get(cache_type.lower())
    if block is None:
        known = ", ".join(_KV_BLOCKS)
        raise EstimateError(f"unknown KV cache type {cache_type!r} (known: {known})")
    per, nbytes = block
    return -(-n // per) * nbytes


def _pad(n: int, to: int = KV_PAD) -> int:
    return -(-n // to) * to


def kv_cells(ctx: int, parallel: int) -> int:
    """Cells of each KV stream llama-server allocates for `-c ctx -np parallel` (one stream
    per slot: llama-server's kv_unified is false): ctx split over the slots and padded to 256.
    Measured: -c 1000 → 1024 cells; -c 4096 -np 3 → 3 × 1536; -c 770 -np 3 → 3 × 512."""
    return _pad(math.ceil(ctx / max(1, parallel)))


def _layer_cells(facts: ModelFacts, il: int, stream_cells: int, n_ubatch: int) -> int:
    if not facts.is_swa(il):
        return stream_cells
    # llama_kv_cache_iswa: the window plus one ubatch, padded, never more than the full cache
    return min(stream_cells, _pad(facts.sliding_window + n_ubatch))


def kv_bytes(facts: ModelFacts, ctx: int, type_k: str, type_v: str,
             n_layers: int | None = None, *, parallel: int = 1) -> int:
    """KV cache bytes for `ctx` cells in all: layers × ctx × (row(type_k, n_head_kv ×
    head_dim_k) + row(type_v, n_head_kv × head_dim_v)), rows rounded to whole ggml blocks as
    ggml stores them. n_layers: only the last n blocks (the ones -ngl n offloads); None: all.
    Sliding-window layers hold the window plus one ubatch per stream, `parallel` streams."""
    count = facts.n_layer if n_layers is None else max(0, min(n_layers, facts.n_layer))
    streams = max(1, parallel)
    n_ubatch = min(N_UBATCH, ctx) if ctx else N_UBATCH
    return sum(_layer_kv(facts, il, ctx // streams, streams, n_ubatch, type_k, type_v)
               for il in range(facts.n_layer - count, facts.n_layer))


# -- the estimate --------------------------------------------------------------------------------

# CPU: llama-server's RSS with (almost) no model: RSS minus the model, KV, compute and output
# buffers it logs. Measured here (CPU-only build, 2 cores) after /health 200 and one 8-token
# completion, -c 512 -np 1, on random 2-layer n_embd 64 models with 259, 8259, 32259 and
# 100259 vocab entries: 19.5, 20.9, 24.8 and 36.7 MiB; SmolLM2-135M (49152 tokens): 24.1 MiB.
# So 19.5 MiB (shared libraries' resident pages ~17 MiB of it, the HTTP server, threads) plus
# ~176 bytes per vocab entry (token strings, lookup maps, caches).
CPU_OVERHEAD = int(19.5 * MiB)
CPU_OVERHEAD_PER_TOKEN = 176
# GPU: the CUDA context of one process (shared/GPU.md: 'the device shows 480 MiB used when
# idle'); cuBLAS workspaces and the like are in GPU_COMPUTE_FIXED below.
GPU_OVERHEAD = 480 * MiB

# Compute buffers, from llama-server's own logs (sched_reserve: ... compute buffer size):
# - activations of one ubatch: n_ubatch × 4 B × (3 n_ff + 6 n_embd). Fitted to 13 random
#   models (n_embd 64…2048, n_ff 128…4096) at -c 512: within -4…+8% (SmolLM2: 15.75 vs 14.64
#   MiB logged), 0.4 MiB over on the tiny one.
# - the KQ mask, one row per ubatch token over a stream's cells: f16 with flash attention, f32
#   without (tiny model: 1.64 / 5.14 / 33.14 MiB at -c 512 / 4096 / 32768, +1 KiB per cell).
# - without flash attention the KQ matrix: cells × n_ubatch × n_head × f32 (SmolLM2 -c 4096
#   -fa off: 87.51 MiB logged; 72 MiB of it KQ). On CPU `-fa auto` turns flash attention on.
# - host logits: n_vocab × 4 B per slot (llama-server caps the outputs of a ubatch at one per
#   slot, so the reserve-time logits are that small too).
ACT_FF, ACT_EMBD = 3, 6
# GPU: calibrated on shared/GPU.md's H100 child (22 layers, n_embd 2048, f16, 2.26 GB, no
# flash attention: that build's FA kernels were off). NVML minus the weights on the GPU (the
# file less token_embd, which stays on the host), the KV and the 480 MiB context leaves ~406
# MiB at ctx 4096 and ~2686 MiB at ctx 65536 (the same with K q8_0 / q4_0). The mask + KQ term
# above (16 heads of 128) grows 2040 MiB over that range, NVML 2280: the CUDA pool's
# temporaries scale it by ~1.12; ~200 MiB stays fixed (cuBLAS workspace, graphs).
# tests/test_memory_estimate.py holds the figures.
GPU_ATTN_FACTOR = 1.12
GPU_COMPUTE_FIXED = 200 * MiB


@dataclass(frozen=True)
class Estimate:
    devices: dict[str, int]  # device name → bytes: "cpu" for RAM, "gpu0", "gpu1"… for GPUs
    weights: int  # totals over all devices, bytes
    kv: int
    compute: int
    overhead: int
    source: str  # "gguf" or "llama-fit-params"
    # llama-server's prompt cache in RAM at its limit (in devices["cpu"] too): it grows with
    # use, so a fresh child's measure leaves it out and the estimate must not.
    cache_ram: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead + self.cache_ram

    def with_cache_ram(self, nbytes: int) -> Estimate:
        """This estimate with a RAM prompt cache of `nbytes` (replacing any counted before)."""
        cpu = self.devices.get("cpu", 0) - self.cache_ram + nbytes
        return dataclasses.replace(self, devices={**self.devices, "cpu": cpu}, cache_ram=nbytes)


@dataclass
class _Tally:
    """Bytes per device and per kind while an estimate is being put together."""

    devices: dict[str, int]
    kinds: dict[str, int]

    def add(self, device: str, kind: str, nbytes: int) -> None:
        self.devices[device] = self.devices.get(device, 0) + nbytes
        self.kinds[kind] = self.kinds.get(kind, 0) + nbytes

    def result(self, source: str) -> Estimate:
        k = self.kinds
        return Estimate(dict(self.devices), k.get("weights", 0), k.get("kv", 0),
                        k.get("compute", 0), k.get("overhead", 0), source)


def _layer_devices(n_layer: int, n_gpu_layers: int, gpus: Sequence[str],
                   split: Sequence[float] = ()) -> list[str]:
    """Each block's device, and the output layer's as the last entry (index n_layer), as
    llama.cpp's llama_model::load_tensors assigns them: the last n_gpu_layers blocks (all,
    and the output layer too, with -1 or more than n_layer) go to the GPUs, block il to the
    first GPU whose cumulative share of `split` (`--tensor-split`; empty: even) exceeds
    (il - first) / offloaded, where offloaded counts the output layer when it goes too."""
    if not gpus:
        return ["cpu"] * (n_layer + 1)
    offloaded = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    first = max(0, n_layer - offloaded)
    weights = [float(w) for w in split] if len(split) == len(gpus) and sum(split) > 0 \
        else [1.0] * len(gpus)
    total = sum(weights)
    bounds = [sum(weights[:i + 1]) / total for i in range(len(weights))]
    out = []
    for il in range(n_layer + 1):
        if il < first or il - first >= offloaded:
            out.append("cpu")
            continue
        at = (il - first) / offloaded
        out.append(gpus[min(bisect.bisect_right(bounds, at), len(gpus) - 1)])
    return out


def _attn_bytes(facts: ModelFacts, cells: int, n_ubatch: int, flash_attn: bool) -> int:
    if flash_attn:
        return cells * n_ubatch * 2  # f16 mask
    return cells * n_ubatch * 4 * (1 + facts.n_head)  # f32 mask + KQ


def _compute_bytes(facts: ModelFacts, cells: int, n_ubatch: int, flash_attn: bool,
                   gpu: bool) -> int:
    act = n_ubatch * 4 * (ACT_FF * facts.n_ff + ACT_EMBD * facts.n_embd)
    attn = _attn_bytes(facts, cells, n_ubatch, flash_attn)
    if gpu:
        return act + int(GPU_ATTN_FACTOR * attn) + GPU_COMPUTE_FIXED
    return act + attn


def estimate(facts: ModelFacts, *, ctx: int, parallel: int, n_gpu_layers: int,
             cache_type_k: str | None, cache_type_v: str | None,
             gpus: Sequence[str] = (), flash_attn: bool | None = None,
             split: Sequence[float] = ()) -> Estimate:
    """Pure arithmetic on the GGUF facts, per device, for llama-server's defaults (n_ubatch
    512, one KV stream per slot, mmap).

    ctx 0 means n_ctx_train (as llama-server does); cache types None mean f16; n_gpu_layers -1
    means all. With no gpus everything is on "cpu". The last n_gpu_layers blocks go to the
    gpus, shared out as llama.cpp does by `split` (`--tensor-split`; empty: even), each with
    its KV; the output layer goes to a GPU (the last, but for a tiny last share) only when all
    blocks and the output are offloaded (n_gpu_layers -1 or > n_layer); token_embd always
    stays on the CPU. flash_attn None: what `-fa auto` gives on CPU (on); with gpus assumed
    off unless V is quantized (which forces it on) — the bigger figure, and what the GPU.md
    build did.
    """
    n_ctx = ctx or facts.n_ctx_train
    parallel = max(1, parallel)
    cells = kv_cells(n_ctx, parallel)  # per slot
    n_ubatch = min(N_UBATCH, n_ctx)
    type_k, type_v = cache_type_k or "f16", cache_type_v or "f16"
    if flash_attn is None:
        flash_attn = not gpus or KV_TYPE_BYTES.get(type_v.lower(), 2) < 2
    *layer_dev, output_dev = _layer_devices(facts.n_layer, n_gpu_layers, gpus, split)
    tally = _Tally({}, {})
    _place_weights_and_kv(tally, facts, layer_dev, output_dev, cells, parallel, n_ubatch,
                          type_k, type_v)
    for dev in gpus:
        if dev in layer_dev or dev == output_dev:
            tally.add(dev, "compute", _compute_bytes(facts, cells, n_ubatch, flash_attn, True))
            tally.add(dev, "overhead", GPU_OVERHEAD)
    if "cpu" in layer_dev:
        tally.add("cpu", "compute", _compute_bytes(facts, cells, n_ubatch, flash_attn, False))
    else:  # the host only looks up the input embeddings (and runs the output layer's norm)
        tally.add("cpu", "compute", n_ubatch * 4 * facts.n_embd * (1 + (output_dev == "cpu")))
    tally.add("cpu", "compute", facts.n_vocab * 4 * parallel)  # host logits, one row a slot
    tally.add("cpu", "overhead", _cpu_overhead(facts.n_vocab))
    return tally.result("gguf")


def _place_weights_and_kv(tally: _Tally, facts: ModelFacts, layer_dev: list[str],
                          output_dev: str, stream_cells: int, parallel: int, n_ubatch: int,
                          type_k: str, type_v: str) -> None:
    if output_dev == "cpu":  # a tied output shares token_embd's pages: no copy
        tally.add("cpu", "weights", facts.other_bytes)
    else:
        tally.add("cpu", "weights",
                  facts.other_bytes - facts.output_bytes + facts.output_shared_bytes)
        tally.add(output_dev, "weights", facts.output_bytes)
    for il, dev in enumerate(layer_dev):
        tally.add(dev, "weights", facts.layer_bytes[il])
        kv = _layer_kv(facts, il, stream_cells, parallel, n_ubatch, type_k, type_v)
        tally.add(dev, "kv", kv)


def _layer_kv(facts: ModelFacts, il: int, stream_cells: int, parallel: int, n_ubatch: int,
              type_k: str, type_v: str) -> int:
    heads = facts.layer_kv_heads(il)
    if heads <= 0:
        return 0
    per_cell = (_row_bytes(type_k, heads * facts.head_dim_k)
                + _row_bytes(type_v, heads * facts.head_dim_v))
    return parallel * _layer_cells(facts, il, stream_cells, n_ubatch) * per_cell


def _cpu_overhead(n_vocab: int) -> int:
    return CPU_OVERHEAD + CPU_OVERHEAD_PER_TOKEN * n_vocab


# -- llama.cpp's own figures ---------------------------------------------------------------------
