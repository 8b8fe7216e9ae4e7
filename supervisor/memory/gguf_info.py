"""A GGUF file described for people (GET /admin/models/{name}/gguf): its shape, quantization,
every tensor with its offset and size, and the bytes per layer the RPC planner works with.
Read with the `gguf` package's reader (it maps the file; seconds for a big vocabulary, so the
caller runs it in a thread)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import gguf

__all__ = ["describe_gguf"]

_MIB = 1024 * 1024


def _scalar(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8", "replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def describe_gguf(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(path))
    arch = _scalar(reader, "general.architecture") or "unknown"

    def meta(name: str) -> Any:
        return _scalar(reader, f"{arch}.{name}")

    n_layer = meta("block_count") or 0
    layer_bytes = [0] * n_layer
    tensors = []
    types: Counter[str] = Counter()
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        size = int(t.n_bytes)
        types[kind] += size
        tensors.append({"name": t.name, "type": kind, "shape": [int(x) for x in t.shape],
                        "offset": int(t.data_offset), "bytes": size})
        found = re.match(r"blk\.(\d+)\.", t.name)
        if found and int(found.group(1)) < n_layer:
            layer_bytes[int(found.group(1))] += size
    file_type = _scalar(reader, "general.file_type")
    try:
        quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") \
            if file_type is not None else None
    except ValueError:
        quantization = None
    head_count_kv = meta("attention.head_count_kv")
    return {
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "architecture": arch,
        "name": _scalar(reader, "general.name"),
        "layers": n_layer,
        "embedding_length": meta("embedding_length"),
        "heads": meta("attention.head_count"),
        "kv_heads": head_count_kv,
        "context_length": meta("context_length"),
        # The file's declared type, else the type holding most of the bytes.
        "quantization": quantization or (types.most_common(1)[0][0] if types else None),
        "bytes_by_type": dict(types),
        "bytes_per_layer": layer_bytes,
        "layer_mib_max": round(max(layer_bytes, default=0) / _MIB, 3),
        "tensors": tensors,
    }
