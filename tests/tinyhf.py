"""A tiny random-weight Llama checkpoint in Hugging Face's layout, for vLLM children.

config.json, model.safetensors and a byte-level BPE tokenizer trained with `tokenizers` on a few
sentences, with a chat template: what `vllm serve DIR` needs. Hidden 128, 2 layers, 2 heads of
64 dims (vLLM's CPU attention rejects a head size of 16). Written in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HIDDEN = 128
LAYERS = 2
HEADS = 2
FF = 256
# Room for test_vllm's kill test: a stream long enough (12,000 tokens, ~35 s here) that no
# busy box lets it finish before the reader's kill lands.
MAX_POSITIONS = 16384
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "Many local models answer one prompt together.",
    "A supervisor starts, watches and stops child processes.",
]


def _tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TEXT * 4, trainer)
    return tok


def write_tiny_hf_llama(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(384)
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": FF, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "max_position_embeddings": MAX_POSITIONS, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>")}))
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>")}))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, HIDDEN),
               "model.norm.weight": np.ones(HIDDEN, np.float32),
               "lm_head.weight": w(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": w(HIDDEN, HIDDEN),
            p + "self_attn.v_proj.weight": w(HIDDEN, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": w(FF, HIDDEN),
            p + "mlp.up_proj.weight": w(FF, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FF),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
