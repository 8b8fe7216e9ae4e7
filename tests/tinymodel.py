"""Tiny random-weight llama GGUFs for tests: 2 layers, n_embd 64, a byte-level SPM vocab.

About 0.5 MB each, loaded by llama-server in well under a second and generating thousands of
tokens a second, so a test can run several real children at once. Equal seeds give equal
weights, so equal answers at temperature 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
SPECIALS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    return tokens, [0.0] * len(tokens), [int(t) for t in types]


def write_tiny_llama(path: Path, seed: int = 0, ctx: int = 32768, n_head: int = N_HEAD,
                     n_layer: int = N_LAYER) -> Path:
    """`n_head` 2 gives heads of 32 dims: quantized KV caches (blocks of 32) need that; more
    layers give an RPC split something to split."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocab()
    n_vocab = len(tokens)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-llama-{seed}")
    writer.add_context_length(ctx)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(N_EMBD // n_head)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", w(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", w(n_vocab, N_EMBD))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
