"""A tiny vision pair for tests: a random-weight CLIP projector (mmproj) and a tiny llama whose
embedding width matches its output, plus a PNG writer for the pictures sent to it.

The projector is llama.cpp's simplest kind, LLaVA's `mlp` (clip.projector_type "mlp"): a 32 px
image cut into 8 px patches, one ViT block of width 32, and a two-layer MLP into the text
model's 64 dims. llama-server started with `--mmproj` loads it in milliseconds and encodes an
image into 16 embedding positions, so a request with one image counts 16 more prompt tokens
than the same request without it (plus the few tokens of the media markers, if any). What the
model answers is noise; that the image reached it is what the tests read.
"""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from tinymodel import N_EMBD, write_tiny_llama

IMAGE_SIZE = 32
PATCH_SIZE = 8
V_EMBD = 32
V_HEAD = 2
V_FF = 64
V_LAYER = 2  # llava's graph runs n_layer - 1 blocks (it takes the second-to-last layer)
MM_HIDDEN = 64
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2


def write_tiny_mmproj(path: Path, seed: int = 0, n_embd_text: int = N_EMBD) -> Path:
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    writer = GGUFWriter(str(path), "clip")
    writer.add_name("tiny-mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", V_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", V_FF)
    writer.add_uint32("clip.vision.projection_dim", n_embd_text)
    writer.add_uint32("clip.vision.block_count", V_LAYER)
    writer.add_uint32("clip.vision.attention.head_count", V_HEAD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    # numpy shapes are ggml's ne reversed: a conv kernel is (out, in, kh, kw), a linear layer
    # (out, in) as in torch.
    writer.add_tensor("v.patch_embd.weight", w(V_EMBD, 3, PATCH_SIZE, PATCH_SIZE))
    writer.add_tensor("v.patch_embd.bias", zeros(V_EMBD))
    writer.add_tensor("v.position_embd.weight", w(IMAGE_TOKENS, V_EMBD))
    writer.add_tensor("v.pre_ln.weight", ones(V_EMBD))
    writer.add_tensor("v.pre_ln.bias", zeros(V_EMBD))
    for i in range(V_LAYER):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"v.blk.{i}.{name}.weight", w(V_EMBD, V_EMBD))
            writer.add_tensor(f"v.blk.{i}.{name}.bias", zeros(V_EMBD))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"v.blk.{i}.{name}.weight", ones(V_EMBD))
            writer.add_tensor(f"v.blk.{i}.{name}.bias", zeros(V_EMBD))
        writer.add_tensor(f"v.blk.{i}.ffn_up.weight", w(V_FF, V_EMBD))
        writer.add_tensor(f"v.blk.{i}.ffn_up.bias", zeros(V_FF))
        writer.add_tensor(f"v.blk.{i}.ffn_down.weight", w(V_EMBD, V_FF))
        writer.add_tensor(f"v.blk.{i}.ffn_down.bias", zeros(V_EMBD))
    writer.add_tensor("mm.0.weight", w(MM_HIDDEN, V_EMBD))
    writer.add_tensor("mm.0.bias", zeros(MM_HIDDEN))
    writer.add_tensor("mm.2.weight", w(n_embd_text, MM_HIDDEN))
    writer.add_tensor("mm.2.bias", zeros(n_embd_text))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_vision(folder: Path, seed: int = 7) -> tuple[Path, Path]:
    """(model, mmproj) in `folder`, named so that discovery pairs them too."""
    model = write_tiny_llama(folder / "tiny-vision.gguf", seed)
    return model, write_tiny_mmproj(folder / "mmproj-tiny-vision.gguf", seed)


def png(width: int = 16, height: int = 16, rgb: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    """A solid-colour RGB PNG, written by hand (no imaging library in the test deps)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width  # filter type 0 per scanline
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(row * height)) + chunk(b"IEND", b""))


def png_data_url(width: int = 16, height: int = 16) -> str:
    return "data:image/png;base64," + base64.b64encode(png(width, height)).decode()
