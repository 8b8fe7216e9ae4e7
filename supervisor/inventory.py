"""What each model file is, from its GGUF header: architecture, parameters, quantisation,
native context and size, as /v1/models shows them.

Read with corral's GGUF header reader (supervisor/gguf_header.py), which skips the tokenizer's
arrays: 40 ms for SmolLM2's 49k-token vocabulary where gguf's GGUFReader takes seconds. Still
file I/O, so `read_facts` runs in a thread (the daemon reads
every model after its start and after each reload); `cached_facts` answers from memory only,
so a poll of /v1/models never touches a file. A file is read again when the size or mtime of
any of its shards changed.
"""

from __future__ import annotations

import collections
import os
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import structlog

from corral.supervisor.gguf_header import gguf_constants, read_header

log = structlog.get_logger("corral.inventory")

_SPLIT = re.compile(r"^(.*)-00001-of-(\d{5})\.gguf$")
_CACHE_SIZE = 1024  # files; an entry is a few hundred bytes

# path → (version: (path, mtime_ns, size) of every shard, facts or None when unreadable)
_Version = tuple[tuple[str, int, int], ...]
_cache: collections.OrderedDict[str, tuple[_Version, dict[str, Any] | None]] = \
    collections.OrderedDict()
_lock = threading.Lock()


def shards(path: Path) -> list[Path]:
    """Every file of the model at `path`: the first shard's siblings by their names (llama.cpp
    names them `<name>-0000i-of-0000N.gguf`), else the file alone."""
    split = _SPLIT.match(path.name)
    if not split:
        return [path]
    count = int(split.group(2))
    return [path.with_name(f"{split.group(1)}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def cached_facts(path: Path) -> dict[str, Any] | None:
    """The facts `read_facts` found for `path` last, without touching the file; None when it
    has not been read yet, or could not be."""
    with _lock:
        entry = _cache.get(str(path))
    return dict(entry[1]) if entry is not None and entry[1] is not None else None


def read_facts(path: Path) -> dict[str, Any] | None:
    """The facts of the model at `path` (its first shard), read from its headers unless this
    version of its files was read already; None (logged once per version) for a file that is
    missing, truncated or not GGUF."""
    files = shards(path)
    try:
        version: _Version = tuple(
            (str(f), st.st_mtime_ns, st.st_size) for f in files for st in (os.stat(f),))
    except OSError as exc:
        return _remember(path, (), None, exc)
    with _lock:
        entry = _cache.get(str(path))
        if entry is not None and entry[0] == version:
            _cache.move_to_end(str(path))
            return dict(entry[1]) if entry[1] is not None else None
    try:
        facts = _read(files, sum(size for _, _, size in version))
    except Exception as exc:  # truncated, not GGUF, a type this gguf does not know
        return _remember(path, version, None, exc)
    return _remember(path, version, facts, None)


def _remember(path: Path, version: _Version, facts: dict[str, Any] | None,
              error: BaseException | None) -> dict[str, Any] | None:
    with _lock:
        before = _cache.get(str(path))
        _cache[str(path)] = (version, facts)
        _cache.move_to_end(str(path))
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    if error is not None and (before is None or before[0] != version):
        log.warning("inventory.unreadable", path=str(path), error=f"{type(error).__name__}: "
                    f"{error}")
    return dict(facts) if facts is not None else None


def _read(files: list[Path], size_bytes: int) -> dict[str, Any]:
    fields, tensors = _header(files[0])
    for more in files[1:]:
        tensors += _header(more)[1]
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("no general.architecture")
    parameters = sum(elements for _, elements, _ in tensors)
    label = fields.get("general.size_label")
    context = fields.get(f"{arch}.context_length")
    return {
        "architecture": arch,
        "parameters": parameters,
        # The uploader's label says what a count cannot (`8x7B` for a mixture of experts).
        "parameters_label": label if isinstance(label, str) and label else
        parameters_label(parameters),
        "quantization": _quantization(fields.get("general.file_type"), tensors),
        "context_length": int(context) if isinstance(context, int) else None,
        "size_bytes": size_bytes,
    }


def _header(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, str]]]:
    """Key/values and (tensor name, elements, type name) of one GGUF file."""
    header = read_header(path)
    return header.fields, [(t.name, t.elements, t.type.name) for t in header.tensors]


def _quantization(file_type: Any, tensors: list[tuple[str, int, str]]) -> str | None:
    """The file's declared type (`general.file_type`: Q4_K_M, ...), else the tensor type that
    holds the most bytes."""
    if isinstance(file_type, int):
        try:
            name = gguf_constants.LlamaFileType(file_type).name
        except ValueError:
            name = ""
        if name and name != "GUESSED":
            return "F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_")
    by_type: Counter[str] = Counter()
    for _, elements, kind in tensors:
        block, size = gguf_constants.GGML_QUANT_SIZES[gguf_constants.GGMLQuantizationType[kind]]
        by_type[kind] += elements // block * size
    return by_type.most_common(1)[0][0] if by_type else None


def parameters_label(count: int) -> str:
    """135M, 1.5B, 70B, 12K: as model names write sizes."""
    label = str(count)
    for unit, scale in (("K", 1e3), ("M", 1e6), ("B", 1e9), ("T", 1e12)):
        value = count / scale
        text = f"{value:.0f}" if value >= 100 else f"{value:.3g}"
        if float(text) >= 1:  # the largest unit that leaves a whole number in front
            label = text + unit
    return label
