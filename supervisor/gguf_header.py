"""A GGUF file's header: its key/values and its tensor table, read without its tensor data.

The one GGUF reader of corral: the memory estimate, the inventory /v1/models shows, the
admin's GGUF view and the prompt cache's setup key all read through it. gguf's GGUFReader
decodes every array, which took 3.7 to 5.4 s for SmolLM2's 49k-token vocabulary on this
machine; this reader skips long arrays (a tokenizer's tokens, scores, merges), keeping their
length, and takes milliseconds. The type
tables (block sizes, type names) are gguf's own. Headers are cached per file version (resolved
path, mtime, size), so the several readers of one file at startup parse it once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = ["Array", "GgufHeader", "Tensor", "gguf_constants", "header_digest", "read_header"]


def _load_gguf_constants() -> ModuleType:
    """gguf's constants.py alone (its type tables, nothing else imported): `import gguf`
    loads numpy and gguf's reader and writer too, ~0.2 CPU-s at every start of a daemon or a
    corral command, for these tables. gguf itself already imported: its own module."""
    loaded = sys.modules.get("gguf.constants")
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("gguf")
    where = list(package.submodule_search_locations or []) if package else []
    spec = (importlib.util.spec_from_file_location(
        "corral.supervisor.gguf_constants", Path(where[0]) / "constants.py") if where else None)
    if spec is None or spec.loader is None:
        import gguf.constants

        return gguf.constants
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gguf_constants = _load_gguf_constants()
if TYPE_CHECKING:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
else:
    GGML_QUANT_SIZES = gguf_constants.GGML_QUANT_SIZES
    GGMLQuantizationType = gguf_constants.GGMLQuantizationType

# GGUF value types (gguf-py's GGUFValueType): struct format of each scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DECODE_LIMIT = 4096  # longer arrays are skipped: only their length is kept
_DEFAULT_ALIGNMENT = 32  # GGUF's, unless general.alignment says otherwise
# header_digest reads at most this much: a header and tensor index are a few MB even for a
# 256k-token vocabulary; a file claiming more is hashed up to here (its size and identity
# are in the prompt cache's key beside the digest).
DIGEST_LIMIT = 64 << 20
_NOT_GGUF_DIGEST = 1 << 20  # a file that is no GGUF: its first MiB


class Array(list[Any]):
    """A decoded GGUF array, or (too long to be worth decoding) just its length."""

    def __init__(self, items: list[Any], length: int):
        super().__init__(items)
        self.length = length


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # as the file stores it: the fastest-varying dimension first
    type: GGMLQuantizationType
    offset: int  # of its data, from the start of the file

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.type]
        return self.elements // block * type_size


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    fields: dict[str, Any]  # key → scalar, str or Array
    tensors: tuple[Tensor, ...]
    data_start: int = 0  # where the tensor data begins: the header and tensor index end there

    def get(self, key: str) -> Any:
        """A key's value, arrays as plain lists; None when absent."""
        value = self.fields.get(key)
        return list(value) if isinstance(value, Array) else value


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF file at `path`. Raises OSError for a file that cannot be read,
    ValueError for one that is not GGUF (bad magic, truncated, an unknown type)."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    return _read_cached(resolved, st.st_mtime_ns, st.st_size)


def header_digest(path: Path) -> tuple[os.stat_result, str]:
    """SHA-256 of the bytes from the file's start to its tensor data (magic, metadata
    key/values, tensor names, shapes, types and offsets), with the stat of the very file
    read (taken from its descriptor: a file renamed into place meanwhile is not mixed in).
    The weights are not read: a file of the same header and other weights hashes alike.
    Blocking: seconds on a slow disk at worst, so callers run it in a thread."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        try:
            # Parsed once per file version: the estimate and the inventory read it too.
            end = _read_cached(Path(path).resolve(), st.st_mtime_ns, st.st_size).data_start
        except (OSError, ValueError):
            end = _NOT_GGUF_DIGEST  # llama-server refuses it anyway: any stable digest
        digest = hashlib.sha256(b"gguf-header\0")
        left = min(end, st.st_size, DIGEST_LIMIT)
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return st, digest.hexdigest()


@functools.lru_cache(maxsize=64)
def _read_cached(path: Path, mtime_ns: int, size: int) -> GgufHeader:
    del mtime_ns  # part of the cache key only: a rewritten file is read again
    if size == 0:
        raise ValueError("not a GGUF file (empty)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(path, buf)
        except (struct.error, KeyError, OverflowError, MemoryError) as exc:
            # Truncated (struct.error), a type this gguf does not know, a length from garbage.
            raise ValueError(f"not a GGUF file ({type(exc).__name__}: {exc})") from exc


def _parse(path: Path, buf: Any) -> GgufHeader:
    magic, version = struct.unpack_from("<II", buf, 0)
    if magic != 0x46554747 or version < 2:
        raise ValueError(f"not a GGUF file (magic {magic:#x}, version {version})")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > len(buf):
            raise ValueError("not a GGUF file (a string runs past its end)")
        pos += 8
        text = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
        pos += n
        return text

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item_kind, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item_kind in _SCALARS and count > DECODE_LIMIT:
                pos += count * struct.calcsize(_SCALARS[item_kind])
                return Array([], count)
            if item_kind == _STRING and count > DECODE_LIMIT:
                for _ in range(count):  # lengths only
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
                return Array([], count)
            return Array([value(item_kind) for _ in range(count)], count)
        fmt = _SCALARS[kind]
        (item,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return item

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        fields[key] = value(kind)
    table: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        ggml_type, relative = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        table.append((name, tuple(dims), GGMLQuantizationType(ggml_type), relative))
    alignment = fields.get("general.alignment")
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = _DEFAULT_ALIGNMENT
    data_start = -(-pos // alignment) * alignment  # the tensor data follows, aligned
    tensors = tuple(Tensor(name, dims, kind, data_start + relative)
                    for name, dims, kind, relative in table)
    return GgufHeader(path, version, fields, tensors, data_start)
