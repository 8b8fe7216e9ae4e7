"""corral's GGUF header reader against gguf's own GGUFReader (the reference) on the fixture's
tiny llama: the same keys, tensors, types, shapes, offsets and sizes; long arrays kept as
their length; broken files refused with ValueError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from corral.supervisor.gguf_header import DECODE_LIMIT, Array, read_header

from tinymodel import write_tiny_llama


def _reference(path: Path) -> tuple[dict[str, object], list[tuple[str, str, list[int], int, int]]]:
    reader = gguf.GGUFReader(str(path))
    fields: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own pseudo-fields (version, counts)
        fields[key] = len(field.data)
    tensors = [(t.name, gguf.GGMLQuantizationType(int(t.tensor_type)).name,
                [int(x) for x in t.shape], int(t.data_offset), int(t.n_bytes))
               for t in reader.tensors]
    return fields, tensors


def test_the_header_matches_ggufs_own_reader(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", seed=3)
    header = read_header(path)
    fields, tensors = _reference(path)
    assert set(header.fields) == set(fields)
    assert [(t.name, t.type.name, list(t.shape), t.offset, t.n_bytes)
            for t in header.tensors] == tensors
    assert header.get("general.architecture") == "llama"
    tokens = header.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, Array) and tokens.length == fields["tokenizer.ggml.tokens"]
    if tokens.length > DECODE_LIMIT:
        assert list(tokens) == []  # skipped, only counted
    else:
        assert len(tokens) == tokens.length


def test_a_rewritten_file_is_read_again(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", seed=1)
    first = read_header(path)
    assert read_header(path) is first  # cached per version
    write_tiny_llama(path, seed=2, ctx=1024)
    assert read_header(path).get("llama.context_length") == 1024


@pytest.mark.parametrize("cut", [0, 3, 30, 400, 2000])
def test_broken_files_are_refused_with_value_error(tmp_path: Path, cut: int) -> None:
    whole = write_tiny_llama(tmp_path / "m.gguf", seed=1).read_bytes()
    broken = tmp_path / f"cut{cut}.gguf"
    broken.write_bytes(whole[:cut])
    with pytest.raises(ValueError, match="GGUF"):
        read_header(broken)


def test_not_gguf_and_missing(tmp_path: Path) -> None:
    html = tmp_path / "page.gguf"
    html.write_text("<!DOCTYPE html><html>rate limited</html>" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(html)
    with pytest.raises(OSError):
        read_header(tmp_path / "missing.gguf")


_STARTS_LIGHT = """
import sys
from corral.supervisor import cli, inventory
from corral.supervisor.daemon import read_model
from corral.supervisor.gguf_header import GGML_QUANT_SIZES, GGMLQuantizationType, gguf_constants
assert "numpy" not in sys.modules and "gguf" not in sys.modules, sorted(sys.modules)
import gguf
assert {int(k): v for k, v in GGML_QUANT_SIZES.items()} \\
    == {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
assert GGMLQuantizationType.Q4_1 == gguf.GGMLQuantizationType.Q4_1
assert GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0] == (32, 34)
assert [t.name for t in gguf_constants.LlamaFileType] == [t.name for t in gguf.LlamaFileType]
"""


def test_a_daemon_or_a_command_starts_without_numpy() -> None:
    """gguf's type tables come from its constants.py alone: `import gguf` loads numpy and
    gguf's reader and writer (~0.2 CPU-s at every start of corral), for these tables."""
    done = subprocess.run([sys.executable, "-c", _STARTS_LIGHT], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
