"""A GGUF file described for people (GET /admin/models/{name}/gguf): its shape, quantization,
every tensor with its offset and size, and the bytes per layer the RPC planner works with.
Read from the header alone (supervisor/gguf_header.py); the caller runs it in a thread."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from corral.supervisor.gguf_header import gguf_constants, read_header

__all__ = ["describe_gguf"]

_MIB = 1024 * 1024


def describe_gguf(path: Path) -> dict[str, Any]:
    header = read_header(path)
    arch = header.get("general.architecture") or "unknown"

    def meta(name: str) -> Any:
        return header.get(f"{arch}.{name}")

    n_layer = meta("block_count") or 0
    layer_bytes = [0] * n_layer
    tensors = []
    types: Counter[str] = Counter()
    for t in header.tensors:
        size = t.n_bytes
        types[t.type.name] += size
        tensors.append({"name": t.name, "type": t.type.name, "shape": list(t.shape),
                        "offset": t.offset, "bytes": size})
        found = re.match(r"blk\.(\d+)\.", t.name)
        if found and int(found.group(1)) < n_layer:
            layer_bytes[int(found.group(1))] += size
    file_type = header.get("general.file_type")
    try:
        quantization = gguf_constants.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") \
            if file_type is not None else None
    except ValueError:
        quantization = None
    return {
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "architecture": arch,
        "name": header.get("general.name"),
        "layers": n_layer,
        "embedding_length": meta("embedding_length"),
        "heads": meta("attention.head_count"),
        "kv_heads": meta("attention.head_count_kv"),
        "context_length": meta("context_length"),
        # The file's declared type, else the type holding most of the bytes.
        "quantization": quantization or (types.most_common(1)[0][0] if types else None),
        "bytes_by_type": dict(types),
        "bytes_per_layer": layer_bytes,
        "layer_mib_max": round(max(layer_bytes, default=0) / _MIB, 3),
        "tensors": tensors,
    }
